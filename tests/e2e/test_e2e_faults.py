"""The fault matrix, end to end: faults a real cluster throws at a run, each injected into a
job the operator really runs, and what it cost — whether the job finished (or failed with a
reason in its status), how many steps were trained twice, and whether the steps trained again
after the fault match the ones trained before it (step-exact resume).

Faults injected from outside: the newest checkpoint damaged on the volume, then the trainer
killed; three preemptions in one run. Faults injected by the trainer itself, behind the
`kubetune.io/test-faults` annotation (only an operator run with KUBETUNE_ALLOW_TEST_FAULTS
obeys it): one rank of two SIGKILLing itself, out of GPU memory while loading the model or
evaluating. A volume that is really full at a save: a size-limited tmpfs, filled. The rest
of the matrix (SIGTERM, a hard kill, a hung rank, out of memory in a step, node loss, the
two-node runs) lives in test_e2e.py and test_e2e_multinode.py; docs/faults.md gathers the
numbers.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest

from support.e2e_jobs import (
    FAULTS,
    LOSS_TOLERANCE,
    STEPS,
    Run,
    check_runs_are_contiguous,
    delete_job,
    event_reasons,
    final_loss,
    job_doc,
    running_pod,
    runs_of,
    status,
    steps_lost,
    train_log,
    wait_phase,
    wait_step,
)
from support.e2e_targets import NAMESPACE, REPORT, Target
from support.waiting import wait_for

pytestmark = pytest.mark.e2e

RETRAINED_TOLERANCE = 1e-6
"""Losses of a step trained before a fault and again after it: resume restores parameters,
optimizer, data order and random state exactly (the trainer tier measures 0.0)."""


def faults(**spec: Any) -> dict[str, str]:
    return {FAULTS: json.dumps(spec)}


def retrained_difference(runs: list[Run]) -> float:
    """The largest loss difference over steps trained both before and after a restart."""
    diffs = [
        abs(before.losses[step] - after.losses[step])
        for before, after in itertools.pairwise(runs)
        for step in set(before.losses) & set(after.losses)
    ]
    return max(diffs, default=0.0)


def baseline_difference(target: Target, baseline: dict[str, Any], runs: list[Run]) -> float:
    """Final-loss difference against the uninterrupted run of the same job."""
    uninterrupted = runs_of(train_log(target, baseline["name"]))
    return abs(final_loss(runs, STEPS) - final_loss(uninterrupted, STEPS))


def test_one_rank_of_two_killed_resumes_both_from_the_last_checkpoint(target: Target) -> None:
    """Rank 1 dies (SIGKILL) mid-interval: rank 0 must not hang in its next collective; the
    launcher ends the pod, the attempt is relaunched and both ranks resume from the last
    checkpoint."""
    name = "rank-killed"
    kill = 14
    doc = job_doc(name, steps=30, annotations=faults(killAtStep=kill, killRank=1),
                  resources={"gpus": 2})  # fmt: skip
    target.apply(doc)
    s = wait_phase(target, name, "Succeeded")
    runs = runs_of(train_log(target, name))
    check_runs_are_contiguous(runs, 30)
    assert len(runs) == 2 and runs[0].end is None and runs[0].last == kill - 1, runs
    assert runs[1].resumed_from == 10
    lost = steps_lost(runs)
    assert [r["reason"] for r in s["recoveries"]] == ["PodFailure"], s["recoveries"]
    retrained = retrained_difference(runs)
    REPORT.append(
        f"SIGKILL of rank 1 of 2 before step {kill}: PodFailure, resumed at "
        f"{runs[1].resumed_from}, steps lost {lost[0]}, re-trained steps differ by {retrained:.1e}"
    )
    assert retrained <= RETRAINED_TOLERANCE
    delete_job(target, name)


def test_a_damaged_newest_checkpoint_is_quarantined_and_the_one_before_resumes(
    target: Target, baseline: dict[str, Any]
) -> None:
    """Bytes of the newest checkpoint flipped on the volume, then the trainer killed: the
    replacement finds the damage against the checkpoint's manifest (sha256), renames it
    aside and resumes from the one before, step-exactly."""
    name = "corrupt"
    target.apply(job_doc(name, annotations=faults(stepSeconds=0.5)))
    wait_step(target, name, 21)
    folder = target.volume_folder(f"{name}-ckpt")
    newest = folder / "step-20"
    wait_for("step-20 complete", lambda: (newest / "manifest.json").exists(), 60)
    shard = max((p for p in newest.rglob("*") if p.is_file() and p.suffix != ".json"),
                key=lambda p: p.stat().st_size)  # fmt: skip
    damage(shard)
    target.hard_kill(running_pod(target, name))
    s = wait_phase(target, name, "Succeeded")
    records = train_log(target, name)
    runs = runs_of(records)
    check_runs_are_contiguous(runs, STEPS)
    assert len(runs) == 2 and runs[1].resumed_from == 10, runs
    (event,) = [r for r in records if r.get("event") == "checkpoint_quarantined"]
    assert event["checkpoint"] == "step-20" and "step-20.corrupt-" in event["moved_to"], event
    assert (folder / event["moved_to"]).is_dir()
    lost = steps_lost(runs)
    retrained = retrained_difference(runs)
    diff = baseline_difference(target, baseline, runs)
    REPORT.append(
        f"newest checkpoint damaged ({shard.name}), trainer killed at step {runs[0].last}: "
        f"step-20 quarantined as {event['moved_to']}, resumed at 10, steps lost {lost[0]}, "
        f"re-trained steps differ by {retrained:.1e}, final loss vs uninterrupted {diff:.1e}; "
        f"{[r['reason'] for r in s['recoveries']]}"
    )
    assert retrained <= RETRAINED_TOLERANCE and diff <= LOSS_TOLERANCE
    delete_job(target, name)


def damage(path: Path) -> None:
    """Flip bytes in the middle of a file, as a bad disk or a torn write would."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, min(middle + 64, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("phase", ["load", "eval"])
