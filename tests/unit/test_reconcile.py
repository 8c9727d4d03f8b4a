"""The operator's decisions for one FineTuneJob, without a cluster.

Each test feeds `reconcile()` a job and what the cluster shows, then applies the returned
status the way the handler would (through the wire format), so sequences of reconciles
play out like the real control loop.
"""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest

from kubetune.api.tenancy import Tenant
from kubetune.api.units import quantity_value
from kubetune.api.v1alpha1 import FineTuneJob, FineTuneJobStatus, LabelSelector
from kubetune.api.vocabulary import ConditionType, Phase, Reason
from kubetune.control import conditions as c
from kubetune.control.build.settings import BuildSettings
from kubetune.control.build.storage import checkpoint_size
from kubetune.control.reconcile import PHASE_HANDLERS, Decision, Observed, reconcile
from kubetune.planning.arch import ArchitectureError
from kubetune.planning.catalog import default_pools
from kubetune_trainer.contract import TrainerResult
from support.reconcile import (
    SETTINGS,
    T0,
    batch_job,
    busy,
    make_job,
    observed,
    pod,
    run,
)

pytestmark = pytest.mark.unit


def kinds(d: Decision) -> list[str]:
    return [m["kind"] for m in d.create]


def test_new_job_is_planned_and_launched() -> None:
    job, d = run(make_job())
    s = job.status
    assert s is not None and s.plan is not None
    assert s.phase == Phase.RUNNING
    assert s.attempt == 1
    assert kinds(d) == ["PersistentVolumeClaim", "ConfigMap", "Service", "NetworkPolicy", "Job"]
    assert d.create[-1]["metadata"]["name"] == "demo-a1"
    assert c.is_true(s.conditions, ConditionType.PLANNED)
    assert [e.reason for e in d.events] == [Reason.PLAN_READY, Reason.LAUNCHED]
    assert s.progress is not None and s.progress.total_steps == s.plan.total_steps
    assert s.cost is not None and s.cost.estimated_usd == s.plan.estimated_cost_usd
    assert s.observed_generation == 1


def test_every_phase_has_its_handler() -> None:
    assert set(PHASE_HANDLERS) == set(Phase)


def test_reconcile_is_idempotent_once_running() -> None:
    job, _ = run(make_job())
    running = observed(batch_job(active=1, ready=1), [pod("demo-a1-0")])
    job, d1 = run(job, running, now=T0 + timedelta(seconds=10))
    job2, d2 = run(job, running, now=T0 + timedelta(seconds=20))
    assert d1.create == [] and d2.create == []
    assert c.is_true(job2.status.conditions, ConditionType.RUNNING)  # type: ignore[union-attr]
    # lastTransitionTime moves only when the status flips.
    t1 = c.get_condition(job.status.conditions, ConditionType.RUNNING).last_transition_time  # type: ignore[union-attr]
    t2 = c.get_condition(job2.status.conditions, ConditionType.RUNNING).last_transition_time  # type: ignore[union-attr]
    assert t1 == t2
    assert [e.reason for e in d2.events] == []


def test_no_pools_waits_instead_of_failing() -> None:
    job, d = run(make_job(), pools=[])
    assert job.status is not None and job.status.phase == Phase.PLANNING
    cond = c.get_condition(job.status.conditions, ConditionType.PLANNED)
    assert cond is not None and cond.reason == Reason.NO_POOLS
    assert d.create == [] and d.requeue_after == SETTINGS.queue_retry_seconds


def test_infeasible_job_fails_with_advice() -> None:
    job, d = run(
        make_job(
            model={"uri": "meta-llama/Llama-3.1-405B", "architecture": None},
            method="full",
            resources={"gpus": 1},
        )
    )
    s = job.status
    assert s is not None and s.phase == Phase.FAILED
    assert "To fix:" in (s.message or "")
    assert c.get_condition(s.conditions, ConditionType.FAILED).reason == Reason.INFEASIBLE  # type: ignore[union-attr]
    assert d.create == []
    assert d.events[-1].type == "Warning"


