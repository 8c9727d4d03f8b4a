"""Shared fixtures and paths."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from kubetune_dev.binaries import Binaries

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


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
