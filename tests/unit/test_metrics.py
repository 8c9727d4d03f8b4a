"""Operator metrics: state series computed at scrape time, event counters from transitions."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kubetune.api.v1alpha1 import FineTuneJobStatus
from kubetune.controller.metrics import GIB, PHASES, OperatorMetrics, sample_loop_lag
from support.statuses import plan

pytestmark = pytest.mark.unit

CREATED = "2025-01-01T00:00:00Z"
T0 = 1735689600.0  # CREATED as Unix time


def status(**over: Any) -> dict[str, Any]:
    """A status in wire format, checked against the real model so the keys stay honest."""
    return FineTuneJobStatus.model_validate(over).to_wire()


def body(name: str = "j1", st: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "team-a", "name": name, "creationTimestamp": CREATED},
        "spec": spec,
        "status": st or {},
    }


def cond(type_: str, at: str, value: str = "True") -> dict[str, Any]:
    return {"type": type_, "status": value, "reason": "X", "lastTransitionTime": at}


@pytest.fixture
def m() -> OperatorMetrics:
    return OperatorMetrics(runtime=False)


def value(m: OperatorMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_jobs_by_phase_is_a_count_of_current_state(m: OperatorMetrics) -> None:
    m.observe_job(body("a"), status(phase="Queued"))
    m.observe_job(body("b"), status(phase="Running", plan=plan()))
    m.observe_job(body("c"), status(phase="Running", plan=plan()))
    assert value(m, "kubetune_finetunejobs", phase="Running") == 2
    assert value(m, "kubetune_finetunejobs", phase="Queued") == 1
    # Every phase is present, so a dashboard shows zeros rather than gaps.
    assert all(value(m, "kubetune_finetunejobs", phase=p) is not None for p in PHASES)
    m.observe_job(body("c", status(phase="Running", plan=plan())), status(phase="Succeeded"))
    assert value(m, "kubetune_finetunejobs", phase="Running") == 1
    assert value(m, "kubetune_finetunejobs", phase="Succeeded") == 1
    assert value(m, "kubetune_gpupool_gpus_in_use", pool="l40s") == 2


def test_per_job_series_follow_the_status_and_vanish_on_forget(m: OperatorMetrics) -> None:
    st = status(
        phase="Running",
        plan=plan(),
        progress={"step": 25, "totalSteps": 100, "etaSeconds": 300.0, "percent": 25},
        cost={"accruedUSD": 0.12, "estimatedUSD": 0.5, "rateUSDPerHour": 1.58},
        checkpoint={"latestStep": 20, "time": "2025-01-01T00:10:00Z"},
        restarts=1,
        recoveries=[{"reason": "Preemption", "time": CREATED}],
    )
    m.observe_job(body(resources={"maxCostUSD": 2.0}), st)
    k = {"namespace": "team-a", "finetunejob": "j1"}
    assert (
        value(
            m,
            "kubetune_finetunejob_info",
            **k,
            phase="Running",
            pool="l40s",
            method="lora",
            gpu_product="NVIDIA-L40S",
            spot="false",
        )
        == 1
    )
    assert value(m, "kubetune_finetunejob_gpus", **k, pool="l40s") == 2
    assert value(
        m, "kubetune_finetunejob_estimated_gpu_memory_bytes", **k, pool="l40s", method="lora"
    ) == pytest.approx(20.5 * GIB)
    # The planned GPU's memory: the ceiling the estimate and the trainer's peak are drawn under.
    assert value(m, "kubetune_finetunejob_gpu_memory_capacity_bytes", **k, pool="l40s") == 48 * GIB
    assert value(m, "kubetune_finetunejob_accrued_cost_usd", **k) == pytest.approx(0.12)
    assert value(m, "kubetune_finetunejob_estimated_cost_usd", **k) == pytest.approx(0.5)
    assert value(m, "kubetune_finetunejob_cost_rate_usd_per_hour", **k) == pytest.approx(1.58)
    assert value(m, "kubetune_finetunejob_budget_usd", **k) == 2.0
    assert value(m, "kubetune_finetunejob_progress_ratio", **k) == 0.25
    assert value(m, "kubetune_finetunejob_eta_seconds", **k) == 300
    assert value(m, "kubetune_finetunejob_checkpoint_step", **k) == 20
    assert value(m, "kubetune_finetunejob_checkpoint_timestamp_seconds", **k) == T0 + 600
    assert value(m, "kubetune_finetunejob_restarts_total", **k) == 1
    assert value(m, "kubetune_finetunejob_recoveries_total", **k, reason="Preemption") == 1
    # status.recoveries keeps only the latest entries of earlier attempts; the counters count.
    trimmed = {**st, "recoveries": [{"reason": "Stalled", "time": CREATED}],
               "recoveryCounts": {"Preemption": 40, "Stalled": 1, "NotAReason": 3}}  # fmt: skip
    m.observe_job(body(resources={"maxCostUSD": 2.0}), trimmed)
    assert value(m, "kubetune_finetunejob_recoveries_total", **k, reason="Preemption") == 40
    assert value(m, "kubetune_finetunejob_recoveries_total", **k, reason="Stalled") == 1
    assert value(m, "kubetune_finetunejob_recoveries_total", **k, reason="NotAReason") is None

    m.forget_job("team-a", "j1")
    text = generate_latest(m.registry).decode()
    assert 'finetunejob="j1"' not in text
    assert value(m, "kubetune_finetunejobs", phase="Running") == 0


def test_transitions_feed_counters_and_histograms(m: OperatorMetrics) -> None:
    # Created at T0; planned 2 s later, queued; capacity frees up at T0+62; running.
    queued = status(
        phase="Queued", plan=plan(), conditions=[cond("Queued", "2025-01-01T00:00:02Z")]
    )
    m.observe_job(body(), queued, now=T0 + 2)
    assert value(m, "kubetune_plans_total", pool="l40s", method="lora", reason="Initial") == 1
    assert value(m, "kubetune_finetunejob_time_to_plan_seconds_sum") == 2
    assert value(m, "kubetune_finetunejob_time_to_plan_seconds_count") == 1
    # The same status again (a timer tick with nothing new) counts nothing.
    m.observe_job(body(st=queued), queued, now=T0 + 30)
    assert value(m, "kubetune_plans_total", pool="l40s", method="lora", reason="Initial") == 1

    running = status(phase="Running", plan=plan(), startTime="2025-01-01T00:01:02Z")
    m.observe_job(body(st=queued), running, now=T0 + 62)
    assert value(m, "kubetune_finetunejob_queue_wait_seconds_sum", pool="l40s") == 60
    assert value(m, "kubetune_finetunejob_time_to_running_seconds_sum", pool="l40s") == 62

    # An OOM: a recovery and a re-plan onto more GPUs.
    replanned = status(
        phase="Running",
        plan=plan(revision=2, reason="OutOfMemory", totalGPUs=4, gpusPerNode=4),
        startTime="2025-01-01T00:01:02Z",
        recoveries=[{"reason": "OOM", "time": "2025-01-01T00:05:00Z"}],
    )
    m.observe_job(body(st=running), replanned, now=T0 + 300)
    assert value(m, "kubetune_recoveries_total", reason="OOM") == 1
    assert value(m, "kubetune_recoveries_total", reason="Preemption") == 0
    assert value(m, "kubetune_plans_total", pool="l40s", method="lora", reason="OutOfMemory") == 1
    # Time to running is observed once per job, not once per attempt.
    assert value(m, "kubetune_finetunejob_time_to_running_seconds_count", pool="l40s") == 1

    done = {**replanned, "phase": "Succeeded"}
    m.observe_job(body(st=replanned), done, now=T0 + 900)
    m.observe_job(body(st=done), done, now=T0 + 910)
    assert value(m, "kubetune_finetunejobs_finished_total", phase="Succeeded") == 1
    assert value(m, "kubetune_finetunejobs_finished_total", phase="Failed") == 0


def test_time_to_loop_counts_each_new_job_from_its_creation(m: OperatorMetrics) -> None:
    m.loop_started(CREATED, now=T0 + 3)
    m.loop_started(None, now=T0 + 3)  # no creation time (an emulated API server): nothing
    m.loop_started(CREATED, now=T0 - 1)  # the operator's clock behind the server's: zero
    assert value(m, "kubetune_finetunejob_time_to_loop_seconds_count") == 2
    assert value(m, "kubetune_finetunejob_time_to_loop_seconds_sum") == 3
    assert value(m, "kubetune_finetunejob_time_to_loop_seconds_bucket", le="2.5") == 1


def test_observing_without_a_new_status_restores_state_after_a_restart(
    m: OperatorMetrics,
) -> None:
    """On resume the handler may pass only the body: state comes back, no event is counted."""
    st = status(
        phase="Running",
        plan=plan(),
        recoveries=[{"reason": "OOM", "time": CREATED}],
        progress={"step": 5, "totalSteps": 100, "updatedAt": "2025-01-01T00:03:00Z"},
    )
    m.observe_job(body(st=st))
    k = {"namespace": "team-a", "finetunejob": "j1"}
    assert value(m, "kubetune_finetunejob_recoveries_total", **k, reason="OOM") == 1
    assert value(m, "kubetune_recoveries_total", reason="OOM") == 0
    assert value(m, "kubetune_plans_total", pool="l40s", method="lora", reason="Initial") is None
    assert value(m, "kubetune_finetunejob_last_progress_timestamp_seconds", **k) == T0 + 180


def test_last_progress_moves_only_when_the_step_moves(m: OperatorMetrics) -> None:
    k = {"namespace": "team-a", "finetunejob": "j1"}
    st = status(phase="Running", plan=plan(), progress={"step": 1, "totalSteps": 10})
    m.observe_job(body(), st, now=T0 + 10)
    m.observe_job(body(st=st), st, now=T0 + 20)
    assert value(m, "kubetune_finetunejob_last_progress_timestamp_seconds", **k) == T0 + 10
    st2 = status(phase="Running", plan=plan(), progress={"step": 2, "totalSteps": 10})
    m.observe_job(body(st=st), st2, now=T0 + 30)
    assert value(m, "kubetune_finetunejob_last_progress_timestamp_seconds", **k) == T0 + 30


def test_pools(m: OperatorMetrics) -> None:
    pool = {"metadata": {"name": "l40s"}, "spec": {"pricePerGPUHour": 0.79}}
    m.observe_pool(pool, {"nodes": 4, "allocatableGPUs": 32, "freeGPUs": 30})
    assert value(m, "kubetune_gpupool_nodes", pool="l40s") == 4
    assert value(m, "kubetune_gpupool_allocatable_gpus", pool="l40s") == 32
    assert value(m, "kubetune_gpupool_free_gpus", pool="l40s") == 30
    assert value(m, "kubetune_gpupool_price_per_gpu_hour_usd", pool="l40s") == 0.79
    assert value(m, "kubetune_gpupool_gpus_in_use", pool="l40s") == 0
    m.forget_pool("l40s")
    assert value(m, "kubetune_gpupool_nodes", pool="l40s") is None


def test_reconcile_timer_counts_errors_and_reraises(m: OperatorMetrics) -> None:
    with m.reconcile_timer("finetunejob"):
        pass
    with pytest.raises(RuntimeError), m.reconcile_timer("finetunejob"):
        raise RuntimeError("boom")
    assert value(m, "kubetune_reconcile_duration_seconds_count", handler="finetunejob") == 2
    assert (
        value(m, "kubetune_reconcile_errors_total", handler="finetunejob", error="RuntimeError")
        == 1
    )


def test_names_follow_conventions(m: OperatorMetrics) -> None:
    m.observe_job(body(), status(phase="Running", plan=plan()))
    m.observe_pool({"metadata": {"name": "l40s"}, "spec": {}}, {"nodes": 1})
    families = list(text_string_to_metric_families(generate_latest(m.registry).decode()))
    assert families
    for fam in families:
        assert fam.name.startswith("kubetune_"), fam.name
        assert fam.documentation, fam.name
        if fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), fam.name
        # Base units only: no milliseconds, kilobytes, gibibytes or percentages.
        assert not any(u in fam.name for u in ("_ms", "_milliseconds", "_gib", "_percent"))


def test_server_serves_the_registry(m: OperatorMetrics) -> None:
    port = m.start_server(0, addr="127.0.0.1")
    try:
        assert m.start_server(0) == port
        m.observe_job(body(), status(phase="Queued"))
        # start_server returns once the socket listens: the first request is answered.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert 'kubetune_finetunejobs{phase="Queued"} 1.0' in text
    finally:
        m.stop_server()


async def test_event_loop_lag_is_how_late_a_due_timer_ran(m: OperatorMetrics) -> None:
    sampler = asyncio.create_task(sample_loop_lag(0.05, m))
    await asyncio.sleep(0.12)  # two or so samples on an idle loop
    time.sleep(0.3)  # the loop is blocked: the sleep due meanwhile wakes about 0.25 s late
    await asyncio.sleep(0.12)
    sampler.cancel()
    samples = value(m, "kubetune_event_loop_lag_seconds_count")
    assert samples is not None and samples >= 3
    on_time = value(m, "kubetune_event_loop_lag_seconds_bucket", le="0.1") or 0.0
    assert 1 <= samples - on_time < samples, "the sample that waited for the blocked loop"
    assert (value(m, "kubetune_event_loop_lag_seconds_sum") or 0.0) >= 0.2
