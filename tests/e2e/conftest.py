"""Fixtures for the e2e tier: a cluster where the trainer really trains.

The target (see support/e2e_targets.py) starts once per session. Every scenario applies its own
FineTuneJob into the `e2e` namespace, which holds a volume with a tiny random-init model
and an Alpaca-style dataset. When a scenario fails, the operator's and the pod runner's
log tails are attached to the report.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from support.e2e_targets import REPORT, Target, make_target


@pytest.fixture(scope="session")
def target(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Target]:
    try:
        t = make_target(
            lambda: tmp_path_factory.mktemp("e2e"), lambda: request.getfixturevalue("binaries")
        )
    except LookupError as exc:
        pytest.skip(str(exc))
    yield t
    t.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and "target" in getattr(item, "funcargs", {}):
        target: Target = item.funcargs["target"]  # type: ignore[attr-defined]
        for name, text in target.diagnostics().items():
            report.sections.append((f"{name} log (tail)", text))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if REPORT:
        terminalreporter.section("e2e measurements")
        for line in REPORT:
            terminalreporter.write_line(line)