def test_unknown_architecture_fails_permanently() -> None:
    def loader(_: str) -> Any:
        raise ArchitectureError("unknown model acme/x; To fix: set spec.model.architecture")

    # Named by spec.model.architecture: the model's own files would not be read for it.
    job = make_job(model={"uri": "pvc://models/x", "architecture": "acme/x"})
    d = reconcile(job, observed(None), SETTINGS, now=T0, load_arch=loader)
    assert d.status.phase == Phase.FAILED
    assert (
        c.get_condition(d.status.conditions, ConditionType.FAILED).reason
        == Reason.UNKNOWN_ARCHITECTURE
    )  # type: ignore[union-attr]


def test_queued_until_capacity_frees() -> None:
    job, d = run(make_job(), pools=busy(default_pools(), free=0))
    assert job.status is not None and job.status.phase == Phase.QUEUED
    assert c.is_true(job.status.conditions, ConditionType.QUEUED)
    assert d.create == [] and d.requeue_after == SETTINGS.queue_retry_seconds
    job, d = run(job, pools=busy(default_pools(), free=8), now=T0 + timedelta(minutes=1))
    assert job.status is not None and job.status.phase == Phase.RUNNING
    assert not c.is_true(job.status.conditions, ConditionType.QUEUED)
    assert kinds(d)[-1] == "Job"


def test_success_then_ttl_cleanup() -> None:
    job, _ = run(make_job(ttlSecondsAfterFinished=60))
    job, d = run(job, observed(batch_job("Complete")), now=T0 + timedelta(minutes=5))
    s = job.status
    assert s is not None and s.phase == Phase.SUCCEEDED
    assert s.progress is not None and s.progress.percent == 100
    assert d.requeue_after == 60 and not d.delete_self
    _, d = run(job, observed(batch_job("Complete")), now=T0 + timedelta(minutes=7))
    assert d.delete_self


def test_the_final_status_takes_the_trainers_own_numbers_not_the_last_scrape() -> None:
    """The last metrics read may be steps behind; the trainer's result (rank 0's termination
    message on exit 0) says where it really ended."""
    job, _ = run(make_job())
    scraped = {"step": 22.0, "total_steps": 40.0, "loss": 6.2106}
    running = Observed(
        pools=default_pools(), batch_job=batch_job(active=1), trainer_metrics=scraped
    )
    job, _ = run(job, running, now=T0 + timedelta(minutes=2))
    assert job.status is not None and job.status.progress is not None
    assert job.status.progress.loss == 6.2106
    result = TrainerResult(outcome="completed", step=40, total_steps=40, loss=6.17867)
    done = pod("demo-a1-0", exit_code=0, msg=result.model_dump_json())
    job, _ = run(job, observed(batch_job("Complete"), [done]), now=T0 + timedelta(minutes=3))
    s = job.status
    assert s is not None and s.phase == Phase.SUCCEEDED and s.progress is not None
    assert (s.progress.step, s.progress.total_steps, s.progress.loss) == (40, 40, 6.1787)


def test_suspend_stops_the_trainer_and_resume_relaunches() -> None:
    job, _ = run(make_job())
    suspended = job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": True})})
    job, d = run(suspended, observed(batch_job(active=1)))
    assert job.status is not None and job.status.phase == Phase.SUSPENDED
    assert d.delete_jobs == ["demo-a1"]
    resumed = job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": False})})
    # Resumed at once: the suspended trainer still writes its checkpoint; wait for it.
    waiting, d = run(resumed, observed(None, [pod("demo-a1-0")]))
    assert waiting.status is not None and waiting.status.phase == Phase.SUSPENDED
    assert d.create == [] and waiting.status.attempt == 1
    assert waiting.status.message == "resuming once the trainer stops: pod demo-a1-0"
    # A pod whose deletion is long overdue is on a lost node: it does not hold the resume.
    lost = pod("demo-a1-0")
    lost["metadata"]["deletionTimestamp"] = "2026-11-22T11:58:00Z"  # T0 - 2 min
    job, d = run(resumed, observed(None, [lost]))
    assert job.status is not None and job.status.phase == Phase.RUNNING
    assert job.status.attempt == 2
    assert d.create[-1]["metadata"]["name"] == "demo-a2"
    assert not c.is_true(job.status.conditions, ConditionType.SUSPENDED)


