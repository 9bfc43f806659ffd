"""Reading and checking a peft adapter folder against a bundle's LoRA layout: an `Adapter`, or an
`AdapterError` naming the file and what differs.

An adapter is what `peft` saves: adapter_config.json (r, lora_alpha, use_rslora, target_modules, ...) and
adapter_model.safetensors with `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight`
[out, r]. Each module's update is scale * B @ A with scale = lora_alpha / r (lora_alpha / sqrt(r) with
rsLoRA; alpha_pattern and rank_pattern per module as peft reads them); the scale is folded into B here.
Modules under the layout's `left_out` prefixes (a multimodal checkpoint's vision tower, which the bundle
leaves out) are skipped with one warning, and its `renamed` prefixes are read as the parts' own.
A registered adapter (`Adapter`) holds its modules at their own ranks, in float32 (fp16 and bf16 widened
exactly), so it costs its own size; it takes the slots' dense layout only when written into one (slots.py).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from serve.bundle import Manifest
from serve.lora_layout import LoraBranch, LoraLayout

CONFIG_FILE = "adapter_config.json"

WEIGHTS_FILE = "adapter_model.safetensors"

PEFT_PREFIX = "base_model.model."

log = logging.getLogger("textgen.lora")

_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<side>[AB])(?:\.[^.]+)?\.weight$")

_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # as a safetensors header names them


class AdapterError(ValueError):
    """An adapter folder that cannot be served by this bundle; the message names the file and what differs."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


@dataclass(frozen=True)
class AdapterModule:
    """One checkpoint module's update at the adapter's own rank r for it: scale * b @ a."""

    projection: str  # the branch's (LoraBranch.projection)
    part: int  # the branch's part that is this module
    a: np.ndarray  # lora_A [r, in_features], float32
    b: np.ndarray  # scale * lora_B [module features, r], float32


@dataclass(frozen=True)
class Adapter:
    """A registered adapter: its modules at their own ranks, as small as the adapter itself; laid out in the
    bundle's dense slot layout only when written into a slot (LoraSlots.write)."""

    path: Path
    modules: tuple[AdapterModule, ...]

    @property
    def rank(self) -> int:
        """The largest of its modules' ranks."""
        return max(m.a.shape[0] for m in self.modules)

    @property
    def nbytes(self) -> int:
        """The memory it holds while registered."""
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules)


@dataclass(frozen=True)
class _Planned:
    """A module of the adapter as its file's header describes it, checked against the bundle, not read yet."""

    module: str
    branch: LoraBranch
    part: int
    a_name: str  # its lora_A tensor
    b_name: str  # its lora_B tensor
    rank: int


def read_adapter(path: Path | str, layout: LoraLayout, base_names: Collection[str] = ()) -> Adapter:
    """The peft adapter at `path`, checked against `layout` and read; AdapterError when it does not fit.

    Everything but the values is checked from adapter_config.json and the safetensors header before any
    tensor is read (a rank above --max-lora-rank, a module the bundle has no branch for, a shape of another
    model); then the tensors are read one at a time, widened to float32 exactly (bf16 and fp16 included),
    and refused if any value, or any after the scale, is not finite. `base_names`: the names the bundle's
    model goes by (model_names); an adapter whose config names another base is served with a warning."""
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(
            path, f"not a directory; give the folder peft saved ({CONFIG_FILE} and {WEIGHTS_FILE})"
        )
    config = _config(path / CONFIG_FILE)
    _check_base(path / CONFIG_FILE, config, base_names)
    weights = path / WEIGHTS_FILE
    with _open(weights) as file:
        planned = _plan(weights, _header(weights, file), layout)
        modules = tuple(_read_module(weights, file, config, entry) for entry in planned)
    return Adapter(path, modules)


def model_names(manifest: Manifest) -> frozenset[str]:
    """The names a bundle's model goes by, as an adapter's base_model_name_or_path may give them: its name
    and the folder (a Hugging Face cache folder as its hub id) it was exported from, without their paths."""
    source = manifest.verification.get("export", {}).get("source") or {}
    names = [manifest.model_name, str(source.get("hf_model") or "")]
    return frozenset(_base_key(name) for name in names if name)


def _base_key(name: str) -> str:
    """`org/model`, a local folder of it, or a hub cache folder (models--org--model/snapshots/<hash>) ->
    `model`, lower case: what two ways of naming one model share."""
    parts = [p for p in name.strip().rstrip("/").split("/") if p]
    cached = next((p for p in parts if p.startswith("models--")), None)
    leaf = cached.rsplit("--", 1)[-1] if cached else (parts[-1] if parts else "")
    return leaf.lower()


def _check_base(path: Path, config: Mapping[str, Any], base_names: Collection[str]) -> None:
    """Warn of an adapter whose config names another base model than the bundle's: its shapes may match
    (fine-tunes of one architecture share them) and its tokens would still be those of another model."""
    base = config.get("base_model_name_or_path")
    if not isinstance(base, str) or not base.strip() or not base_names:
        return
    if _base_key(base) not in base_names:
        log.warning(
            "%s: base_model_name_or_path %r is not the bundle's model (%s): an adapter trained on another "
            "model is served, and gives that model's tokens only if the weights are the same",
            path,
            base,
            ", ".join(sorted(base_names)),
        )


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


