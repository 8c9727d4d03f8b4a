"""Shared fixtures and paths, and the tiers.

Each tier is a directory of tests/ and a marker of the same name: unit, trainer, tooling,
integration, e2e (every test gets its directory's marker here, and carrying another tier's
marker is an error). `pytest -m <tier>` selects tiers. Tests that need the local control
plane, built from Go modules, carry the `controlplane` marker too: every integration and
e2e test (given here), and the tooling tests that say so themselves; a unit or trainer test
never does. A bare `pytest` runs the tests without it (unit, trainer, most of tooling): the
others run when `-m` selects them or the command line names their directory or files.

The control plane's fixtures (a cluster on loopback, the operator, a namespace) come from
`support.control_plane`, for every tier that starts one.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from kubetune_dev.binaries import Binaries

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
EXAMPLES = ROOT / "examples"

pytest_plugins = ["support.control_plane", "support.ordering"]

TIERS = ("unit", "trainer", "tooling", "integration", "e2e")
CONTROL_PLANE = "controlplane"
"""The marker of the tests that need the control plane: a bare `pytest` leaves them out."""
GATED = ("integration", "e2e")
"""The tiers whose every test needs the control plane (carries `CONTROL_PLANE`)."""
NEVER_GATED = ("unit", "trainer")
"""The tiers none of whose tests may need it."""
HOW_TO_RUN = {
    "tooling": '`pytest -m "tooling and controlplane"` (the local pod runner on a real '
    "control plane)",
    "integration": "`pytest -m integration` (a real control plane on loopback, the operator "
    "as a process)",
    "e2e": "`pytest -m e2e` (the trainer really trains; a pytest run of its own)",
}
_LEFT_OUT = pytest.StashKey[Counter[str]]()


def _tier(item: pytest.Item) -> str | None:
    """The tier directory of tests/ the item lives in."""
    parts = item.path.relative_to(TESTS).parts if item.path.is_relative_to(TESTS) else ()
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


def _named(config: pytest.Config, item: pytest.Item, tier: str) -> bool:
    """Whether the command line names the item's tier directory, or a part of it that holds
    the item (`pytest tests/integration/test_operator.py`, or `pytest` run in that folder)."""
    if config.args_source is pytest.Config.ArgsSource.TESTPATHS:
        return False
    for arg in config.args:
        path = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if path.is_relative_to(TESTS / tier) and item.path.is_relative_to(path):
            return True
    return False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    misplaced = []
    for item in items:
        tier = _tier(item)
        others = {m.name for m in item.iter_markers() if m.name in TIERS} - {tier}
        gated = item.get_closest_marker(CONTROL_PLANE) is not None
        if tier is None or others:
            misplaced.append(f"{item.nodeid} (tier markers: {sorted(others)})")
        elif tier in NEVER_GATED and gated:
            misplaced.append(f"{item.nodeid} (a {tier} test needs no control plane)")
        else:
            item.add_marker(tier)
            if tier in GATED:
                item.add_marker(CONTROL_PLANE)
    if misplaced:
        raise pytest.UsageError(
            f"tests must live in tests/<tier>/ ({', '.join(TIERS)}), carry no other tier's "
            f"marker, and only the {', '.join(t for t in TIERS if t not in NEVER_GATED)} "
            f"tiers may carry `{CONTROL_PLANE}`:\n  " + "\n  ".join(misplaced)
        )
    if config.option.markexpr:
        return
    left_out = []
    for item in items:
        tier = _tier(item)
        gated = item.get_closest_marker(CONTROL_PLANE) is not None
        if gated and tier is not None and not _named(config, item, tier):
            left_out.append(item)
    if left_out:
        dropped = {id(item) for item in left_out}
        items[:] = [item for item in items if id(item) not in dropped]
        config.hook.pytest_deselected(items=left_out)
        config.stash[_LEFT_OUT] = Counter(str(_tier(item)) for item in left_out)


def pytest_report_header(config: pytest.Config) -> list[str]:
    if config.option.markexpr:
        return [f"tiers: those -m {config.option.markexpr!r} selects (of {', '.join(TIERS)})"]
    return [
        "tiers: unit, trainer and tooling, without the tests that need the local control "
        "plane (a bare `pytest`); `pytest -m integration`, `pytest -m e2e` and "
        '`pytest -m "tooling and controlplane"` run those'
    ]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    left_out = terminalreporter.config.stash.get(_LEFT_OUT, None)
    if not left_out:
        return
    terminalreporter.write_sep("-", "tiers not run")
    for tier in HOW_TO_RUN:
        if left_out[tier]:
            terminalreporter.write_line(
                f"{left_out[tier]} {tier} tests not run by a bare `pytest`: {HOW_TO_RUN[tier]}"
            )
    terminalreporter.write_line(
        "They need the local control plane, built from Go modules on first use (about 10 "
        "minutes on 2 cores, then cached). `make test` runs every tier."
    )


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def binaries(pytestconfig: pytest.Config) -> Binaries:
    """The control-plane binaries, built from Go modules on first use (then cached).

    What the build says goes straight to the terminal's stderr, past pytest's capturing:
    a first build takes minutes, and the wait should not be silent.
    """
    from support.binaries import control_plane_binaries

    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    first = True

    def say(msg: str) -> None:
        nonlocal first
        shown = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
        with shown:
            print(f"\n{msg}" if first else msg, file=sys.stderr, flush=True)
        first = False

    return control_plane_binaries(say)
