"""Shared fixtures: tiny decoder configs for fast model tests, and the demo checkpoint built once."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_tools import LoopThread

from export.model import DecoderConfig
from serve.process import allowed_cpus, pin_process

POSITIONS = ("learned", "sinusoidal", "rotary")


@pytest.fixture(params=POSITIONS)
def tiny_config(request: pytest.FixtureRequest) -> DecoderConfig:
    """A decoder small enough for exact comparisons in milliseconds, once per position variant."""
    return DecoderConfig(
        vocab_size=97,
        context_length=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=64,
        positions=request.param,
    )


@pytest.fixture(scope="session", autouse=True)
def compiled_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Where the servers the tests start keep their prepared graphs (textgen-serve --compiled-cache), rather
    than under $TEXTGEN_HOME."""
    path = tmp_path_factory.mktemp("compiled")
    before = os.environ.get("TEXTGEN_COMPILED_CACHE")
    os.environ["TEXTGEN_COMPILED_CACHE"] = str(path)
    yield path
    if before is None:
        del os.environ["TEXTGEN_COMPILED_CACHE"]
    else:
        os.environ["TEXTGEN_COMPILED_CACHE"] = before


@pytest.fixture(scope="session")
def demo_checkpoint() -> Path:
    """Path of the trained demo checkpoint; trained on first use (~3 min), reused after that."""
    from export.demo import ensure_demo_checkpoint

    return ensure_demo_checkpoint(progress=False)


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A verified bundle of the exporter's random "tiny" preset (seed 0); exported once per session."""
    from export.pipeline import random_bundle

    return random_bundle("tiny", tmp_path_factory.mktemp("bundles") / "tiny", seed=0, progress=False).root


@pytest.fixture(scope="session")
def demo_bundle(demo_checkpoint: Path) -> Path:
    """The demo checkpoint's verified bundle: models/demo/bundle, exported only if missing or stale."""
    from export.pipeline import ensure_demo_bundle

    return ensure_demo_bundle(progress=False)[0].root


@pytest.fixture(scope="session")
def lora_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """The tiny preset with 2 LoRA slots and three peft adapters of its model (support/lora_adapters.py)."""
    from lora_adapters import lora_bundle

    return lora_bundle(tmp_path_factory.mktemp("lora-serving"))


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    """An asyncio event loop on its own thread, for the real servers the tests start (one per module)."""
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture
def cpus_restored() -> Iterator[frozenset[int]]:
    """The CPUs this process may use; given back afterwards (an in-process server with engine_cpus moves
    every thread of this process)."""
    before = allowed_cpus()
    yield before
    pin_process(before)
