"""Tokens as OpenAI shows them (each id's text and bytes) and the two logprobs formats: the legacy
completions object and chat's `logprobs.content` entries."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders

from serve.api.openai.protocol import CompletionLogprobs, TokenLogprob, TopLogprob
from serve.engine.sampling import Alternatives

# --- tokens as OpenAI shows them ----------------------------------------------------------------------------


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet backwards: each printable stand-in character -> its byte."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class Vocabulary:
    """Each token id's text (decoded alone, special tokens kept) and bytes, cached."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._bytes_of = _byte_decoder()
        self._special = {
            token.content for token in tokenizer.get_added_tokens_decoder().values() if token.special
        }
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def token(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            piece = self._tokenizer.id_to_token(token_id)
            if self._byte_level and piece is not None and piece not in self._special:
                raw = [self._bytes_of[c] for c in piece if c in self._bytes_of]
            else:
                raw = list(text.encode("utf-8"))
            cached = self._cache[token_id] = (text, raw)
        return cached

    def text(self, token_id: int) -> str:
        return self.token(token_id)[0]


# --- logprobs in the two formats ----------------------------------------------------------------------------


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
