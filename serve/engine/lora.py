"""LoRA adapters in a bundle's slots: peft folders read, checked against the bundle, written into its inputs.

A bundle exported with `--lora-slots N --max-lora-rank R` (export/lora.py) has, per targeted projection,
weight inputs (its a, and a b per part) that hold every slot's adapter side by side (serve/bundle.py's
LoraBranch has the layout).
`LoraSlots` owns those arrays: the engine binds them once (ONNX Runtime reads them in place), and writing an
adapter into a slot between two steps is a copy into its columns; no session is rebuilt and no other slot
changes. Which tokens of a run take which slot, the engine says per run (`token_slots`).

An adapter is what `peft` saves: adapter_config.json (r, lora_alpha, use_rslora, target_modules, ...) and
adapter_model.safetensors with `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight`
[out, r]. Each module's update is scale * B @ A with scale = lora_alpha / r (lora_alpha / sqrt(r) with
rsLoRA; alpha_pattern and rank_pattern per module as peft reads them); the scale is folded into B here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from serve.bundle import (
    LORA_POSITIONS_INPUT,
    LORA_ROWS_INPUT,
    LORA_TOKENS_INPUT,
    LoraBranch,
    LoraLayout,
)
from serve.errors import BundleError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<side>[AB])(?:\.[^.]+)?\.weight$")
_FLOAT_KINDS = ("f",)


class AdapterError(ValueError):
    """An adapter folder that cannot be served by this bundle; the message names the file and what differs."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")


@dataclass(frozen=True)
class Adapter:
    """An adapter laid out for one slot: per branch, its a columns [in, width], and per part of it, its b
    rows [max_rank, features] (the scale folded into b); zero where the adapter has no module."""

    path: Path
    rank: int  # the largest of its modules' ranks
    a: Mapping[str, np.ndarray]  # by projection
    b: Mapping[str, np.ndarray]  # by b input (LoraBranch.b_input)


def read_adapter(path: Path | str, layout: LoraLayout) -> Adapter:
    """The peft adapter at `path` laid out for `layout`'s slots; AdapterError when it does not fit."""
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(
            path, f"not a directory; give the folder peft saved ({CONFIG_FILE} and {WEIGHTS_FILE})"
        )
    config = _config(path / CONFIG_FILE)
    tensors = _tensors(path / WEIGHTS_FILE)
    modules = _modules(path / WEIGHTS_FILE, tensors)
    where = {part.module: (branch, j) for branch in layout.branches for j, part in enumerate(branch.parts)}
    a = {b.projection: np.zeros((b.in_features, layout.width(b)), np.float32) for b in layout.branches}
    b_ = {}
    for branch in layout.branches:
        for j in range(len(branch.parts)):
            start, stop = layout.features(branch, j)
            b_[branch.b_input(j)] = np.zeros((layout.max_rank, stop - start), np.float32)
    rank = 0
    for module, (lora_a, lora_b) in modules.items():
        branch, j = _place(path, module, where, layout)
        part = branch.parts[j]
        r = lora_a.shape[0]
        if r > layout.max_rank:
            raise AdapterError(
                path, f"{module} has rank {r}, above the bundle's --max-lora-rank {layout.max_rank}"
            )
        expected = {"lora_A": (r, branch.in_features), "lora_B": (part.stop - part.start, r)}
        for side, tensor in (("lora_A", lora_a), ("lora_B", lora_b)):
            if tensor.shape != expected[side]:
                raise AdapterError(
                    path,
                    f"{module}.{side} has shape {list(tensor.shape)} where the bundle's model needs "
                    f"{list(expected[side])}: an adapter of another base model",
                )
        scale = _scale(config, module, r)
        a[branch.projection][:, j * layout.max_rank : j * layout.max_rank + r] = lora_a.T
        offset = layout.features(branch, j)[0]
        b_[branch.b_input(j)][:r, part.start - offset : part.stop - offset] = scale * lora_b.T
        rank = max(rank, r)
    return Adapter(path, rank, a, b_)


def check_graph_inputs(
    layout: LoraLayout, inputs: Mapping[str, Sequence[int | str | None]], graph: str
) -> None:
    """BundleError naming the first LoRA input of `graph` whose rank or fixed sizes are not what the engine
    binds for `layout` (LoraLayout.input_shapes): a bundle exported with an earlier LoRA layout, which ONNX
    Runtime would otherwise refuse only at the first run, with a bare shape error."""
    for name, expected in layout.input_shapes().items():
        found = inputs.get(name)
        fits = found is not None and len(found) == len(expected)
        if fits and all(isinstance(e, str) or f == e for e, f in zip(expected, found or [], strict=True)):
            continue
        what = "missing from" if found is None else f"{list(found)} in"
        raise BundleError(
            f"{graph}: LoRA input {name} is {what} the serving graph, where this textgen binds "
            f"{expected} (named axes change from run to run): the bundle was exported with an earlier LoRA "
            "layout; "
            "re-export it with this textgen's `textgen-export ... "
            f"--lora-slots {layout.slots} --max-lora-rank {layout.max_rank}`"
        )


