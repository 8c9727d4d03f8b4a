"""The test order: longest first by test, or by file for `--dist loadfile`; by tier unknown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support.ordering import ordered, pytest_collection_modifyitems


class _Item:
    def __init__(self, path: str, name: str) -> None:
        self.path = Path("/repo/tests") / path
        self.nodeid = f"tests/{path}::{name}"


def _names(items: list[Any]) -> list[str]:
    return [item.nodeid.split("/", 1)[1] for item in items]


ITEMS = [
    _Item("unit/test_a.py", "fast"),
    _Item("unit/test_a.py", "slow"),
    _Item("trainer/test_t.py", "one"),
    _Item("unit/test_b.py", "new"),
]


def test_known_durations_order_tests_longest_first_and_tiers_guess_the_rest() -> None:
    known = {"tests/unit/test_a.py::fast": 0.01, "tests/unit/test_a.py::slow": 30.0}
    got = ordered(ITEMS, known, by_file=False)  # type: ignore[arg-type]
    # slow 30 s; the trainer test unknown (a trainer test's guess, 5 s); new (a unit test's).
    assert _names(got) == [
        "unit/test_a.py::slow",
        "trainer/test_t.py::one",
        "unit/test_b.py::new",
        "unit/test_a.py::fast",
    ]


def test_by_file_keeps_each_file_together_in_its_order() -> None:
    known = {"tests/unit/test_a.py::fast": 0.01, "tests/unit/test_a.py::slow": 30.0}
    got = ordered(ITEMS, known, by_file=True)  # type: ignore[arg-type]
    assert _names(got) == [
        "unit/test_a.py::fast",
        "unit/test_a.py::slow",
        "trainer/test_t.py::one",
        "unit/test_b.py::new",
    ]


class _Config:
    def __init__(self, workerinput: dict[str, Any] | None = None) -> None:
        if workerinput is not None:
            self.workerinput = workerinput


def test_workers_order_by_file_when_told_and_one_process_keeps_the_collected_order() -> None:
    """A worker's own options say `--dist no` (pytest-xdist sets it): how tests are handed
    out comes in its workerinput. Without workers nothing is reordered."""
    known = {"tests/unit/test_a.py::fast": 0.01, "tests/unit/test_a.py::slow": 30.0}
    items = list(ITEMS)
    worker = _Config({"kubetune_durations": known, "kubetune_by_file": True})
    pytest_collection_modifyitems(worker, items)  # type: ignore[arg-type]
    assert _names(items) == _names(ordered(ITEMS, known, by_file=True))  # type: ignore[arg-type]
    items = list(ITEMS)
    pytest_collection_modifyitems(_Config(), items)  # type: ignore[arg-type]
    assert items == ITEMS
