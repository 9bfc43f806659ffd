"""`textgen-bench <scenario>`: every scenario a module with main(argv), its flags under its own name, and the
rounds' order that the A/B scenarios share."""

from __future__ import annotations

import importlib.util
import inspect

import pytest

from bench.cli import SCENARIOS, main, module_of, scenario_main
from bench.rounds import in_turn, median_ratio


def test_every_scenario_names_a_module_with_a_main_taking_its_flags() -> None:
    for name in SCENARIOS:
        assert importlib.util.find_spec(module_of(name)) is not None, name
    run = scenario_main("serve-ab")
    assert list(inspect.signature(run).parameters) == ["argv"]


def test_a_scenario_reads_its_own_flags_under_its_own_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["serve-ab", "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage: textgen-bench serve-ab ")


def test_an_unknown_scenario_lists_the_scenarios(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["no-such-scenario"]) == 2
    listed = capsys.readouterr().err
    assert all(f"  {name} " in listed for name in SCENARIOS)
    assert main([]) == 2


def test_each_variant_goes_first_in_turn() -> None:
    assert [in_turn(["a", "b", "c"], r) for r in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]
    assert [in_turn(("x", "y"), r) for r in range(2)] == [["x", "y"], ["y", "x"]]


def test_the_ratio_is_the_median_of_each_rounds_ratio() -> None:
    # the machine halved its speed in round 2: each round's ratio is 0.5, the medians' ratio would not be
    assert median_ratio([50.0, 25.0, 50.0, 25.0], [100.0, 50.0, 100.0, 50.0]) == 0.5
    assert median_ratio([1.0], [0.0]) != median_ratio([1.0], [0.0])  # no round to pair: NaN
