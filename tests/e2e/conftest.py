"""Fixtures for the e2e tier: a cluster where the trainer really trains.

The target (see support/e2e_targets.py) starts once per session: once per pytest-xdist
worker where the run has several (`make test` runs the local target's scenarios on two, each
with a control plane, an operator and pod runners of its own; most of a scenario is waiting
for a trainer, an operator poll or a timeout, so two share the cores well). Every scenario
applies its own FineTuneJob into the `e2e` namespace, which holds a volume with a tiny
random-init model and an Alpaca-style dataset. When a scenario fails, the operator's and the
pod runner's log tails are attached to the report. What scenarios measured (REPORT) travels
with their reports, so the run's summary prints it whichever worker ran them.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from support.e2e_jobs import delete_job, job_doc
from support.e2e_targets import NAMESPACE, REPORT, Target, make_target
from support.waiting import wait_for


@pytest.fixture(scope="session")
def target(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Target]:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # gw0, gw1, ...
    try:
        t = make_target(
            lambda: tmp_path_factory.mktemp("e2e"),
            lambda: request.getfixturevalue("binaries"),
            block=int(worker.removeprefix("gw")),
        )
    except LookupError as exc:
        pytest.skip(str(exc))
    yield t
    t.close()


@pytest.fixture(scope="session")
def baseline(target: Target) -> Iterator[dict[str, Any]]:
    """An uninterrupted run (also the happy path): its log, statuses and write counts."""
    name = "baseline"
    watch = subprocess.Popen(
        [
            *target.kubectl_argv(),
            "get",
            "finetunejobs",
            "-n",
            NAMESPACE,
            f"--field-selector=metadata.name={name}",
            "--watch-only",
            "-o",
            "jsonpath={.metadata.resourceVersion} {.status.phase}{'\\n'}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines: list[str] = []

    def read() -> None:
        for line in watch.stdout or ():
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    snapshots: list[dict[str, Any]] = []

    def finished() -> dict[str, Any] | None:
        obj = target.get("finetunejob", name) or {}
        snapshots.append(dict(obj.get("status") or {}))
        return obj if snapshots[-1].get("phase") in ("Succeeded", "Failed") else None

    try:
        target.apply(job_doc(name, output={"mergeAdapter": True}))
        started = time.monotonic()
        last = wait_for(f"{name} to finish", finished, 300)
        seconds = time.monotonic() - started
        # Every write up to the one that finished the job has reached the watch.
        version = last["metadata"]["resourceVersion"]
        wait_for(
            f"the watch to see resourceVersion {version}",
            lambda: any(line.split(" ")[0] == version for line in list(lines)),
            30,
            0.1,
        )
    finally:
        watch.terminate()
        watch.wait(timeout=10)
        reader.join(timeout=10)
    writes = [line.rstrip("\n") for line in lines]
    yield {"name": name, "snapshots": snapshots, "writes": writes, "seconds": seconds}
    delete_job(target, name)


MEASURED = "e2e measurement"
"""The user property a report carries each REPORT line under."""
_MEASUREMENTS: list[str] = []
"""The run's REPORT lines, gathered from the reports (in the process that prints them)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and "target" in getattr(item, "funcargs", {}):
        target: Target = item.funcargs["target"]  # type: ignore[attr-defined]
        for name, text in target.diagnostics().items():
            report.sections.append((f"{name} log (tail)", text))
    if REPORT:  # what this test's phase measured, carried by its report
        report.user_properties.extend((MEASURED, line) for line in REPORT)
        REPORT.clear()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _MEASUREMENTS.extend(value for name, value in report.user_properties if name == MEASURED)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _MEASUREMENTS:
        terminalreporter.section("e2e measurements")
        for line in _MEASUREMENTS:
            terminalreporter.write_line(line)
