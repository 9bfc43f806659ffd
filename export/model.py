"""A GPT-style decoder-only transformer, written from first principles.

One function serves prefill and decode: ``forward`` takes the new tokens, the attention mask over
past + new positions, their position ids and the past key/values (possibly empty, P = 0), and returns
the logits of the new tokens with the present key/values (past + new).

The defaults are the GPT-style decoder this project trains (LayerNorm, GELU MLP, multi-head attention, biases
everywhere). The other options are the blocks of the Hugging Face families export/hf_import.py reads: RMSNorm,
SwiGLU, tanh-approximated GELU, grouped-query attention (fewer key/value heads, each shared by a group of
query heads; the cache holds the key/value heads only), an explicit head dim, RMSNorm of q and k (per head,
or over the whole projection), scaled RoPE (linear, llama3, YaRN, longrope) on all of the head dim or its
first part, GeGLU, norms before and/or after each sublayer, scales of the embedding, the residual branches,
the attention scores and the logits, tanh soft-capping of the attention scores and of the logits, layers
that attend differently (`LayerAttention`: a sliding window, a RoPE base of their own, or no rotary at all),
and sparse mixture-of-experts feed-forward layers (export/moe.py).

Shapes in comments: B batch, S new tokens, P past tokens, T = P + S, H heads, Hkv key/value heads, Dh head
dim, D d_model, F d_ff, V vocab.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from export.moe import Experts, ExpertsConfig

Positions = Literal["learned", "sinusoidal", "rotary"]
Activation = Literal["gelu", "relu", "gelu_tanh", "swiglu", "geglu"]
Norm = Literal["layer", "rms"]
NormPlacement = Literal["pre", "post", "sandwich"]
QKNormScope = Literal["head", "projection"]
RopeScaling = Literal["none", "linear", "llama3", "longrope", "yarn"]
KV = tuple[Tensor, Tensor]

ACTIVATIONS = ("gelu", "relu", "gelu_tanh", "swiglu", "geglu")
GATED_ACTIVATIONS = ("swiglu", "geglu")  # `up` computes [gate; up]: act(gate) * up
NORMS = ("layer", "rms")
NORM_PLACEMENTS = ("pre", "post", "sandwich")
QK_NORM_SCOPES = ("head", "projection")
ROPE_SCALINGS = ("none", "linear", "llama3", "longrope", "yarn")


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends, where the layers of one model differ (Gemma 2 and 3 interleave sliding-window
    and global layers, Gemma 3's with RoPE bases of their own; SmolLM3 leaves every fourth layer without
    rotary). The sizes and the projections are the same in every layer."""

    window: int = 0  # W > 0: a query sees the last W keys, itself included; 0: all
    rotary: bool = True  # False: no position encoding in this layer (of a rotary model)
    rope_theta: float = 0.0  # > 0: this layer's own RoPE base, unscaled; 0: the config's RoPE

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 0:
            raise ValueError(f"a layer's window must be a non-negative integer, got {self.window!r}")
        if self.rope_theta < 0:
            raise ValueError(
                f"a layer's rope_theta must be positive (or 0: the config's), got {self.rope_theta}"
            )


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int = 8192
    context_length: int = 1024
    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 8
    d_ff: int = 2048
    positions: Positions = "learned"
    activation: Activation = "gelu"
    tie_embeddings: bool = True
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5  # of every norm, LayerNorm or RMSNorm
    rope_theta: float = 10000.0
    # Blocks of imported checkpoints (export/hf_import.py). A config saved before these existed loads with
    # the defaults, which are the decoder above.
    norm: Norm = "layer"  # "rms": RMSNorm, a weight and no bias (Llama)
    n_kv_heads: int = 0  # key/value heads, dividing n_heads (grouped-query attention); 0: n_heads
    explicit_head_dim: int = 0  # 0: d_model // n_heads; else H x Dh need not be D (Qwen3)
    qkv_bias: bool = True
    out_bias: bool = True
    mlp_bias: bool = True
    qk_norm: bool = False  # a norm over each head of q and of k, before RoPE (Qwen3)
    qk_norm_scope: QKNormScope = (
        "head"  # "projection": one norm over all heads of q, one of k (OLMoE, OLMo 2)
    )
    sliding_window: int = 0  # W > 0: a query sees the last W keys, itself included (Mistral); 0: all
    rope_scaling: RopeScaling = "none"  # of the rotary frequencies; see rope_frequencies
    rope_factor: float = 1.0  # linear, llama3
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_context: int = 0  # llama3, yarn, longrope: the context pretrained with; 0: context_length
    rope_short_factors: tuple[float, ...] = ()  # longrope: frequency i / factor i before the original context
    rope_long_factors: tuple[float, ...] = ()  # longrope: frequency i / factor i from the original context on
    rope_beta_fast: float = 32.0  # yarn: rotations per original context above which frequencies stay
    rope_beta_slow: float = 1.0  # yarn: ... below which they are interpolated
    rope_truncate: bool = True  # yarn: the ramp between them on whole dims
    rope_attention_factor: float = 1.0  # cos and sin times this (longrope's, yarn's mscale); 1: unscaled
    rotary_dim: int = 0  # RoPE on the first rotary_dim features of each head (Phi-4-mini); 0: all of them
    # One per layer where the layers attend differently; (): every layer LayerAttention(sliding_window).
    layer_attention: tuple[LayerAttention, ...] = ()
    norm_placement: NormPlacement = "pre"  # "post": norm(sublayer(x)) (OLMo 2); "sandwich": both (Gemma)
    embedding_scale: float = 1.0  # the token embeddings times this (Gemma: sqrt(d_model); Granite)
    residual_scale: float = 1.0  # each sublayer's output times this before it is added (Granite)
    attn_scale: float = 0.0  # of q.k; 0: 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar^-0.5; Granite)
    attn_softcap: float = 0.0  # c > 0: scores become c * tanh(scores / c) before the mask (Gemma 2)
    logit_scale: float = 1.0  # the logits times this (Granite: 1 / logits_scaling)
    logit_softcap: float = 0.0  # c > 0: logits become c * tanh(logits / c), after logit_scale (Gemma 2)
    attention_sinks: bool = False  # a learned logit per head beside the keys in the softmax (gpt-oss)
    experts: ExpertsConfig | None = None  # sparse feed-forward layers (export/moe.py); None: dense

    def __post_init__(self) -> None:
        # A config read back from a dict or JSON has lists and dicts where the dataclass holds tuples.
        layers = tuple(
            LayerAttention(**layer) if isinstance(layer, dict) else layer for layer in self.layer_attention
        )
        object.__setattr__(self, "layer_attention", layers)
        for name in ("rope_short_factors", "rope_long_factors"):
            object.__setattr__(self, name, tuple(float(f) for f in getattr(self, name)))
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in (
            "n_kv_heads",
            "explicit_head_dim",
            "sliding_window",
            "rope_original_context",
            "rotary_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.explicit_head_dim and self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_kv_heads ({self.kv_heads}) must divide n_heads ({self.n_heads})")
        if self.positions not in ("learned", "sinusoidal", "rotary"):
            raise ValueError(f"positions must be learned, sinusoidal or rotary, not {self.positions!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, not {self.activation!r}")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be layer or rms, not {self.norm!r}")
        if self.positions == "rotary" and self.rotary_features % 2:
            raise ValueError(
                f"rotary positions need an even head_dim (or rotary_dim), got {self.rotary_features}"
            )
        if self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim ({self.rotary_dim}) must not exceed head_dim ({self.head_dim})")
        if self.layer_attention and len(self.layer_attention) != self.n_layers:
            raise ValueError(
                f"layer_attention has {len(self.layer_attention)} entries for {self.n_layers} layers"
            )
        if self.layer_attention and self.sliding_window:
            raise ValueError("give the window in layer_attention or in sliding_window, not both")
        if not all(isinstance(layer, LayerAttention) for layer in self.layer_attention):
            raise ValueError("layer_attention must hold LayerAttention entries")
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(
                f"norm_placement must be one of {', '.join(NORM_PLACEMENTS)}, not {self.norm_placement!r}"
            )
        for name in ("embedding_scale", "residual_scale", "logit_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("attn_scale", "attn_softcap", "logit_softcap"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be positive (or 0: none), got {getattr(self, name)}")
        if self.qk_norm_scope not in QK_NORM_SCOPES:
            raise ValueError(f"qk_norm_scope must be head or projection, not {self.qk_norm_scope!r}")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(
                f"rope_scaling must be one of {', '.join(ROPE_SCALINGS)}, not {self.rope_scaling!r}"
            )
        if self.rope_factor <= 0:
            raise ValueError(f"rope_factor must be positive, got {self.rope_factor}")
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError(
                f"llama3 rope scaling needs rope_high_freq_factor ({self.rope_high_freq_factor}) above "
                f"rope_low_freq_factor ({self.rope_low_freq_factor})"
            )
        if self.rope_scaling == "longrope":
            pairs = self.rotary_features // 2
            for name in ("rope_short_factors", "rope_long_factors"):
                factors = getattr(self, name)
                if len(factors) != pairs or not all(f > 0 for f in factors):
                    raise ValueError(f"longrope needs {pairs} positive {name}, got {factors!r}")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.d_model // self.n_heads

    @property
    def rotary_features(self) -> int:
        """The features of each head RoPE rotates: the first rotary_dim, or all head_dim."""
        return self.rotary_dim or self.head_dim

    @property
    def layers(self) -> tuple[LayerAttention, ...]:
        """Each layer's attention: layer_attention, or every layer alike with sliding_window."""
        return self.layer_attention or (LayerAttention(window=self.sliding_window),) * self.n_layers

    @property
    def rope_thetas(self) -> tuple[float, ...]:
        """The RoPE bases the rotary layers use, each once: 0.0 (the config's RoPE) first if any use it."""
        if self.positions != "rotary":
            return ()
        return tuple(sorted({layer.rope_theta for layer in self.layers if layer.rotary}))

    @property
    def attention_scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, or n_heads when it is 0."""
        return self.n_kv_heads or self.n_heads

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def sparse(self, layer: int) -> bool:
        """Whether the layer's feed-forward is the experts (export/moe.py)."""
        return self.experts is not None and self.experts.sparse(layer)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> DecoderConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown decoder config keys: {sorted(unknown)}")
        experts = data.get("experts")
        if isinstance(experts, dict):
            data = {**data, "experts": ExpertsConfig.from_dict(experts)}
        return cls(**data)  # type: ignore[arg-type]  # layer_attention's dicts: __post_init__