def test_a_launch_the_status_never_recorded_is_adopted() -> None:
    job, _ = run(make_job())
    # Attempt 2 was created (say, after a relaunch) but the status still says attempt 1.
    newer = Observed(
        pools=default_pools(),
        batch_job={**batch_job(active=1), "metadata": {"name": "demo-a2"}},
        attempt=2,
        other_attempts=[1],
    )
    job, d = run(job, newer)
    s = job.status
    assert s is not None and s.attempt == 2 and s.phase == Phase.RUNNING
    assert d.create == []
    assert d.delete_jobs == ["demo-a1"]
    assert Reason.ADOPTED in [e.reason for e in d.events]


def test_a_finished_job_deletes_every_batch_job_left() -> None:
    job, _ = run(make_job())
    job, _ = run(job, observed(batch_job("Complete")))
    assert job.status is not None and job.status.phase == Phase.SUCCEEDED
    left = Observed(pools=default_pools(), attempt=1, other_attempts=[2])
    _, d = run(job, left)
    assert d.delete_jobs == ["demo-a2"]


def test_unknown_lora_targets_fail_the_job_with_the_fix() -> None:
    job, d = run(make_job(lora={"targetModules": ["foo_proj"]}))
    s = job.status
    assert s is not None and s.phase == Phase.FAILED and d.create == []
    assert c.get_condition(s.conditions, ConditionType.FAILED).reason == Reason.INVALID_SPEC  # type: ignore[union-attr]
    assert "foo_proj" in (s.message or "") and "To fix" in (s.message or "")


def test_a_plan_too_large_for_int64_fails_instead_of_breaking_the_status() -> None:
    job, d = run(make_job(training={"epochs": 100}, dataset={"numExamples": 10**17}))
    s = job.status
    assert s is not None and s.phase == Phase.FAILED and d.create == []
    assert "does not fit in a 64-bit integer" in (s.message or "")
    FineTuneJobStatus.model_validate(s.to_wire())


def test_failing_outside_reconcile_keeps_the_plan_and_says_why() -> None:
    from kubetune.control.lifecycle import failed

    job, _ = run(make_job())
    assert job.status is not None
    status = failed(job.status, Reason.INVALID_SPEC, "rejected", T0)
    assert status.phase == Phase.FAILED and status.message == "rejected"
    assert status.plan == job.status.plan
    cond = c.get_condition(status.conditions, ConditionType.FAILED)
    assert cond is not None and cond.reason == Reason.INVALID_SPEC
    assert job.status.phase == Phase.RUNNING  # the original is untouched


FAULTS_ON = replace(SETTINGS, build=BuildSettings(allow_test_faults=True))


def test_a_bad_fault_annotation_fails_the_job_with_the_fix() -> None:
    job = make_job()
    job.metadata["annotations"] = {"kubetune.io/test-faults": "{oops"}
    job, d = run(job, settings=FAULTS_ON)
    s = job.status
    assert s is not None and s.phase == Phase.FAILED and s.attempt == 0
    assert "kubetune.io/test-faults is not JSON" in (s.message or "")
    assert "To fix:" in (s.message or "")
    assert d.create == []


def test_budget_stops_the_job() -> None:
    job, _ = run(make_job(resources={"maxCostUSD": 1.0}))
    rate = job.status.cost.rate_usd_per_hour  # type: ignore[union-attr]
    assert rate is not None and rate > 0
    running = observed(batch_job(active=1, ready=1), [pod("demo-a1-0")])
    job, d = run(job, running, now=T0 + timedelta(hours=0.5 / rate))
    assert job.status is not None and job.status.phase == Phase.RUNNING
    job, d = run(job, running, now=T0 + timedelta(hours=1.01 / rate))
    s = job.status
    assert s is not None and s.phase == Phase.FAILED
    assert c.get_condition(s.conditions, ConditionType.FAILED).reason == Reason.BUDGET_EXCEEDED  # type: ignore[union-attr]
    assert s.cost is not None and s.cost.accrued_usd >= 1.0
    assert d.delete_jobs == ["demo-a1"]


