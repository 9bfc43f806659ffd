"""Greedy generation with a KV cache over the standard graph's interface, for PyTorch and ONNX Runtime alike.

One loop (`greedy`) drives any step function taking the standard graph's inputs and returning its outputs
(`logits`, `present.*`), so the PyTorch reference, the exported graph and its INT8 variant are compared by
exactly the same code. Prompts are left-padded; decode concatenates caches (the graph does it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
import torch
from tokenizers import Tokenizer

from export.model import Decoder, position_ids_from_mask
from export.onnx_standard import standard_io_names

DECODE_STEPS = 20
# Python-ish prompts of different lengths, so the batch really is left-padded.
PROMPTS = (
    "def __init__(self",
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    'class Parser:\n    """',
    "for i in range(10):\n    if i % 2:\n        print(i)\n    else:",
    "x",
)

Feed = dict[str, np.ndarray]
StepFn = Callable[[Feed], list[np.ndarray]]  # standard graph inputs -> [logits, present...]


@dataclass(frozen=True)
class Shape:
    """The KV cache's shape: n_heads are its heads, the key/value heads (fewer than the query heads in a
    grouped-query model)."""

    n_layers: int
    n_heads: int
    head_dim: int


@dataclass
class Generation:
    tokens: np.ndarray  # [B, 1 + steps] the tokens fed back (forced or own)
    own: np.ndarray  # [B, 1 + steps] each step's argmax
    logits: list[np.ndarray]  # [B, S, V] for the prefill, then [B, V] per decode step
    prompt_mask: np.ndarray  # [B, S] 1 at real prompt positions
    finite: bool


def encode_prompts(tokenizer: Tokenizer, context_length: int, steps: int = DECODE_STEPS) -> list[list[int]]:
    """The fixed prompt set as token ids, cut so prompt + generated tokens fit the context."""
    room = context_length - steps - 1
    if room < 1:
        raise ValueError(f"context length {context_length} leaves no room for {steps} generated tokens")
    return [enc.ids[:room] or [0] for enc in tokenizer.encode_batch(list(PROMPTS))]


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = p
        mask[row, width - len(p) :] = 1
    return ids, mask


def _positions(mask: np.ndarray) -> np.ndarray:
    return position_ids_from_mask(torch.from_numpy(mask)).numpy()


def torch_step(model: Decoder) -> StepFn:
    n_layers = model.cfg.n_layers

    @torch.no_grad()
    def step(feed: Feed) -> list[np.ndarray]:
        t = {k: torch.from_numpy(v) for k, v in feed.items()}
        past = [(t[f"past_key_values.{i}.key"], t[f"past_key_values.{i}.value"]) for i in range(n_layers)]
        logits, presents = model(t["input_ids"], t["attention_mask"], t["position_ids"], past)
        return [logits.numpy(), *[x.numpy() for kv in presents for x in kv]]

    return step


def session_step(session: ort.InferenceSession) -> StepFn:
    names = [o.name for o in session.get_outputs()]
    expected = standard_io_names((len(names) - 1) // 2)[1]
    if names != expected:
        raise ValueError(f"not a standard KV-cache graph: outputs {names[:3]}..., expected {expected[:3]}...")
    return lambda feed: session.run(None, feed)


def greedy(
    step: StepFn,
    prompts: Sequence[Sequence[int]],
    pad_id: int,
    shape: Shape,
    steps: int = DECODE_STEPS,
    forced: np.ndarray | None = None,
    dtype: type = np.float32,
) -> Generation:
    """Prefill a left-padded batch, then `steps` decode steps feeding back argmax (or `forced`) tokens."""
    ids, prompt_mask = left_pad(prompts, pad_id)
    mask = prompt_mask
    batch = len(prompts)
    empty: np.ndarray = np.zeros((batch, shape.n_heads, 0, shape.head_dim), dtype)
    past = [empty] * (2 * shape.n_layers)
    positions = _positions(mask)
    fed: list[np.ndarray] = []
    own: list[np.ndarray] = []
    logits_seen: list[np.ndarray] = []
    finite = True
    names = standard_io_names(shape.n_layers)[0]
    for t in range(steps + 1):
        out = step(dict(zip(names, [ids, mask, positions, *past], strict=True)))
        finite = finite and all(bool(np.isfinite(x).all()) for x in out)
        logits_seen.append(out[0] if t == 0 else out[0][:, -1])
        own.append(out[0][:, -1].argmax(-1))
        fed.append(own[-1] if forced is None else forced[:, t])
        ids = fed[-1][:, None].astype(np.int64)
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
        positions = mask.sum(axis=1, keepdims=True) - 1
        past = out[1:]
    return Generation(np.stack(fed, 1), np.stack(own, 1), logits_seen, prompt_mask, finite)


def agreement_prefix(ref_tokens: np.ndarray, cand_tokens: np.ndarray) -> np.ndarray:
    """[B, T] True while row b's tokens up to and including step t all agree."""
    return np.cumprod(ref_tokens == cand_tokens, axis=1).astype(bool)
