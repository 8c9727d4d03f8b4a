"""spec.training.earlyStopping: what admission refuses, what the trainer is told, and how a
run that stopped early ends (Succeeded, reason EarlyStopped, status.earlyStopped)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from kubetune.api.crdgen import finetunejob_crd
from kubetune.api.v1alpha1 import (
    EARLY_STOPPING_NEEDS_VALIDATION,
    REWARD_ACCURACY_NEEDS_DPO,
    FineTuneJobSpec,
)
from kubetune.api.vocabulary import ConditionType, Reason, StepKind
from kubetune.control import conditions as c
from kubetune.control import pods as p
from kubetune.control.build.config import build_trainer_config
from kubetune.control.build.storage import checkpoint_size
from kubetune.control.reconcile import Observed
from kubetune.planning.catalog import default_pools
from kubetune_trainer.contract import (
    EARLY_STOPPED,
    EarlyStoppingConfig,
    EarlyStoppingResult,
    StageOutResult,
    TrainerResult,
)
from support.reconcile import (
    SETTINGS,
    T0,
    batch_job,
    make_job,
    observed,
    run,
    step_job,
    step_pod,
)

pytestmark = pytest.mark.unit

DATASET = {"uri": "pvc://data/train.jsonl", "numExamples": 20000, "validationSplit": 0.05}


def spec(**over: Any) -> FineTuneJobSpec:
    base: dict[str, Any] = {
        "model": {"uri": "pvc://models/qwen", "architecture": "Qwen/Qwen2.5-7B"},
        "dataset": DATASET,
        "method": "lora",
    }
    return FineTuneJobSpec.model_validate({**base, **over})


# ------------------------------------------------------------------ the API


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (
            {"dataset": {**DATASET, "validationSplit": 0.0}, "training": {"earlyStopping": {}}},
            EARLY_STOPPING_NEEDS_VALIDATION,
        ),
        (
            {"dataset": {"uri": "pvc://data/train.jsonl"}, "training": {"earlyStopping": {}}},
            EARLY_STOPPING_NEEDS_VALIDATION,
        ),
        (
            {"training": {"earlyStopping": {"metric": "eval_reward_accuracy"}}},
            REWARD_ACCURACY_NEEDS_DPO,
        ),
    ],
)
def test_early_stopping_without_what_it_needs_is_refused(
    over: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError) as err:
        spec(**over)
    assert message in str(err.value) and "To fix:" in message


@pytest.mark.parametrize(
    ("early_stopping", "error"),
    [
        ({"patience": 0}, "greater than or equal to 1"),
        ({"minDelta": -0.1}, "greater than or equal to 0"),
        ({"metric": "accuracy"}, "'eval_loss' or 'eval_reward_accuracy'"),
        ({"patients": 3}, "Extra inputs are not permitted"),
    ],
)
def test_bad_early_stopping_fields_are_refused(early_stopping: dict[str, Any], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        spec(training={"earlyStopping": early_stopping})


def test_valid_settings_and_their_defaults() -> None:
    sft = spec(training={"earlyStopping": {}})
    es = sft.training.early_stopping
    assert es is not None and es.patience is None  # the schema fills nothing in
    assert es.effective() == {"patience": 3, "min_delta": 0.0, "metric": "eval_loss"}
    dpo = spec(
        training={
            "objective": "dpo",
            "earlyStopping": {"patience": 5, "minDelta": 0.01, "metric": "eval_reward_accuracy"},
        }
    )
    assert dpo.training.early_stopping is not None
    assert dpo.training.early_stopping.effective() == {
        "patience": 5,
        "min_delta": 0.01,
        "metric": "eval_reward_accuracy",
    }
    assert FineTuneJobSpec.model_validate(dpo.to_wire()) == dpo
    assert "earlyStopping" not in spec().to_wire()["training"]


def test_crd_has_the_rules_and_no_defaults_for_early_stopping() -> None:
    schema = finetunejob_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec_schema = schema["properties"]["spec"]
    es = spec_schema["properties"]["training"]["properties"]["earlyStopping"]
    assert set(es["properties"]) == {"patience", "minDelta", "metric"}
    assert "default" not in es and all("default" not in f for f in es["properties"].values())
    assert es["properties"]["metric"]["enum"] == ["eval_loss", "eval_reward_accuracy"]
    messages = {rule["message"] for rule in spec_schema["x-kubernetes-validations"]}
    assert {EARLY_STOPPING_NEEDS_VALIDATION, REWARD_ACCURACY_NEEDS_DPO} <= messages
    status = schema["properties"]["status"]["properties"]["earlyStopped"]
    assert {"step", "bestStep", "metric", "value"} <= set(status["properties"])


# ------------------------------------------------------------------ the trainer's config


def test_the_trainer_config_carries_early_stopping_with_defaults_filled_in() -> None:
    job, _ = run(make_job(dataset=DATASET, training={"earlyStopping": {"patience": 4}}))
    assert job.status is not None and job.status.plan is not None
    config = build_trainer_config(job, job.status.plan, SETTINGS.build, 1)
    assert config.training.early_stopping == EarlyStoppingConfig(
        patience=4, min_delta=0.0, metric="eval_loss"
    )
    plain, _ = run(make_job())
    assert plain.status is not None and plain.status.plan is not None
    config = build_trainer_config(plain, plain.status.plan, SETTINGS.build, 1)
    assert config.training.early_stopping is None


def test_the_volume_holds_one_checkpoint_more_with_early_stopping() -> None:
    """The best step's checkpoint is kept beside the `keep` newest ones."""
    job, _ = run(make_job(dataset=DATASET, method="full", checkpoint={"keep": 1}))
    assert job.status is not None and job.status.plan is not None
    plan = job.status.plan
    es = make_job(
        dataset=DATASET,
        method="full",
        checkpoint={"keep": 1},
        training={"earlyStopping": {}},
    )
    two, three = (int(checkpoint_size(j, plan).removesuffix("Gi")) for j in (job, es))
    per_copy = 12 * plan.model_params / 2**30
    assert three - two == pytest.approx(per_copy, abs=1)