def test_deadline_stops_the_job() -> None:
    job, _ = run(make_job(resources={"deadline": "100h"}))
    job, _d = run(job, observed(batch_job(active=1)), now=T0 + timedelta(hours=101))
    assert job.status is not None and job.status.phase == Phase.FAILED
    assert (
        c.get_condition(job.status.conditions, ConditionType.FAILED).reason
        == Reason.DEADLINE_EXCEEDED
    )  # type: ignore[union-attr]


def test_missing_children_are_recreated() -> None:
    job, first = run(make_job())
    job, d = run(job, observed(None))
    assert [m["metadata"]["name"] for m in d.create] == [
        m["metadata"]["name"] for m in first.create
    ]
    assert job.status is not None and job.status.attempt == 1


def test_cost_accrual_does_not_drift_with_sub_second_ticks() -> None:
    job, _ = run(make_job())
    rate = job.status.cost.rate_usd_per_hour  # type: ignore[union-attr]
    assert rate is not None
    running = observed(batch_job(active=1, ready=1), [pod("demo-a1-0")])
    now = T0
    for _ in range(360):  # one hour of ticks every 10.4 s
        now += timedelta(seconds=10, milliseconds=400)
        job, _ = run(job, running, now=now)
    elapsed_h = (now.replace(microsecond=0) - T0).total_seconds() / 3600
    assert job.status.cost.accrued_usd == pytest.approx(rate * elapsed_h, rel=1e-4)  # type: ignore[union-attr]


def timed_pod(name: str, started: datetime, finished: datetime | None = None) -> dict[str, Any]:
    """A trainer pod with the kubelet's start (and finish) times of its container."""
    stamp = "%Y-%m-%dT%H:%M:%SZ"
    state: dict[str, Any] = {"running": {"startedAt": started.strftime(stamp)}}
    if finished is not None:
        state = {"terminated": {"exitCode": 0, "startedAt": started.strftime(stamp),
                                "finishedAt": finished.strftime(stamp)}}  # fmt: skip
    phase = "Running" if finished is None else "Succeeded"
    cs = [{"name": "trainer", "state": state}]
    return {"metadata": {"name": name}, "status": {"phase": phase, "containerStatuses": cs}}


def test_cost_over_an_operator_outage_is_what_the_trainers_ran_in_it() -> None:
    """The operator was away two hours: billed by the pods' own times, not at the share of
    running pods it sees on its return (all of it for a pod just started, none of it for
    one that ended just before)."""
    rwx = {"storage": {"accessMode": "ReadWriteMany"}}
    job, _ = run(make_job(resources={"gpus": 16}, checkpoint=rwx))  # two nodes
    plan, rate = job.status.plan, job.status.cost.rate_usd_per_hour  # type: ignore[union-attr]
    assert plan is not None and plan.nodes == 2 and rate is not None
    back = T0 + timedelta(hours=2)
    pods = [
        timed_pod("demo-a1-0", T0, finished=T0 + timedelta(hours=1)),  # ended in the outage
        timed_pod("demo-a1-1", back - timedelta(minutes=10)),  # started just before the return
    ]
    job, _ = run(job, observed(batch_job(active=1, ready=1), pods), now=back)
    ran_hours = (1.0 + 10 / 60) / 2  # each pod is half the plan's GPUs
    assert job.status.cost.accrued_usd == pytest.approx(rate * ran_hours, rel=1e-4)  # type: ignore[union-attr]


