"""How the operator reads a trainer's end: a pod the kernel killed for host memory (OOMKilled)
is told apart from other failures and relaunched with more host memory, and the phase of a
GPU out-of-memory reaches the recovery."""

from __future__ import annotations

from datetime import timedelta

import pytest

from kubetune.api.v1alpha1 import GPUPoolStatus
from kubetune.control import pods as p
from kubetune.control.conditions import get_condition
from kubetune.control.reconcile import Decision, Observed
from kubetune.planning.catalog import default_pools
from kubetune_trainer.contract import (
    EXIT_CONFIG_ERROR,
    EXIT_OOM,
    OutOfMemoryResult,
    TrainerResult,
)
from support.reconcile import T0, batch_job, make_job, observed, pod, run

pytestmark = pytest.mark.unit


def test_an_oomkilled_trainer_is_reported_as_out_of_host_memory() -> None:
    end = p.trainer_exit([pod("demo-a1-0", 137, msg="step 40/100 loss 1.2", reason="OOMKilled")])
    assert end.host_oom and end.code == 137
    assert end.describe() == "out of host memory (OOMKilled, exit code 137)"
    assert "operator.trainerMemoryPerGPU" in end.detail and "Error" not in end.detail
    plain = p.trainer_exit([pod("demo-a1-0", 137, msg="Killed", reason="Error")])
    assert not plain.host_oom and plain.describe() == "exit code 137"


def test_the_pod_killed_for_memory_is_the_one_reported_but_contract_exits_come_first() -> None:
    peer = pod("demo-a1-1", 1, msg="crash rank=4 DistBackendError: connection reset")
    killed = pod("demo-a1-0", 137, reason="OOMKilled")
    assert p.trainer_exit([peer, killed]).host_oom
    config = pod("demo-a1-2", EXIT_CONFIG_ERROR, msg="config_error bad data")
    assert p.trainer_exit([killed, config]).code == EXIT_CONFIG_ERROR


def memory(decision: Decision) -> tuple[str, str]:
    """(request, limit) of host memory of the trainer container the decision creates."""
    (batch,) = [m for m in decision.create if m["kind"] == "Job"]
    (container,) = batch["spec"]["template"]["spec"]["containers"]
    resources = container["resources"]
    return resources["requests"]["memory"], resources["limits"]["memory"]


def killed_for_memory(attempt: int = 1, failed: bool = False) -> Observed:
    state = batch_job("Failed") if failed else batch_job(active=0)
    return observed(state, [pod(f"demo-a{attempt}-0", 137, reason="OOMKilled")])


def test_a_pod_killed_for_host_memory_relaunches_with_half_again_the_memory() -> None:
    job, d = run(make_job())
    assert job.status is not None and job.status.plan is not None
    assert job.status.plan.host_memory_gib == 16.0 and memory(d) == ("16Gi", "16Gi")
    job, d = run(job, killed_for_memory(), now=T0 + timedelta(minutes=3))
    s = job.status
    assert s is not None and s.plan is not None
    assert (s.phase, s.attempt, s.restarts) == ("Running", 2, 0)
    assert (s.plan.revision, s.plan.reason) == (2, "HostOutOfMemory")
    assert (s.plan.host_memory_scale, s.plan.host_memory_gib) == (1.5, 24.0)
    assert memory(d) == ("24Gi", "24Gi")
    assert d.delete_jobs == ["demo-a1"]
    (rec,) = s.recoveries
    assert (rec.reason, rec.pod, rec.attempt) == ("HostOutOfMemory", "demo-a1-0", 1)
    assert s.recovery_counts == {"HostOutOfMemory": 1}
    said = "pod demo-a1-0 ran out of host memory (OOMKilled); relaunched from the latest "
    said += "checkpoint with 16Gi → 24Gi of host memory per trainer pod. To fix for good: "
    assert rec.message.startswith(said) and "operator.trainerMemoryPerGPU" in rec.message
    assert s.message == f"launched attempt 2: {rec.message}"
    assert s.plan.message == (
        "pod demo-a1-0 ran out of host memory (OOMKilled); 16Gi → 24Gi of host memory per "
        "trainer pod"
    )
    (event,) = [e for e in d.events if e.reason == "HostOutOfMemory"]
    assert event.type == "Warning" and event.message == rec.message
    # Again: 1.5 × 1.5, counted.
    job, d = run(job, killed_for_memory(2), now=T0 + timedelta(minutes=6))
    s = job.status
    assert s is not None and s.plan is not None and s.attempt == 3
    assert (s.plan.host_memory_scale, s.plan.host_memory_gib) == (2.25, 36.0)
    assert memory(d) == ("36Gi", "36Gi") and s.recovery_counts == {"HostOutOfMemory": 2}


