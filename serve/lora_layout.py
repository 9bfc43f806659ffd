"""The LoRA slots' layout in a bundle's serving graph (the manifest's `lora`, serve/bundle.py): which
projections have a branch, over which of the checkpoint's modules, and the shapes of the graph's LoRA inputs
that hold every slot's weights and route a run's tokens to them. export/lora.py writes the branches into the
graph; serve/engine/lora/ fills and binds their inputs.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator


class _Strict(BaseModel):
    # As every model of the manifest: a misspelt key is refused rather than silently defaulted.
    model_config = ConfigDict(extra="forbid", frozen=True)


# Graph inputs of a bundle exported with LoRA slots (export/lora.py) that say which tokens of a run (each a
# [batch, seq] position) take which slot of the span of slots it is given (LoraSlots.span):
LORA_ROWS_INPUT = "lora_rows"  # [k, 1, n, 2] int64: row i the tokens of the span's slot i, padded with any
LORA_POSITIONS_INPUT = "lora_positions"  # [m, 2] int64: each token with an adapter, its place in lora_rows
LORA_TOKENS_INPUT = "lora_tokens"  # [m, 2] int64: that token
LORA_ROUTING_INPUTS = (LORA_ROWS_INPUT, LORA_POSITIONS_INPUT, LORA_TOKENS_INPUT)  # int64; the weights float32
LORA_GEMM_TERMS = 128  # ONNX Runtime's CPU SGEMM sums at least this many terms in one block (LoraLayout)


class LoraPart(_Strict):
    """A checkpoint module whose output features a branch covers: what an adapter's weights name."""

    # Its path in the checkpoint, as a peft adapter names it (model.layers.0.mlp.up_proj).
    module: str = Field(min_length=1)
    start: NonNegativeInt  # its output features are the projection's [start, stop)
    stop: PositiveInt


class LoraBranch(_Strict):
    """One projection's LoRA branch: y += (x @ a_s) @ b_s for each token with an adapter, s its slot.

    a_s is [in_features, width], width = len(parts) * max_rank: part j's columns [j * max_rank, (j + 1) *
    max_rank). Each part has a b of its own, [max_rank, features], which writes the projection's output
    features LoraLayout.features says: the parts' outputs side by side are the projection's. The graph's
    inputs hold every slot's as LoraLayout's a_shape and b_shape say."""

    projection: str = Field(min_length=1)  # the serving graph's projection (blocks.0.attn.qkv)
    in_features: PositiveInt
    out_features: PositiveInt
    parts: list[LoraPart] = Field(min_length=1)  # in the order of their output features

    @model_validator(mode="after")
    def _parts_in_order(self) -> LoraBranch:
        stops = [0] + [p.stop for p in self.parts]
        if any(p.start < stop or p.stop <= p.start for p, stop in zip(self.parts, stops, strict=False)):
            raise ValueError(f"{self.projection}: parts must cover ascending, disjoint output features")
        if self.parts[-1].stop > self.out_features:
            raise ValueError(f"{self.projection}: a part ends past out_features {self.out_features}")
        return self

    @property
    def a_input(self) -> str:
        return f"lora_a.{self.projection}"

    def b_input(self, part: int) -> str:
        return f"lora_b.{self.projection}" if len(self.parts) == 1 else f"lora_b.{self.projection}.{part}"