def test_progress_eta_and_checkpoint_come_from_trainer_metrics() -> None:
    job, _ = run(make_job())
    total = job.status.plan.total_steps  # type: ignore[union-attr]
    metrics = {
        "step": 10.0,
        "total_steps": float(total),
        "epoch": 0.25,
        "loss": 2.34567,
        "tokens_per_second": 32 * 2048 / 2.0,  # one step every 2 s
        "last_checkpoint_step": 10.0,
        "eval_loss": float("nan"),  # no evaluation yet: must not reach the status
    }
    obs = Observed(pools=default_pools(), batch_job=batch_job(active=1), trainer_metrics=metrics)
    job, d = run(job, obs)
    p = job.status.progress  # type: ignore[union-attr]
    assert p is not None
    assert (p.step, p.total_steps, p.loss) == (10, total, 2.3457)
    assert p.eval_loss is None
    assert p.eta_seconds == pytest.approx((total - 10) * 2.0)
    assert p.summary == f"10/{total} ({int(100 * 10 / total)}%)"
    assert job.status.checkpoint is not None and job.status.checkpoint.latest_step == 10  # type: ignore[union-attr]
    assert Reason.CHECKPOINT in [e.reason for e in d.events]
    # The same checkpoint is not announced twice.
    _, d = run(job, obs)
    assert Reason.CHECKPOINT not in [e.reason for e in d.events]


def test_dpo_rewards_reach_the_progress_status_and_sft_nans_do_not() -> None:
    job, _ = run(make_job())
    metrics = {
        "step": 4.0,
        "loss": 0.61234,
        "dpo_reward_accuracy": 0.75,
        "dpo_reward_margin": 0.123456,
        "dpo_rewards_chosen": 0.1,
        "dpo_rewards_rejected": -0.023456,
        "eval_dpo_reward_accuracy": float("nan"),  # no evaluation yet
        "eval_dpo_reward_margin": float("nan"),
    }
    obs = Observed(pools=default_pools(), batch_job=batch_job(active=1), trainer_metrics=metrics)
    job, _ = run(job, obs)
    p = job.status.progress  # type: ignore[union-attr]
    assert p is not None
    assert (p.dpo_reward_accuracy, p.dpo_reward_margin) == (0.75, 0.1235)
    assert (p.dpo_rewards_chosen, p.dpo_rewards_rejected) == (0.1, -0.0235)
    assert p.eval_dpo_reward_accuracy is None and p.eval_dpo_reward_margin is None
    wire = job.status.to_wire()["progress"]  # type: ignore[union-attr]
    assert wire["dpoRewardAccuracy"] == 0.75 and "evalDpoRewardAccuracy" not in wire
    # The first evaluation arrives; a later NaN never erases a number read before.
    evaluated = {**metrics, "step": 5.0, "eval_dpo_reward_accuracy": 0.9,
                 "eval_dpo_reward_margin": 0.2}  # fmt: skip
    job, _ = run(job, replace(obs, trainer_metrics=evaluated))
    job, _ = run(job, replace(obs, trainer_metrics={**evaluated, "dpo_reward_accuracy": math.nan}))
    p = job.status.progress  # type: ignore[union-attr]
    assert p is not None
    assert (p.eval_dpo_reward_accuracy, p.eval_dpo_reward_margin) == (0.9, 0.2)
    assert p.dpo_reward_accuracy == 0.75
    # An SFT run's gauges are NaN: its status has no DPO numbers at all.
    sft, _ = run(make_job())
    sft_metrics = {**dict.fromkeys(metrics, math.nan), "step": 3.0, "loss": 2.0}
    sft, _ = run(sft, replace(obs, trainer_metrics=sft_metrics))
    wire = sft.status.to_wire()["progress"]  # type: ignore[union-attr]
    assert not [k for k in wire if "Dpo" in k or k.startswith("dpo")], wire


def test_human_duration() -> None:
    from kubetune.control.progress import human_duration

    assert human_duration(35) == "35s"
    assert human_duration(250) == "4m10s"
    assert human_duration(4800) == "1h20m"


# ---------------------------------------------------------------------- what admins allow


