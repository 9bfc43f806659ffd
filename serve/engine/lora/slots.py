"""The bundle's LoRA slots: every slot's adapter weights, in the arrays the serving graph reads them from.

A bundle exported with `--lora-slots N --max-lora-rank R` (export/lora.py) has, per targeted projection,
weight inputs (its a, and a b per part) that hold every slot's adapter side by side (serve/lora_layout.py's
LoraBranch has the layout). `LoraSlots` owns those arrays: the engine binds them once (ONNX Runtime reads them
in place), and writing an adapter into a slot between two steps is a copy into its columns; no session is
rebuilt and no other slot changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from serve.engine.lora.reading import Adapter
from serve.errors import BundleError
from serve.lora_layout import LoraLayout


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
        """Put `adapter` in `slot` (1-based), replacing what it held; None empties it. Each module's a fills
        its part's first r columns of the slot's a, its b the first r rows of the part's b; the rest is 0."""
        if not 1 <= slot <= self.layout.slots:
            raise ValueError(f"slot {slot} is not one of the bundle's 1..{self.layout.slots}")
        for array in self.arrays.values():
            array[slot - 1] = 0.0
        for module in adapter.modules if adapter is not None else ():
            branch = self._branches[module.projection]
            rank, group = module.a.shape[0], self.layout.group
            # Column c of the slot's [in, width] a is [c // group, :, c % group] of its grouped form.
            columns = module.part * self.layout.max_rank + np.arange(rank)
            self.arrays[branch.a_input][slot - 1][columns // group, :, columns % group] = module.a
            part, offset = branch.parts[module.part], self.layout.features(branch, module.part)[0]
            b = self.arrays[branch.b_input(module.part)][slot - 1]
            b[:rank, part.start - offset : part.stop - offset] = module.b.T
