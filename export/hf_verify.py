"""transformers as the reference of a bundle exported from a Hugging Face folder (export.verify.Reference).

Each verification prompt is run alone (no padding) through the folder's model as transformers loads it
(`AutoModelForCausalLM`, float32, eager CPU), greedy for DECODE_STEPS tokens with its own KV cache, the way
`generate` runs; the logits are laid out as export.generation's left-padded `Generation`, so the bundle's
graphs are compared with them by the same code as with our PyTorch decoder. A longrope model's prompt that
runs past its original context is prefilled in one call up to it and one call per token after it, so each
position is rotated by its own factors, as in the bundle (export/model.py's rotary_tables). The model is
loaded when the reference is asked for and dropped before the bundle's sessions are made: the weights are
not held twice during the comparison.
"""

from __future__ import annotations

import gc
import inspect
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from export.generation import DECODE_STEPS, Generation, left_pad
from export.hf_import import HFImportError
from export.verify import Reference


def _load(folder: Path) -> torch.nn.Module:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise HFImportError(
            folder, f"verifying against transformers needs it ({exc}): pip install transformers"
        ) from exc
    major, minor = (int(p) for p in metadata.version("transformers").split(".")[:2])
    # `dtype` replaced `torch_dtype` in transformers 4.56.
    kwargs = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.float32}
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    except Exception as exc:  # what transformers raises for a folder it cannot load varies by version
        detail = " ".join(str(exc).split())
        raise HFImportError(
            folder,
            f"transformers could not load the model to verify against ({type(exc).__name__}: {detail})",
        ) from exc
    return model.eval()


def _longrope_original(model: torch.nn.Module) -> int | None:
    """The original context of a longrope model (original_max_position_embeddings), None for other RoPE."""
    config = getattr(model, "config", None)
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict) or params.get("rope_type", params.get("type")) != "longrope":
        return None
    original = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    return int(original) if original else None


@torch.no_grad()
def transformers_greedy(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], pad_id: int, steps: int = DECODE_STEPS
) -> Generation:
    """Each prompt alone: a prefill, then `steps` decode steps feeding back the argmax."""
    # transformers 5.x renamed the cache argument and output `cache` (past_key_values before).
    cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    _, prompt_mask = left_pad(prompts, pad_id)
    width = prompt_mask.shape[1]
    prefill: np.ndarray | None = None
    decode: list[list[np.ndarray]] = [[] for _ in range(steps)]
    own = np.zeros((len(prompts), steps + 1), np.int64)
    finite = True
    original = _longrope_original(model)
    for row, prompt in enumerate(prompts):
        ids = torch.tensor([list(prompt)])
        # One call, except for a longrope prompt past the original context: transformers would rotate all of
        # one call's positions by the long factors, the bundle each position by its own (export/model.py's
        # rotary_tables); one call up to the original context and one per token after it rotate as it does.
        cut = len(prompt) if original is None else min(len(prompt), original)
        parts: list[torch.Tensor] = []
        past: Any = None
        for start, stop in [(0, cut), *((i, i + 1) for i in range(cut, len(prompt)))]:
            mask = torch.ones(1, stop, dtype=torch.long)
            cache = {} if past is None else {cache_name: past}
            out = model(input_ids=ids[:, start:stop], attention_mask=mask, use_cache=True, **cache)
            parts.append(out.logits[0])
            past = out[cache_name]
        logits = torch.cat(parts).float().numpy()  # [S, V]
        if prefill is None:
            prefill = np.zeros((len(prompts), width, logits.shape[-1]), np.float32)
        prefill[row, width - len(prompt) :] = logits
        finite = finite and bool(np.isfinite(logits).all())
        token = int(logits[-1].argmax())
        own[row, 0] = token
        mask = torch.ones(1, len(prompt) + 1, dtype=torch.long)
        for t in range(steps):
            feed = {"input_ids": torch.tensor([[token]]), "attention_mask": mask, cache_name: past}
            out = model(**feed, use_cache=True)
            step = out.logits[0, -1].float().numpy()
            decode[t].append(step)
            finite = finite and bool(np.isfinite(step).all())
            token = int(step.argmax())
            own[row, t + 1] = token
            past, mask = out[cache_name], torch.ones(1, mask.shape[1] + 1, dtype=torch.long)
    assert prefill is not None
    logits_seen = [prefill, *(np.stack(rows) for rows in decode)]
    return Generation(own.copy(), own, logits_seen, prompt_mask, finite)


def transformers_reference(folder: Path | str) -> Reference:
    """The folder's transformers model as a verification reference (loaded when asked, then freed)."""
    folder = Path(folder)

    def generate(prompts: Sequence[Sequence[int]], pad_id: int) -> Generation:
        model = _load(folder)
        try:
            return transformers_greedy(model, prompts, pad_id)
        finally:
            del model
            gc.collect()

    return Reference("transformers", generate)
