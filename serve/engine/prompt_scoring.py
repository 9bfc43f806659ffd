"""Prompt logprobs (vLLM's `prompt_logprobs`, TGI's `decoder_input_details`): how likely the model finds each
prompt token after the ones before it, what evaluation harnesses score texts with.

The serving graph returns one position's logits per row (its head runs on the last position only: see
export/onnx_inplace.py), so a prompt is scored by the bundle's standard graph, which returns every
position's logits, run on the prompt alone with an empty past. Its session is created on first use, with the
serving session's providers and threads: built from the prepared graph (serve/engine/prepared.py) it maps the
serving session's packed weights, from the bundle's graph it packs a second copy, which a server that is never
asked for prompt logprobs does not pay for, nor for hashing the graph's file (the bundle checks it when it is
first asked for: a changed file fails each request for prompt logprobs with a BundleError naming it). On an
INT8 bundle the two graphs are quantized separately, so the scores can differ from the serving graph's
logprobs in the last digits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from serve.engine.runtime import TENSORRT, create_session
from serve.engine.sampling import PromptScores, score_tokens
from serve.engine.types import SessionConfig

_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def scoring_session(serving: SessionConfig, providers: Sequence[str]) -> SessionConfig:
    """The scorer's session: the serving session's threads and providers (as resolved), but TensorRT, which
    builds an engine per input shape profile while prompts come in every length."""
    return replace(serving, providers=tuple(p for p in providers if p != TENSORRT), tensorrt_options={})


class PromptScorer:
    def __init__(self, graph: Callable[[], Path], session: SessionConfig) -> None:
        self._graph = graph
        self._config = session
        self._session: Any = None
        self._empty_past: dict[str, np.ndarray] = {}

    def score(self, prompt_ids: Sequence[int], top: int = 0) -> PromptScores:
        """The prompt's scores under the model's raw distribution, with the `top` most likely tokens of each
        position (0: none)."""
        if len(prompt_ids) < 2:
            return PromptScores([], [])
        session = self._session or self._open()
        ids = np.asarray(prompt_ids, dtype=np.int64)[None]
        feed = {
            "input_ids": ids,
            "attention_mask": np.ones_like(ids),
            "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None],
            **self._empty_past,
        }
        (logits,) = session.run(["logits"], feed)  # [1, len, vocab]; position i predicts token i + 1
        chosen, alternatives = score_tokens(logits[0, :-1], ids[0, 1:], top)
        return PromptScores(chosen.tolist(), alternatives)

    def _open(self) -> Any:
        session = create_session(self._graph(), self._config)
        for spec in session.get_inputs():
            if spec.name.startswith("past_"):  # [batch, heads, past, head_dim]: one row, nothing past
                _, heads, _, head_dim = spec.shape
                self._empty_past[spec.name] = np.zeros((1, heads, 0, head_dim), _NUMPY_TYPES[spec.type])
        self._session = session
        return session
