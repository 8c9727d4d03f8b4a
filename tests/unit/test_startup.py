"""The launch preflight (claims and Secret a job reads) and what a job says while its trainer
pods do not run: the reason, the cost that does not accrue, the startup timeout."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest

from kubetune.api.vocabulary import ConditionType, Reason, RecoveryReason
from kubetune.control import conditions as c
from kubetune.control import pods as p
from kubetune.control.build.storage import InputRef, input_refs
from kubetune.control.reconcile import MissingInput, Observed, needs_preflight
from kubetune.planning.catalog import default_pools
from support.reconcile import SETTINGS, T0, batch_job, make_job, pod, run

TIMEOUT = SETTINGS.startup_timeout_seconds
CLAIM = InputRef("PersistentVolumeClaim", "data", "spec.dataset.uri")
TOKEN = InputRef("Secret", "hf", "spec.model.tokenSecretRef", "token")


def stamp(t: Any) -> str:
    return str(t.strftime("%Y-%m-%dT%H:%M:%SZ"))


def waiting_pod(
    name: str,
    reason: str,
    message: str = "",
    *,
    bound_at: Any = T0,
    unschedulable: str | None = None,
) -> dict[str, Any]:
    """A Pending trainer pod as the kubelet and scheduler report it."""
    status: dict[str, Any] = {"phase": "Pending", "conditions": []}
    spec: dict[str, Any] = {}
    if unschedulable is not None:
        status["conditions"].append(
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": unschedulable,
                "lastTransitionTime": stamp(bound_at),
            }
        )
    else:
        spec["nodeName"] = "gpu-node-1"
        status["conditions"].append(
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp(bound_at)}
        )
        waiting = {"reason": reason, **({"message": message} if message else {})}
        status["containerStatuses"] = [{"name": "trainer", "state": {"waiting": waiting}}]
    return {
        "metadata": {"name": name, "creationTimestamp": stamp(bound_at)},
        "spec": spec,
        "status": status,
    }


def launched(**spec: Any) -> Any:
    job, _ = run(make_job(**spec))
    assert job.status is not None and job.status.phase == "Running", job.status
    return job


def following(
    job: Any, pods: list[dict[str, Any]], after: float, only_its_pool: bool = False
) -> tuple[Any, Any]:
    pools = default_pools()
    if only_its_pool:  # nowhere else to move to
        pools = [pool for pool in pools if pool.name == job.status.plan.pool]
    seen = Observed(pools=pools, batch_job=batch_job(active=len(pods)), pods=pods)
    return run(job, seen, now=T0 + timedelta(seconds=after))


# ---------------------------------------------------------------------- the preflight


def test_input_refs_name_every_claim_once_and_the_token_secret() -> None:
    job = make_job(
        model={"uri": "pvc://models/llama", "architecture": "meta-llama/Llama-3.1-8B",
               "tokenSecretRef": {"name": "hf", "key": "token"}},
        dataset={"uri": "pvc://models/data.jsonl"},
        output={"uri": "pvc://results/run1"},
    )  # fmt: skip
    assert input_refs(job) == [
        InputRef("PersistentVolumeClaim", "models", "spec.model.uri"),
        InputRef("PersistentVolumeClaim", "results", "spec.output.uri"),
        TOKEN,
    ]
    hub = {"uri": "Qwen/Qwen2.5-7B"}
    assert input_refs(make_job(model=hub, dataset={"uri": "/data/train.jsonl"})) == []


def test_a_missing_claim_holds_the_job_before_planning_and_says_how_to_fix_it() -> None:
    seen = Observed(pools=default_pools(), missing_inputs=[MissingInput(CLAIM, "does not exist")])
    job, d = run(make_job(), seen)
    s = job.status
    assert s is not None and s.phase == "Pending" and s.plan is None
    assert d.create == [] and d.requeue_after == SETTINGS.queue_retry_seconds
    cond = c.get_condition(s.conditions, ConditionType.INPUTS_READY)
    assert cond is not None and cond.status == "False" and cond.reason == Reason.MISSING_VOLUME
    assert "PersistentVolumeClaim 'data' (spec.dataset.uri) does not exist" in (s.message or "")
    assert "To fix: create the claim 'data'" in (s.message or "")
    assert [(e.reason, e.type) for e in d.events] == [(Reason.MISSING_VOLUME, "Warning")]

    # Looked at again, still missing: no second Event.
    job, d = run(job, seen, now=T0 + timedelta(seconds=15))
    assert d.events == [] and job.status is not None and job.status.phase == "Pending"


def test_a_secret_without_its_key_is_missing_too() -> None:
    job = make_job(model={"tokenSecretRef": {"name": "hf"}})
    seen = Observed(
        pools=default_pools(), missing_inputs=[MissingInput(TOKEN, "has no key 'token'")]
    )
    job, _ = run(job, seen)
    cond = c.get_condition(job.status.conditions, ConditionType.INPUTS_READY)  # type: ignore[union-attr]
    assert cond is not None and cond.reason == Reason.MISSING_SECRET
    assert "Secret 'hf' (spec.model.tokenSecretRef) has no key 'token'" in cond.message
    assert "kubectl create secret generic hf --from-literal=token=<token>" in cond.message


def test_the_job_launches_once_its_inputs_exist() -> None:
    missing = Observed(
        pools=default_pools(), missing_inputs=[MissingInput(CLAIM, "does not exist")]
    )
    job, _ = run(make_job(), missing)
    job, d = run(job, Observed(pools=default_pools()), now=T0 + timedelta(seconds=30))
    s = job.status
    assert s is not None and s.phase == "Running" and d.create
    cond = c.get_condition(s.conditions, ConditionType.INPUTS_READY)
    assert cond is not None and cond.status == "True" and cond.reason == Reason.INPUTS_FOUND


def test_inputs_still_missing_after_the_startup_timeout_fail_the_job() -> None:
    seen = Observed(pools=default_pools(), missing_inputs=[MissingInput(CLAIM, "does not exist")])
    job, _ = run(make_job(), seen)
    job, d = run(job, seen, now=T0 + timedelta(seconds=TIMEOUT + 1))
    s = job.status
    assert s is not None and s.phase == "Failed"
    failed = c.get_condition(s.conditions, ConditionType.FAILED)
    assert failed is not None and failed.reason == Reason.MISSING_VOLUME
    assert (
        f"still missing after {TIMEOUT + 1:.0f}s" in failed.message and "To fix:" in failed.message
    )
    assert d.create == []


def test_only_a_job_about_to_launch_is_preflighted() -> None:
    fresh = make_job()
    assert needs_preflight(fresh)
    assert not needs_preflight(make_job(suspend=True))
    assert not needs_preflight(launched())


# ---------------------------------------------------------------------- pods that do not start


@pytest.mark.parametrize(
    ("pod_", "reason", "for_room"),
    [
        (waiting_pod("a", "ImagePullBackOff", 'Back-off pulling "x"'),
         Reason.IMAGE_PULL_FAILED, False),
        (waiting_pod("a", "ErrImagePull"), Reason.IMAGE_PULL_FAILED, False),
        (waiting_pod("a", "CreateContainerConfigError", 'secret "hf" not found'),
         Reason.CONTAINER_CONFIG_ERROR, False),
        (waiting_pod("a", "ContainerCreating"), Reason.PODS_STARTING, False),
        (waiting_pod("a", "", unschedulable="0/4 nodes: 4 Insufficient nvidia.com/gpu."),
         Reason.UNSCHEDULABLE, True),
        (waiting_pod("a", "", unschedulable='persistentvolumeclaim "data" not found'),
         Reason.UNSCHEDULABLE, False),
    ],
)  # fmt: skip
def test_startup_reads_why_a_pod_does_not_run(
    pod_: dict[str, Any], reason: Reason, for_room: bool
) -> None:
    found = p.startup(pod_)
    assert found is not None and found.reason == reason and found.for_room == for_room
    assert found.pod == "a" and found.since == T0


def test_a_running_or_ended_pod_has_no_startup_problem() -> None:
    assert p.startup(pod("a")) is None
    assert p.startup(pod("a", exit_code=1)) is None


def test_an_image_that_cannot_be_pulled_shows_in_status_costs_nothing_then_fails_the_job() -> None:
    job = launched()
    pulling = [waiting_pod("demo-a1-0", "ImagePullBackOff", 'Back-off pulling image "x"')]
    job, d = following(job, pulling, after=60)
    s = job.status
    assert s is not None and s.phase == "Running"
    cond = c.get_condition(s.conditions, ConditionType.RUNNING)
    assert cond is not None and cond.status == "False" and cond.reason == Reason.IMAGE_PULL_FAILED
    assert 'Back-off pulling image "x"' in (s.message or "")
    assert [e.reason for e in d.events] == [Reason.IMAGE_PULL_FAILED]
    assert s.cost is not None and s.cost.accrued_usd == 0.0

    job, d = following(job, pulling, after=120)
    assert d.events == []  # the same reason is told once

    job, d = following(job, pulling, after=TIMEOUT + 1)
    s = job.status
    assert s is not None and s.phase == "Failed"
    failed = c.get_condition(s.conditions, ConditionType.FAILED)
    assert failed is not None and failed.reason == Reason.STARTUP_TIMEOUT
    assert "ImagePullBackOff" in failed.message and "To fix: check the image name" in failed.message
    assert d.delete_jobs == ["demo-a1"]
    assert s.cost is not None and s.cost.accrued_usd == 0.0


def test_a_pod_stuck_creating_is_relaunched_as_a_restart() -> None:
    job = launched()
    stuck = [waiting_pod("demo-a1-0", "ContainerCreating")]
    job, d = following(job, stuck, after=TIMEOUT + 1)
    s = job.status
    assert s is not None and s.phase == "Running" and s.attempt == 2 and s.restarts == 1
    assert s.recoveries[-1].reason == RecoveryReason.POD_FAILURE
    assert "not started after" in (s.recoveries[-1].message or "")
    assert "demo-a1" in d.delete_jobs and d.create


def test_waiting_for_room_never_times_out() -> None:
    job = launched()
    full = [
        waiting_pod(
            "demo-a1-0", "", unschedulable="0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
        )
    ]
    job, _ = following(job, full, after=10 * TIMEOUT, only_its_pool=True)
    s = job.status
    assert s is not None and s.phase == "Running" and s.attempt == 1
    cond = c.get_condition(s.conditions, ConditionType.RUNNING)
    assert cond is not None and cond.reason == Reason.UNSCHEDULABLE
    assert "Insufficient nvidia.com/gpu" in cond.message


def test_the_startup_timer_starts_when_the_pod_gets_its_node() -> None:
    job = launched()
    late = [waiting_pod("demo-a1-0", "ContainerCreating", bound_at=T0 + timedelta(seconds=TIMEOUT))]
    job, _ = following(job, late, after=TIMEOUT + 60)
    assert job.status is not None and job.status.attempt == 1 and job.status.restarts == 0


def test_cost_accrues_for_the_share_of_trainers_that_run() -> None:
    # Two nodes: the checkpoint volume must be able to follow (ReadWriteMany).
    job = launched(resources={"gpus": 16}, checkpoint={"storage": {"accessMode": "ReadWriteMany"}})
    plan = job.status.plan  # type: ignore[union-attr]
    assert plan is not None and plan.nodes == 2, plan
    rate = job.status.cost.rate_usd_per_hour  # type: ignore[union-attr]
    bound = T0 + timedelta(seconds=3000)
    half = [pod("demo-a1-0"), waiting_pod("demo-a1-1", "ContainerCreating", bound_at=bound)]
    job, _ = following(job, half, after=3600)
    assert job.status.cost.accrued_usd == pytest.approx(rate / 2, rel=1e-6)  # type: ignore[union-attr]
    assert not c.is_true(job.status.conditions, ConditionType.RUNNING)  # type: ignore[union-attr]
    both = [pod("demo-a1-0"), pod("demo-a1-1")]
    job, d = following(job, both, after=7200)
    assert job.status.cost.accrued_usd == pytest.approx(rate * 1.5, rel=1e-6)  # type: ignore[union-attr]
    assert c.is_true(job.status.conditions, ConditionType.RUNNING)  # type: ignore[union-attr]
    assert job.status.message == "attempt 1 training"  # type: ignore[union-attr]
    assert [e.reason for e in d.events] == [Reason.TRAINING]


def test_a_settings_override_of_the_timeout_is_obeyed() -> None:
    job = launched()
    short = replace(SETTINGS, startup_timeout_seconds=30)
    pulling = [waiting_pod("demo-a1-0", "ErrImagePull")]
    seen = Observed(pools=default_pools(), batch_job=batch_job(active=1), pods=pulling)
    job, _ = run(job, seen, now=T0 + timedelta(seconds=31), settings=short)
    assert job.status is not None and job.status.phase == "Failed"