def test_a_job_failed_by_host_memory_relaunches_with_more_memory() -> None:
    # The batch Job gave up on the pod (its backoffLimit) before a look saw it end.
    job, _ = run(make_job(recovery={"maxRestarts": 0}))
    job, d = run(job, killed_for_memory(failed=True))
    s = job.status
    assert s is not None and s.plan is not None and s.phase == "Running" and s.attempt == 2
    (rec,) = s.recoveries
    assert rec.reason == "HostOutOfMemory" and rec.pod is None
    assert rec.message.startswith("a trainer ran out of host memory (OOMKilled); relaunched")
    assert memory(d) == ("24Gi", "24Gi")


def test_host_and_gpu_out_of_memory_share_the_budget() -> None:
    job, _ = run(make_job(recovery={"maxOOMReplans": 2}))
    msg = "oom peak_gib=70.2 step=120 rank=0 out of GPU memory"
    gpu = observed(batch_job("Failed"), [pod("demo-a1-0", EXIT_OOM, msg=msg)])
    job, _ = run(job, gpu, now=T0 + timedelta(minutes=3))
    job, _ = run(job, killed_for_memory(2), now=T0 + timedelta(minutes=6))
    assert job.status is not None and job.status.phase == "Running"
    assert job.status.recovery_counts == {"OOM": 1, "HostOutOfMemory": 1}
    plan = job.status.plan
    assert plan is not None and plan.host_memory_gib is not None
    job, d = run(job, killed_for_memory(3), now=T0 + timedelta(minutes=9))
    s = job.status
    assert s is not None and s.phase == "Failed"
    failed = get_condition(s.conditions, "Failed")
    assert failed is not None and failed.reason == "OutOfMemoryLimitReached"
    assert s.message is not None and s.message.startswith(
        f"pod demo-a3-0 ran out of host memory (OOMKilled) with {plan.host_memory_gib:g}Gi per "
        "trainer pod: out of memory 3 times, GPU and host together "
        "(spec.recovery.maxOOMReplans=2). To fix: raise"
    )
    assert not [m for m in d.create if m["kind"] == "Job"]


def test_a_gpu_out_of_memory_re_plan_keeps_the_host_memory_learned() -> None:
    job, _ = run(make_job())
    job, _ = run(job, killed_for_memory(), now=T0 + timedelta(minutes=3))
    msg = "oom peak_gib=70.2 step=120 rank=0 out of GPU memory"
    gpu = observed(batch_job("Failed"), [pod("demo-a2-0", EXIT_OOM, msg=msg)])
    job, d = run(job, gpu, now=T0 + timedelta(minutes=6))
    s = job.status
    assert s is not None and s.plan is not None
    assert (s.plan.reason, s.plan.revision) == ("OutOfMemory", 3)
    assert s.plan.memory_scale > 1 and s.plan.host_memory_scale == 1.5
    request, limit = memory(d)
    assert request == limit == f"{s.plan.host_memory_gib:g}Gi"
    assert s.plan.host_memory_gib == 1.5 * 16 * s.plan.gpus_per_node


