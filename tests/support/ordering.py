"""Longest tests first, so that the workers of a run finish together.

pytest-xdist hands tests to its workers in the order collected; a long test that starts last
keeps its worker busy while the others have nothing left to do (a minute at the end of the
unit and trainer run, measured). This plugin orders each distributed run's tests by how long
they took before, longest first: by test where the run hands out single tests, by file where
it hands out whole files (`--dist loadfile`; each file's tests keep their order, since they
may share a module fixture that the file's last test tears down). A run in one process keeps
the collected order. The durations of passed tests are kept in
`~/.cache/kubetune/test-durations.json` (`$KUBETUNE_TEST_DURATIONS`), read once by the process
that hands out the tests and passed to its workers, so that every worker collects the same
order. Without the file (a fresh machine) the tiers go by how long their tests usually take:
e2e, trainer, integration and tooling tests before unit tests.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

ENV = "KUBETUNE_TEST_DURATIONS"
_KEY = "kubetune_durations"
_BY_FILE = "kubetune_by_file"
TIER_GUESS = {"e2e": 60.0, "trainer": 5.0, "integration": 5.0, "tooling": 1.0, "unit": 0.05}
"""Seconds a test of a tier takes, where no earlier run says."""

_measured: dict[str, float] = defaultdict(float)
_failed: set[str] = set()
_STASH = pytest.StashKey[dict[str, float]]()


def durations_file() -> Path:
    default = Path.home() / ".cache/kubetune/test-durations.json"
    return Path(os.environ.get(ENV) or default)


def _read() -> dict[str, float]:
    try:
        data = json.loads(durations_file().read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the process that hands out the tests
        config.stash[_STASH] = _read()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:  # pytest-xdist's hook, in the controller
    node.workerinput[_KEY] = node.config.stash.get(_STASH, {})
    # A worker's own options say `--dist no`: it is told how the controller hands out tests.
    node.workerinput[_BY_FILE] = node.config.getoption("dist", "no") == "loadfile"


def ordered(items: list[pytest.Item], known: dict[str, float], by_file: bool) -> list[pytest.Item]:
    """The items longest first (a stable sort: ties keep their collected order)."""

    def seconds(item: pytest.Item) -> float:
        tier = item.path.parent.name
        return known.get(item.nodeid, TIER_GUESS.get(tier, 1.0))

    if not by_file:
        return sorted(items, key=lambda item: -seconds(item))
    per_file: dict[Path, float] = defaultdict(float)
    for item in items:
        per_file[item.path] += seconds(item)
    return sorted(items, key=lambda item: -per_file[item.path])


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order a distributed run's tests (each worker collects them so); a run in one process
    keeps the collected order, where the order changes nothing but what a file's tests may
    assume of each other (a test marked to run last in its file)."""
    worker = getattr(config, "workerinput", None)
    if worker is None:
        return
    items[:] = ordered(items, worker.get(_KEY, {}), bool(worker.get(_BY_FILE, False)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Setup, call and teardown, summed: a session fixture counts for the test it first
    served (it starts as early as that test does)."""
    _measured[report.nodeid] += report.duration
    if report.failed:
        _failed.add(report.nodeid)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The durations of this run's passed tests, merged into the file (controller only)."""
    if hasattr(session.config, "workerinput") or not _measured:
        return
    path = durations_file()
    ran = {k: round(v, 3) for k, v in _measured.items() if k not in _failed}
    merged = {**_read(), **ran}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(merged, sort_keys=True))
        tmp.replace(path)
    except OSError:  # a cache: the next run orders by tier instead
        pass