class LoraLayout(_Strict):
    """The LoRA branches of a bundle's serving graph, fed per run by LORA_ROWS_INPUT and the rest."""

    slots: PositiveInt  # adapters resident at once (ids 1..slots)
    max_rank: PositiveInt = Field(le=LORA_GEMM_TERMS)  # the largest adapter rank a slot holds
    branches: list[LoraBranch] = Field(min_length=1)
    # Prefixes of the checkpoint's modules the bundle's model leaves out (a multimodal checkpoint's vision
    # tower): an adapter trained on the whole checkpoint may hold weights for them, which are not served.
    left_out: list[str] = Field(default_factory=list)
    # Other prefixes adapters give the parts' modules -> the prefix the parts' names have (transformers 4
    # named Gemma 3's multimodal text stack language_model.model.*, transformers 5 model.language_model.*).
    renamed: dict[str, str] = Field(default_factory=dict)

    def module_name(self, module: str) -> str:
        """An adapter's module name as the parts name it (an old prefix replaced)."""
        for old, new in self.renamed.items():
            if module.startswith(old):
                return new + module.removeprefix(old)
        return module

    def leaves_out(self, module: str) -> bool:
        return module.startswith(tuple(self.left_out))

    def width(self, branch: LoraBranch) -> int:
        return len(branch.parts) * self.max_rank

    @property
    def max_adapter_bytes(self) -> int:
        """The most memory one registered adapter holds (serve/engine/lora/reading.py's Adapter, float32 at
        its own ranks): one of --max-lora-rank on every module the branches cover, A [r, in] and B
        [features, r]."""
        elements = sum(
            self.max_rank * (branch.in_features + part.stop - part.start)
            for branch in self.branches
            for part in branch.parts
        )
        return elements * 4

    @property
    def slots_bytes(self) -> int:
        """The memory of every slot's A and B as the engine holds them (serve/engine/lora/slots.py)."""
        shapes = [
            shape
            for b in self.branches
            for shape in (
                self.a_shape(b, self.slots),
                *(self.b_shape(b, j, self.slots) for j in range(len(b.parts))),
            )
        ]
        return sum(math.prod(shape) for shape in shapes) * 4

    # Why a is not a plain [in, columns] matrix: ONNX Runtime's CPU GEMM sums a product of more than
    # LORA_GEMM_TERMS terms in blocks whose length follows the columns each thread computes, and how it splits
    # the columns among threads follows the row count. A token's sums would then round differently alone and
    # in a batch. A product by `group` columns at a time cannot be split among threads. A part's b product
    # sums max_rank <= LORA_GEMM_TERMS terms: one block whatever the split.
    @property
    def group(self) -> int:
        """Columns of a multiplied at once: every slot's width is a whole number of groups."""
        return math.gcd(self.max_rank, 16)

    def a_shape(self, branch: LoraBranch, slots: int) -> tuple[int, int, int, int]:
        """The a input of `slots` slots: [slots, groups, in_features, group], a slot's columns [g * group,
        (g + 1) * group) in its group g."""
        return (slots, self.width(branch) // self.group, branch.in_features, self.group)

    def b_shape(self, branch: LoraBranch, part: int, slots: int) -> tuple[int, int, int]:
        """Part `part`'s b input of `slots` slots: [slots, max_rank, features]."""
        start, stop = self.features(branch, part)
        return (slots, self.max_rank, stop - start)

    def input_shapes(self) -> dict[str, list[int | str]]:
        """Every LoRA input of the serving graph and its shape, a name for an axis whose size changes from run
        to run: the routing inputs, and each branch's a and b's over the span of slots a run is given."""
        shapes: dict[str, list[int | str]] = {
            LORA_ROWS_INPUT: ["lora_span", 1, "lora_slot_tokens", 2],
            LORA_POSITIONS_INPUT: ["lora_tokens", 2],
            LORA_TOKENS_INPUT: ["lora_tokens", 2],
        }
        for b in self.branches:
            shapes[b.a_input] = ["lora_span", *self.a_shape(b, self.slots)[1:]]
            for j in range(len(b.parts)):
                shapes[b.b_input(j)] = ["lora_span", *self.b_shape(b, j, self.slots)[1:]]
        return shapes

    @staticmethod
    def features(branch: LoraBranch, part: int) -> tuple[int, int]:
        """The output features part `part`'s b writes, [start, stop): its module's, and the features up to
        the next part's that no part covers (zero there), so that the parts' outputs side by side are the
        projection's."""
        parts = branch.parts
        start = 0 if part == 0 else parts[part].start
        stop = parts[part + 1].start if part + 1 < len(parts) else branch.out_features
        return start, stop
