"""Recording the decoder's attention weights for a batch of texts.

The weights come from the model's own forward (`Attention.record`), not from a re-implementation, and
`recompute_errors` checks that they are the weights the fast (SDPA) path applies: recomputing each layer's
output from the recorded weights and its V reproduces the output of the unrecorded forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer
from torch import Tensor

from export.model import KV, Attention, Decoder, position_ids_from_mask
from export.tokenizer import PAD_ID

PAD_LABEL = "<pad>"
# Make whitespace visible in tick labels (glyphs that matplotlib's bundled DejaVu Sans has).
_VISIBLE = str.maketrans({" ": "␣", "\n": "↵", "\t": "→", "\r": "\\r"})


class InspectionError(ValueError):
    """Input the inspection cannot work with (an empty text, a text longer than the context, ...)."""


@dataclass(frozen=True)
class TextBatch:
    """Texts encoded and left-padded into one batch, as `position_ids_from_mask` expects."""

    input_ids: Tensor  # [B,S] int64
    attention_mask: Tensor  # [B,S] int64 0/1
    position_ids: Tensor  # [B,S] int64
    labels: list[list[str]]  # [B][S] decoded token strings, PAD_LABEL on padding
    truncated: list[bool]  # per text: cut to max_tokens

    @property
    def lengths(self) -> list[int]:
        return [int(n) for n in self.attention_mask.sum(dim=1)]

    def allowed(self) -> Tensor:
        """[B,S,S] bool: which keys each real query may attend to (causal and not padding)."""
        s = self.input_ids.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        mask = self.attention_mask.bool()
        return causal[None] & mask[:, None, :] & mask[:, :, None]


def token_label(tokenizer: Tokenizer, token_id: int) -> str:
    """One token as readable text, whitespace made visible.

    A token holding part of a multi-byte character decodes to U+FFFD alone; its byte-level symbol
    string (e.g. "Ã©") tells such tokens apart.
    """
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if "\ufffd" in text:
        return tokenizer.id_to_token(token_id) or text
    return text.translate(_VISIBLE)


def encode_texts(tokenizer: Tokenizer, texts: list[str], max_tokens: int) -> TextBatch:
    """Encode each text (cut to `max_tokens`) and left-pad them to one length."""
    if not texts:
        raise InspectionError("no text to inspect")
    encoded = [tokenizer.encode(text).ids for text in texts]
    for i, ids in enumerate(encoded):
        if not ids:
            raise InspectionError(f"text {i + 1} is empty: give at least one token of text")
    truncated = [len(ids) > max_tokens for ids in encoded]
    encoded = [ids[:max_tokens] for ids in encoded]
    width = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(encoded), width), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)
    labels = []
    for row, ids in enumerate(encoded):
        pad = width - len(ids)
        input_ids[row, pad:] = torch.tensor(ids)
        attention_mask[row, pad:] = 1
        labels.append([PAD_LABEL] * pad + [token_label(tokenizer, t) for t in ids])
    return TextBatch(input_ids, attention_mask, position_ids_from_mask(attention_mask), labels, truncated)


def attention_layers(model: Decoder) -> list[Attention]:
    return [module for module in model.modules() if isinstance(module, Attention)]


@contextmanager
def recording(model: Decoder) -> Iterator[list[Attention]]:
    """Switch every layer to the explicit, recording attention path; restore the flags on exit.

    The recorded tensors are dropped on exit so a checkpoint held in memory does not keep them alive.
    """
    layers = attention_layers(model)
    previous = [layer.record for layer in layers]
    for layer in layers:
        layer.record = True
    try:
        yield layers
    finally:
        for layer, was in zip(layers, previous, strict=True):
            layer.record = was
            layer.recorded = None


def _recorded(layers: list[Attention]) -> list[Tensor]:
    weights = [layer.recorded for layer in layers]
    missing = [i for i, w in enumerate(weights) if w is None]
    if missing:
        raise RuntimeError(f"attention layers {missing} recorded nothing: is the record flag honoured?")
    return weights  # type: ignore[return-value]


def _forward(model: Decoder, batch: TextBatch) -> None:
    model(batch.input_ids, batch.attention_mask, batch.position_ids)


@torch.no_grad()
def record_attention(model: Decoder, batch: TextBatch) -> Tensor:
    """Attention weights [L,B,H,S,S] of the batch.

    Rows of padding queries are zeroed: their keys are all masked, so the softmax over finfo.min scores
    gives them a meaningless uniform row. Every other row sums to 1 over its allowed keys.
    """
    with recording(model) as layers:
        _forward(model, batch)
        weights = torch.stack(_recorded(layers))
    return weights * batch.attention_mask[None, :, None, :, None].to(weights.dtype)


@torch.no_grad()
def recompute_errors(model: Decoder, batch: TextBatch) -> list[float]:
    """Per layer, max |out_proj(recorded weights @ V) - the layer's output on the fast path|, relative to
    max |the layer's output| (trained layers write values of very different sizes)."""
    layers = attention_layers(model)
    fast: list[tuple[Tensor, KV]] = []
    hooks = [layer.register_forward_hook(lambda _m, _args, out: fast.append(out)) for layer in layers]
    try:
        _forward(model, batch)
    finally:
        for hook in hooks:
            hook.remove()
    with recording(model):
        _forward(model, batch)
        weights = _recorded(layers)
    errors = []
    for layer, w, (output, (_k, v)) in zip(layers, weights, fast, strict=True):
        b, _, s, _ = w.shape
        mixed = (w @ v).transpose(1, 2).reshape(b, s, -1)  # [B,S,D]
        scale = output.abs().max().clamp(min=torch.finfo(output.dtype).tiny)
        errors.append(float((layer.out(mixed) - output).abs().max() / scale))
    return errors


def weight_on_padding(weights: Tensor, batch: TextBatch) -> float:
    """The most total weight any query puts on padding keys; weights [L,B,H,S,S]. 0 when masking works."""
    pad_keys = ~batch.attention_mask.bool()  # [B,T]
    return float((weights * pad_keys[None, :, None, None, :]).sum(-1).max())
