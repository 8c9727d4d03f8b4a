"""What the operator does after a failure, without a cluster: out-of-memory re-plans, config
errors, relaunches, preemptions, moves to another pool, stalls and the limits on each
(control/reconcile/recovery.py). Replayed like tests/unit/test_reconcile.py.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from kubetune.api.v1alpha1 import PlanStatus, Recovery
from kubetune.api.vocabulary import ConditionType, Phase, PlanReason, Reason, RecoveryReason
from kubetune.control import conditions as c
from kubetune.control.reconcile import (
    KEEP_RECOVERIES,
    Decision,
    Observed,
    preemptions_without_progress,
    reconcile,
    trim_recoveries,
)
from kubetune.planning.catalog import default_pools
from kubetune_trainer.contract import EXIT_CONFIG_ERROR, EXIT_OOM, EXIT_PREEMPTED
from support.reconcile import (
    SETTINGS,
    T0,
    batch_job,
    load_arch,
    make_job,
    observed,
    pod,
    run,
    unschedulable,
)

pytestmark = pytest.mark.unit


def kinds(d: Decision) -> list[str]:
    return [m["kind"] for m in d.create]


def test_oom_replans_with_a_safer_layout_then_gives_up() -> None:
    job, _ = run(make_job(recovery={"maxOOMReplans": 2}))
    first = job.status.plan  # type: ignore[union-attr]
    assert first is not None
    oom = observed(batch_job("Failed"), [pod("demo-a1-0", EXIT_OOM, msg="peak_gib=79.5")])
    job, d = run(job, oom, now=T0 + timedelta(minutes=3))
    s = job.status
    assert s is not None and s.plan is not None
    assert s.plan.revision == 2
    assert s.plan.reason.startswith("OutOfMemory")
    assert s.plan.memory_scale > 1.0
    assert [r.reason for r in s.recoveries] == ["OOM"]
    assert s.attempt == 2 and d.create[-1]["metadata"]["name"] == "demo-a2"
    assert "demo-a1" in d.delete_jobs
    new_layout = (
        s.plan.pool,
        s.plan.total_gpus,
        s.plan.micro_batch_size,
        s.plan.gradient_checkpointing,
    )
    old_layout = (
        first.pool,
        first.total_gpus,
        first.micro_batch_size,
        first.gradient_checkpointing,
    )
    assert new_layout != old_layout
    assert s.failed_layouts == [
        f"{first.pool}/lora/{first.total_gpus}/{first.micro_batch_size}/"
        + ("ckpt" if first.gradient_checkpointing else "nockpt")
    ]
    # Second OOM → another re-plan; third → give up with a clear message.
    job, _ = run(job, oom, now=T0 + timedelta(minutes=6))
    assert job.status is not None and job.status.plan.revision == 3  # type: ignore[union-attr]
    job, d = run(job, oom, now=T0 + timedelta(minutes=9))
    s = job.status
    assert s is not None and s.phase == Phase.FAILED
    assert c.get_condition(s.conditions, ConditionType.FAILED).reason == Reason.OOM_LIMIT  # type: ignore[union-attr]
    assert "maxOOMReplans=2" in (s.message or "")


def test_config_error_is_permanent() -> None:
    job, _ = run(make_job())
    bad = observed(
        batch_job("Failed"),
        [pod("demo-a1-0", EXIT_CONFIG_ERROR, msg="train.jsonl line 3: missing 'output'")],
    )
    job, d = run(job, bad)
    s = job.status
    assert s is not None and s.phase == Phase.FAILED
    assert "line 3" in (s.message or "")
    assert d.create == []


def test_generic_failure_relaunches_until_the_limit() -> None:
    job, _ = run(make_job(recovery={"maxRestarts": 1}))
    crash = observed(batch_job("Failed"), [pod("demo-a1-0", 1, msg="segfault")])
    job, d = run(job, crash)
    assert d.create[-1]["metadata"]["name"] == "demo-a2"
    assert job.status is not None and job.status.restarts == 1 and job.status.attempt == 2
    assert job.status.recoveries[-1].reason == "PodFailure"
    crash2 = observed(
        {**batch_job("Failed"), "metadata": {"name": "demo-a2"}}, [pod("demo-a2-0", 1)]
    )
    job, _d = run(job, crash2)
    assert job.status is not None and job.status.phase == Phase.FAILED
    assert (
        c.get_condition(job.status.conditions, ConditionType.FAILED).reason == Reason.RESTART_LIMIT
    )  # type: ignore[union-attr]


def test_preemption_is_recorded_once() -> None:
    job, _ = run(make_job())
    pre = observed(batch_job(active=1), [pod("demo-a1-0", EXIT_PREEMPTED)])
    job, first = run(job, pre)
    job, second = run(job, pre)
    s = job.status
    assert s is not None and s.restarts == 1
    assert [r.reason for r in s.recoveries] == ["Preemption"]
    assert [e.reason for e in first.events].count(Reason.PREEMPTED) == 1
    assert Reason.PREEMPTED not in [e.reason for e in second.events]
    evicted = observed(
        batch_job(active=1),
        [pod("demo-a1-0", EXIT_PREEMPTED), pod("demo-a1-0b", 137, disrupted=True)],
    )
    job, _ = run(job, evicted)
    assert job.status is not None and job.status.restarts == 2
    assert [r.reason for r in job.status.recoveries] == ["Preemption", "Preemption"]
    assert all(r.attempt == 1 for r in job.status.recoveries)


def test_a_preempted_attempt_with_no_pod_left_is_relaunched_at_once() -> None:
    """The Job controller would replace the pod only after its back-off (10 s, then 20 s,
    40 s ...: ignored failures count too), so a new attempt starts at once."""
    job, _ = run(make_job())
    preempted = observed(batch_job(active=0), [pod("demo-a1-0-aaaaa", EXIT_PREEMPTED)])
    job, d = run(job, preempted)
    s = job.status
    assert s is not None and s.phase == Phase.RUNNING and s.attempt == 2 and s.restarts == 1
    assert [(r.reason, r.attempt) for r in s.recoveries] == [("Preemption", 1)]
    assert d.delete_jobs == ["demo-a1"]
    assert [m["metadata"]["name"] for m in d.create if m["kind"] == "Job"] == ["demo-a2"]
    assert [e.reason for e in d.events] == [Reason.PREEMPTED, Reason.LAUNCHED]
    # The new attempt's first look, before the Job controller made its pod: nothing more.
    job, d = run(job, observed({**batch_job(), "metadata": {"name": "demo-a2"}}))
    assert job.status is not None and job.status.attempt == 2 and job.status.restarts == 1
    assert d.delete_jobs == [] and kinds(d) == []


def test_a_preempted_pod_is_left_to_the_batch_job_while_another_runs_or_is_replaced() -> None:
    job, _ = run(make_job())
    # One node's pod of a two-node attempt preempted, the other still saving: wait for it.
    saving = observed(
        batch_job(active=1), [pod("demo-a1-0-aaaaa"), pod("demo-a1-1-bbbbb", EXIT_PREEMPTED)]
    )
    job, d = run(job, saving)
    assert job.status is not None and job.status.attempt == 1 and d.delete_jobs == []
    # The Job controller's status still counts a pod active (its replacement, not yet seen).
    replaced = observed(batch_job(active=1), [pod("demo-a1-1-bbbbb", EXIT_PREEMPTED)])
    job, d = run(job, replaced)
    assert job.status is not None and job.status.attempt == 1 and d.delete_jobs == []
    # Both ended (every rank checkpointed): one preemption, the next attempt now.
    ended = observed(
        batch_job(active=0),
        [pod("demo-a1-0-aaaaa", EXIT_PREEMPTED), pod("demo-a1-1-bbbbb", EXIT_PREEMPTED)],
    )
    job, d = run(job, ended)
    s = job.status
    assert s is not None and s.attempt == 2 and s.restarts == 2
    assert preemptions_without_progress(s.recoveries) == 1
    assert d.delete_jobs == ["demo-a1"]


def test_a_crashed_pod_is_left_to_the_batch_job_and_its_back_off() -> None:
    job, _ = run(make_job())
    job, _ = run(job, observed(batch_job(active=0), [pod("demo-a1-0-aaaaa", EXIT_PREEMPTED)]))
    assert job.status is not None and job.status.attempt == 2
    crashed = observed(
        {**batch_job(active=0), "metadata": {"name": "demo-a2"}, "status": {"failed": 1}},
        [pod("demo-a2-0-ccccc", 1)],
    )
    job, d = run(job, crashed)
    s = job.status
    assert s is not None and s.attempt == 2 and s.restarts == 2
    assert [r.reason for r in s.recoveries] == ["Preemption", "PodFailure"]
    assert d.delete_jobs == [] and kinds(d) == []


def test_preemptions_in_attempts_of_their_own_count_past_the_kept_recoveries() -> None:
    """Each preemption now starts an attempt of its own; a limit above KEEP_RECOVERIES is
    still reached, since the run of preemptions is kept."""
    limit = KEEP_RECOVERIES + 5
    job, _ = run(make_job(recovery={"maxPreemptionsWithoutProgress": limit}))
    for _ in range(limit + 1):
        s = job.status
        assert s is not None and s.phase == Phase.RUNNING
        a = s.attempt
        ended = observed(
            {**batch_job(active=0), "metadata": {"name": f"demo-a{a}"}},
            [pod(f"demo-a{a}-0-aaaaa", EXIT_PREEMPTED)],
        )
        job, d = run(job, ended)
    s = job.status
    assert s is not None and s.phase == Phase.FAILED and s.attempt == limit + 1
    assert d.delete_jobs == [f"demo-a{limit + 1}"]  # its batch Job stops
    assert c.get_condition(s.conditions, ConditionType.FAILED).reason == Reason.PREEMPTION_LIMIT  # type: ignore[union-attr]
    assert len(s.recoveries) == limit + 1 and s.recovery_counts == {"Preemption": limit + 1}


def test_an_oom_exit_seen_before_the_job_fails_is_left_to_the_replan() -> None:
    job, _ = run(make_job())
    # The pod has failed with the OOM code; the Job controller has not failed the Job yet.
    job, _ = run(job, observed(batch_job(active=0), [pod("demo-a1-0", EXIT_OOM)]))
    assert job.status is not None and job.status.recoveries == []
    job, _ = run(job, observed(batch_job("Failed"), [pod("demo-a1-0", EXIT_OOM)]))
    assert job.status is not None
    assert [r.reason for r in job.status.recoveries] == ["OOM"]


def test_a_killed_pod_is_a_pod_failure_recorded_once() -> None:
    job, _ = run(make_job())
    killed = observed(batch_job(active=0), [pod("demo-a1-0", 137, msg="Killed")])
    job, first = run(job, killed)
    job, _ = run(job, killed)
    s = job.status
    assert s is not None and s.restarts == 1 and s.phase == Phase.RUNNING
    (rec,) = s.recoveries
    assert rec.reason == "PodFailure" and rec.message.startswith("pod demo-a1-0 failed (exit")
    assert Reason.TRAINER_FAILED in [e.reason for e in first.events]


@pytest.mark.parametrize(("failed", "reason"), [(0, "Preemption"), (1, "PodFailure")])
def test_a_pod_gone_before_its_end_was_seen_is_classified_by_the_job(
    failed: int, reason: str
) -> None:
    job, _ = run(make_job())
    job, _ = run(job, observed(batch_job(active=1), [pod("demo-a1-0-aaaaa")]))
    assert job.status is not None and job.status.trainer_pods == ["demo-a1-0-aaaaa"]
    replaced = observed(
        {**batch_job(active=1), "status": {"active": 1, "failed": failed}},
        [pod("demo-a1-0-bbbbb")],
    )
    job, _ = run(job, replaced)
    job, _ = run(job, replaced)
    s = job.status
    assert s is not None and [r.reason for r in s.recoveries] == [reason]
    assert s.restarts == 1 and s.trainer_pods == ["demo-a1-0-bbbbb"]


def test_a_pod_without_room_moves_the_job_to_another_pool() -> None:
    job, _ = run(make_job())
    first = job.status.plan  # type: ignore[union-attr]
    assert first is not None
    stuck = observed(batch_job(active=1), [unschedulable("demo-a1-0-bbbbb", T0)])
    # Not yet: it may still get room.
    job, d = run(job, stuck, now=T0 + timedelta(seconds=SETTINGS.reschedule_seconds - 5))
    assert d.create == [] and job.status is not None and job.status.attempt == 1
    job, d = run(job, stuck, now=T0 + timedelta(seconds=SETTINGS.reschedule_seconds + 1))
    s = job.status
    assert s is not None and s.plan is not None
    assert s.attempt == 2 and s.plan.revision == 2 and s.plan.pool != first.pool
    assert s.plan.reason == PlanReason.UNSCHEDULABLE
    assert (s.plan.message or "").startswith("pod demo-a1-0-bbbbb found no room")
    assert [(r.reason, r.pod) for r in s.recoveries] == [
        (RecoveryReason.RESCHEDULED, "demo-a1-0-bbbbb")
    ]
    assert d.delete_jobs == ["demo-a1"]
    assert Reason.RESCHEDULED in [e.reason for e in d.events]
    # Its pod, not yet being deleted, might still be placed: attempt 2 waits for that.
    assert "Job" not in [m["kind"] for m in d.create]
    going = unschedulable("demo-a1-0-bbbbb", T0)
    going["metadata"]["deletionTimestamp"] = "2026-11-22T12:00:40Z"
    later = T0 + timedelta(seconds=SETTINGS.reschedule_seconds + 3)
    job, d = run(job, Observed(pools=default_pools(), earlier_pods=[going]), now=later)
    assert d.create[-1]["metadata"]["name"] == "demo-a2"


def test_a_move_waits_for_the_queue_of_the_pool_it_would_move_to() -> None:
    """A move is a launch: the new pool's queue and reservations decide it, and a job that
    may not go now stays where it is (it joins no queue: it still has its pods)."""
    job, _ = run(make_job())
    stuck = observed(batch_job(active=1), [unschedulable("demo-a1-0-bbbbb", T0)])
    asked: list[tuple[str, bool, bool]] = []

    def queue_full(plan: PlanStatus, queued: bool, join: bool = True) -> str | None:
        asked.append((plan.pool, queued, join))
        return "position 3 in the queue"

    late = T0 + timedelta(seconds=SETTINGS.reschedule_seconds + 1)
    d = reconcile(job, stuck, SETTINGS, now=late, load_arch=load_arch, admit=queue_full)

    assert len(asked) == 1 and asked[0][1:] == (False, False)
    assert d.create == [] and d.delete_jobs == []
    s = d.status
    assert s.attempt == 1 and s.restarts == 0 and s.recoveries == [] and s.phase == Phase.RUNNING
    assert s.plan is not None and s.plan.revision == 1


def test_a_pod_stuck_on_its_volume_does_not_move() -> None:
    job, _ = run(make_job())
    pod = unschedulable("demo-a1-0-bbbbb", T0)
    pod["status"]["conditions"][0]["message"] = (
        '0/4 nodes are available: persistentvolumeclaim "data" not found.'
    )
    job, d = run(job, observed(batch_job(active=1), [pod]), now=T0 + timedelta(hours=1))
    assert job.status is not None and job.status.attempt == 1 and d.create == []


def test_moving_pools_counts_against_the_restart_limit() -> None:
    job, _ = run(make_job(recovery={"maxRestarts": 0}))
    stuck = observed(batch_job(active=1), [unschedulable("demo-a1-0-bbbbb", T0)])
    job, d = run(job, stuck, now=T0 + timedelta(hours=1))
    s = job.status
    assert s is not None and s.phase == Phase.FAILED
    assert c.get_condition(s.conditions, ConditionType.FAILED).reason == Reason.RESTART_LIMIT  # type: ignore[union-attr]
    assert d.delete_jobs == ["demo-a1"]


def test_a_pod_without_room_waits_when_no_other_pool_is_allowed() -> None:
    job, _ = run(make_job())
    pool = job.status.plan.pool  # type: ignore[union-attr]
    job, _ = run(job.model_copy(update={"spec": make_job(resources={"pools": [pool]}).spec}))
    stuck = observed(batch_job(active=1), [unschedulable("demo-a1-0-bbbbb", T0)])
    job, d = run(job, stuck, now=T0 + timedelta(hours=1))
    assert job.status is not None and job.status.attempt == 1
    assert d.create == [] and d.delete_jobs == []


def running_with(step: int, checkpoint: int = 0, pods: bool = True) -> Observed:
    metrics = {"step": float(step), "total_steps": 100.0}
    if checkpoint:
        metrics["last_checkpoint_step"] = float(checkpoint)
    return Observed(
        pools=default_pools(),
        batch_job=batch_job(active=1, ready=1),
        pods=[pod("demo-a1-0")] if pods else [],
        trainer_metrics=metrics,
    )


def test_a_stalled_attempt_is_relaunched_from_its_checkpoint() -> None:
    job, _ = run(make_job(recovery={"stallTimeoutSeconds": 600}))
    # No step reported yet (loading the model): the stall timer has not started.
    job, d = run(job, observed(batch_job(active=1, ready=1), [pod("demo-a1-0")]),
                 now=T0 + timedelta(hours=3))  # fmt: skip
    assert job.status is not None and job.status.attempt == 1 and not d.delete_jobs
    job, _ = run(job, running_with(5, checkpoint=4), now=T0 + timedelta(hours=3, minutes=1))
    job, d = run(job, running_with(5, checkpoint=4), now=T0 + timedelta(hours=3, minutes=10))
    assert job.status is not None and job.status.attempt == 1 and not d.delete_jobs
    job, d = run(job, running_with(5, checkpoint=4), now=T0 + timedelta(hours=3, minutes=12))
    s = job.status
    assert s is not None and s.phase == Phase.RUNNING and s.attempt == 2 and s.restarts == 1
    (rec,) = s.recoveries
    assert rec.reason == RecoveryReason.STALLED and rec.step == 4
    assert rec.message == "no step progress for 660s (stall timeout 600s) at step 5"
    assert d.delete_jobs == ["demo-a1"] and "ConfigMap" in [m["kind"] for m in d.create]
    assert [e.reason for e in d.events if e.type == "Warning"] == [Reason.STALLED]
    assert s.recovery_counts == {"Stalled": 1}
    # The hung trainer still runs: attempt 2's pods wait until it stopped (two trainers on
    # one checkpoint folder would remove each other's files).
    assert "Job" not in [m["kind"] for m in d.create]
    assert s.message == (
        "attempt 2 starts once the earlier attempt's trainer has stopped: pod demo-a1-0"
    )
    stopping = Observed(pools=default_pools(), earlier_pods=[pod("demo-a1-0")])
    job, d = run(job, stopping, now=T0 + timedelta(hours=3, minutes=12, seconds=30))
    assert "Job" not in [m["kind"] for m in d.create] and job.status.attempt == 2  # type: ignore[union-attr]
    stopped = Observed(pools=default_pools(), earlier_pods=[pod("demo-a1-0", exit_code=137)])
    job, d = run(job, stopped, now=T0 + timedelta(hours=3, minutes=12, seconds=40))
    assert [m["metadata"]["name"] for m in d.create if m["kind"] == "Job"] == ["demo-a2"]
    # The new attempt loads and reports the checkpoint's step for a long while: not timed.
    job, d = run(job, running_with(4, checkpoint=4), now=T0 + timedelta(hours=3, minutes=13))
    job, d = run(job, running_with(4, checkpoint=4), now=T0 + timedelta(hours=5))
    assert job.status is not None and job.status.attempt == 2 and not d.delete_jobs


def test_a_trainer_the_operator_cannot_read_is_not_stalled_for_it() -> None:
    """The stall timer counts time the trainer was seen not to move: metrics unreadable for
    longer than the timeout (a NetworkPolicy, the operator's network) relaunch nothing; a
    read that shows the same step again counts the whole gap."""
    job, _ = run(make_job(recovery={"stallTimeoutSeconds": 600}))
    job, _ = run(job, running_with(5), now=T0 + timedelta(minutes=1))
    blind = observed(batch_job(active=1, ready=1), [pod("demo-a1-0")])  # no metrics read
    for minutes in (5, 30, 120):
        job, d = run(job, blind, now=T0 + timedelta(minutes=minutes))
        assert job.status is not None and job.status.attempt == 1 and not d.delete_jobs
    job, d = run(job, running_with(9), now=T0 + timedelta(minutes=121))  # it moved meanwhile
    assert job.status is not None and job.status.attempt == 1 and not d.delete_jobs
    job, _ = run(job, blind, now=T0 + timedelta(minutes=200))
    job, d = run(job, running_with(9), now=T0 + timedelta(minutes=201))  # it did not
    s = job.status
    assert s is not None and [r.reason for r in s.recoveries] == [RecoveryReason.STALLED]
    assert d.delete_jobs == ["demo-a1"]


def test_stall_detection_can_be_turned_off_and_counts_against_max_restarts() -> None:
    off, _ = run(make_job(recovery={"stallTimeoutSeconds": 0}))
    off, _ = run(off, running_with(5), now=T0 + timedelta(minutes=1))
    off, d = run(off, running_with(5), now=T0 + timedelta(days=2))
    assert off.status is not None and off.status.attempt == 1 and not d.delete_jobs
    capped, _ = run(make_job(recovery={"stallTimeoutSeconds": 60, "maxRestarts": 0}))
    capped, _ = run(capped, running_with(5), now=T0 + timedelta(minutes=1))
    capped, d = run(capped, running_with(5), now=T0 + timedelta(minutes=3))
    s = capped.status
    assert s is not None and s.phase == Phase.FAILED
    assert c.get_condition(s.conditions, ConditionType.FAILED).reason == Reason.RESTART_LIMIT  # type: ignore[union-attr]
    assert "trainer stalled (no step progress for 120s" in (s.message or "")


def test_preemptions_without_progress_are_bounded() -> None:
    job, _ = run(make_job(recovery={"maxPreemptionsWithoutProgress": 2}))
    job, _ = run(job, running_with(3, checkpoint=2, pods=False))
    for i in range(2):  # preempted twice at the same checkpoint: still within the limit
        job, _ = run(job, observed(batch_job(active=1), [pod(f"demo-a1-0-{i}", EXIT_PREEMPTED)]))
        assert job.status is not None and job.status.phase == Phase.RUNNING
    # A new checkpoint in between: the count starts again.
    job, _ = run(job, running_with(9, checkpoint=8, pods=False))
    for i in range(2, 4):
        job, _ = run(job, observed(batch_job(active=1), [pod(f"demo-a1-0-{i}", EXIT_PREEMPTED)]))
        assert job.status is not None and job.status.phase == Phase.RUNNING
    job, d = run(job, observed(batch_job(active=1), [pod("demo-a1-0-4", EXIT_PREEMPTED)]))
    s = job.status
    assert s is not None and s.phase == Phase.FAILED
    assert c.get_condition(s.conditions, ConditionType.FAILED).reason == Reason.PREEMPTION_LIMIT  # type: ignore[union-attr]
    assert (s.message or "").startswith(
        "preempted 3 times in a row without a new checkpoint in between "
        "(spec.recovery.maxPreemptionsWithoutProgress=2). To fix:"
    )
    assert d.delete_jobs == ["demo-a1"]
    assert s.recovery_counts == {"Preemption": 5}


def test_a_trainer_pod_on_a_node_that_is_not_ready_is_reported_with_the_fix() -> None:
    job, _ = run(make_job())
    on_node = {**pod("demo-a1-0"), "spec": {"nodeName": "gpu-7"}}
    lost = replace(
        running_with(5, checkpoint=4), pods=[on_node], lost_nodes={"gpu-7": "2026-11-22T12:03:00Z"}
    )
    job, d = run(job, lost, now=T0 + timedelta(minutes=5))
    s = job.status
    assert s is not None and s.phase == Phase.RUNNING
    cond = c.get_condition(s.conditions, ConditionType.RUNNING)
    assert cond is not None and cond.status == "False" and cond.reason == Reason.NODE_NOT_READY
    assert (s.message or "").startswith(
        "attempt 1: pod demo-a1-0 is on node gpu-7, not Ready since 2026-11-22T12:03:00Z"
    )
    assert "To fix: if the machine is lost, delete the Node object" in (s.message or "")
    assert [e.reason for e in d.events if e.type == "Warning"] == [Reason.NODE_NOT_READY]
    # Said once, not on every look; gone once the node is Ready again.
    job, d = run(job, lost, now=T0 + timedelta(minutes=6))
    assert Reason.NODE_NOT_READY not in [e.reason for e in d.events]
    job, d = run(job, replace(lost, lost_nodes={}), now=T0 + timedelta(minutes=7))
    cond = c.get_condition(job.status.conditions, ConditionType.RUNNING)  # type: ignore[union-attr]
    assert cond is not None and cond.reason == Reason.TRAINING
    assert not d.delete_jobs and job.status is not None and job.status.attempt == 1


def test_a_preempted_two_node_attempt_counts_once_against_the_limit() -> None:
    """Both pods of a two-node attempt exit with the preemption code when one is preempted
    (every rank checkpoints): one preemption. Their replacements preempted again at the
    same checkpoint: the second."""

    def preempted(pod: str, step: int = 8, attempt: int = 1) -> Recovery:
        return Recovery(
            reason=RecoveryReason.PREEMPTION, time="t", attempt=attempt, step=step, pod=pod
        )

    first = [preempted("demo-a1-1-x7k2p"), preempted("demo-a1-0-q9zt4")]
    assert preemptions_without_progress(first) == 1
    again = [*first, preempted("demo-a1-0-b2c3d"), preempted("demo-a1-1-k4l5m")]
    assert preemptions_without_progress(again) == 2
    # One pod at a time (one node): each is a preemption of its own, as before.
    single = [preempted("demo-a1-0-aaaaa"), preempted("demo-a1-0-bbbbb")]
    assert preemptions_without_progress(single) == 2
    # Progress in between, or another attempt: never merged.
    assert preemptions_without_progress([preempted("demo-a1-0-x", 4), *first]) == 1
    moved = [preempted("demo-a1-0-x"), preempted("demo-a2-1-y", attempt=2)]
    assert preemptions_without_progress(moved) == 2


def test_recoveries_keep_the_current_attempt_and_the_latest_of_earlier_ones() -> None:
    old = [
        Recovery(reason=RecoveryReason.POD_FAILURE, time="t", attempt=a, message=str(a))
        for a in range(1, 31)
    ]
    current = [
        Recovery(reason=RecoveryReason.PREEMPTION, time="t", attempt=31, pod=f"p{i}")
        for i in range(25)
    ]
    kept = trim_recoveries(old + current, attempt=31)
    assert kept == current  # the current attempt's entries all stay, even past the cap
    kept = trim_recoveries(old + current[:5], attempt=31)
    assert len(kept) == KEEP_RECOVERIES and kept[-5:] == current[:5]
    assert [r.attempt for r in kept[:15]] == list(range(16, 31))  # the latest earlier ones
    # Preemptions in a row at the end stay too, one attempt each: the limit counts them.
    run_of = [
        Recovery(reason=RecoveryReason.PREEMPTION, time="t", attempt=a, pod=f"p{a}")
        for a in range(31, 56)
    ]
    kept = trim_recoveries(old + run_of, attempt=55)
    assert kept == run_of and preemptions_without_progress(kept) == 25