def sinusoidal_table(length: int, dim: int) -> Tensor:
    """The fixed sin/cos position table of "Attention is all you need": [length, dim]."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    inv = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv[: dim // 2])
    return table


def rope_frequencies(cfg: DecoderConfig, theta: float = 0.0, long: bool = False) -> Tensor:
    """The rotary angle per position of each rotated pair of the head dim, [rotary/2], scaled as cfg says;
    with `theta` > 0, that base unscaled instead (a layer's own RoPE, LayerAttention.rope_theta).

    The scalings are of the frequencies, so the tables do not depend on the sequence length:
    - linear: every frequency / factor (positions interpolated by the factor);
    - longrope: each frequency / its own short factor, or with `long` its long factor (transformers'
      _compute_longrope_parameters; rotary_tables uses the long ones from the original context on and
      scales cos and sin by the attention factor);
    - llama3: wavelengths shorter than original / high_freq_factor unchanged, longer than
      original / low_freq_factor divided by the factor, and those between interpolated smoothly
      (transformers' _compute_llama3_parameters);
    - yarn: dims that turn more than beta_fast times over the original context unchanged, fewer than
      beta_slow times divided by the factor, a linear ramp between (transformers' _compute_yarn_parameters;
      the attention factor scales the tables, rotary_tables).
    """
    dim = cfg.rotary_features
    inv = 1.0 / (theta or cfg.rope_theta) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if theta:
        return inv
    factor = cfg.rope_factor
    if cfg.rope_scaling == "linear":
        return inv / factor
    if cfg.rope_scaling == "longrope":
        factors = cfg.rope_long_factors if long else cfg.rope_short_factors
        return inv / torch.tensor(factors, dtype=torch.float32)
    if cfg.rope_scaling == "llama3":
        original = cfg.rope_original_context or cfg.context_length
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        wavelength = 2 * math.pi / inv
        long_scaled = torch.where(wavelength > original / low, inv / factor, inv)
        smooth = (original / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * long_scaled / factor + smooth * long_scaled
        medium = (wavelength >= original / high) & (wavelength <= original / low)
        return torch.where(medium, smoothed, long_scaled)
    if cfg.rope_scaling == "yarn":
        original = cfg.rope_original_context or cfg.context_length

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

        low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
        if cfg.rope_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
        extrapolated = 1 - ramp
        return inv / factor * (1 - extrapolated) + inv * extrapolated
    return inv


def rotary_tables(cfg: DecoderConfig, theta: float = 0.0) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, [context_length, rotary/2] each (GPT-NeoX, non-interleaved
    halves), times the attention factor of the config's RoPE; `theta` as rope_frequencies takes it.

    longrope: the rows before the original context of the short factors' frequencies, the rows from it on
    of the long factors'. transformers picks one set per forward call, by the call's last position, for all
    of the call's positions; a row of its own per position makes a token's rotation depend on its position
    alone (not on how the sequence is cut into calls, nor on its batch), which is what transformers gives
    when it is fed one token per call with its KV cache, and what a KV cache computed once needs."""
    positions = torch.arange(cfg.context_length, dtype=torch.float32)[:, None]
    angles = positions * rope_frequencies(cfg, theta)[None, :]
    if cfg.rope_scaling == "longrope" and not theta:
        original = cfg.rope_original_context or cfg.context_length
        long = positions[original:] * rope_frequencies(cfg, long=True)[None, :]
        angles = torch.cat((angles[:original], long))
    scale = 1.0 if theta else cfg.rope_attention_factor
    return torch.cos(angles) * scale, torch.sin(angles) * scale


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x1[i], x2[i]) of the two halves of the first 2 * cos.shape[-1] features of the head
    dim, the rest unchanged (partial rotary). x [B,H,S,Dh], cos/sin [B,1,S,rotary/2]."""
    rotary = 2 * cos.shape[-1]
    x1, x2 = x[..., : rotary // 2], x[..., rotary // 2 : rotary]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary:]), dim=-1)


def attention_bias(attention_mask: Tensor, seq_len: int, dtype: torch.dtype, window: int = 0) -> Tensor:
    """Additive causal + padding (+ sliding window) bias [B,1,S,T] from a 0/1 mask over past + new [B,T].

    New token i sits at absolute position T - S + i and may see key j iff j <= T - S + i and key j is
    not padding, and with a window W > 0 also j > T - S + i - W (the last W keys, itself included, as
    transformers' sliding_window_overlay). Padding is on the left only, so index distance is token
    distance. The causal part is built explicitly: SDPA's is_causal aligns top-left, which is wrong
    once there is a past. Masked entries get finfo.min, not -inf: a fully masked (padding) query row
    then softmaxes to a uniform row instead of NaN, which ONNX Runtime would propagate.
    """
    total = attention_mask.shape[-1]
    key_pos = torch.arange(total, device=attention_mask.device)
    # Offset arithmetic, not a slice under a Python `if`: no shape-dependent branch for the tracer.
    query_pos = torch.arange(seq_len, device=attention_mask.device) + (total - seq_len)
    causal = key_pos[None, :] <= query_pos[:, None]  # [S,T]
    if window:
        causal = causal & (key_pos[None, :] > query_pos[:, None] - window)
    allowed = causal[None, None, :, :] & attention_mask[:, None, None, :].bool()  # [B,1,S,T]
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def make_norm(cfg: DecoderConfig, dim: int) -> nn.LayerNorm | nn.RMSNorm:
    """The config's norm over the last `dim` features: LayerNorm (weight and bias) or RMSNorm (weight)."""
    if cfg.norm == "rms":
        return nn.RMSNorm(dim, eps=cfg.layer_norm_eps)
    return nn.LayerNorm(dim, eps=cfg.layer_norm_eps)


class Attention(nn.Module):
    """Causal self-attention; with n_kv_heads < n_heads, grouped-query: query head h reads key/value head
    h // (H / Hkv), as transformers' repeat_kv and ONNX Runtime's GroupQueryAttention do."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.q_dim, self.kv_dim = cfg.q_dim, cfg.kv_dim
        # One projection for q, k and v: rows [0, H*Dh) are q, then Hkv*Dh of k, then Hkv*Dh of v.
        self.qkv = nn.Linear(cfg.d_model, self.q_dim + 2 * self.kv_dim, bias=cfg.qkv_bias)
        self.out = nn.Linear(self.q_dim, cfg.d_model, bias=cfg.out_bias)
        self.per_head_norm = cfg.qk_norm_scope == "head"
        q_features, k_features = (cfg.head_dim,) * 2 if self.per_head_norm else (cfg.q_dim, cfg.kv_dim)
        self.q_norm = make_norm(cfg, q_features) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, k_features) if cfg.qk_norm else None
        self.scale = cfg.attn_scale or None  # None: SDPA's own 1/sqrt(Dh)
        self.softcap = cfg.attn_softcap
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attention_sinks else None
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)
        # Inspection only: when set, the weights are computed explicitly and kept in `recorded`.
        self.record = False
        self.recorded: Tensor | None = None

    def split_heads(self, x: Tensor, heads: int) -> Tensor:
        return x.unflatten(-1, (heads, self.head_dim)).transpose(1, 2)  # [B,S,heads*Dh] -> [B,heads,S,Dh]

    def forward(
        self, x: Tensor, bias: Tensor, past: KV, rotary: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, KV]:
        q, k, v = self.qkv(x).split((self.q_dim, self.kv_dim, self.kv_dim), dim=-1)
        if self.q_norm is not None and self.k_norm is not None and not self.per_head_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # over all heads at once
        q = self.split_heads(q, self.n_heads)  # [B,H,S,Dh]
        k, v = self.split_heads(k, self.kv_heads), self.split_heads(v, self.kv_heads)  # [B,Hkv,S,Dh]
        if self.q_norm is not None and self.k_norm is not None and self.per_head_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # over Dh, each head on its own
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        k = torch.cat((past[0], k), dim=2)  # [B,Hkv,T,Dh]: the cache keeps the key/value heads only
        v = torch.cat((past[1], v), dim=2)
        present = (k, v)
        if self.kv_heads != self.n_heads:  # each key/value head serves H / Hkv consecutive query heads
            k = k.repeat_interleave(self.n_heads // self.kv_heads, dim=1)  # [B,H,T,Dh]
            v = v.repeat_interleave(self.n_heads // self.kv_heads, dim=1)
        if self.record or self.softcap or self.sinks is not None:  # what SDPA lacks: computed here
            scores = q @ k.transpose(-2, -1) * (self.scale or 1 / math.sqrt(self.head_dim))  # [B,H,S,T]
            if self.softcap:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            scores = scores + bias
            if self.sinks is None:
                weights = scores.softmax(dim=-1)
            else:  # each head's sink takes its share of the softmax and is dropped
                sink = self.sinks[None, :, None, None].expand(*scores.shape[:-1], 1)
                weights = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
            if self.record:
                self.recorded = weights.detach()
            y = F.dropout(weights, self.dropout, self.training) @ v
        else:
            drop = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, dropout_p=drop, scale=self.scale
            )  # [B,H,S,Dh]
        y = y.transpose(1, 2).flatten(2)  # [B,S,H*Dh]
        return self.resid_dropout(self.out(y)), present


class FeedForward(nn.Module):
    """down(act(up(x))); gated (SwiGLU, GeGLU): `up` computes [gate; up] ([B,S,2F]), down(act(gate) * up)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gated = cfg.activation in GATED_ACTIVATIONS
        self.up = nn.Linear(cfg.d_model, (2 if self.gated else 1) * cfg.d_ff, bias=cfg.mlp_bias)
        self.act: nn.Module = {
            "gelu": nn.GELU(),
            "gelu_tanh": nn.GELU(approximate="tanh"),  # GPT-2's gelu_new
            "relu": nn.ReLU(),
            "swiglu": nn.SiLU(),
            "geglu": nn.GELU(approximate="tanh"),  # Gemma's gelu_pytorch_tanh
        }[cfg.activation]
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.mlp_bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.up(x)  # [B,S,F] or [B,S,2F]
        if self.gated:
            gate, h = h.chunk(2, dim=-1)  # [B,S,F] each
            h = self.act(gate) * h
        else:
            h = self.act(h)
        return self.dropout(self.down(h))


class Block(nn.Module):
    """Residual block: x + scale * attn(x), then x + scale * ffn(x), each sublayer with the norms of the
    config's norm_placement: "pre" sublayer(norm(x)), "post" norm(sublayer(x)), "sandwich" both; the ffn is
    the experts in a sparse layer."""

    def __init__(self, cfg: DecoderConfig, layer: int) -> None:
        super().__init__()
        pre, post = cfg.norm_placement != "post", cfg.norm_placement != "pre"
        self.ln_attn = make_norm(cfg, cfg.d_model) if pre else None
        self.attn = Attention(cfg)
        self.ln_attn_out = make_norm(cfg, cfg.d_model) if post else None
        self.ln_ffn = make_norm(cfg, cfg.d_model) if pre else None
        self.ffn: FeedForward | Experts = (
            Experts(cfg.d_model, cfg.experts)
            if cfg.experts is not None and cfg.sparse(layer)
            else FeedForward(cfg)
        )
        self.ln_ffn_out = make_norm(cfg, cfg.d_model) if post else None
        self.residual_scale = cfg.residual_scale

    def forward(
        self, x: Tensor, bias: Tensor, past: KV, rotary: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, KV]:
        a, present = self.attn(_normed(self.ln_attn, x), bias, past, rotary)
        x = x + _scaled(_normed(self.ln_attn_out, a), self.residual_scale)
        f = self.ffn(_normed(self.ln_ffn, x))
        return x + _scaled(_normed(self.ln_ffn_out, f), self.residual_scale), present


def _normed(norm: nn.Module | None, x: Tensor) -> Tensor:
    return x if norm is None else norm(x)


def _scaled(x: Tensor, scale: float) -> Tensor:
    return x if scale == 1.0 else x * scale


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.positions == "learned":
            self.pos_emb = nn.Embedding(cfg.context_length, cfg.d_model)
        self.make_tables()
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.ln_f = make_norm(cfg, cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    def make_tables(self) -> None:
        """(Re)compute the fixed position tables, non-persistent buffers: for a model built on the meta
        device whose weights were then loaded (export/hf_import.py). Rotary: one cos/sin pair per RoPE
        base the layers use (rope_cos_0 / rope_sin_0, ... in the order of cfg.rope_thetas)."""
        cfg = self.cfg
        if cfg.positions == "sinusoidal":
            self.register_buffer(
                "pos_table", sinusoidal_table(cfg.context_length, cfg.d_model), persistent=False
            )
        for j, theta in enumerate(cfg.rope_thetas):
            cos, sin = rotary_tables(cfg, theta)
            self.register_buffer(f"rope_cos_{j}", cos, persistent=False)
            self.register_buffer(f"rope_sin_{j}", sin, persistent=False)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def buffer(self, name: str) -> Tensor:
        """A registered (non-persistent) table, typed: the position and rotary tables."""
        table = getattr(self, name)
        assert isinstance(table, Tensor)
        return table

    def block_list(self) -> list[Block]:
        return [b for b in self.blocks if isinstance(b, Block)]

    def empty_past(self, batch: int) -> list[KV]:
        cfg = self.cfg
        shape = (batch, cfg.kv_heads, 0, cfg.head_dim)
        dev, dt = self.tok_emb.weight.device, self.tok_emb.weight.dtype
        return [
            (torch.zeros(shape, device=dev, dtype=dt), torch.zeros(shape, device=dev, dtype=dt))
            for _ in range(cfg.n_layers)
        ]

    def forward(
        self,
        input_ids: Tensor,  # [B,S] int64
        attention_mask: Tensor,  # [B,T] 0/1
        position_ids: Tensor,  # [B,S] int64
        past_key_values: list[KV] | None = None,  # per layer ([B,Hkv,P,Dh], [B,Hkv,P,Dh])
    ) -> tuple[Tensor, list[KV]]:
        cfg = self.cfg
        if past_key_values is None:
            past_key_values = self.empty_past(input_ids.shape[0])
        x = _scaled(self.tok_emb(input_ids), cfg.embedding_scale)  # [B,S,D]
        if cfg.positions == "learned":
            x = x + self.pos_emb(position_ids)
        elif cfg.positions == "sinusoidal":
            x = x + self.buffer("pos_table")[position_ids]
        rotaries = {
            theta: (
                self.buffer(f"rope_cos_{j}")[position_ids][:, None],
                self.buffer(f"rope_sin_{j}")[position_ids][:, None],
            )  # [B,1,S,rotary/2]
            for j, theta in enumerate(cfg.rope_thetas)
        }
        x = self.emb_dropout(x)
        biases = {
            w: attention_bias(attention_mask, input_ids.shape[1], x.dtype, w)  # [B,1,S,T]
            for w in sorted({layer.window for layer in cfg.layers})
        }
        presents: list[KV] = []
        for block, layer, past in zip(self.block_list(), cfg.layers, past_key_values, strict=True):
            rotary = rotaries.get(layer.rope_theta) if layer.rotary else None
            x, present = block(x, biases[layer.window], past, rotary)
            presents.append(present)
        logits = _scaled(self.lm_head(self.ln_f(x)), cfg.logit_scale)  # [B,S,V]
        if cfg.logit_softcap:
            logits = torch.tanh(logits / cfg.logit_softcap) * cfg.logit_softcap
        return logits, presents


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions of a left-padded batch: cumsum(mask) - 1, clamped at 0 for padding [B,T]."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def count_active_parameters(model: Decoder) -> int:
    """The weights one token reads: all but the experts it is not routed to (count_parameters when dense)."""
    experts = [b.ffn for b in model.block_list() if isinstance(b.ffn, Experts)]
    total = sum(p.numel() for e in experts for p in e.parameters())
    return count_parameters(model) - total + sum(e.active_parameters() for e in experts)
