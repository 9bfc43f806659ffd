"""The suite's own layout: pytest imports test modules by their basename (rootdir-relative, no packages),
so two test files with one name in different folders stop the whole collection on a clean clone."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_test_module_has_a_unique_basename() -> None:
    folders: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        folders[path.name].append(str(path.parent.relative_to(TESTS)))
    repeated = {name: sorted(where) for name, where in folders.items() if len(where) > 1}
    assert not repeated, f"test modules sharing a basename (rename one): {repeated}"
