"""Phase transitions: the table, and random sequences of reconciles that must respect it.

The random sequences drive `reconcile()` the way the control loop does — each status goes
through the wire format into the next reconcile — while the cluster answers with whatever
hypothesis draws: batch Jobs that complete, fail with any of the trainer's exit codes or
vanish, pods that are preempted or stuck, busy pools, suspend flipped on and off, time
passing past a budget or a deadline. Whatever happens, every phase change must be one the
table allows, a finished job must stay finished, and `reconcile` must never raise.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubetune.api.v1alpha1 import FineTuneJobStatus
from kubetune.api.vocabulary import TERMINAL_PHASES, ConditionType, Phase, Reason
from kubetune.control import conditions as c
from kubetune.control.lifecycle import TRANSITIONS, IllegalTransition, failed, move
from kubetune.control.reconcile import Observed
from kubetune.planning.catalog import default_pools
from kubetune_trainer.contract import EXIT_CONFIG_ERROR, EXIT_OOM, EXIT_PREEMPTED, EXIT_STOPPED
from support.reconcile import T0, busy, make_job, pod, run, unschedulable

pytestmark = pytest.mark.unit

POOLS = default_pools()


def test_every_phase_has_a_row_and_finished_phases_have_no_way_out() -> None:
    assert set(TRANSITIONS) == set(Phase)
    for phase in TERMINAL_PHASES:
        assert TRANSITIONS[phase] == frozenset()
    for phase, targets in TRANSITIONS.items():
        assert phase not in targets, "staying is always allowed; the table lists moves"


def test_every_phase_is_reachable_from_pending_and_every_unfinished_one_can_end() -> None:
    assert _reachable(Phase.PENDING) == set(Phase)
    for phase in set(Phase) - TERMINAL_PHASES:
        assert Phase.FAILED in TRANSITIONS[phase]


def test_move_refuses_what_the_table_does_not_allow() -> None:
    status = FineTuneJobStatus(phase=Phase.SUCCEEDED)
    with pytest.raises(IllegalTransition, match="Succeeded to Running"):
        move(status, Phase.RUNNING)
    status = FineTuneJobStatus(phase=Phase.QUEUED)
    with pytest.raises(IllegalTransition):
        move(status, Phase.PENDING)
    move(status, Phase.QUEUED)  # staying is fine
    move(status, Phase.RUNNING)
    assert status.phase == Phase.RUNNING


def test_failing_is_one_function_with_one_shape() -> None:
    status = failed(FineTuneJobStatus(), Reason.INVALID_SPEC, "bad", T0)
    assert status.phase == Phase.FAILED and status.message == "bad"
    assert status.completion_time == "2026-11-22T12:00:00Z"
    cond = c.get_condition(status.conditions, ConditionType.FAILED)
    assert cond is not None and cond.reason == Reason.INVALID_SPEC and cond.status == "True"
    assert not c.is_true(status.conditions, ConditionType.RUNNING)


def test_a_job_suspended_before_it_was_planned_is_planned_when_resumed() -> None:
    job = run(make_job(suspend=True), Observed(pools=POOLS))[0]
    assert job.status is not None and job.status.phase == Phase.SUSPENDED
    assert job.status.plan is None
    resumed = job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": False})})
    job, _ = run(resumed, Observed(pools=POOLS), T0 + timedelta(seconds=10))
    assert job.status is not None and job.status.phase == Phase.RUNNING
    assert job.status.plan is not None and job.status.attempt == 1


# ---------------------------------------------------------------------- random sequences


def _pod(name: str, kind: str, now: datetime) -> dict[str, Any]:
    """A trainer pod as hypothesis draws it: running, stuck for 5 minutes, or ended."""
    if kind == "running":
        return pod(name)
    if kind == "stuck":
        return unschedulable(name, now - timedelta(minutes=5))
    code = {
        "preempted": EXIT_PREEMPTED,
        "oom": EXIT_OOM,
        "config": EXIT_CONFIG_ERROR,
        "stopped": EXIT_STOPPED,
        "crash": 1,
    }[kind]
    return pod(name, code, disrupted=kind == "preempted", msg=kind)


def _reachable(phase: Phase) -> set[Phase]:
    seen, todo = {phase}, [phase]
    while todo:
        for nxt in TRANSITIONS[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


world = st.fixed_dictionaries(
    {
        "job": st.sampled_from(["none", "active", "complete", "failed"]),
        "pod": st.sampled_from(
            ["none", "running", "preempted", "oom", "config", "stopped", "crash", "stuck"]
        ),
        "pools": st.sampled_from(["free", "busy", "none"]),
        "suspend": st.booleans(),
        "minutes": st.integers(min_value=0, max_value=90),
        "metrics_step": st.integers(min_value=0, max_value=400),
    }
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    worlds=st.lists(world, min_size=1, max_size=14),
    spec=st.sampled_from(
        [
            {},
            {"resources": {"maxCostUSD": 2.0}},
            {"resources": {"deadline": "1h"}},
            {"recovery": {"maxRestarts": 1, "maxOOMReplans": 1}},
            {"ttlSecondsAfterFinished": 60},
        ]
    ),
)
def test_random_reconcile_sequences_only_make_legal_moves(
    worlds: list[dict[str, Any]], spec: dict[str, Any]
) -> None:
    job, now = make_job(**spec), T0
    for w in worlds:
        now += timedelta(minutes=w["minutes"])
        status = job.status or FineTuneJobStatus()
        pools = {"free": busy(POOLS, 8), "busy": busy(POOLS, 0), "none": []}[w["pools"]]
        attempt = status.attempt
        name = f"demo-a{attempt}"
        batch = None
        if w["job"] != "none" and attempt:
            conditions = []
            if w["job"] in ("complete", "failed"):
                kind = "Complete" if w["job"] == "complete" else "Failed"
                conditions = [{"type": kind, "status": "True"}]
            batch = {
                "metadata": {"name": name},
                "status": {"active": int(w["job"] == "active"), "conditions": conditions},
            }
        pods = [] if w["pod"] == "none" or not attempt else [_pod(f"{name}-0", w["pod"], now)]
        metrics = {"step": float(w["metrics_step"]), "tokens_per_second": 1000.0}
        observed = Observed(
            pools=pools, batch_job=batch, pods=pods, trainer_metrics=metrics, attempt=attempt
        )
        current = job.model_copy(
            update={"spec": job.spec.model_copy(update={"suspend": w["suspend"]})}
        )
        before = Phase(status.phase)
        job, _ = run(current, observed, now)
        assert job.status is not None
        after = Phase(job.status.phase)
        # One reconcile may take several moves (Pending → Planning → Running); each was
        # checked by `move`, so the end must be reachable through the table.
        assert after in _reachable(before), f"{before} -> {after}"
        if before in TERMINAL_PHASES:
            assert after == before
        assert job.status.attempt >= attempt


def test_an_oom_replan_onto_busy_gpus_queues_the_job() -> None:
    job, _ = run(make_job(), Observed(pools=busy(POOLS, 8)))
    assert job.status is not None and job.status.phase == Phase.RUNNING
    oom = Observed(
        pools=busy(POOLS, 0),
        batch_job={
            "metadata": {"name": "demo-a1"},
            "status": {"conditions": [{"type": "Failed", "status": "True"}]},
        },
        pods=[_pod("demo-a1-0", "oom", T0)],
        attempt=1,
    )
    job, _ = run(job, oom, T0 + timedelta(minutes=5))
    s = job.status
    assert s is not None and s.phase == Phase.QUEUED
    assert s.plan is not None and s.plan.revision == 2
    assert s.message == "waiting for capacity after re-plan"
    assert c.is_true(s.conditions, ConditionType.QUEUED)
    # Capacity frees: the re-planned layout launches as attempt 2.
    job, _ = run(job, Observed(pools=busy(POOLS, 8), attempt=1), T0 + timedelta(minutes=6))
    assert job.status is not None and job.status.phase == Phase.RUNNING
    assert job.status.attempt == 2
