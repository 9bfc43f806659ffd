"""A GPT-style decoder-only transformer, written from first principles.

One function serves prefill and decode: ``forward`` takes the new tokens, the attention mask over
past + new positions, their position ids and the past key/values (possibly empty, P = 0), and returns
the logits of the new tokens with the present key/values (past + new).

The defaults are the GPT-style decoder this project trains (LayerNorm, GELU MLP, multi-head attention, biases
everywhere). The other options are the blocks of the Hugging Face families export/hf_import.py reads: RMSNorm,
SwiGLU, tanh-approximated GELU, grouped-query attention (fewer key/value heads, each shared by a group of
query heads; the cache holds the key/value heads only), an explicit head dim, per-head RMSNorm of q and k,
scaled RoPE (linear, llama3), a sliding window, and sparse mixture-of-experts feed-forward layers
(export/moe.py).

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
Activation = Literal["gelu", "relu", "gelu_tanh", "swiglu"]
Norm = Literal["layer", "rms"]
QKNormScope = Literal["head", "projection"]
RopeScaling = Literal["none", "linear", "llama3", "yarn"]
KV = tuple[Tensor, Tensor]

ACTIVATIONS = ("gelu", "relu", "gelu_tanh", "swiglu")
NORMS = ("layer", "rms")
QK_NORM_SCOPES = ("head", "projection")
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")


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
    qk_norm_scope: QKNormScope = "head"  # "projection": one norm over all heads of q, one of k (OLMoE)
    sliding_window: int = 0  # W > 0: a query sees the last W keys, itself included (Mistral); 0: all
    rope_scaling: RopeScaling = "none"  # of the rotary frequencies; see rope_frequencies
    rope_factor: float = 1.0  # linear, llama3
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_context: int = (
        0  # llama3, yarn: the context the model was pretrained with; 0: context_length
    )
    rope_beta_fast: float = 32.0  # yarn: rotations per original context above which frequencies stay
    rope_beta_slow: float = 1.0  # yarn: ... below which they are interpolated
    rope_truncate: bool = True  # yarn: the ramp between them on whole dims
    rope_attention_factor: float = 1.0  # cos and sin scaled by it (yarn's mscale); 1: unscaled
    attention_sinks: bool = False  # a learned logit per head beside the keys in the softmax (gpt-oss)
    experts: ExpertsConfig | None = None  # sparse feed-forward layers (export/moe.py); None: dense

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("n_kv_heads", "explicit_head_dim", "sliding_window", "rope_original_context"):
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
        if self.qk_norm_scope not in QK_NORM_SCOPES:
            raise ValueError(f"qk_norm_scope must be head or projection, not {self.qk_norm_scope!r}")
        if self.positions == "rotary" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head_dim, got {self.head_dim}")
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

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.d_model // self.n_heads

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
        return cls(**data)  # type: ignore[arg-type]


def sinusoidal_table(length: int, dim: int) -> Tensor:
    """The fixed sin/cos position table of "Attention is all you need": [length, dim]."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    inv = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv[: dim // 2])
    return table


def rope_frequencies(cfg: DecoderConfig) -> Tensor:
    """The rotary angle per position of each pair of the head dim, [Dh/2], scaled as cfg says.

    The scalings are of the frequencies, so the tables do not depend on the sequence length:
    - linear: every frequency / factor (positions interpolated by the factor);
    - llama3: wavelengths shorter than original / high_freq_factor unchanged, longer than
      original / low_freq_factor divided by the factor, and those between interpolated smoothly
      (transformers' _compute_llama3_parameters);
    - yarn: dims that turn more than beta_fast times over the original context unchanged, fewer than
      beta_slow times divided by the factor, a linear ramp between (transformers' _compute_yarn_parameters;
      the attention factor scales the tables, rotary_tables).
    """
    dim = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    factor = cfg.rope_factor
    if cfg.rope_scaling == "linear":
        return inv / factor
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


