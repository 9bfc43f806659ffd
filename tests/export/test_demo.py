"""ensure_demo_checkpoint: trains once, reuses a current file, replaces a stale or damaged one; a checkpoint
given by $TEXTGEN_DEMO_CHECKPOINT is used as it is; variants of the recipe with another seed."""

from __future__ import annotations

from pathlib import Path

import pytest

from export import demo
from export.checkpoint import CheckpointError, load_checkpoint
from export.model import DecoderConfig
from export.train import TrainConfig, TrainResult, train

TINY = DecoderConfig(vocab_size=300, context_length=16, d_model=16, n_layers=1, n_heads=2, d_ff=32)
TINY_TRAIN = TrainConfig(
    steps=2,
    batch_size=2,
    warmup_steps=1,
    corpus_bytes=60_000,
    heldout_percent=20,
    eval_every=2,
    eval_batches=1,
)


@pytest.fixture
def tiny_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Point the demo at a temp home with a tiny recipe; returns a list that counts training runs."""
    runs: list[int] = []

    def counting_train(
        cfg: DecoderConfig, tc: TrainConfig, progress: bool = True, threads: int = 2
    ) -> TrainResult:
        runs.append(1)
        return train(cfg, tc, progress=progress, threads=threads)

    monkeypatch.setenv("TEXTGEN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TEXTGEN_DEMO_CHECKPOINT", raising=False)
    monkeypatch.setattr(demo, "DEMO_CONFIG", TINY)
    monkeypatch.setattr(demo, "DEMO_TRAIN", TINY_TRAIN)
    monkeypatch.setattr(demo, "train", counting_train)
    return runs


def test_paths_follow_textgen_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TEXTGEN_DEMO_CHECKPOINT", raising=False)
    monkeypatch.setenv("TEXTGEN_HOME", str(tmp_path))
    assert demo.demo_checkpoint_path() == tmp_path / "demo" / "checkpoint.pt"
    assert demo.demo_bundle_path() == tmp_path / "demo" / "bundle"
    monkeypatch.delenv("TEXTGEN_HOME")
    assert demo.textgen_home() == Path("models")


def test_trains_once_then_reuses(tiny_demo: list[int]) -> None:
    path = demo.ensure_demo_checkpoint(progress=False)
    assert path == demo.demo_checkpoint_path()
    assert load_checkpoint(path).config == TINY
    assert demo.ensure_demo_checkpoint(progress=False) == path
    assert len(tiny_demo) == 1


def test_damaged_checkpoint_is_rebuilt(tiny_demo: list[int]) -> None:
    path = demo.demo_checkpoint_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"half a checkpoint")
    demo.ensure_demo_checkpoint(progress=False)
    assert len(tiny_demo) == 1
    assert load_checkpoint(path).config == TINY


def test_stale_recipe_is_rebuilt(tiny_demo: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    demo.ensure_demo_checkpoint(progress=False)
    monkeypatch.setattr(demo, "DEMO_TRAIN", TrainConfig(**{**TINY_TRAIN.to_dict(), "seed": 7}))
    demo.ensure_demo_checkpoint(progress=False)
    assert len(tiny_demo) == 2
    assert load_checkpoint(demo.demo_checkpoint_path()).meta["train_config"]["seed"] == 7


def test_a_given_checkpoint_is_used_as_it_is(
    tiny_demo: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    given = demo.train_variant(tmp_path / "other" / "checkpoint.pt", seed=99, threads=1)
    assert len(tiny_demo) == 1 and load_checkpoint(given).meta["train_config"]["seed"] == 99
    monkeypatch.setenv("TEXTGEN_DEMO_CHECKPOINT", str(given))
    assert demo.demo_checkpoint_path() == given
    assert demo.ensure_demo_checkpoint(progress=False) == given  # not the recipe's seed: kept all the same
    assert len(tiny_demo) == 1
    missing = tmp_path / "missing.pt"
    monkeypatch.setenv("TEXTGEN_DEMO_CHECKPOINT", str(missing))
    with pytest.raises(CheckpointError, match=r"missing\.pt"):
        demo.ensure_demo_checkpoint(progress=False)
    assert not missing.exists() and len(tiny_demo) == 1  # never trained over


def test_a_variant_is_trained_once_and_retrained_for_another_seed(
    tiny_demo: list[int], tmp_path: Path
) -> None:
    out = tmp_path / "variant.pt"
    assert demo.train_variant(out, seed=5, threads=1) == out
    demo.train_variant(out, seed=5, threads=1)
    assert len(tiny_demo) == 1
    demo.train_variant(out, seed=6, threads=1)
    assert len(tiny_demo) == 2 and load_checkpoint(out).meta["train_config"]["seed"] == 6


def test_the_demo_config_meets_the_server_needs() -> None:
    assert demo.DEMO_CONFIG.context_length >= 256
    assert demo.DEMO_TRAIN.steps > demo.DEMO_TRAIN.warmup_steps