def test_out_of_memory_while_loading_or_evaluating_replans_and_resumes(
    target: Target, phase: str
) -> None:
    name = f"oom-{phase}"
    doc = job_doc(name, steps=20, interval=5, annotations=faults(oomInPhase=phase, attempts=[1]),
                  resources={"gpus": "auto"}, dataset={"validationSplit": 0.1})  # fmt: skip
    del doc["spec"]["training"]["microBatchSize"]
    del doc["spec"]["training"]["gradientCheckpointing"]
    target.apply(doc)
    s = wait_phase(target, name, "Succeeded")
    runs = runs_of(train_log(target, name))
    check_runs_are_contiguous(runs, 20)
    (rec,) = s["recoveries"]
    assert rec["reason"] == "OOM" and "re-planned" in rec["message"], rec
    assert s["plan"]["revision"] == 2 and s["attempt"] == 2
    if phase == "load":  # nothing trained yet: the model never loaded
        assert len(runs) == 1 and runs[0].resumed_from == 0, runs
        lost = [0]
    else:  # the first evaluation follows the first checkpoint (step 5)
        assert len(runs) == 2 and runs[0].end == "oom" and runs[1].resumed_from == 5, runs
        lost = steps_lost(runs)
    assert "OutOfMemory" in event_reasons(target, name)
    REPORT.append(
        f"OOM while {'loading the model' if phase == 'load' else 'evaluating'}: "
        f"{rec['message'][:120]}; steps lost {lost[0]}"
    )
    delete_job(target, name)


@pytest.mark.kubelet
def test_a_trainer_killed_for_host_memory_is_relaunched_with_more(target: Target) -> None:
    """Rank 0 allocates host memory past the pod's limit (request = limit, from the plan): the
    kernel kills the container (OOMKilled), and the operator relaunches the same layout with
    1.5 times the host memory, from the last checkpoint."""
    if not target.enforces_memory_limits:
        pytest.skip(f"the {target.name} target enforces no memory limits (no cgroups)")
    name = "host-oom"
    target.apply(job_doc(name, steps=30, annotations=faults(hostMemoryAtStep=14)))
    first = wait_for("the first plan", lambda: status(target, name).get("plan"), 60)
    s = wait_phase(target, name, "Succeeded")
    runs = runs_of(train_log(target, name))
    check_runs_are_contiguous(runs, 30)
    assert len(runs) == 2 and runs[0].end is None and runs[0].last == 13, runs
    assert runs[1].resumed_from == 10, runs
    (rec,) = s["recoveries"]
    assert rec["reason"] == "HostOutOfMemory" and "OOMKilled" in rec["message"], rec
    plan = s["plan"]
    assert plan["revision"] == 2 and plan["hostMemoryScale"] == 1.5, plan
    assert plan["hostMemoryGiB"] == pytest.approx(1.5 * first["hostMemoryGiB"], rel=0.05), (
        first,
        plan,
    )
    assert "HostOutOfMemory" in event_reasons(target, name)
    retrained = retrained_difference(runs)
    REPORT.append(
        f"host memory exhausted before step 14: OOMKilled at {first['hostMemoryGiB']:g} GiB, "
        f"relaunched with {plan['hostMemoryGiB']:g} GiB, resumed at 10, steps lost "
        f"{steps_lost(runs)[0]}, re-trained steps differ by {retrained:.1e}"
    )
    assert retrained <= RETRAINED_TOLERANCE
    delete_job(target, name)


