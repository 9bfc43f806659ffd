"""The two logprobs formats: the legacy completions object and chat's `logprobs.content` entries, of the
tokens as the vocabulary shows them (serve/api/http/vocabulary.py)."""

from __future__ import annotations

from serve.api.http.vocabulary import Vocabulary
from serve.api.openai.protocol import CompletionLogprobs, TokenLogprob, TopLogprob
from serve.engine.sampling import Alternatives


def completion_logprobs(
    vocab: Vocabulary,
    token_ids: list[int],
    logprobs: list[float | None],
    tops: list[Alternatives | None],
    offset: int,
) -> tuple[CompletionLogprobs, int]:
    """The legacy completions `logprobs` object for some tokens, their text starting at `offset` of the
    choice's text; returns it and the offset after them."""
    tokens: list[str] = []
    offsets: list[int] = []
    top_dicts: list[dict[str, float] | None] = []
    for token_id, top in zip(token_ids, tops, strict=True):
        text = vocab.text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        top_dicts.append(
            None
            if top is None
            else {vocab.text(t): lp for t, lp in zip(top.token_ids, top.logprobs, strict=True)}
        )
    body: CompletionLogprobs = {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": top_dicts,
        "text_offset": offsets,
    }
    return body, offset


def chat_logprobs(
    vocab: Vocabulary, token_ids: list[int], logprobs: list[float], tops: list[Alternatives]
) -> list[TokenLogprob]:
    """Chat's `logprobs.content` entries for some tokens."""
    out: list[TokenLogprob] = []
    for index, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
        text, raw = vocab.token(token_id)
        top = tops[index] if index < len(tops) else None
        alternatives: list[TopLogprob] = (
            []
            if top is None
            else [
                {"token": vocab.token(t)[0], "logprob": lp, "bytes": vocab.token(t)[1]}
                for t, lp in zip(top.token_ids, top.logprobs, strict=True)
            ]
        )
        out.append({"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": alternatives})
    return out
