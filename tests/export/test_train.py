"""Trainer, stdlib corpus and tokenizer."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from export.model import DecoderConfig
from export.tokenizer import (
    EOS_ID,
    EOS_TOKEN,
    PAD_ID,
    PAD_TOKEN,
    TokenizerError,
    tokenizer_from_json,
    tokenizer_to_json,
    train_tokenizer,
)
from export.train import (
    Corpus,
    TrainConfig,
    learning_rate,
    load_corpus,
    stdlib_root,
    stdlib_sources,
    train,
    unigram_cross_entropy,
)

TEXTS = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n"] * 10


@pytest.fixture(scope="module")
def small_corpus() -> Corpus:
    return load_corpus(budget_bytes=120_000, heldout_percent=20)


def test_training_lowers_the_loss(small_corpus: Corpus) -> None:
    cfg = DecoderConfig(vocab_size=320, context_length=32, d_model=32, n_layers=2, n_heads=2, d_ff=64)
    tc = TrainConfig(
        steps=60,
        batch_size=8,
        learning_rate=1e-2,
        min_learning_rate=1e-3,
        warmup_steps=5,
        eval_every=30,
        eval_batches=2,
    )
    result = train(cfg, tc, corpus=small_corpus, progress=False)
    meta = result.meta
    assert meta["train_loss"] < meta["first_train_loss"] - 1.0
    assert meta["heldout_loss"] < meta["unigram_baseline"]
    assert not result.model.training


def test_training_is_deterministic(small_corpus: Corpus) -> None:
    cfg = DecoderConfig(
        vocab_size=300, context_length=16, d_model=16, n_layers=1, n_heads=2, d_ff=32, dropout=0.1
    )
    tc = TrainConfig(steps=4, batch_size=2, warmup_steps=1, eval_every=4, eval_batches=1, label_smoothing=0.1)
    a = train(cfg, tc, corpus=small_corpus, progress=False)
    b = train(cfg, tc, corpus=small_corpus, progress=False)
    assert a.meta["train_loss"] == b.meta["train_loss"]
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_corpus_is_the_stdlib_without_tests() -> None:
    files = stdlib_sources()
    root = stdlib_root()
    rel = [p.relative_to(root).parts for p in files]
    assert ("os.py",) in rel
    assert not any("test" in parts or "site-packages" in parts for parts in rel)
    assert files == stdlib_sources()


def test_corpus_split_is_deterministic_and_disjoint(small_corpus: Corpus) -> None:
    again = load_corpus(budget_bytes=120_000, heldout_percent=20)
    assert again == small_corpus
    assert small_corpus.train and small_corpus.heldout
    assert not set(small_corpus.train) & set(small_corpus.heldout)


def test_corpus_budget_too_small_is_an_error() -> None:
    with pytest.raises(ValueError, match="too small"):
        load_corpus(budget_bytes=1, heldout_percent=5)


def test_learning_rate_warms_up_then_decays_to_the_minimum() -> None:
    tc = TrainConfig(steps=100, warmup_steps=10, learning_rate=1e-3, min_learning_rate=1e-4)
    lrs = [learning_rate(s, tc) for s in range(tc.steps)]
    assert lrs[0] == pytest.approx(1e-4)
    assert lrs[9] == pytest.approx(1e-3)
    assert all(a <= b for a, b in itertools.pairwise(lrs[:10]))
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))
    assert lrs[-1] == pytest.approx(1e-4)


def test_unigram_baseline_of_a_uniform_stream_is_log_vocab() -> None:
    stream = torch.arange(8).repeat(10)
    assert unigram_cross_entropy(stream, stream, 8) == pytest.approx(math.log(8))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"steps": 0}, "steps must be positive"),
        ({"label_smoothing": 1.0}, "label_smoothing"),
        ({"warmup_steps": 700}, "warmup_steps"),
        ({"heldout_percent": 0}, "heldout_percent"),
        ({"min_learning_rate": 1.0}, "min_learning_rate"),
    ],
)
def test_train_config_validation(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**changes)  # type: ignore[arg-type]


def test_tokenizer_special_ids() -> None:
    tok = train_tokenizer(TEXTS, vocab_size=300)
    assert tok.token_to_id(EOS_TOKEN) == EOS_ID == 0
    assert tok.token_to_id(PAD_TOKEN) == PAD_ID == 1
    assert tok.get_vocab_size() <= 300
    assert tok.encode(f"x{EOS_TOKEN}").ids[-1] == EOS_ID


@pytest.mark.parametrize("text", ["def __init__(self):\n\tpass", "naïve café — 日本語 🐍", "  two spaces"])
def test_tokenizer_round_trips_text(text: str) -> None:
    tok = tokenizer_from_json(tokenizer_to_json(train_tokenizer(TEXTS, vocab_size=300)))
    assert tok.decode(tok.encode(text).ids) == text


def test_tokenizer_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="vocab_size must be at least"):
        train_tokenizer(TEXTS, vocab_size=100)
    with pytest.raises(TokenizerError, match=r"not a valid tokenizer\.json"):
        tokenizer_from_json("{}")