class LoraSlots:
    """Every slot's adapter weights, as the graph's LoRA inputs read them (one array per input), and the
    inputs over a span of slots: a run is given those of the slots its rows use, first to last, so it reads
    no other slot's weights (with no slot, none at all: each branch multiplies no token)."""

    def __init__(self, layout: LoraLayout) -> None:
        self.layout = layout
        self._branches = {b.projection: b for b in layout.branches}
        self.arrays: dict[str, np.ndarray] = {}  # every slot's A and B, by input name
        for b in layout.branches:
            self.arrays[b.a_input] = np.zeros(layout.a_shape(b, layout.slots), np.float32)
            for j in range(len(b.parts)):
                self.arrays[b.b_input(j)] = np.zeros(layout.b_shape(b, j, layout.slots), np.float32)

    def span(self, first: int, last: int) -> dict[str, np.ndarray]:
        """The inputs of slots first..last (1-based; (0, 0): no slot, inputs of no length): views of the
        slots' arrays, so an adapter written later is read."""
        return {name: array[max(first - 1, 0) : last] for name, array in self.arrays.items()}

    @property
    def weight_bytes(self) -> int:
        """The bytes of every slot's A and B."""
        return sum(array.nbytes for array in self.arrays.values())

    def write(self, slot: int, adapter: Adapter | None) -> None:
        """Put `adapter` in `slot` (1-based), replacing what it held; None empties it."""
        if not 1 <= slot <= self.layout.slots:
            raise ValueError(f"slot {slot} is not one of the bundle's 1..{self.layout.slots}")
        group = self.layout.group
        for projection, branch in self._branches.items():
            self.arrays[branch.a_input][slot - 1] = (
                0.0
                if adapter is None
                else adapter.a[projection].reshape(branch.in_features, -1, group).transpose(1, 0, 2)
            )  # [groups, in, group]
            for j in range(len(branch.parts)):
                name = branch.b_input(j)
                self.arrays[name][slot - 1] = 0.0 if adapter is None else adapter.b[name]


def token_slots(row_slots: np.ndarray, tokens: int, span: tuple[int, int]) -> dict[str, np.ndarray]:
    """The graph's inputs that route a run's tokens to their slots (serve/bundle.py, LORA_ROWS_INPUT and the
    rest), for rows whose slots are `row_slots` (0: none; the others within `span`, the slots the run is
    given, first to last), `tokens` positions each: the tokens of each slot of the span in a row of their
    own (in token order, padded with token (0, 0) to the longest), and each token with an adapter, where it
    is there. A token is its (row, position)."""
    slot = np.repeat(row_slots.astype(np.int64), tokens)  # by token, flat
    token = np.flatnonzero(slot)  # the tokens with an adapter, in order
    span_slot = slot[token] - span[0]  # each one's slot counted in the span
    k = span[1] - span[0] + 1 if token.size else 0
    counts = np.bincount(span_slot, minlength=k)
    n = int(counts.max()) if token.size else 0
    order = np.argsort(span_slot, kind="stable")  # the tokens grouped by slot, in order within each
    place = np.empty(token.size, np.int64)
    place[order] = np.arange(token.size) - (np.cumsum(counts) - counts)[span_slot[order]]
    at = np.stack(np.divmod(token, tokens), axis=-1)  # [m, 2]: (row, position)
    rows = np.zeros((k, 1, n, 2), np.int64)
    rows[span_slot, 0, place] = at
    return {
        LORA_ROWS_INPUT: rows,
        LORA_POSITIONS_INPUT: np.stack([span_slot, place], axis=-1),
        LORA_TOKENS_INPUT: at,
    }


