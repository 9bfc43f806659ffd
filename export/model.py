"""A GPT-style decoder-only transformer, written from first principles.

One function serves prefill and decode: ``forward`` takes the new tokens, the attention mask over
past + new positions, their position ids and the past key/values (possibly empty, P = 0), and returns
the logits of the new tokens with the present key/values (past + new).

Shapes in comments: B batch, S new tokens, P past tokens, T = P + S, H heads, Dh head dim, D d_model,
V vocab.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Positions = Literal["learned", "sinusoidal", "rotary"]
Activation = Literal["gelu", "relu"]
KV = tuple[Tensor, Tensor]


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
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.positions not in ("learned", "sinusoidal", "rotary"):
            raise ValueError(f"positions must be learned, sinusoidal or rotary, not {self.positions!r}")
        if self.activation not in ("gelu", "relu"):
            raise ValueError(f"activation must be gelu or relu, not {self.activation!r}")
        if self.positions == "rotary" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head_dim, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> DecoderConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown decoder config keys: {sorted(unknown)}")
        return cls(**data)  # type: ignore[arg-type]


def sinusoidal_table(length: int, dim: int) -> Tensor:
    """The fixed sin/cos position table of "Attention is all you need": [length, dim]."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    inv = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv[: dim // 2])
    return table


def rotary_tables(length: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, [length, head_dim / 2] each (GPT-NeoX, non-interleaved halves)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cos(angles), torch.sin(angles)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x1[i], x2[i]) of the two halves of the head dim. x [B,H,S,Dh], cos/sin [B,1,S,Dh/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attention_bias(attention_mask: Tensor, seq_len: int, dtype: torch.dtype) -> Tensor:
    """Additive causal + padding bias [B,1,S,T] from a 0/1 mask over past + new positions [B,T].

    New token i sits at absolute position T - S + i and may see key j iff j <= T - S + i and key j is
    not padding. The causal part is built explicitly: SDPA's is_causal aligns top-left, which is wrong
    once there is a past. Masked entries get finfo.min, not -inf: a fully masked (padding) query row
    then softmaxes to a uniform row instead of NaN, which ONNX Runtime would propagate.
    """
    total = attention_mask.shape[-1]
    key_pos = torch.arange(total, device=attention_mask.device)
    # Offset arithmetic, not a slice under a Python `if`: no shape-dependent branch for the tracer.
    query_pos = torch.arange(seq_len, device=attention_mask.device) + (total - seq_len)
    causal = key_pos[None, :] <= query_pos[:, None]  # [S,T]
    allowed = causal[None, None, :, :] & attention_mask[:, None, None, :].bool()  # [B,1,S,T]
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.d_model = cfg.d_model
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)
        # Inspection only: when set, the weights are computed explicitly and kept in `recorded`.
        self.record = False
        self.recorded: Tensor | None = None

    def split_heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.n_heads, self.head_dim)).transpose(1, 2)  # [B,S,D] -> [B,H,S,Dh]

    def forward(
        self, x: Tensor, bias: Tensor, past: KV, rotary: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, KV]:
        q, k, v = (self.split_heads(t) for t in self.qkv(x).split(self.d_model, dim=-1))  # [B,H,S,Dh] each
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        k = torch.cat((past[0], k), dim=2)  # [B,H,T,Dh]
        v = torch.cat((past[1], v), dim=2)
        if self.record:
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim) + bias  # [B,H,S,T]
            weights = scores.softmax(dim=-1)
            self.recorded = weights.detach()
            y = weights @ v
        else:
            drop = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=drop)  # [B,H,S,Dh]
        y = y.transpose(1, 2).flatten(2)  # [B,S,D]
        return self.resid_dropout(self.out(y)), (k, v)


class FeedForward(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.d_ff)
        self.act: nn.Module = nn.GELU() if cfg.activation == "gelu" else nn.ReLU()
        self.down = nn.Linear(cfg.d_ff, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.down(self.act(self.up(x))))


class Block(nn.Module):
    """Pre-LayerNorm residual block: x + attn(ln(x)), then x + ffn(ln(x))."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.attn = Attention(cfg)
        self.ln_ffn = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.ffn = FeedForward(cfg)

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
        elif cfg.positions == "sinusoidal":
            self.register_buffer(
                "pos_table", sinusoidal_table(cfg.context_length, cfg.d_model), persistent=False
            )
        else:
            cos, sin = rotary_tables(cfg.context_length, cfg.head_dim, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

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
        shape = (batch, cfg.n_heads, 0, cfg.head_dim)
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
        past_key_values: list[KV] | None = None,  # per layer ([B,H,P,Dh], [B,H,P,Dh])
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
        bias = attention_bias(attention_mask, input_ids.shape[1], x.dtype)  # [B,1,S,T]
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
