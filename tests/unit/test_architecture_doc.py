"""docs/architecture.md draws what the code enforces: its phase diagram is the lifecycle table,
and its contract table names every import-linter contract."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from kubetune.api.vocabulary import Phase
from kubetune.control.lifecycle import TRANSITIONS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs/architecture.md").read_text()


def test_the_phase_diagram_is_the_transition_table() -> None:
    diagram = DOC.split("stateDiagram-v2", 1)[1].split("```", 1)[0]
    edges = set(re.findall(r"^\s*(\w+) --> (\w+)\s*$", diagram, re.MULTILINE))
    drawn = {(Phase(a), Phase(b)) for a, b in edges}
    table = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    assert drawn == table, f"missing: {table - drawn}; not in the table: {drawn - table}"


def test_the_contract_table_names_every_contract() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    ids = {c["id"] for c in config["tool"]["importlinter"]["contracts"]}
    rows = set(re.findall(r"^\| `([\w-]+)` \|", DOC, re.MULTILINE))
    assert ids <= rows, f"contracts missing from docs/architecture.md: {ids - rows}"
