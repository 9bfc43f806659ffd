"""bench.serve_ab reads a configuration: its environment words, its own client call, the round order."""

from __future__ import annotations

import pytest

from bench.serve_ab import client_rpc, round_order, split_config


def test_a_configuration_splits_into_environment_and_flags() -> None:
    env, flags = split_config("PYTHONPATH=/tmp/old A=1 --threads 2 --engine-process")
    assert env == {"PYTHONPATH": "/tmp/old", "A": "1"}
    assert flags == ["--threads", "2", "--engine-process"]


@pytest.mark.parametrize("rpc", ["stream", "unary", "http"])
def test_a_configuration_may_choose_its_clients_call(rpc: str) -> None:
    assert client_rpc(["--x", f"--bench-rpc={rpc}"], "stream") == (rpc, ["--x"])
    assert client_rpc(["--x"], rpc) == (rpc, ["--x"])


def test_an_unknown_call_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="stream, unary, http"):
        client_rpc(["--bench-rpc=udp"], "stream")


def test_each_configuration_goes_first_equally_often() -> None:
    configs = ["a", "b", "c"]
    firsts = [round_order(configs, r)[0] for r in range(1, 7)]
    assert sorted(firsts) == ["a", "a", "b", "b", "c", "c"]
    assert all(sorted(round_order(configs, r)) == configs for r in range(1, 7))