SIZED_CLASS = "kubetune-local-sized"
"""The local target's class of volumes that are each a tmpfs of the claim's size."""


def test_a_full_volume_at_a_save_fails_the_job_and_keeps_the_checkpoint_before(
    target: Target,
) -> None:
    """A volume that is really full: the checkpoint claim is a 96 MiB tmpfs, and once step-10
    is on it the test fills what is left, so the save of step 20 finds no room."""
    if target.name != "local":
        pytest.skip(f"the {target.name} target has no size-limited volumes ({SIZED_CLASS})")
    name = "disk-full"
    storage = {"storage": {"storageClassName": SIZED_CLASS, "size": "96Mi"}}
    target.apply(job_doc(name, annotations=faults(stepSeconds=1.0), checkpoint=storage))
    claim = f"{name}-ckpt"
    wait_for(
        "step-10 on the volume",
        lambda: target.read_volume_file(claim, "step-10/manifest.json") is not None,
        240,
    )
    folder = target.volume_folder(claim)
    assert os.path.ismount(folder), f"{folder} is not a size-limited file system"
    fs = os.statvfs(folder)
    free = fs.f_bavail * fs.f_frsize
    (folder / "filler").write_bytes(bytes(max(0, free - 4 * 2**20)))  # 4 MiB left
    s = wait_phase(target, name, "Failed")
    cond = next(c for c in s["conditions"] if c["type"] == "Failed")
    assert cond["reason"] == "CheckpointFailed", cond
    assert "not enough space for checkpoint step-20" in s["message"], s["message"]
    assert "step-10" in s["message"], s["message"]  # the checkpoint kept, named
    manifest = target.read_volume_file(f"{name}-ckpt", "step-10/manifest.json")
    assert manifest and json.loads(manifest), "step-10 is gone"
    assert target.read_volume_file(f"{name}-ckpt", "step-20/manifest.json") is None
    REPORT.append(
        f"96 MiB tmpfs filled after step 10: Failed/CheckpointFailed at step 20, step-10 intact; "
        f"{s['message'][:200]}"
    )
    delete_job(target, name)


def test_three_preemptions_in_one_run_lose_nothing(
    target: Target, baseline: dict[str, Any]
) -> None:
    name = "preempted-thrice"
    target.apply(job_doc(name))
    for step in (8, 25, 42):
        wait_step(target, name, step)
        pod = running_pod(target, name)
        target.kubectl("delete", "pod", pod, "-n", NAMESPACE, "--grace-period=60", "--wait=false")
        wait_for(f"{pod} gone", lambda p=pod: target.get("pod", p) is None, 120)
    s = wait_phase(target, name, "Succeeded")
    runs = runs_of(train_log(target, name))
    check_runs_are_contiguous(runs, STEPS)
    assert len(runs) == 4 and all(r.end == "preempted" for r in runs[:3]), runs
    assert steps_lost(runs) == [0, 0, 0]
    assert [r["reason"] for r in s["recoveries"]] == ["Preemption"] * 3, s["recoveries"]
    diff = baseline_difference(target, baseline, runs)
    REPORT.append(
        f"three preemptions (at steps {[r.last for r in runs[:3]]}): steps lost 0, 0, 0, "
        f"final loss vs uninterrupted {diff:.1e}"
    )
    assert diff <= LOSS_TOLERANCE
    delete_job(target, name)