def test_fault_annotation_is_ignored_with_a_warning_without_the_setting() -> None:
    job = make_job()
    job.metadata["annotations"] = {"kubetune.io/test-faults": '{"oomAtStep": 2}'}
    job, d = run(job)
    assert job.status is not None and job.status.phase == Phase.RUNNING
    (ignored,) = [e for e in d.events if e.reason == Reason.TEST_FAULTS_IGNORED]
    assert ignored.type == "Warning" and "KUBETUNE_ALLOW_TEST_FAULTS" in ignored.message
    _, d = run(job, settings=FAULTS_ON)  # obeyed: no warning
    assert not [e for e in d.events if e.reason == Reason.TEST_FAULTS_IGNORED]


@pytest.mark.parametrize(
    ("image", "allowed", "refused"),
    [
        ("evil.example/miner:1", (), True),
        ("registry.example.com/ml/trainer:2", ("registry.example.com/ml/*",), False),
        ("registry.example.com/other/trainer:2", ("registry.example.com/ml/*",), True),
        (BuildSettings().trainer_image, (), False),  # the operator's own image
    ],
)
def test_a_trainer_image_off_the_allow_list_fails_before_planning(
    image: str, allowed: tuple[str, ...], refused: bool
) -> None:
    settings = replace(SETTINGS, allowed_trainer_images=allowed)
    job, d = run(make_job(trainerImage=image), settings=settings)
    s = job.status
    assert s is not None
    if not refused:
        assert s.phase == Phase.RUNNING
        return
    assert s.phase == Phase.FAILED and s.plan is None and d.create == []
    assert c.get_condition(s.conditions, ConditionType.FAILED).reason == Reason.IMAGE_NOT_ALLOWED  # type: ignore[union-attr]
    assert f"spec.trainerImage {image!r} is not allowed on this cluster" in (s.message or "")
    assert "To fix: remove spec.trainerImage" in (s.message or "")
    assert "operator.allowedTrainerImages" in (s.message or "")


def test_a_secret_the_namespace_did_not_allow_fails_before_planning() -> None:
    job = make_job(model={"tokenSecretRef": {"name": "hf-token"}})
    other = Tenant.of("team-a", {}, {"kubetune.io/allowed-secrets": "s3-creds"})
    refused, d = run(job, Observed(pools=default_pools(), tenant=other))
    s = refused.status
    assert s is not None and s.phase == Phase.FAILED and d.create == []
    assert c.get_condition(s.conditions, ConditionType.FAILED).reason == Reason.SECRET_NOT_ALLOWED  # type: ignore[union-attr]
    assert s.message == (
        "spec.model.tokenSecretRef names Secret 'hf-token', which namespace team-a has not "
        "allowed FineTuneJobs to use (allowed: s3-creds). To fix: a namespace admin runs "
        "`kubectl annotate namespace team-a --overwrite "
        "kubetune.io/allowed-secrets=hf-token,s3-creds`"
    )
    consenting = Tenant.of("team-a", {}, {"kubetune.io/allowed-secrets": "s3-creds, hf-token"})
    allowed, _ = run(job, Observed(pools=default_pools(), tenant=consenting))
    assert allowed.status is not None and allowed.status.phase == Phase.RUNNING


def patched(job: FineTuneJob, **update: Any) -> FineTuneJob:
    """The job after a `kubectl patch` of its spec (by alias, as the API takes it)."""
    spec = type(job.spec).model_validate({**job.spec.model_dump(by_alias=True), **update})
    return job.model_copy(update={"spec": spec})


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"trainerImage": "evil.example/miner:1"}, Reason.IMAGE_NOT_ALLOWED),
        ({"model": {"uri": "org/model", "tokenSecretRef": {"name": "aws-admin"}}},
         Reason.SECRET_NOT_ALLOWED),
    ],
)  # fmt: skip
def test_a_spec_patched_after_the_first_launch_is_checked_again_before_the_next(
    change: dict[str, Any], reason: Reason
) -> None:
    """The rules are checked before every launch: a job patched while suspended (or before
    a relaunch) gets no pod with an image or a Secret the rules refuse."""
    tenant = Tenant.of("team-a", {}, {"kubetune.io/allowed-secrets": "hf-token"})
    seen = Observed(pools=default_pools(), tenant=tenant)
    job, _ = run(make_job(), seen)
    assert job.status is not None and job.status.phase == Phase.RUNNING
    suspended = job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": True})})
    job, _ = run(suspended, replace(seen, batch_job=batch_job(active=1)))
    assert job.status is not None and job.status.phase == Phase.SUSPENDED
    resumed = patched(job, suspend=False, **change)
    job, d = run(resumed, replace(seen, attempt=1))
    s = job.status
    assert s is not None and s.phase == Phase.FAILED and d.create == [], s
    assert c.get_condition(s.conditions, ConditionType.FAILED).reason == reason  # type: ignore[union-attr]


