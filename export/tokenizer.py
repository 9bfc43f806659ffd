"""Byte-level BPE tokenizer (the `tokenizers` library) with the two special tokens the stack relies on.

Byte-level means every string, whatever its script, encodes without an unknown token and decodes back
to itself. The special tokens are added first so their ids are fixed: EOS = 0, PAD = 1.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
EOS_ID = 0
PAD_ID = 1
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)


class TokenizerError(ValueError):
    """A tokenizer that cannot be used: bad JSON or special tokens at the wrong ids."""


def _empty_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: a prompt like "def f" must encode the same at the start of a text as
    # the model saw it in training, and the decoder must not invent a leading space.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE of at most `vocab_size` ids (specials and the 256 byte symbols included)."""
    minimum = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (specials + 256 bytes), got {vocab_size}")
    tok = _empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    check_special_tokens(tok)
    return tok


def check_special_tokens(tok: Tokenizer) -> None:
    """Raise TokenizerError unless EOS and PAD sit at their fixed ids."""
    for token, expected in ((EOS_TOKEN, EOS_ID), (PAD_TOKEN, PAD_ID)):
        actual = tok.token_to_id(token)
        if actual != expected:
            raise TokenizerError(f"tokenizer must map {token} to id {expected}, found {actual}")


def tokenizer_to_json(tok: Tokenizer) -> str:
    """The tokenizer.json text (what `tokenizers` and the server load)."""
    return tok.to_str()


def tokenizer_from_json(text: str) -> Tokenizer:
    """Parse tokenizer.json text; raises TokenizerError if it is not a tokenizer or lacks the specials."""
    try:
        tok = Tokenizer.from_str(text)
    except Exception as exc:  # the Rust side raises a bare Exception subclass
        raise TokenizerError(f"not a valid tokenizer.json: {exc}") from exc
    check_special_tokens(tok)
    return tok
