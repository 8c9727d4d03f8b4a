"""The analytical estimator against the simulated step: a sample of the grid
(`benchmarks/simulate_grid.py`, docs/simulate-grid.md) and of the DPO grid
(`--objective dpo`, docs/simulate-grid-dpo.md) held in CI.

The simulations are too slow for a unit test; their results are data here, and the estimator
is recomputed for each cell. A change of the estimator that moves it away from the simulation
(or towards it) fails until the grid is run again, so its table and this sample stay true."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubetune.planning.estimator import (
    TRAINER_QLORA_MATMUL_KEEPS_INPUT,
    TrainingSetup,
    comparable_bytes,
    estimate_vram,
    trainer_attention,
)
from kubetune.planning.throughput import ROWS_PER_PAIR
from kubetune.sources import load_arch

pytestmark = pytest.mark.unit

SAMPLE = Path(__file__).parent / "data" / "simulate_grid_sample.json"
DPO_SAMPLE = SAMPLE.with_name("simulate_grid_dpo_sample.json")
"""`benchmarks/simulate_grid.py --objective dpo`: the DPO step, micro-batches of pairs."""
# The recorded error is a ratio of integers computed the same way: only a change of the
# estimator moves it.
DRIFT = 1e-9


def _cells(sample: Path = SAMPLE) -> list[dict[str, object]]:
    return list(json.loads(sample.read_text()))


def _error(cell: dict[str, object]) -> float:
    arch = load_arch(str(cell["model"]))
    # A DPO cell's micro-batch counts pairs; the planner estimates the rows of the pairs.
    rows = ROWS_PER_PAIR if cell.get("objective") == "dpo" else 1
    setup = TrainingSetup(
        method=cell["method"],  # type: ignore[arg-type]
        seq_len=int(cell["seq_len"]),  # type: ignore[call-overload]
        micro_batch=int(cell["micro_batch"]) * rows,  # type: ignore[call-overload]
        grad_ckpt=bool(cell["grad_ckpt"]),
        lora_dropout=float(cell["lora_dropout"]),  # type: ignore[arg-type]
        attention=trainer_attention(arch),
        # Cells on several GPUs: rank 0 of an FSDP2 run (older cells are one GPU).
        gpus=int(cell.get("gpus", 1)),  # type: ignore[call-overload]
        sharding=cell.get("sharding", "full"),  # type: ignore[arg-type]
        # The simulation runs one micro-batch from a fresh state: no accumulation.
        grad_accumulation=int(cell.get("grad_accumulation", 1)),  # type: ignore[call-overload]
        # The planner's estimate for the trainer, whose bitsandbytes the simulation runs.
        qlora_matmul_keeps_input=TRAINER_QLORA_MATMUL_KEEPS_INPUT,
    )
    estimate = comparable_bytes(estimate_vram(arch, setup), "allocated")
    return estimate / int(cell["simulated_bytes"]) - 1  # type: ignore[call-overload]


def test_the_sample_covers_every_family_and_every_method() -> None:
    cells = _cells()
    assert len(cells) >= 40
    assert {c["method"] for c in cells} == {"full", "lora", "qlora"}
    qlora = [c for c in cells if c["method"] == "qlora"]
    assert len({c["model"] for c in qlora}) >= 10
    assert len({c["model"] for c in cells}) >= 10
    assert {c["grad_ckpt"] for c in cells} == {True, False}


def test_the_sample_covers_several_gpus_sharded() -> None:
    cells = [c for c in _cells() if int(c.get("gpus", 1)) > 1]  # type: ignore[call-overload]
    assert {c["gpus"] for c in cells} >= {2, 8}
    assert {c["method"] for c in cells} == {"full", "lora", "qlora"}
    assert {c["sharding"] for c in cells} == {"full"}


def test_the_dpo_sample_covers_both_methods_and_the_pairs() -> None:
    cells = _cells(DPO_SAMPLE)
    assert len(cells) >= 20
    assert {c["objective"] for c in cells} == {"dpo"}
    assert {c["method"] for c in cells} == {"full", "lora"}
    assert len({c["model"] for c in cells}) >= 10


def test_no_sampled_cell_is_below_the_simulation_by_more_than_3_percent() -> None:
    """The planner must not under-size a step: full fine-tuning's gradients, which a step
    without accumulation makes only in backward, included."""
    below = [c for c in _cells() + _cells(DPO_SAMPLE) if float(c["error"]) < -0.03]  # type: ignore[arg-type]
    assert not below


@pytest.mark.parametrize(
    "cell",
    _cells() + _cells(DPO_SAMPLE),
    ids=lambda c: (
        f"{c.get('objective', 'sft')}-{c['model']}-{c['method']}-b{c['micro_batch']}x{c['seq_len']}"
        f"-{c.get('gpus', 1)}gpu"
    ),
)
def test_the_estimate_is_where_the_grid_recorded_it(cell: dict[str, object]) -> None:
    assert _error(cell) == pytest.approx(cell["error"], abs=DRIFT), (
        "the estimator moved against the simulation: run benchmarks/simulate_grid.py again"
    )