def test_a_relaunch_onto_a_pool_that_no_longer_takes_the_namespace_plans_again() -> None:
    job, _ = run(make_job())
    assert job.status is not None and job.status.plan is not None
    pool = job.status.plan.pool
    closed = [
        p.model_copy(
            update={
                "spec": p.spec.model_copy(
                    update={"namespace_selector": LabelSelector(match_labels={"team": "b"})}
                )
            }
        )
        if p.name == pool
        else p
        for p in default_pools()
    ]
    tenant = Tenant.of("team-a", {"team": "a"}, {})
    suspended = job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": True})})
    job, _ = run(suspended, Observed(pools=closed, tenant=tenant, batch_job=batch_job(active=1)))
    resumed = job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": False})})
    job, d = run(resumed, Observed(pools=closed, tenant=tenant, attempt=1))
    s = job.status
    assert s is not None and d.create == [], d.create
    assert s.plan is None and s.phase == Phase.PLANNING, s  # the planner picks another pool


def test_pools_keep_to_the_namespaces_they_select() -> None:
    pools = default_pools()
    mine = pools[0].model_copy(
        update={
            "spec": pools[0].spec.model_copy(
                update={"namespace_selector": LabelSelector(match_labels={"team": "a"})}
            )
        }
    )
    others = [
        p.model_copy(
            update={
                "spec": p.spec.model_copy(
                    update={
                        "namespace_selector": LabelSelector.model_validate(
                            {"matchExpressions": [{"key": "team", "operator": "In",
                                                   "values": ["b", "c"]}]}
                        )
                    }
                )
            }
        )
        for p in pools[1:]
    ]  # fmt: skip
    team_a = Tenant.of("team-a", {"team": "a"}, {})
    job, _ = run(make_job(), Observed(pools=[mine, *others], tenant=team_a))
    s = job.status
    assert s is not None and s.plan is not None and s.plan.pool == mine.name
    reasons = {r.pool: r.reason for r in s.plan.rejected}
    assert reasons[others[0].name] == (
        "namespace team-a may not use it (its spec.namespaceSelector selects team in (b,c))"
    )
    # A namespace no pool takes: no plan, and the reason says who can change that.
    team_z = Tenant.of("team-z", {"team": "z"}, {})
    job, d = run(make_job(), Observed(pools=[mine, *others], tenant=team_z))
    s = job.status
    assert s is not None and s.plan is None and d.create == []
    assert "namespace team-z may not use it" in (s.message or "")
    assert "ask the cluster admin for a pool this namespace may use" in (s.message or "")


# ---------------------------------------------------------------------- checkpoint volume

RWX_CLASS = replace(SETTINGS, build=BuildSettings(checkpoint_read_write_many=True))


def two_node_job() -> Any:
    """Full fine-tuning of an 8B model on 16 GPUs: two 8-GPU nodes of h100."""
    return make_job(
        model={"uri": "pvc://models/llama", "architecture": "meta-llama/Llama-3.1-8B"},
        method="full",
        lora=None,
        resources={"gpus": 16, "pools": ["h100"]},
    )


def with_claim(*modes: str) -> Observed:
    claim = {"metadata": {"name": "demo-ckpt"}, "spec": {"accessModes": list(modes)}}
    return Observed(pools=default_pools(), checkpoint_claim=claim)


