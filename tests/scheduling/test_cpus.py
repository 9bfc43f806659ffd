"""CPU placement (serve.process, and bench.cpus for the benchmarks): the CPU lists `--engine-cpus` and
`textgen-bench load --cpus` take, and moving a process's threads (the server's own placement is tested with
a real engine process in test_engine_process)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from bench.cpus import engine_cpus_flag, pinned
from bench.loadgen import LoadConfig, main
from serve.api.config import ConfigError, ServerSettings, load_settings
from serve.api.loading import checked_engine_cpus
from serve.process import beside, check_cpus, engine_cpus, format_cpu_list, parse_cpu_list


@pytest.mark.parametrize(
    ("text", "cpus", "folded"),
    [
        ("0", {0}, "0"),
        ("0-3", {0, 1, 2, 3}, "0-3"),
        ("5, 0-1,3", {0, 1, 3, 5}, "0-1,3,5"),
        ("2-2,2", {2}, "2"),
    ],
)
def test_cpu_lists_read_as_taskset_reads_them_and_fold_back(text: str, cpus: set[int], folded: str) -> None:
    assert parse_cpu_list(text) == cpus
    assert format_cpu_list(cpus) == folded
    assert parse_cpu_list(folded) == cpus


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("", "bad part ''"),
        ("a", "bad part 'a'"),
        ("3-1", "bad range '3-1'"),
        ("1,,2", "bad part ''"),
        ("-1", "bad part '-1'"),
    ],
)
def test_a_bad_cpu_list_says_which_part_is_bad(text: str, bad: str) -> None:
    with pytest.raises(ValueError, match=f"is not a CPU list such as 0-3,6 \\({bad}\\)"):
        parse_cpu_list(text)


def test_engine_cpus_setting_from_a_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TEXTGEN_ENGINE_CPUS", raising=False)
    assert load_settings(["--bundle", "b"]).engine_cpus is None
    assert load_settings(["--bundle", "b", "--engine-cpus", "0-1,3"]).engine_cpus == {0, 1, 3}
    monkeypatch.setenv("TEXTGEN_ENGINE_CPUS", "2")
    assert load_settings(["--bundle", "b"]).engine_cpus == {2}
    with pytest.raises(ConfigError, match="engine_cpus: 'x' is not a CPU list"):
        load_settings(["--bundle", "b", "--engine-cpus", "x"])
    with pytest.raises(ConfigError, match="engine_cpus pins the engine process: it needs engine_process"):
        load_settings(["--bundle", "b", "--no-engine-process"])


def test_auto_engine_cpus_leave_the_lowest_cpu_to_the_server(cpus_restored: frozenset[int]) -> None:
    assert load_settings(["--bundle", "b", "--engine-cpus", "AUTO"]).engine_cpus == "auto"
    assert engine_cpus("auto") == (frozenset(sorted(cpus_restored)[1:]) or None)
    assert engine_cpus(None) is None and engine_cpus(frozenset({0})) == {0}
    with pinned(frozenset({min(cpus_restored)})):
        assert engine_cpus("auto") is None  # one CPU: nothing to keep apart
    assert engine_cpus_flag(["--engine-cpus", "auto"]) == engine_cpus("auto")


def test_engine_cpus_that_cannot_do_what_was_asked_say_so(
    cpus_restored: frozenset[int], caplog: pytest.LogCaptureFixture
) -> None:
    auto = ServerSettings(bundle=Path("b"), engine_cpus="auto")
    with pinned(frozenset({min(cpus_restored)})), caplog.at_level(logging.WARNING, "textgen.server"):
        assert checked_engine_cpus(auto) is None
    assert "engine_cpus auto: this process may run on one CPU only" in caplog.text
    one = frozenset({min(cpus_restored)})
    with caplog.at_level(logging.WARNING, "textgen.server"):
        assert checked_engine_cpus(ServerSettings(bundle=Path("b"), engine_cpus=one, threads=2)) == one
    assert "threads 2 on 1 engine CPUs: ONNX Runtime's threads will take turns" in caplog.text
    with pytest.raises(ConfigError, match="engine_cpus 4095: this process may run on CPUs"):
        checked_engine_cpus(ServerSettings(bundle=Path("b"), engine_cpus=frozenset({4095})))


def test_cpus_beside_the_engine_and_cpus_this_process_may_not_use(cpus_restored: frozenset[int]) -> None:
    first = min(cpus_restored)
    rest = cpus_restored - {first}
    assert beside(frozenset({first})) == (tuple(sorted(rest)) or None)
    assert beside(cpus_restored) is None  # nothing left: the server's process stays where it is
    check_cpus(cpus_restored, "engine_cpus")
    refused = r"engine_cpus 4095: this process may run on CPUs .+ only \(not 4095\)"
    with pytest.raises(ValueError, match=refused):
        check_cpus(frozenset({4095}), "engine_cpus")


def test_pinned_moves_every_thread_and_then_back(cpus_restored: frozenset[int]) -> None:
    started, stop = threading.Event(), threading.Event()
    seen: list[set[int]] = []

    def worker() -> None:  # a thread that exists before the move, as gRPC's do
        started.set()
        stop.wait()
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait()
    one = frozenset({min(cpus_restored)})
    with pinned(one):
        assert os.sched_getaffinity(0) == one
        assert os.sched_getaffinity(thread.native_id) == one  # type: ignore[arg-type]
    assert os.sched_getaffinity(0) == cpus_restored
    stop.set()
    thread.join()
    assert seen == [set(cpus_restored)]
    with pinned(None):
        assert os.sched_getaffinity(0) == cpus_restored


def test_a_benchmark_command_line_names_the_engine_cpus() -> None:
    assert engine_cpus_flag(["--threads", "1", "--engine-cpus", "0-1"]) == {0, 1}
    assert engine_cpus_flag(["--engine-cpus=3"]) == {3}
    assert engine_cpus_flag(["--threads", "1"]) is None


def test_the_load_generator_refuses_cpus_it_may_not_use(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="invalid load settings: cpus"):
        LoadConfig(target="x:1", cpus=())
    with pytest.raises(SystemExit) as exited:
        main(["--target", "127.0.0.1:1", "--cpus", "4095"])
    assert exited.value.code == 2
    assert "--cpus 4095: this process may run on CPUs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--target", "127.0.0.1:1", "--cpus", "x"])
    assert "'x' is not a CPU list such as 0-3,6" in capsys.readouterr().err