def _open(path: Path) -> Any:
    """The safetensors file at `path`, open for its header and for reading its tensors one at a time."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise AdapterError(
            path, "not found: an adapter folder holds the adapter_model.safetensors peft saves"
        )
    try:
        return safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(path, f"not a readable safetensors file ({exc})") from exc


def _header(path: Path, file: Any) -> dict[str, tuple[list[int], str]]:
    """tensor name -> (shape, dtype) as the file's header gives them, no tensor read; AdapterError for a
    tensor that is not a float matrix."""
    shapes = {}
    for name in file.keys():  # noqa: SIM118 (a safe_open handle is no dict)
        entry = file.get_slice(name)
        shape, dtype = list(entry.get_shape()), entry.get_dtype()
        if dtype not in _FLOAT_DTYPES:
            raise AdapterError(
                path, f"{name} is {dtype}: adapter weights must be float ({', '.join(_FLOAT_DTYPES)})"
            )
        if len(shape) != 2:
            raise AdapterError(path, f"tensor {name!r} has shape {shape}, not a matrix")
        shapes[name] = (shape, dtype)
    return shapes


def _plan(path: Path, header: Mapping[str, tuple[list[int], str]], layout: LoraLayout) -> list[_Planned]:
    """The adapter's modules as the header describes them, each checked against `layout`: a LoRA A or B
    name, both halves, one rank within --max-lora-rank, a module with a branch, the model's shapes."""
    halves: dict[str, dict[str, str]] = {}
    left_out: set[str] = set()
    for name in header:
        match = _KEY.match(name.removeprefix(PEFT_PREFIX))
        if match is None:
            raise AdapterError(
                path,
                f"tensor {name!r} is not a LoRA A or B weight (embedding or other adapters are not served)",
            )
        module = match["module"]
        if layout.leaves_out(layout.module_name(module)):
            left_out.add(module)
        else:
            halves.setdefault(module, {})[match["side"]] = name
    if left_out:
        log.warning(
            "%s: %d modules of the adapter are outside the bundle's model (%s, ...), which leaves out %s: "
            "served without them",
            path,
            len(left_out),
            min(left_out),
            ", ".join(layout.left_out),
        )
    if not halves:
        raise AdapterError(path, "holds no LoRA weights" + (" for the bundle's model" if left_out else ""))
    where = {part.module: (branch, j) for branch in layout.branches for j, part in enumerate(branch.parts)}
    planned = []
    for module, sides in halves.items():
        if set(sides) != {"A", "B"}:
            raise AdapterError(path, f"{module} has lora_{''.join(sides)} without its other half")
        (rank, in_features), (out_features, b_rank) = header[sides["A"]][0], header[sides["B"]][0]
        if rank != b_rank:
            raise AdapterError(path, f"{module}: lora_A has rank {rank}, lora_B {b_rank}")
        if rank > layout.max_rank:
            raise AdapterError(
                path, f"{module} has rank {rank}, above the bundle's --max-lora-rank {layout.max_rank}"
            )
        branch, j = _place(path, layout.module_name(module), where, layout)
        part = branch.parts[j]
        expected = {"A": [rank, branch.in_features], "B": [part.stop - part.start, rank]}
        for side, found in (("A", [rank, in_features]), ("B", [out_features, b_rank])):
            if found != expected[side]:
                raise AdapterError(
                    path,
                    f"{module}.lora_{side} has shape {found} where the bundle's model needs "
                    f"{expected[side]}: an adapter of another base model",
                )
        planned.append(_Planned(module, branch, j, sides["A"], sides["B"], rank))
    return planned


def _read_module(path: Path, file: Any, config: Mapping[str, Any], planned: _Planned) -> AdapterModule:
    """One planned module's tensors, read and widened to float32, the scale folded into b; AdapterError
    naming the tensor for a value that is not finite, read or once scaled."""
    a = _read_tensor(path, file, planned.a_name)
    b = _read_tensor(path, file, planned.b_name)
    scale = _scale(config, planned.module, planned.rank)
    with np.errstate(over="ignore"):
        scaled = b * np.float32(scale)
    if not np.isfinite(scaled).all():
        raise AdapterError(
            path,
            f"{planned.b_name} times its scale {scale:g} (lora_alpha {config['lora_alpha']!r}) is past "
            "float32's range: give a lora_alpha that keeps the scaled weights finite",
        )
    return AdapterModule(planned.branch.projection, planned.part, a, scaled)


def _read_tensor(path: Path, file: Any, name: str) -> np.ndarray:
    """Tensor `name` as float32: fp16 and bf16 widened exactly (ml_dtypes, imported here, gives numpy the
    bfloat16 that safetensors reads bf16 as); AdapterError if a value is NaN or infinite."""
    import ml_dtypes  # noqa: F401

    with np.errstate(over="ignore"):
        tensor = np.asarray(file.get_tensor(name)).astype(np.float32, copy=False)
    if not np.isfinite(tensor).all():
        bad = int(np.size(tensor) - np.isfinite(tensor).sum())
        raise AdapterError(path, f"{name} holds {bad} NaN or infinite values: the adapter is broken")
    return tensor


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
