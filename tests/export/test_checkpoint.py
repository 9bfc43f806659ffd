"""Checkpoint: round trip, and a clear error naming the file for every kind of bad file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from export.checkpoint import FORMAT, CheckpointError, load_checkpoint, save_checkpoint
from export.model import Decoder, DecoderConfig, position_ids_from_mask
from export.tokenizer import train_tokenizer

CFG = DecoderConfig(vocab_size=300, context_length=32, d_model=16, n_layers=2, n_heads=2, d_ff=32)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_tokenizer(["def f(x):\n    return x + 1\n"] * 20, vocab_size=CFG.vocab_size)


@pytest.fixture
def saved(tmp_path: Path, tokenizer: Tokenizer) -> tuple[Path, Decoder]:
    torch.manual_seed(0)
    model = Decoder(CFG).eval()
    path = save_checkpoint(tmp_path / "ckpt.pt", model, tokenizer, {"heldout_loss": 1.5})
    return path, model


def test_round_trip(saved: tuple[Path, Decoder], tokenizer: Tokenizer) -> None:
    path, model = saved
    ckpt = load_checkpoint(path)
    assert ckpt.config == CFG
    assert ckpt.meta == {"heldout_loss": 1.5}
    assert not ckpt.model.training
    assert ckpt.tokenizer.to_str() == tokenizer.to_str()
    assert ckpt.model.lm_head.weight is ckpt.model.tok_emb.weight
    ids = torch.randint(0, CFG.vocab_size, (2, 9))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected, _ = model(ids, mask, position_ids_from_mask(mask))
        actual, _ = ckpt.model(ids, mask, position_ids_from_mask(mask))
    assert torch.equal(actual, expected)


def test_save_leaves_no_temp_files(saved: tuple[Path, Decoder]) -> None:
    path, _ = saved
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert path.stat().st_mode & 0o777 == 0o644


def _expect_error(path: Path, problem: str) -> None:
    with pytest.raises(CheckpointError, match=problem) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    _expect_error(tmp_path / "nope.pt", "file not found")


def test_truncated_file(saved: tuple[Path, Decoder]) -> None:
    path, _ = saved
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _expect_error(path, "truncated or not a torch checkpoint")


def test_not_a_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "notes.pt"
    path.write_text("hello, I am text")
    _expect_error(path, "truncated or not a torch checkpoint")


def test_foreign_torch_file(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(2)}, path)
    _expect_error(path, f"not a {FORMAT} file")


def _rewrite(path: Path, **changes: object) -> None:
    payload = torch.load(path, weights_only=True)
    payload.update(changes)
    torch.save(payload, path)


def test_wrong_version(saved: tuple[Path, Decoder]) -> None:
    path, _ = saved
    _rewrite(path, version=99)
    _expect_error(path, "unsupported version 99")


def test_config_does_not_match_weights(saved: tuple[Path, Decoder]) -> None:
    path, _ = saved
    _rewrite(path, config={**CFG.to_dict(), "d_model": 32})
    _expect_error(path, "weight shapes do not match the config")


def test_config_with_other_layer_count(saved: tuple[Path, Decoder]) -> None:
    path, _ = saved
    _rewrite(path, config={**CFG.to_dict(), "n_layers": 3})
    _expect_error(path, r"weights do not match the config: missing \['blocks.2")


def test_invalid_config(saved: tuple[Path, Decoder]) -> None:
    path, _ = saved
    _rewrite(path, config={**CFG.to_dict(), "n_heads": 3})
    _expect_error(path, "invalid decoder config: d_model")


def test_tokenizer_larger_than_vocab(saved: tuple[Path, Decoder], tokenizer: Tokenizer) -> None:
    path, _ = saved
    _rewrite(path, config={**CFG.to_dict(), "vocab_size": 100})
    _expect_error(path, f"tokenizer has {tokenizer.get_vocab_size()} ids but config vocab_size is 100")


def test_invalid_tokenizer(saved: tuple[Path, Decoder]) -> None:
    path, _ = saved
    _rewrite(path, tokenizer="{not json")
    _expect_error(path, "invalid tokenizer")


def test_save_refuses_meta_that_would_not_load(tmp_path: Path, tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="plain Python types"):
        save_checkpoint(tmp_path / "ckpt.pt", Decoder(CFG), tokenizer, {"path": tmp_path})
    assert list(tmp_path.iterdir()) == []


def test_save_refuses_a_tokenizer_larger_than_the_vocab(tmp_path: Path, tokenizer: Tokenizer) -> None:
    small = DecoderConfig(**{**CFG.to_dict(), "vocab_size": 100})
    with pytest.raises(ValueError, match="vocab_size"):
        save_checkpoint(tmp_path / "ckpt.pt", Decoder(small), tokenizer)