def _config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AdapterError(
            path, "not found: an adapter folder holds the adapter_config.json peft saves"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(path, f"not readable JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AdapterError(path, "not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(path, f"peft_type {peft_type!r}: only LORA adapters are served")
    if config.get("use_dora"):
        raise AdapterError(path, "use_dora: DoRA adapters are not served, only plain LoRA")
    if config.get("bias", "none") != "none":
        raise AdapterError(path, f"bias {config.get('bias')!r}: adapters that train biases are not served")
    if config.get("modules_to_save"):
        raise AdapterError(
            path,
            f"modules_to_save {config['modules_to_save']}: adapters replacing whole modules are not served",
        )
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise AdapterError(path, f"{key} must be a positive number, got {value!r}")
    return config


def _tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    if not path.is_file():
        raise AdapterError(
            path, "not found: an adapter folder holds the adapter_model.safetensors peft saves"
        )
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(path, f"not a readable safetensors file ({exc})") from exc
    for name, tensor in tensors.items():
        if tensor.dtype.kind not in _FLOAT_KINDS:
            raise AdapterError(path, f"{name} is {tensor.dtype}: adapter weights must be float")
    return {name: tensor.astype(np.float32) for name, tensor in tensors.items()}


def _modules(path: Path, tensors: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """module -> (lora_A [r, in], lora_B [out, r]); AdapterError for other tensors or a missing half."""
    halves: dict[str, dict[str, np.ndarray]] = {}
    for name, tensor in tensors.items():
        match = _KEY.match(name.removeprefix(PEFT_PREFIX))
        if match is None:
            raise AdapterError(
                path,
                f"tensor {name!r} is not a LoRA A or B weight (embedding or other adapters are not served)",
            )
        if tensor.ndim != 2:
            raise AdapterError(path, f"tensor {name!r} has shape {list(tensor.shape)}, not a matrix")
        halves.setdefault(match["module"], {})[match["side"]] = tensor
    if not halves:
        raise AdapterError(path, "holds no LoRA weights")
    modules = {}
    for module, sides in halves.items():
        if set(sides) != {"A", "B"}:
            raise AdapterError(path, f"{module} has lora_{''.join(sides)} without its other half")
        if sides["A"].shape[0] != sides["B"].shape[1]:
            raise AdapterError(
                path, f"{module}: lora_A has rank {sides['A'].shape[0]}, lora_B {sides['B'].shape[1]}"
            )
        modules[module] = (sides["A"], sides["B"])
    return modules


def _place(
    path: Path, module: str, where: Mapping[str, tuple[LoraBranch, int]], layout: LoraLayout
) -> tuple[LoraBranch, int]:
    """The branch and part of the bundle's module `module` names (exactly, or as a path ending in it: a
    checkpoint whose file names its modules without the model's prefix)."""
    found = where.get(module) or next((v for k, v in where.items() if module.endswith(f".{k}")), None)
    if found is None:
        leaves = sorted({p.module.rsplit(".", 1)[-1] for b in layout.branches for p in b.parts})
        raise AdapterError(
            path,
            f"targets {module}, for which the bundle has no LoRA branch (its branches are on "
            f"{', '.join(leaves)}; export with --lora-target-modules to add others)",
        )
    return found


def _scale(config: Mapping[str, Any], module: str, rank: int) -> float:
    alpha = float(config["lora_alpha"])
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):  # as peft matches a pattern key
            alpha = float(value)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


class Residency:
    """Which of the registered adapters sit in which slots. An adapter not resident is written into a free
    slot when a sequence needs it, else into the slot of the least recently used adapter no sequence holds
    (the scheduler admits no more distinct adapters than there are slots)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.registered: dict[str, Adapter] = {}
        self.resident: dict[str, int] = {}  # name -> slot
        self._used: dict[str, int] = {}  # name -> the clock when a sequence last took it
        self._clock = 0
        self.loads = 0  # adapters written into a slot, ever
        self.evictions = 0  # of them, those that replaced another adapter

    def register(self, name: str, adapter: Adapter) -> None:
        if name in self.registered:
            raise ValueError(f"an adapter named {name!r} is already loaded")
        self.registered[name] = adapter

    def unregister(self, name: str, busy: Collection[str]) -> int | None:
        """Forget `name`; returns the slot it leaves empty (None: it was not resident). ValueError while a
        sequence runs with it."""
        if name not in self.registered:
            raise ValueError(f"no adapter named {name!r} is loaded")
        if name in busy:
            raise ValueError(f"adapter {name!r} is in use by running requests; unload it once they finish")
        del self.registered[name]
        self._used.pop(name, None)
        return self.resident.pop(name, None)

    def free_slot(self) -> int | None:
        taken = set(self.resident.values())
        return next((s for s in range(1, self.slots + 1) if s not in taken), None)

    def place(self, name: str, busy: Collection[str]) -> int:
        """The slot `name` is written into: a free one, else the least recently used adapter's that no
        sequence in `busy` holds (it is evicted). ValueError when every slot is held."""
        slot = self.free_slot()
        if slot is None:
            idle = [n for n in self.resident if n not in busy]
            if not idle:
                raise ValueError(
                    f"every one of the {self.slots} LoRA slots holds an adapter a running request uses"
                )
            slot = self.resident.pop(min(idle, key=lambda n: self._used.get(n, 0)))
            self.evictions += 1
        self.resident[name] = slot
        self.loads += 1
        return slot

    def touch(self, name: str) -> None:
        self._clock += 1
        self._used[name] = self._clock
