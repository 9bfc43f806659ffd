"""The pod memory formula (`textgen-serve --print-pod-memory`) counts what each feature a flag turns on makes
a server hold: a bundle is served with and without the feature, the feature is used, and what it added to the
resident memory of the server's processes must be within what the formula adds for it.

The "small" preset has 16 MiB of fp32 weights, so a second copy of them stands well out of the noise of two
server starts (about a MiB); the tiny preset's would not."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from server_process import served_memory_mib

from serve.api.config import ServerSettings
from serve.api.loading import kv_rows, served_features
from serve.api.sizing import PodMemory, pod_memory
from serve.bundle import read_manifest
from serve.engine.lora import LoraSlots
from serve.lora_layout import LoraLayout

MAX_MODEL_LEN = 256
COMMON = {"max_model_len": MAX_MODEL_LEN, "max_batch_size": 4, "threads": 2, "prompt_logprobs": False}
PLAIN = {"prompt": "def add(a, b):", "max_tokens": 8}
# Token ids filling the context but for a few positions: the most logits a scored prompt takes.
LONG = [7 + i % 1000 for i in range(MAX_MODEL_LEN - 8)]


@pytest.fixture(scope="module")
def small_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from export.pipeline import random_bundle

    return random_bundle("small", tmp_path_factory.mktemp("small") / "bundle", seed=0, progress=False).root


def formula(bundle: Path, settings: dict[str, Any]) -> PodMemory:
    """What --print-pod-memory gives for these settings."""
    served = ServerSettings(bundle=bundle, **settings)
    manifest = read_manifest(bundle)
    return pod_memory(bundle, manifest, kv_rows(served, manifest), served_features(served))


def flags(settings: dict[str, Any]) -> list[str]:
    """The settings as textgen-serve's flags."""
    out: list[str] = []
    for name, value in settings.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            out.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            out += [f"--{flag}", str(value)]
    return out


def served_mib(
    bundle: Path, settings: dict[str, Any], bodies: Sequence[dict[str, Any]]
) -> tuple[float, float]:
    """The resident memory (steady, peak) of a server's processes after it answered `bodies` one by one."""
    return served_memory_mib(
        ["--bundle", str(bundle), *flags(settings)], [{"model": "small-random", **b} for b in bodies]
    )


@pytest.fixture(scope="module")
def base(small_bundle: Path) -> tuple[float, PodMemory]:
    """The server with no feature: its steady memory and its formula."""
    steady, _ = served_mib(small_bundle, COMMON, [PLAIN] * 2)
    return steady, formula(small_bundle, COMMON)


CASES: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {
    # A request alone speculates: the verification session is made and run.
    "speculative": (
        {"speculative": "ngram"},
        [PLAIN, {"prompt": "a b c a b c a b c a b c", "max_tokens": 16}],
    ),
    # The first scored prompt makes the standard graph's session; a long one takes the most logits.
    "prompt logprobs": (
        {"prompt_logprobs": True},
        [PLAIN, {"prompt": LONG, "max_tokens": 1, "echo": True, "logprobs": 1}],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_what_a_feature_adds_is_within_what_the_formula_adds(
    case: str, small_bundle: Path, base: tuple[float, PodMemory]
) -> None:
    extra, bodies = CASES[case]
    settings = {**COMMON, **extra}
    steady, peak = served_mib(small_bundle, settings, bodies)
    pod = formula(small_bundle, settings)
    base_steady, base_pod = base
    added, counted = steady - base_steady, pod.request_mib - base_pod.request_mib
    assert added > 0, (added, pod.describe())
    assert added <= counted, (f"{case} added {added:.1f} MiB, the formula {counted} MiB", pod.describe())
    assert steady <= pod.request_mib and peak <= pod.limit_mib, (steady, peak, pod.describe())


def test_the_formula_counts_the_lora_slots_as_the_engine_holds_them(
    lora_bundle: tuple[Path, dict[str, Path]],
) -> None:
    bundle, _ = lora_bundle
    layout = read_manifest(bundle).lora
    assert isinstance(layout, LoraLayout)
    assert layout.slots_bytes == LoraSlots(layout).weight_bytes > 0
    runtime = {"lora_runtime_updates": True, "allow_unauthenticated_lora_updates": True, "lora_root": bundle}
    parts = {part.what: part.bytes for part in formula(bundle, {**runtime, "max_cpu_loras": 3}).parts}
    assert parts[f"{layout.slots} LoRA slots"] == layout.slots_bytes
    assert parts["3 registered adapters"] == 3 * layout.max_adapter_bytes
    # Without runtime loads, only the adapters given at start are ever held: none here.
    assert "3 registered adapters" not in {part.what for part in formula(bundle, {"max_cpu_loras": 3}).parts}


def test_the_formula_counts_a_lora_bundles_branch_free_session_where_it_runs(
    lora_bundle: tuple[Path, dict[str, Path]],
) -> None:
    """From the prepared graph a LoRA bundle's base-only steps run a second session (its graph without
    branches): counted as a second session of the serving graph is; without the prepared graph there is
    none."""
    bundle, _ = lora_bundle
    assert read_manifest(bundle).graphs.inplace_base is not None
    branch_free = "branch-free session (base-only steps)"
    prepared = {part.what: part.bytes for part in formula(bundle, {}).parts}
    speculating = {part.what: part.bytes for part in formula(bundle, {"speculative": "ngram"}).parts}
    assert prepared[branch_free] == speculating["verification session (--speculative)"] > 0
    assert branch_free not in {part.what for part in formula(bundle, {"prepared_graph": False}).parts}


def test_the_formula_counts_the_swap_cap_under_the_priority_policy(tiny_bundle: Path) -> None:
    """The planner never swaps out more than --swap-space (tests/scheduling/test_planner.py): the formula
    counts the cap itself, and only where preemption can happen."""
    swap = {"swap_space": "64MiB"}
    parts = formula(tiny_bundle, {**swap, "scheduling_policy": "priority"}).parts
    assert [p.bytes for p in parts if p.what.startswith("swapped rows")] == [64 * 2**20]
    assert not [p for p in formula(tiny_bundle, swap).parts if p.what.startswith("swapped rows")]