def test_the_plan_does_not_change_with_early_stopping() -> None:
    """Early stopping only ends a run sooner: duration, cost and steps are planned as
    without it."""
    with_es, _ = run(make_job(dataset=DATASET, training={"earlyStopping": {}}))
    without, _ = run(make_job(dataset=DATASET))
    assert with_es.status is not None and without.status is not None
    assert with_es.status.plan == without.status.plan


# ------------------------------------------------------------------ how the run ends


def succeeded_pod(name: str, message: str) -> dict[str, Any]:
    terminated = {"exitCode": 0, "reason": "Completed", "message": message}
    return {
        "metadata": {"name": name},
        "status": {
            "phase": "Succeeded",
            "containerStatuses": [{"name": "trainer", "state": {"terminated": terminated}}],
        },
    }


STOPPED = (
    f"{EARLY_STOPPED} step=120 best_step=80 metric=eval_loss value=1.23456789 patience=3 "
    "evaluations_without_improvement=3\n"
)


def test_termination_message_is_read_from_the_pod_that_wrote_it() -> None:
    pods = [succeeded_pod("demo-a1-1", ""), succeeded_pod("demo-a1-0", STOPPED)]
    stopped = p.early_stopped(pods)
    assert stopped is not None
    assert (stopped.step, stopped.best_step, stopped.metric) == (120, 80, "eval_loss")
    assert stopped.value == pytest.approx(1.234568) and stopped.patience == 3
    assert p.early_stopped([succeeded_pod("demo-a1-0", "completed step=400 best_step=400")]) is None
    assert p.early_stopped([succeeded_pod("demo-a1-0", f"{EARLY_STOPPED} step=x")]) is None


def test_a_run_that_stopped_early_succeeds_with_reason_early_stopped() -> None:
    job, _ = run(make_job(dataset=DATASET, training={"earlyStopping": {}}))
    assert job.status is not None and job.status.plan is not None
    total = job.status.plan.total_steps
    assert total > 120
    pods = [succeeded_pod("demo-a1-0", STOPPED)]
    job, d = run(job, observed(batch_job("Complete"), pods), now=T0 + timedelta(minutes=5))
    s = job.status
    assert s is not None and s.phase == "Succeeded"
    assert s.early_stopped is not None and s.early_stopped.best_step == 80
    cond = c.get_condition(s.conditions, ConditionType.SUCCEEDED)
    assert cond is not None and cond.status == "True" and cond.reason == Reason.EARLY_STOPPED
    assert s.message == cond.message
    assert "stopped early at step 120" in s.message and "step 80's weights" in s.message
    assert "eval_loss did not improve for 3 evaluations" in s.message
    assert [e.reason for e in d.events] == [Reason.EARLY_STOPPED]
    assert s.progress is not None and s.progress.step == 120
    assert s.progress.percent == int(100 * 120 / total) and s.progress.eta_seconds == 0
    assert s.progress.summary is not None and "early stopped, best step 80" in s.progress.summary
    assert s.checkpoint is not None and s.checkpoint.latest_step == 120


