"""How the operator reads a trainer's end: a pod the kernel killed for host memory (OOMKilled)
is told apart from other failures, and the phase of a GPU out-of-memory reaches the recovery."""

from __future__ import annotations

from datetime import timedelta

import pytest

from kubetune.control import pods as p
from kubetune_trainer.contract import EXIT_CONFIG_ERROR, EXIT_OOM
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


def test_a_pod_killed_for_host_memory_is_recorded_with_the_fix() -> None:
    job, _ = run(make_job())
    killed = observed(batch_job(active=0), [pod("demo-a1-0", 137, reason="OOMKilled")])
    job, d = run(job, killed)
    s = job.status
    assert s is not None and s.phase == "Running" and s.restarts == 1
    (rec,) = s.recoveries
    assert rec.reason == "PodFailure"
    assert rec.message.startswith(
        "pod demo-a1-0 failed (out of host memory (OOMKilled, exit code 137): the node ran out"
    )
    assert "To fix: raise the trainer's memory request per GPU" in rec.message
    assert any("out of host memory" in e.message for e in d.events)


def test_a_job_failed_by_host_memory_relaunches_and_says_why() -> None:
    job, _ = run(make_job(recovery={"maxRestarts": 0}))
    failed = observed(batch_job("Failed"), [pod("demo-a1-0", 137, reason="OOMKilled")])
    job, _ = run(job, failed)
    s = job.status
    assert s is not None and s.phase == "Failed"
    assert "trainer failed (out of host memory (OOMKilled, exit code 137): " in (s.message or "")
    assert "Error" not in (s.message or "")


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
