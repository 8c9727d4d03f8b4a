"""A DPO job (spec.training.objective: dpo): the API takes it, the trainer's config carries
it, and the planner sizes two rows per preference pair plus the reference model's passes."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kubetune.api.v1alpha1 import DPO_NEEDS_OBJECTIVE, FineTuneJobSpec
from kubetune.control.build.config import build_trainer_config
from kubetune.planning.catalog import default_pools
from kubetune.planning.planner import PlannerSettings, plan_job
from kubetune.planning.throughput import flops_per_token, reference_passes
from kubetune.sources import load_arch
from support.reconcile import SETTINGS, make_job, run

pytestmark = pytest.mark.unit

NO_LIVE = PlannerSettings(use_live_capacity=False)
POOLS = [p for p in default_pools() if p.name == "h100"]


def spec(**training: Any) -> FineTuneJobSpec:
    return FineTuneJobSpec.model_validate(
        {
            "model": {"uri": "meta-llama/Llama-3.1-8B"},
            "dataset": {"uri": "pvc://d/pairs.jsonl", "numExamples": 20000},
            "method": "lora",
            "resources": {"gpus": 1},
            "training": {
                "sequenceLength": 2048,
                "globalBatchSize": 32,
                "microBatchSize": 2,
                "gradientCheckpointing": True,
                **training,
            },
        }
    )


def test_dpo_settings_need_the_dpo_objective() -> None:
    with pytest.raises(ValidationError, match=r"only valid with spec\.training\.objective: dpo"):
        spec(dpo={"beta": 0.2})
    assert "To fix" in DPO_NEEDS_OBJECTIVE
    dpo = spec(objective="dpo", dpo={"beta": 0.2, "labelSmoothing": 0.1})
    assert dpo.training.dpo is not None and dpo.training.dpo.beta == 0.2
    with pytest.raises(ValidationError):
        spec(objective="dpo", dpo={"labelSmoothing": 0.5})  # half the labels flipped: no signal


def test_the_trainer_config_carries_the_objective() -> None:
    job = make_job(training={"objective": "dpo", "dpo": {"beta": 0.3}})
    job, _ = run(job)
    assert job.status is not None and job.status.plan is not None
    config = build_trainer_config(job, job.status.plan, SETTINGS.build, 1)
    assert config.training.objective == "dpo"
    assert (config.training.dpo.beta, config.training.dpo.label_smoothing) == (0.3, 0.0)
    sft, _ = run(make_job())
    assert sft.status is not None and sft.status.plan is not None
    assert build_trainer_config(sft, sft.status.plan, SETTINGS.build, 1).training.objective == "sft"


def test_a_dpo_plan_sizes_two_rows_a_pair_and_the_reference_passes() -> None:
    arch = load_arch("meta-llama/Llama-3.1-8B")
    sft = plan_job(spec(packing=False), POOLS, arch, NO_LIVE).chosen
    dpo_plan = plan_job(spec(objective="dpo"), POOLS, arch, NO_LIVE)
    dpo = dpo_plan.chosen
    # One step per 32 pairs, as many steps as SFT takes for 32 unpacked records.
    assert dpo_plan.total_steps == -(-20000 // 32)
    assert dpo_plan.dataset.tokens_per_epoch == 20000 * 2048 * 2
    # Memory: a micro-batch of 2 pairs runs 4 rows, so activations double.
    assert dpo.estimate.setup.micro_batch == 2 * sft.estimate.setup.micro_batch
    # Accumulation counts micro-batches of pairs: 32 pairs / 2 pairs on one GPU, not rows.
    assert dpo.grad_accum == dpo.estimate.setup.grad_accumulation == 16
    assert dpo.estimate.breakdown["activations"] == pytest.approx(
        2 * sft.estimate.breakdown["activations"], rel=0.01
    )
    # Time: twice the rows, and a reference forward on each with the adapters off.
    passes = (4.0 + 2.0 + 2.0) / (4.0 + 2.0)  # LoRA fwd+bwd, recompute, then the reference
    assert dpo.duration_s / sft.duration_s == pytest.approx(2 * passes, rel=0.15)


def test_full_dpo_pays_the_reference_pass_once_per_start() -> None:
    training = spec(objective="dpo", epochs=3).training
    assert reference_passes(training, "lora") == 2.0
    assert reference_passes(training, "full") == pytest.approx(2.0 / 3)
    assert reference_passes(spec().training, "full") == 0.0
    base = flops_per_token(8_000_000_000, 32, 4096, 2048, "full", False)
    more = flops_per_token(8_000_000_000, 32, 4096, 2048, "full", False, extra_passes=2.0)
    assert more / base == pytest.approx(8 / 6, rel=0.01)