def test_a_job_stays_on_one_node_unless_its_checkpoint_volume_can_follow() -> None:
    """Without the setting, `auto` means a ReadWriteOnce volume: a plan over two nodes is
    refused, and the message names the setting; with it the volume is ReadWriteMany."""
    job, d = run(two_node_job())
    s = job.status
    assert s is not None and s.phase == Phase.FAILED
    assert c.get_condition(s.conditions, ConditionType.FAILED).reason == Reason.INFEASIBLE  # type: ignore[union-attr]
    assert "spans 2 nodes, but its checkpoint volume would be ReadWriteOnce" in (s.message or "")
    assert "operator.checkpointReadWriteMany" in (s.message or "")
    assert d.create == []

    job, d = run(two_node_job(), settings=RWX_CLASS)
    assert job.status is not None and job.status.plan is not None
    assert job.status.plan.nodes == 2
    assert d.create[0]["spec"]["accessModes"] == ["ReadWriteMany"]


def test_an_existing_checkpoint_volume_decides_whether_a_plan_may_span_nodes() -> None:
    """The volume of the first attempt stays: a ReadWriteOnce one holds every later plan to
    one node whatever the setting says; a ReadWriteMany one lets it span nodes."""
    job, _ = run(two_node_job(), with_claim("ReadWriteOnce"), settings=RWX_CLASS)
    s = job.status
    assert s is not None and s.phase == Phase.FAILED
    assert "its checkpoint volume demo-ckpt is ReadWriteOnce" in (s.message or "")
    assert "spec.checkpoint.storage.accessMode ReadWriteMany" in (s.message or "")

    job, _ = run(two_node_job(), with_claim("ReadWriteMany"))
    assert job.status is not None and job.status.plan is not None
    assert job.status.plan.nodes == 2


def test_a_one_node_job_is_planned_as_before_with_a_read_write_once_volume() -> None:
    plain, _ = run(make_job())
    held, _ = run(make_job(), with_claim("ReadWriteOnce"))
    assert plain.status is not None and held.status is not None
    assert held.status.plan == plain.status.plan


def claim_of(size: str, expands: bool | None) -> Observed:
    claim = {
        "metadata": {"name": "demo-ckpt"},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": size}},
            "storageClassName": "fast",
        },
    }
    return Observed(pools=default_pools(), checkpoint_claim=claim, checkpoint_class_expands=expands)


def test_a_launch_that_needs_a_larger_checkpoint_volume_expands_it_where_the_class_allows() -> None:
    job, d = run(make_job(), claim_of("1Gi", True))
    assert job.status is not None and job.status.plan is not None
    want = checkpoint_size(job, job.status.plan)
    assert quantity_value(want) > quantity_value("1Gi")
    assert d.resize_claims == [("demo-ckpt", want)]
    grown = [e for e in d.events if e.reason == Reason.CHECKPOINT_VOLUME_EXPANDED]
    assert len(grown) == 1 and grown[0].type == "Normal"
    assert f"demo-ckpt asks for 1Gi: its request was raised to {want}" in grown[0].message


@pytest.mark.parametrize("expands", [False, None])
def test_a_checkpoint_volume_that_cannot_grow_is_warned_about(expands: bool | None) -> None:
    job, d = run(make_job(), claim_of("1Gi", expands))
    assert d.resize_claims == []
    small = [e for e in d.events if e.reason == Reason.CHECKPOINT_VOLUME_SMALL]
    assert len(small) == 1 and small[0].type == "Warning"
    assert "StorageClass fast does not allow volume expansion" in small[0].message
    assert "To fix:" in small[0].message
    # The launch goes ahead: the volume may well be large enough in practice.
    assert job.status is not None and job.status.phase == Phase.RUNNING


def test_a_checkpoint_volume_large_enough_is_left_alone() -> None:
    _, d = run(make_job(), claim_of("1Ti", True))
    assert d.resize_claims == []
    assert {e.reason for e in d.events} == {Reason.PLAN_READY, Reason.LAUNCHED}