def rotary_tables(cfg: DecoderConfig) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, [context_length, Dh/2] each (GPT-NeoX, non-interleaved halves)."""
    angles = torch.arange(cfg.context_length, dtype=torch.float32)[:, None] * rope_frequencies(cfg)[None, :]
    scale = cfg.rope_attention_factor
    return torch.cos(angles) * scale, torch.sin(angles) * scale


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x1[i], x2[i]) of the two halves of the head dim. x [B,H,S,Dh], cos/sin [B,1,S,Dh/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


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
        q_norm_dim, k_norm_dim = (cfg.head_dim,) * 2 if self.per_head_norm else (cfg.q_dim, cfg.kv_dim)
        self.q_norm = make_norm(cfg, q_norm_dim) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, k_norm_dim) if cfg.qk_norm else None
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
        if self.record or self.sinks is not None:
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim) + bias  # [B,H,S,T]
            if self.sinks is None:
                weights = scores.softmax(dim=-1)
            else:  # each head's sink takes its share of the softmax and is dropped
                sink = self.sinks[None, :, None, None].expand(*scores.shape[:-1], 1)
                weights = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
            if self.record:
                self.recorded = weights.detach()
            y = weights @ v
        else:
            drop = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=drop)  # [B,H,S,Dh]
        y = y.transpose(1, 2).flatten(2)  # [B,S,H*Dh]
        return self.resid_dropout(self.out(y)), present


class FeedForward(nn.Module):
    """down(act(up(x))); SwiGLU: `up` computes [gate; up] ([B,S,2F]) and down(silu(gate) * up)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gated = cfg.activation == "swiglu"
        self.up = nn.Linear(cfg.d_model, (2 if self.gated else 1) * cfg.d_ff, bias=cfg.mlp_bias)
        self.act: nn.Module = {
            "gelu": nn.GELU(),
            "gelu_tanh": nn.GELU(approximate="tanh"),  # GPT-2's gelu_new
            "relu": nn.ReLU(),
            "swiglu": nn.SiLU(),
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
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x)); the ffn is the experts in a sparse
    layer."""

    def __init__(self, cfg: DecoderConfig, layer: int) -> None:
        super().__init__()
        self.ln_attn = make_norm(cfg, cfg.d_model)
        self.attn = Attention(cfg)
        self.ln_ffn = make_norm(cfg, cfg.d_model)
        self.ffn: FeedForward | Experts = (
            Experts(cfg.d_model, cfg.experts)
            if cfg.experts is not None and cfg.sparse(layer)
            else FeedForward(cfg)
        )

    def forward(
        self, x: Tensor, bias: Tensor, past: KV, rotary: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, KV]:
        a, present = self.attn(self.ln_attn(x), bias, past, rotary)
        x = x + a
        return x + self.ffn(self.ln_ffn(x)), present


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
        device whose weights were then loaded (export/hf_import.py)."""
        cfg = self.cfg
        if cfg.positions == "sinusoidal":
            self.register_buffer(
                "pos_table", sinusoidal_table(cfg.context_length, cfg.d_model), persistent=False
            )
        elif cfg.positions == "rotary":
            cos, sin = rotary_tables(cfg)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

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
        if past_key_values is None:
            past_key_values = self.empty_past(input_ids.shape[0])
        x = self.tok_emb(input_ids)  # [B,S,D]
        rotary = None
        if self.cfg.positions == "learned":
            x = x + self.pos_emb(position_ids)
        elif self.cfg.positions == "sinusoidal":
            x = x + self.buffer("pos_table")[position_ids]
        else:
            rotary = (
                self.buffer("rope_cos")[position_ids][:, None],
                self.buffer("rope_sin")[position_ids][:, None],
            )  # [B,1,S,Dh/2]
        x = self.emb_dropout(x)
        bias = attention_bias(
            attention_mask, input_ids.shape[1], x.dtype, self.cfg.sliding_window
        )  # [B,1,S,T]
        presents: list[KV] = []
        for block, past in zip(self.block_list(), past_key_values, strict=True):
            x, present = block(x, bias, past, rotary)
            presents.append(present)
        return self.lm_head(self.ln_f(x)), presents  # [B,S,V]


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
