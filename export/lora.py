"""LoRA slots in the serving graph: any mix of adapters in one batch, each token on its own adapter.

`textgen-export ... --lora-slots N --max-lora-rank R` gives every targeted projection y = x @ W (+ bias) a
branch over the slots a run is given (a span of k of the N, serve/lora_layout.py's LoraBranch has the layout):

    xs  = Gather(x, lora_rows)                 [k,n,in]   each slot's tokens in a row of their own
    d   = (xs @ lora_a) @ lora_b               [k,n,out]  each slot's tokens by that slot's a and b only
    y   = ScatterND(y, lora_tokens, Gather(d, lora_positions), add)   each token's d added where it was

with lora_a [k*groups, in, group] (groups of at most 16 columns) and lora_b one [k, max_rank, features] per
part: products that sum a token's terms in the same blocks alone and in any batch, on any number of threads
(serve/lora_layout.py's LoraLayout says why). The engine computes the three routing inputs per run
(serve/engine/lora/routing.py, token_slots).

Why this form: each token multiplies its own adapter's weights only (16 rows over 4 adapters do the
arithmetic of 16 rows of one), each slot's weights are read once per step whatever its tokens, and a token
with no adapter is not in any product: its projection is exactly the bundle without slots' (a run with no
adapter token routes none, k = 0). A row's tokens take the same products whatever rows share the run:
batch invariance holds. The weights are inputs, not initializers, so the quantizers leave the branches in
float32 and the server writes an adapter into a slot between two steps without touching the session.

Which modules get a branch: every projection (q, k, v, o, gate, up, down; GPT-2's c_attn, c_proj, c_fc) or
those `--lora-target-modules` names. A fused projection of ours (q/k/v, gate/up) gets one branch whose
parts are the checkpoint's modules, each its own `max_rank` columns of lora_a and its own lora_b over its
output features (a token multiplies no zeros of the other parts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from export.model import GATED_ACTIVATIONS, DecoderConfig
from serve.lora_layout import LORA_GEMM_TERMS, LoraBranch, LoraLayout, LoraPart

# Our projection -> the checkpoint modules it is made of, in order, each with its output features.
ModuleMap = Mapping[str, Sequence[tuple[str, int]]]


@dataclass(frozen=True)
class AdapterNames:
    """What else adapters of a checkpoint may name than the ModuleMap's modules (LoraLayout's left_out and
    renamed): prefixes of modules the bundle's model leaves out, and other prefixes of its own modules."""

    left_out: tuple[str, ...] = ()
    renamed: Mapping[str, str] = field(default_factory=dict)


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
        if not (cfg.sparse(i) and p.startswith("ffn."))  # the experts take no LoRA branch
    }


def projection_features(cfg: DecoderConfig, projection: str) -> int:
    """The output features of one of PROJECTIONS."""
    gated = cfg.activation in GATED_ACTIVATIONS
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


def lora_layout(
    cfg: DecoderConfig, modules: ModuleMap, options: LoraOptions, names: AdapterNames | None = None
) -> LoraLayout:
    """The branches for `options.target_modules` (all when empty); ValueError naming a target that matches no
    module of the model. `names`: what adapters may name besides `modules`."""
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
    names = names or AdapterNames()
    return LoraLayout(
        slots=options.slots,
        max_rank=options.max_rank,
        branches=branches,
        left_out=list(names.left_out),
        renamed=dict(names.renamed),
    )


def _leaf(module: str) -> str:
    return module.rsplit(".", 1)[-1]
