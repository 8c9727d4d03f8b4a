"""The analytical estimator against the simulated step: a sample of the grid
(`benchmarks/simulate_grid.py`, docs/simulate-grid.md) held in CI.

The simulations are too slow for a unit test; their results are data here, and the estimator
is recomputed for each cell. A change of the estimator that moves it away from the simulation
(or towards it) fails until the grid is run again, so its table and this sample stay true."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubetune.planning.estimator import (
    TrainingSetup,
    comparable_bytes,
    estimate_vram,
    trainer_attention,
)
from kubetune.sources import load_arch

pytestmark = pytest.mark.unit

SAMPLE = Path(__file__).parent / "data" / "simulate_grid_sample.json"
# The recorded error is a ratio of integers computed the same way: only a change of the
# estimator moves it.
DRIFT = 1e-9


def _cells() -> list[dict[str, object]]:
    return list(json.loads(SAMPLE.read_text()))


def _error(cell: dict[str, object]) -> float:
    arch = load_arch(str(cell["model"]))
    setup = TrainingSetup(
        method=cell["method"],  # type: ignore[arg-type]
        seq_len=int(cell["seq_len"]),  # type: ignore[call-overload]
        micro_batch=int(cell["micro_batch"]),  # type: ignore[call-overload]
        grad_ckpt=bool(cell["grad_ckpt"]),
        lora_dropout=float(cell["lora_dropout"]),  # type: ignore[arg-type]
        attention=trainer_attention(arch),
    )
    estimate = comparable_bytes(estimate_vram(arch, setup), "allocated")
    return estimate / int(cell["simulated_bytes"]) - 1  # type: ignore[call-overload]


def test_the_sample_covers_every_family_and_both_methods() -> None:
    cells = _cells()
    assert len(cells) >= 40
    assert {c["method"] for c in cells} == {"full", "lora"}
    assert len({c["model"] for c in cells}) >= 10
    assert {c["grad_ckpt"] for c in cells} == {True, False}


@pytest.mark.parametrize(
    "cell", _cells(), ids=lambda c: f"{c['model']}-{c['method']}-b{c['micro_batch']}x{c['seq_len']}"
)
def test_the_estimate_is_where_the_grid_recorded_it(cell: dict[str, object]) -> None:
    assert _error(cell) == pytest.approx(cell["error"], abs=DRIFT), (
        "the estimator moved against the simulation: run benchmarks/simulate_grid.py again"
    )