def test_no_relaunch_with_more_memory_than_the_pool_nodes_have() -> None:
    job, _ = run(make_job())
    pools = [
        pool.model_copy(update={"status": GPUPoolStatus.model_validate({"nodeMemoryGiB": 20})})
        for pool in default_pools()
    ]
    killed = Observed(
        pools=pools,
        batch_job=batch_job(active=0),
        pods=[pod("demo-a1-0", 137, reason="OOMKilled")],
    )
    job, d = run(job, killed)
    s = job.status
    assert s is not None and s.phase == "Failed"
    failed = get_condition(s.conditions, "Failed")
    assert failed is not None and failed.reason == "HostMemoryUnavailable"
    assert s.message == (
        "pod demo-a1-0 ran out of host memory (OOMKilled); the next attempt would need 16Gi → "
        "24Gi of host memory per trainer pod, and the largest node of pool h100-spot has 20 "
        "GiB allocatable: its pods could never be scheduled. To fix: raise the trainer's "
        "memory per GPU (Helm value operator.trainerMemoryPerGPU, "
        "KUBETUNE_TRAINER_MEMORY_PER_GPU) or allow a pool whose nodes have more memory "
        "(spec.resources.pools)"
    )
    assert not [m for m in d.create if m["kind"] == "Job"]


def test_a_crash_message_reaches_the_status() -> None:
    job, _ = run(make_job(recovery={"maxRestarts": 0}))
    msg = "crash rank=0 KeyError: 'model.layers.0.mlp.up_proj'"
    job, _ = run(job, observed(batch_job("Failed"), [pod("demo-a1-0", 1, msg=msg)]))
    assert job.status is not None and msg in (job.status.message or "")


def test_the_oom_recovery_names_the_phase() -> None:
    assert p.oom_phase("oom peak_gib=3.1 step=0 rank=0 phase=load out of GPU memory") == (
        "loading the model"
    )
    assert p.oom_phase("oom peak_gib=3.1 step=4") is None
    job, _ = run(make_job())
    msg = "oom peak_gib=70.2 step=120 rank=3 phase=eval out of GPU memory while evaluating"
    oom = observed(batch_job("Failed"), [pod("demo-a1-0", EXIT_OOM, msg=msg)])
    job, _ = run(job, oom, now=T0 + timedelta(minutes=3))
    s = job.status
    assert s is not None and s.plan is not None
    (rec,) = s.recoveries
    assert rec.reason == "OOM" and "ran out of memory while evaluating; re-planned" in rec.message
    assert s.plan.message is not None and s.plan.message.endswith("while evaluating")


def test_an_out_of_memory_result_re_plans_as_the_words_of_version_1_did() -> None:
    """A contract 2 trainer leaves its out-of-memory details as a `TrainerResult`; the re-plan
    takes the same peak and phase from it as from a version 1 trainer's words."""
    oom = OutOfMemoryResult(
        peak_gib=70.2,
        step=120,
        rank=3,
        phase="eval",
        message="out of GPU memory while evaluating (step 120, rank 3): CUDA out of memory",
    )
    result = TrainerResult(outcome="out_of_memory", step=119, total_steps=400, out_of_memory=oom)
    words = "oom peak_gib=70.2 step=120 rank=3 phase=eval out of GPU memory while evaluating"
    end = p.trainer_exit([pod("demo-a1-0", EXIT_OOM, msg=result.model_dump_json() + "\n")])
    assert end.result == result and end.code == EXIT_OOM
    assert (end.oom_peak_gib, end.oom_while) == (70.2, "evaluating")
    assert (p.peak_gib(end.detail), p.oom_phase(end.detail)) == (70.2, "evaluating")
    old = p.trainer_exit([pod("demo-a1-0", EXIT_OOM, msg=words)])
    assert old.result is None and (old.oom_peak_gib, old.oom_while) == (70.2, "evaluating")

    plans = []
    for msg in (result.model_dump_json(), words):
        job, _ = run(make_job())
        failed = observed(batch_job("Failed"), [pod("demo-a1-0", EXIT_OOM, msg=msg)])
        job, _ = run(job, failed, now=T0 + timedelta(minutes=3))
        assert job.status is not None and job.status.plan is not None
        plans.append(job.status.plan.model_dump(exclude={"created_at"}))
    assert plans[0] == plans[1] and plans[0]["message"].endswith("while evaluating")
