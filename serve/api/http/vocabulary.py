"""Tokens as the HTTP APIs show them: each id's text (decoded alone, special tokens kept) and bytes, which a
renderer takes for its logprobs (serve/api/openai/logprobs.py) and its text."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders


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
