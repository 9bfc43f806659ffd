"""The serve-ab scenario: configurations alternated round by round against servers of the tiny bundle, and
how it reads a configuration (its environment words, its own client call)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from bench.scenarios.serve_ab import (
    CPU_PARTS,
    Figures,
    Served,
    client_rpc,
    main,
    served,
    split_config,
    summary,
)


def test_the_ab_benchmark_alternates_server_configurations(tiny_bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    flags = ["--config=TEXTGEN_ENGINE_PROCESS=false", "--config=--engine-process --bench-rpc=unary"]
    args = ["--bundle", str(tiny_bundle), "--rounds", "2", "--clients", "2", "--requests", "4"]
    assert main([*args, "--new-tokens", "5", "--threads", "1", *flags, "--json", str(out)]) == 0
    runs = json.loads(out.read_text())
    assert list(runs) == ["TEXTGEN_ENGINE_PROCESS=false", "--engine-process --bench-rpc=unary"]
    for rounds in runs.values():
        assert len(rounds) == 2 and all(r["tokens_per_second"] > 0 for r in rounds)
        assert all(set(r["cpu_us_per_token"]) == set(CPU_PARTS) for r in rounds)
    in_thread, in_process = runs.values()
    # /proc counts CPU in clock ticks, so a short run may read 0 anywhere; but an engine thread's CPU is
    # the server's own (no engine process to count), and the two runs together cost something.
    assert all(r["cpu_us_per_token"]["engine"] == 0 for r in in_thread)
    assert sum(c for r in [*in_thread, *in_process] for c in r["cpu_us_per_token"].values()) > 0
    # The unary clients get no per-token messages: ITL is a streamed figure. (A streamed round may read NaN
    # too, when a busy client reads each answer as one message: test_loadgen checks the streamed gaps.)
    assert all(math.isnan(r["itl_p50_ms"]) for r in in_process)
    assert all(math.isnan(r["itl_p50_ms"]) or r["itl_p50_ms"] > 0 for r in in_thread)


@pytest.mark.parametrize("rpc", ["stream", "unary", "http"])
def test_an_ab_configuration_may_choose_its_clients_call(rpc: str) -> None:
    assert client_rpc(["--threads", "1", f"--bench-rpc={rpc}"], "stream") == (rpc, ["--threads", "1"])
    assert client_rpc(["--threads", "1"], "stream") == ("stream", ["--threads", "1"])


def test_an_unknown_client_call_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="stream, unary, http"):
        client_rpc(["--bench-rpc=udp"], "stream")


def test_an_ab_configuration_starts_with_the_servers_environment() -> None:
    env, flags = split_config("PYTHONPATH=/tmp/old A_B='x y' --threads 1 --label=K=V")
    assert env == {"PYTHONPATH": "/tmp/old", "A_B": "x y"}
    assert flags == ["--threads", "1", "--label=K=V"]
    assert split_config("") == ({}, [])


def test_an_ab_configuration_may_serve_its_own_bundle_and_name_adapters() -> None:
    args = argparse.Namespace(bundle=Path("plain"), rpc="stream", models=())
    flags = ["--bench-bundle=lora", "--lora", "a=/x,b=/y", "--bench-models=a,,b", "--bench-rpc=http"]
    assert served(flags, args) == Served(Path("lora"), "http", ("a", "", "b"), ["--lora", "a=/x,b=/y"])
    assert served(["--threads", "1"], args) == Served(Path("plain"), "stream", (), ["--threads", "1"])
    with pytest.raises(ValueError, match="bench-"):
        served(["--bench-bundel=lora"], args)


def test_a_configuration_is_compared_with_the_first_by_the_rounds_ratios_not_the_medians() -> None:
    def run(rate: float) -> Figures:
        return Figures(rate, 10.0, 20.0, dict.fromkeys(CPU_PARTS, 1.0))

    # The machine slowed in the second round: B was 0.8x then 1.2x A; the medians (70 against 64) would say
    # 0.91x, the rounds' ratios say 1.00x.
    lines = summary({"": [run(100), run(40)], "--b": [run(80), run(48)]})
    assert lines[0].startswith("  [defaults] 70 tok/s (1.00x the first")
    assert lines[1].startswith("  [--b] 64 tok/s (1.00x the first")
