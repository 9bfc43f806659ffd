"""LoRA slots in the serving graph: any mix of adapters in one batch, chosen per token by an adapter id.

`textgen-export ... --lora-slots N --max-lora-rank R` gives every targeted projection y = x @ W (+ bias) a
branch over all N slots at once (serve/bundle.py's LoraBranch has the layout):

    mask = Gather(onehot, lora_ids)          [B*S,N*width]  1 on the columns of the token's slot, else 0
    y   += ((x @ lora_a) * mask) @ lora_b    lora_a [in, N*width], lora_b [N*width, out]: graph inputs
                                             (FusedMatMuls: export/onnx_inplace.py says why)

with lora_a held as groups of at most 16 columns, and lora_b as one matrix per part ([N*max_rank, its
features], past 128 rows in chunks of a slot each): products that sum a token's terms in the same blocks
alone and in any batch, on any number of threads (serve/bundle.py's LoraLayout says why and how).

Why this form rather than gathering each row's adapter matrices: a gather copies an adapter's weights once per
row per step (16 rows, 4 adapters: 4x the bytes of reading each adapter once), and it makes the per-row
batched MatMul a row-mixing op that the 4-bit row pad (export/row_pad.py) would have to cut around. Here
every op computes each token on its own (two plain MatMuls, an elementwise Mul), so a request's result does
not depend on its batch company, and a token of another slot (or of none, id 0) contributes exact zeros:
a base request on a LoRA bundle computes exactly what it computes without slots, plus 0. The weights are
inputs, not initializers, so the quantizers leave the branches in float32 and the server writes an adapter
into a slot between two steps without touching the session.

Which modules get a branch: every projection (q, k, v, o, gate, up, down; GPT-2's c_attn, c_proj, c_fc) or
those `--lora-target-modules` names. A fused projection of ours (q/k/v, gate/up) gets one branch whose
parts are the checkpoint's modules, each its own `max_rank` columns of lora_a and its own lora_b over its
output features (a token multiplies no zeros of the other parts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from export.model import DecoderConfig
from serve.bundle import LORA_GEMM_TERMS, LoraBranch, LoraLayout, LoraPart

# Our projection -> the checkpoint modules it is made of, in order, each with its output features.
ModuleMap = Mapping[str, Sequence[tuple[str, int]]]
PROJECTIONS = ("attn.qkv", "attn.out", "ffn.up", "ffn.down")


@dataclass(frozen=True)
class LoraOptions:
    slots: int
    max_rank: int
    target_modules: tuple[str, ...] = ()  # the modules' last names (q_proj, c_attn, ...); (): all

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"--lora-slots must be >= 1, got {self.slots}")
        if not 1 <= self.max_rank <= LORA_GEMM_TERMS:
            raise ValueError(f"--max-lora-rank must be between 1 and {LORA_GEMM_TERMS}, got {self.max_rank}")


def own_modules(cfg: DecoderConfig) -> dict[str, list[tuple[str, int]]]:
    """Our decoder's projections as modules of their own (what peft names on export.model.Decoder)."""
    return {
        f"blocks.{i}.{p}": [(f"blocks.{i}.{p}", projection_features(cfg, p))]
        for i in range(cfg.n_layers)
        for p in PROJECTIONS
    }


def projection_features(cfg: DecoderConfig, projection: str) -> int:
    """The output features of one of PROJECTIONS."""
    gated = cfg.activation == "swiglu"
    return {
        "attn.qkv": cfg.q_dim + 2 * cfg.kv_dim,
        "attn.out": cfg.d_model,
        "ffn.up": (2 if gated else 1) * cfg.d_ff,
        "ffn.down": cfg.d_model,
    }[projection]


def projection_inputs(cfg: DecoderConfig, projection: str) -> int:
    return {"attn.qkv": cfg.d_model, "attn.out": cfg.q_dim, "ffn.up": cfg.d_model, "ffn.down": cfg.d_ff}[
        projection
    ]


def lora_layout(cfg: DecoderConfig, modules: ModuleMap, options: LoraOptions) -> LoraLayout:
    """The branches for `options.target_modules` (all when empty); ValueError naming a target that matches no
    module of the model."""
    targets = set(options.target_modules)
    known = {_leaf(name) for parts in modules.values() for name, _ in parts}
    unknown = sorted(targets - known)
    if unknown:
        raise ValueError(
            f"--lora-target-modules {', '.join(unknown)}: the model has no such module; it has "
            f"{', '.join(sorted(known))}"
        )
    branches = []
    for projection, parts in modules.items():
        kept, start = [], 0
        for name, features in parts:
            if not targets or _leaf(name) in targets:
                kept.append(LoraPart(module=name, start=start, stop=start + features))
            start += features
        if kept:
            kind = projection.split(".", 2)[2]
            branches.append(
                LoraBranch(
                    projection=projection,
                    in_features=projection_inputs(cfg, kind),
                    out_features=start,
                    parts=kept,
                )
            )
    return LoraLayout(slots=options.slots, max_rank=options.max_rank, branches=branches)


def _leaf(module: str) -> str:
    return module.rsplit(".", 1)[-1]