def test_a_run_that_trained_to_the_end_is_completed() -> None:
    job, _ = run(make_job(dataset=DATASET, training={"earlyStopping": {}}))
    pods = [succeeded_pod("demo-a1-0", "completed step=400 best_step=380 metric=eval_loss")]
    job, d = run(job, observed(batch_job("Complete"), pods), now=T0 + timedelta(minutes=5))
    s = job.status
    assert s is not None and s.phase == "Succeeded" and s.early_stopped is None
    cond = c.get_condition(s.conditions, ConditionType.SUCCEEDED)
    assert cond is not None and cond.reason == Reason.COMPLETED
    assert [e.reason for e in d.events] == [Reason.COMPLETED]
    assert s.progress is not None and s.progress.percent == 100


def test_early_stopping_is_recorded_before_the_upload_and_kept_after_the_pods_are_gone() -> None:
    """With an s3:// output the job succeeds only after the stage-out step: the trainer's
    pods tell of the early stop when its Job completes, and status keeps it until the end."""
    s3 = {
        "output": {"uri": "s3://results/support-bot/v1"},
        "s3": {"credentialsSecret": "s3-creds", "region": "eu-west-1"},
    }
    job, _ = run(make_job(dataset=DATASET, training={"earlyStopping": {}}, **s3))
    trained = Observed(
        pools=default_pools(),
        batch_job=batch_job("Complete"),
        pods=[succeeded_pod("demo-a1-0", STOPPED)],
    )
    job, _ = run(job, trained, now=T0 + timedelta(minutes=5))
    s = job.status
    assert s is not None and s.phase == "Running"  # uploading
    assert s.early_stopped is not None and s.early_stopped.step == 120
    uploaded = StageOutResult(destination="s3://results/support-bot/v1", files=1, bytes=1,
                              uploaded_bytes=1)  # fmt: skip
    done = Observed(
        pools=default_pools(),
        batch_job=batch_job("Complete"),
        pods=[],  # the trainer's pods are gone by now
        stage_out_job=step_job(StepKind.STAGE_OUT, "Complete"),
        stage_out_pods=[step_pod(StepKind.STAGE_OUT, 0, uploaded.model_dump_json())],
    )
    job, d = run(job, done, now=T0 + timedelta(minutes=6))
    s = job.status
    assert s is not None and s.phase == "Succeeded"
    cond = c.get_condition(s.conditions, ConditionType.SUCCEEDED)
    assert cond is not None and cond.reason == Reason.EARLY_STOPPED
    assert Reason.EARLY_STOPPED in [e.reason for e in d.events]


def test_a_result_that_stopped_early_succeeds_as_the_words_did() -> None:
    """A contract 2 trainer's `TrainerResult` ends the job EarlyStopped as a version 1
    trainer's `early_stopped ...` line does."""
    result = TrainerResult(
        outcome=EARLY_STOPPED,
        step=120,
        # The planned total is the plan's (157 here); a result's total would override it.
        total_steps=None,
        loss=1.61803,
        tokens_seen=1000,
        early_stopping=EarlyStoppingResult(
            stopped_early=True,
            best_step=80,
            metric="eval_loss",
            best_value=1.23456789,
            patience=3,
            evaluations_without_improvement=3,
        ),
    )
    ends = []
    for message in (result.model_dump_json(), STOPPED):
        job, _ = run(make_job(dataset=DATASET, training={"earlyStopping": {}}))
        pods = [succeeded_pod("demo-a1-0", message)]
        job, _ = run(job, observed(batch_job("Complete"), pods), now=T0 + timedelta(minutes=5))
        s = job.status
        assert s is not None and s.phase == "Succeeded"
        cond = c.get_condition(s.conditions, ConditionType.SUCCEEDED)
        assert cond is not None and cond.reason == Reason.EARLY_STOPPED
        ends.append((s.early_stopped, s.message, s.checkpoint))
    assert ends[0] == ends[1]
