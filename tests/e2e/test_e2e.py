"""End to end: apply a FineTuneJob, the trainer really trains, the operator recovers.

Every scenario reads the trainer's own record of what it did — `train-log.jsonl` on the
job's checkpoint volume, one JSON line per step, checkpoint, signal and (re)start — and
asserts on it: how many steps a preemption, a kill or an out-of-memory exit cost, and that
the resumed run ends where an uninterrupted one does.

The model is a tiny random-init Llama on CPU; planning sizes it as Qwen2.5-0.5B. Each
scenario's numbers are printed in the "e2e measurements" section at the end of the run.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from support.e2e_jobs import (
    FAULTS,
    INTERVAL,
    LOSS_TOLERANCE,
    STEPS,
    active_pods,
    check_runs_are_contiguous,
    delete_job,
    event_reasons,
    final_loss,
    job_doc,
    outcome,
    patch_spec,
    pod_summary,
    progress_step,
    running_pod,
    runs_of,
    status,
    steps_lost,
    train_log,
    wait_phase,
    wait_step,
)
from support.e2e_targets import (
    DATA_CLAIM,
    DATASET_PATH,
    NAMESPACE,
    POOL_B_NAME,
    REPORT,
    Target,
    say,
)
from support.waiting import wait_for

pytestmark = pytest.mark.e2e

# ---------------------------------------------------------------------- scenarios


@pytest.mark.kubelet
@pytest.mark.xdist_group("baseline")  # one worker runs the baseline once
def test_happy_path(target: Target, baseline: dict[str, Any]) -> None:
    name = baseline["name"]
    final = baseline["snapshots"][-1]
    assert final.get("phase") == "Succeeded", outcome(target, name)
    # The plan was in status before anything ran, and progress showed while it ran.
    planned = [s for s in baseline["snapshots"] if s.get("plan")]
    assert planned and planned[0]["plan"]["pool"] == "local-cpu"
    running = [
        s
        for s in baseline["snapshots"]
        if s.get("phase") == "Running" and (s.get("progress") or {}).get("step", 0) > 0
    ]
    assert running, "no status showed progress while the job ran"
    progress = running[-1]["progress"]
    assert progress["totalSteps"] == STEPS and progress["loss"] > 0
    assert progress["tokensPerSecond"] > 0 and progress["eta"]
    assert any((s.get("cost") or {}).get("accruedUSD", 0) > 0 for s in running)
    assert any(s.get("checkpoint") for s in running), "no checkpoint showed in status"
    assert final["checkpoint"]["latestStep"] == STEPS
    assert final["progress"]["percent"] == 100
    # The trainer trained every step once, in order.
    runs = runs_of(train_log(target, name))
    assert len(runs) == 1
    check_runs_are_contiguous(runs, STEPS)
    # Adapter and merged model in the output location.
    outputs = target.list_volume(f"{name}-ckpt", "output")
    assert "adapter/adapter_config.json" in outputs, outputs
    assert any(p.startswith("adapter/adapter_model") for p in outputs), outputs
    assert "merged/config.json" in outputs and any(
        p.startswith("merged/") and p.endswith(".safetensors") for p in outputs
    ), outputs
    # GPUs are free at once: no trainer pod left running or pending.
    wait_for("trainer pods gone", lambda: not active_pods(target, name), 30)
    # Status writes: at most one per poll, and far fewer than the apiserver could take.
    writes = baseline["writes"]
    seconds = baseline["seconds"]
    per_minute = 60 * len(writes) / seconds
    REPORT.append(
        f"happy path: {STEPS} steps, final loss {final_loss(runs, STEPS):.4f}; "
        f"{len(writes)} FineTuneJob writes in {seconds:.0f}s = {per_minute:.0f}/min "
        "at a 1 s poll interval"
    )
    assert per_minute <= 2 * 60, f"{per_minute:.0f} writes/min at a 1 s poll"


LONG_NAME = "a-fine-tune-job-whose-name-is-longer-than-any-kubernetes-label-value"


def kubetune(target: Target, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The installed `kubetune` command, through the target's kubeconfig."""
    argv = [str(Path(sys.executable).parent / "kubetune"), *args, *target.kubectl_argv()[1:]]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def test_the_cli_follows_a_long_named_two_rank_job(target: Target) -> None:
    """`kubetune watch` follows a job to its end, `kubetune logs` reads each rank of it
    (names over 63 characters too), and `kubectl kubetune` is the same CLI as a plugin."""
    name = LONG_NAME
    assert len(name) > 63
    target.apply(job_doc(name, steps=6, interval=3, resources={"gpus": 2}))
    watch = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "kubetune"), "watch", name, "-n", NAMESPACE,
            "--interval", "0.5", "--timeout", "300", *target.kubectl_argv()[1:],
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    out, err = watch.communicate(timeout=330)
    assert watch.returncode == 0, out + err
    lines = out.splitlines()
    (plan,) = [line for line in lines if line.startswith("plan ")]
    assert plan.startswith("plan r1: lora on 2× local-cpu (pool local-cpu)"), out
    assert any(re.search(r"Running .*step [1-5]/6", line) for line in lines), out
    assert any(line.startswith("event Normal Launched: Attempt 1") for line in lines), out
    assert lines[-1].startswith(f"{name} Succeeded"), out
    progress = [line for line in lines if line.startswith("Running")]
    assert len(progress) == len(set(progress)), out  # a line per change, not per look
    say("kubetune watch:\n" + out)

    everything = kubetune(target, "logs", name, "-n", NAMESPACE)
    assert everything.returncode == 0, everything.stderr
    assert " rank0 " in everything.stdout, everything.stdout[-2000:]
    ranks: dict[int, str] = {}
    for rank in (0, 1):
        one = kubetune(target, "logs", name, "-n", NAMESPACE, "--rank", str(rank))
        assert one.returncode == 0, one.stderr
        ranks[rank] = one.stdout
        assert f" rank{1 - rank} " not in one.stdout, one.stdout[-2000:]
    assert " rank0 " in ranks[0]
    tail = kubetune(target, "logs", name, "-n", NAMESPACE, "--tail", "3")
    assert tail.stdout.splitlines() == everything.stdout.splitlines()[-3:]
    missing = kubetune(target, "logs", name, "-n", NAMESPACE, "--attempt", "2")
    assert missing.returncode == 1 and "has attempts 1 to 1, not 2" in missing.stderr
    no_rank = kubetune(target, "logs", name, "-n", NAMESPACE, "--rank", "2")
    assert no_rank.returncode == 1 and "no pod of attempt 1 runs rank 2" in no_rank.stderr

    # The same CLI through kubectl's plugin mechanism (kubectl finds kubectl-kubetune on PATH).
    kubectl, kubeconfig = target.kubectl_argv()[0], target.kubectl_argv()[1].split("=", 1)[1]
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "KUBECONFIG": kubeconfig,
    }
    plugin = subprocess.run(
        [kubectl, "kubetune", "get", "-n", NAMESPACE],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert plugin.returncode == 0, plugin.stderr
    (row,) = [line for line in plugin.stdout.splitlines() if line.startswith(name)]
    assert row.split()[1:4] == ["Succeeded", "local-cpu", "2"], plugin.stdout
    described = subprocess.run(
        [kubectl, "kubetune", "describe", name, "-n", NAMESPACE],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert described.returncode == 0 and f"Name:        {name}" in described.stdout
    say(
        "kubectl kubetune get:\n"
        + plugin.stdout
        + "kubectl kubetune describe:\n"
        + described.stdout
    )
    delete_job(target, name)


@pytest.mark.kubelet
@pytest.mark.xdist_group("baseline")  # one worker runs the baseline once
def test_preemption_resumes_at_the_same_step(target: Target, baseline: dict[str, Any]) -> None:
    name = "preempt"
    target.apply(job_doc(name))
    wait_step(target, name, INTERVAL + 3)
    pod = running_pod(target, name)
    # A preemption: the pod is deleted with a grace period; the trainer checkpoints on SIGTERM.
    target.kubectl("delete", "pod", pod, "-n", NAMESPACE, "--grace-period=60", "--wait=false")
    s = wait_phase(target, name, "Succeeded")
    runs = runs_of(train_log(target, name))
    check_runs_are_contiguous(runs, STEPS)
    assert len(runs) == 2 and runs[0].end == "preempted", runs
    lost = steps_lost(runs)
    assert lost == [0], lost
    assert [r["reason"] for r in s["recoveries"]] == ["Preemption"], s["recoveries"]
    # The next attempt started at once, not after the Job controller's back-off.
    assert s["restarts"] == 1 and s["attempt"] == 2
    assert "Preempted" in event_reasons(target, name)
    diff = abs(final_loss(runs, STEPS) - final_loss(runs_of(train_log(target, "baseline")), STEPS))
    REPORT.append(
        f"preemption at step {runs[0].last}: resumed at {runs[1].resumed_from}, "
        f"steps lost {lost[0]}, final-loss difference vs uninterrupted {diff:.2e}"
    )
    assert diff <= LOSS_TOLERANCE
    delete_job(target, name)


def test_preempted_without_room_moves_to_another_pool(target: Target) -> None:
    if not target.volumes_follow_pods:
        pytest.skip(
            f"on {target.name}, volumes are pinned to the node that wrote them: a job cannot "
            "take its checkpoint volume to another pool's node"
        )
    name = "move"
    target.apply(job_doc(name))
    first = wait_for("the plan", lambda: status(target, name).get("plan"), 60)
    assert first["pool"] != POOL_B_NAME  # the cheaper pool first
    wait_step(target, name, INTERVAL + 2)
    pod = running_pod(target, name)
    # The node is taken away (cordoned) and the pod preempted: the next attempt has no room.
    node_a, node_b = target.nodes
    target.kubectl("cordon", node_a)
    try:
        target.kubectl("delete", "pod", pod, "-n", NAMESPACE, "--grace-period=60", "--wait=false")
        s = wait_phase(target, name, "Succeeded")
    finally:
        target.kubectl("uncordon", node_a)
    assert s["plan"]["pool"] == POOL_B_NAME and s["plan"]["revision"] == 2
    assert [r["reason"] for r in s["recoveries"]] == ["Preemption", "Rescheduled"], s["recoveries"]
    assert s["attempt"] == 3  # relaunched after the preemption, then moved
    nodes = {p["spec"].get("nodeName") for p in target.list("pods", f"kubetune.io/job={name}")}
    assert node_b in nodes
    runs = runs_of(train_log(target, name))
    check_runs_are_contiguous(runs, STEPS)
    assert runs[0].end == "preempted" and steps_lost(runs) == [0], runs
    assert "Rescheduled" in event_reasons(target, name)
    REPORT.append(
        f"preempted at step {runs[0].last} with no room left in pool {first['pool']}: moved to "
        f"{POOL_B_NAME}, resumed at {runs[1].resumed_from}, steps lost {steps_lost(runs)[0]}"
    )
    delete_job(target, name)


@pytest.mark.kubelet
def test_hard_kill_resumes_from_the_last_checkpoint(
    target: Target, baseline: dict[str, Any]
) -> None:
    name = "killed"
    target.apply(job_doc(name))
    wait_step(target, name, INTERVAL + 4)
    pod = running_pod(target, name)
    # No grace: the trainer is SIGKILLed mid-interval, as when a node dies.
    target.hard_kill(pod)
    s = wait_phase(target, name, "Succeeded")
    runs = runs_of(train_log(target, name))
    check_runs_are_contiguous(runs, STEPS)
    assert len(runs) == 2 and runs[0].end is None, runs
    lost = steps_lost(runs)
    assert 0 <= lost[0] <= INTERVAL, lost
    assert runs[1].resumed_from % INTERVAL == 0 and runs[1].resumed_from > 0
    assert [r["reason"] for r in s["recoveries"]] == ["PodFailure"], s["recoveries"]
    diff = abs(final_loss(runs, STEPS) - final_loss(runs_of(train_log(target, "baseline")), STEPS))
    REPORT.append(
        f"hard kill at step {runs[0].last}: resumed at {runs[1].resumed_from}, "
        f"steps lost {lost[0]} (interval {INTERVAL}), final-loss difference {diff:.2e}"
    )
    assert diff <= LOSS_TOLERANCE
    delete_job(target, name)


def test_a_hung_trainer_is_relaunched_from_its_checkpoint(target: Target) -> None:
    """A rank that stops making progress and ignores stop requests (as one stuck in a
    collective does): the operator's stall detection relaunches the attempt."""
    name = "hung"
    faults = {FAULTS: json.dumps({"hangAtStep": 8, "attempts": [1]})}
    doc = job_doc(name, steps=20, interval=5, annotations=faults,
                  recovery={"stallTimeoutSeconds": 15})  # fmt: skip
    target.apply(doc)
    s = wait_phase(target, name, "Succeeded", timeout=400)
    runs = runs_of(train_log(target, name))
    check_runs_are_contiguous(runs, 20)
    assert len(runs) == 2 and runs[0].end is None and runs[0].last == 7, runs
    assert runs[1].resumed_from == 5
    assert [r["reason"] for r in s["recoveries"]] == ["Stalled"], s["recoveries"]
    rec = s["recoveries"][0]
    assert rec["step"] == 5, rec
    assert rec["message"].startswith("no step progress for ")
    assert s["attempt"] == 2 and s["restarts"] == 1
    assert "Stalled" in event_reasons(target, name)
    REPORT.append(
        f"hung rank before step 8: stall noticed after {rec['message'].split()[4]}, "
        f"resumed at {runs[1].resumed_from}, steps lost {steps_lost(runs)[0]}"
    )
    delete_job(target, name)


def test_out_of_memory_replans_and_resumes(target: Target) -> None:
    name = "oom"
    faults = {FAULTS: json.dumps({"oomAtStep": 8, "attempts": [1]})}
    doc = job_doc(name, steps=20, interval=5, annotations=faults, resources={"gpus": "auto"})
    del doc["spec"]["training"]["microBatchSize"]
    del doc["spec"]["training"]["gradientCheckpointing"]
    target.apply(doc)
    first = wait_for("the first plan", lambda: status(target, name).get("plan"), 60)
    s = wait_phase(target, name, "Succeeded")
    runs = runs_of(train_log(target, name))
    check_runs_are_contiguous(runs, 20)
    assert len(runs) == 2 and runs[0].end == "oom", runs
    assert runs[1].resumed_from == 5
    (rec,) = s["recoveries"]
    assert rec["reason"] == "OOM" and "re-planned" in rec["message"]
    plan = s["plan"]
    assert plan["revision"] == 2 and s["attempt"] == 2
    layout = (plan["totalGPUs"], plan["microBatchSize"], plan["gradientCheckpointing"])
    before = (first["totalGPUs"], first["microBatchSize"], first["gradientCheckpointing"])
    assert layout != before
    assert "OutOfMemory" in event_reasons(target, name)
    REPORT.append(
        f"OOM at step 8: re-planned {before} -> {layout} (GPUs, micro-batch, checkpointing), "
        f"resumed at {runs[1].resumed_from}, steps lost {steps_lost(runs)[0]}"
    )
    delete_job(target, name)


def test_repeated_out_of_memory_fails_instead_of_looping(target: Target) -> None:
    name = "oom-limit"
    faults = {FAULTS: json.dumps({"oomAtStep": 3})}
    doc = job_doc(
        name,
        steps=20,
        interval=2,
        annotations=faults,
        resources={"gpus": "auto"},
        recovery={"maxOOMReplans": 1},
    )
    del doc["spec"]["training"]["microBatchSize"]
    del doc["spec"]["training"]["gradientCheckpointing"]
    target.apply(doc)
    s = wait_phase(target, name, "Failed")
    reason = next(c["reason"] for c in s["conditions"] if c["type"] == "Failed")
    assert reason == "OutOfMemoryLimitReached", outcome(target, name)
    assert "maxOOMReplans=1" in s["message"] and "To fix" in s["message"]
    assert [r["reason"] for r in s["recoveries"]] == ["OOM"]
    wait_for("trainer pods gone", lambda: not active_pods(target, name), 60)
    delete_job(target, name)


@pytest.mark.parametrize("limit", ["budget", "deadline"])
def test_budget_and_deadline_stop_the_job_with_a_checkpoint(target: Target, limit: str) -> None:
    # The plan-time estimate includes a two-minute startup allowance, so a job admitted with a
    # budget or deadline tighter than that never starts. The scenario therefore lowers the
    # limit while the job runs, to just above what is spent: training reaches it on its own.
    name = f"limit-{limit}"
    target.apply(
        job_doc(name, steps=2000, interval=50, resources={"maxCostUSD": 5, "deadline": "1h"})
    )
    wait_step(target, name, 5)
    s = status(target, name)
    if limit == "budget":
        spent = float(s["cost"]["accruedUSD"])
        patch_spec(target, name, {"resources": {"maxCostUSD": round(spent + 0.004, 6)}})
        expected = "BudgetExceeded"
    else:
        started = time.mktime(time.strptime(s["startTime"], "%Y-%m-%dT%H:%M:%SZ"))
        elapsed = time.mktime(time.gmtime()) - started
        patch_spec(target, name, {"resources": {"deadline": f"{int(elapsed) + 5}s"}})
        expected = "DeadlineExceeded"
    s = wait_phase(target, name, "Failed", timeout=120)
    reason = next(c["reason"] for c in s["conditions"] if c["type"] == "Failed")
    assert reason == expected, outcome(target, name)
    assert "checkpoints on stop" in s["message"]
    wait_for("trainer pods gone", lambda: not active_pods(target, name), 90)
    runs = runs_of(train_log(target, name))
    assert runs[-1].end == "preempted", runs  # SIGTERM: the work so far is saved
    saved = runs[-1].last
    assert any(p.startswith(f"step-{saved}/") for p in target.list_volume(f"{name}-ckpt", ""))
    if limit == "budget":
        assert s["cost"]["accruedUSD"] >= float(
            target.get("finetunejob", name)["spec"]["resources"]["maxCostUSD"]  # type: ignore[index]
        )
    REPORT.append(f"{limit} reached: stopped at step {saved} with a checkpoint; {s['message']}")
    delete_job(target, name)


def test_suspend_checkpoints_and_resume_continues(target: Target) -> None:
    name = "pause"
    target.apply(job_doc(name))
    wait_step(target, name, INTERVAL + 2)
    patch_spec(target, name, {"suspend": True})
    wait_phase(target, name, "Suspended", timeout=60)
    wait_for("trainer pods gone", lambda: not active_pods(target, name), 90)
    runs = runs_of(train_log(target, name))
    assert runs[-1].end == "preempted", runs
    paused_at = runs[-1].last
    patch_spec(target, name, {"suspend": False})
    s = wait_phase(target, name, "Succeeded")
    runs = runs_of(train_log(target, name))
    check_runs_are_contiguous(runs, STEPS)
    assert steps_lost(runs) == [0]
    assert runs[1].resumed_from == paused_at and s["attempt"] == 2
    REPORT.append(f"suspend at step {paused_at}, resume: steps lost {steps_lost(runs)[0]}")
    delete_job(target, name)


def test_a_job_created_again_under_its_old_name_starts_over_unless_told_to_resume(
    target: Target,
) -> None:
    # The checkpoint volume is retained, so a new job of the same name mounts the old one's
    # checkpoints: it must not take them for its own (a v2 with new data would train 0 steps
    # and export v1's adapter).
    name, steps = "again", 20
    target.apply(job_doc(name, steps=steps))
    wait_phase(target, name, "Succeeded")
    v1 = target.get("finetunejob", name)["metadata"]["uid"]  # type: ignore[index]
    delete_job(target, name)

    target.apply(job_doc(name, steps=steps, training={"learningRate": 1e-3}))
    wait_phase(target, name, "Succeeded")
    v2 = target.get("finetunejob", name)["metadata"]["uid"]  # type: ignore[index]
    runs = runs_of(train_log(target, name))
    assert runs[-1].resumed_from == 0 and runs[-1].steps == list(range(1, steps + 1)), runs
    moved = [p for p in target.list_volume(f"{name}-ckpt", "") if p.startswith("foreign/")]
    assert any(p.startswith(f"foreign/{v1}-") and f"/step-{steps}/" in p for p in moved), moved
    delete_job(target, name)

    # Named explicitly, another job's checkpoints are resumed: v2 had finished, so v3 resumes
    # at its last step and trains none.
    target.apply(job_doc(name, steps=steps, checkpoint={"resumeFromUID": v2}))
    wait_phase(target, name, "Succeeded")
    runs = runs_of(train_log(target, name))
    assert runs[-1].resumed_from == steps and runs[-1].steps == [], runs
    REPORT.append(
        f"re-created under its old name: v2 trained {steps} steps from 0 (v1's checkpoints moved "
        f"to foreign/); v3 with resumeFromUID resumed at step {steps}"
    )
    delete_job(target, name)
    target.kubectl("delete", "pvc", f"{name}-ckpt", "-n", NAMESPACE, "--wait=false")


@pytest.mark.kubelet
def test_data_from_s3_is_staged_in_once_measured_and_trained_on(
    target: Target, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from support.s3server import s3_server

    records = (target.read_volume_file(DATA_CLAIM, DATASET_PATH) or "").splitlines()
    assert records, "the e2e dataset is missing"
    target.kubectl("annotate", "namespace", NAMESPACE, "--overwrite",
                   "kubetune.io/allowed-secrets=s3-creds")  # fmt: skip
    # On the address of this machine the pods reach (kind: the Docker network's gateway).
    with s3_server(tmp_path_factory.mktemp("s3"), host=target.host_address) as s3:
        s3.make_bucket("data")
        # A key of its own: the namespace's cache is keyed by the URI, not by the store it
        # came from, and another scenario on this target may have staged s3://data/support/.
        s3.client().put_object(Bucket="data", Key="staged-once/train.jsonl",
                               Body="\n".join(records).encode() + b"\n")  # fmt: skip
        creds = {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
        target.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-creds"},
                      "stringData": creds})  # fmt: skip
        store = {"credentialsSecret": "s3-creds", "region": s3.region, "endpoint": s3.endpoint}
        data = {"uri": "s3://data/staged-once/train.jsonl"}
        timings = []
        for name in ("from-s3", "from-s3-again"):
            started = time.monotonic()
            target.apply(job_doc(name, steps=10, dataset=data, s3=store))
            wait_step(target, name, 1)
            timings.append(time.monotonic() - started)
            s = wait_phase(target, name, "Succeeded")
            staged = s["stageIn"]
            assert staged["examples"] == len([r for r in records if r.strip()]), staged
            assert staged["tokens"] > 0 and staged["datasetPath"].startswith("/cache/")
            assert any(c["type"] == "StagedIn" and c["status"] == "True"
                       for c in s["conditions"])  # fmt: skip
            runs = runs_of(train_log(target, name))
            assert runs[-1].end == "finish" and runs[-1].last == 10, runs
        # The second job found the data in the namespace's cache: one GET in all.
        assert s3.gets("data", "staged-once/") == 1
        assert staged["downloadedBytes"] == 0 and staged["reusedBytes"] > 0
    REPORT.append(
        f"S3 stage-in: apply → first step {timings[0]:.1f}s (fetched), {timings[1]:.1f}s "
        f"(from the cache); {staged['examples']} examples, {staged['tokens']} tokens measured"
    )
    for name in ("from-s3", "from-s3-again"):
        delete_job(target, name)
        target.kubectl("delete", "pvc", f"{name}-ckpt", "-n", NAMESPACE, "--wait=false")


def test_the_output_is_uploaded_to_s3_before_the_job_succeeds(
    target: Target, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from safetensors import safe_open

    from kubetune_trainer.tiny import make_model
    from support.s3server import s3_server

    records = (target.read_volume_file(DATA_CLAIM, DATASET_PATH) or "").splitlines()
    target.kubectl("annotate", "namespace", NAMESPACE, "--overwrite",
                   "kubetune.io/allowed-secrets=s3-creds")  # fmt: skip
    if not target.pulls_images:  # the GGUF export's converter, as in the e2e GGUF scenario
        from kubetune_dev.llamacpp import ensure_llama_cpp

        ensure_llama_cpp(progress=say)
    name = "to-s3"
    gguf = {"quantization": "q8_0", "preTokenizer": "gpt-2"}
    model = make_model(tmp_path_factory.mktemp("model") / "tiny-llama", arch="llama")
    with s3_server(tmp_path_factory.mktemp("s3-out"), host=target.host_address) as s3:
        for bucket in ("models", "data", "results"):
            s3.make_bucket(bucket)
        client = s3.client()
        for file in sorted(model.rglob("*")):
            if file.is_file():
                client.upload_file(str(file), "models", f"tiny-llama/{file.relative_to(model)}")
        client.put_object(Bucket="data", Key="support/train.jsonl",
                          Body="\n".join(records).encode() + b"\n")  # fmt: skip
        creds = {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
        target.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-creds"},
                      "stringData": creds})  # fmt: skip
        store = {"credentialsSecret": "s3-creds", "region": s3.region, "endpoint": s3.endpoint}
        started = time.monotonic()
        target.apply(job_doc(name, steps=10, model={"uri": "s3://models/tiny-llama"},
                             dataset={"uri": "s3://data/support/train.jsonl"},
                             output={"uri": "s3://results/support-bot/v1", "mergeAdapter": True,
                                     "gguf": gguf},
                             s3=store))  # fmt: skip
        s = wait_phase(target, name, "Succeeded")
        took = time.monotonic() - started
        assert s["stageIn"]["modelPath"].startswith("/cache/models/"), s["stageIn"]
        uploaded = s["stageOut"]
        assert uploaded["destination"] == "s3://results/support-bot/v1", uploaded
        assert any(c["type"] == "Uploaded" and c["status"] == "True"
                   for c in s["conditions"])  # fmt: skip
        # Succeeded only after the upload: the manifest is in the store, and every file it
        # lists is there with the bytes the volume holds.
        manifest = json.loads(
            client.get_object(Bucket="results", Key="support-bot/v1/kubetune-upload.json")[
                "Body"
            ].read()
        )
        files = {f["path"]: f for f in manifest["files"]}
        assert len(files) == uploaded["files"] and uploaded["bytes"] > 0
        assert "adapter/adapter_config.json" in files and "merged/config.json" in files
        # The export ran before the upload: the GGUF file went to the store with the rest.
        assert f"gguf/{name}-q8_0.gguf" in files and s["export"]["bytes"] > 0, s["export"]
        download = tmp_path_factory.mktemp("downloaded")
        for path, entry in files.items():
            local = download / path
            local.parent.mkdir(parents=True, exist_ok=True)
            client.download_file("results", f"support-bot/v1/{path}", str(local))
            digest = hashlib.sha256(local.read_bytes()).hexdigest()
            assert digest == entry["sha256"], path
            assert target.volume_sha256(f"{name}-ckpt", f"output/{path}") == digest, path
        # The uploaded adapter loads: its config is a LoRA one and its weights read.
        config = json.loads((download / "adapter/adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and config["r"] == 8
        weights = next(p for p in files if p.startswith("adapter/") and p.endswith(".safetensors"))
        with safe_open(str(download / weights), framework="numpy") as tensors:
            keys = list(tensors.keys())
            assert keys and all("lora_" in key for key in keys), keys[:5]
            assert all(tensors.get_tensor(key).size > 0 for key in keys)
    REPORT.append(
        f"S3 output: apply → Succeeded {took:.1f}s, {uploaded['files']} files "
        f"({uploaded['bytes'] / 1e6:.1f} MB) uploaded in {uploaded['seconds']}s, every sha256 "
        "matching the volume's"
    )
    delete_job(target, name)
    target.kubectl("delete", "pvc", f"{name}-ckpt", "-n", NAMESPACE, "--wait=false")


def test_a_gguf_file_is_exported_after_training_before_the_job_succeeds(target: Target) -> None:
    """spec.output.gguf: once training finished, a CPU-only export step converts the merged
    model with llama.cpp's converter; the job succeeds after it, with the file on the volume."""
    if not target.pulls_images:
        # Pods run with this machine's Python: the converter the image has in /opt/llama.cpp
        # comes from the cache the pod runner points KUBETUNE_LLAMA_CPP_DIR at.
        from kubetune_dev.llamacpp import ensure_llama_cpp

        ensure_llama_cpp(progress=say)
    name = "to-gguf"
    gguf = {"quantization": "q8_0", "preTokenizer": "gpt-2"}  # the tiny tokenizer's family
    started = time.monotonic()
    target.apply(job_doc(name, steps=10, output={"mergeAdapter": True, "gguf": gguf}))
    s = wait_phase(target, name, "Succeeded")
    took = time.monotonic() - started
    exported = s["export"]
    assert exported["uri"] == f"pvc://{name}-ckpt/output/gguf/{name}-q8_0.gguf", exported
    assert exported["quantization"] == "q8_0" and exported["bytes"] > 0, exported
    conditions = {c["type"]: c for c in s["conditions"]}
    assert (conditions["Exported"]["status"], conditions["Exported"]["reason"]) == (
        "True",
        "Exported",
    ), conditions["Exported"]
    assert (
        conditions["Exported"]["lastTransitionTime"]
        <= conditions["Succeeded"]["lastTransitionTime"]
    )
    assert target.list_volume(f"{name}-ckpt", "output/gguf") == [f"{name}-q8_0.gguf"]
    assert target.volume_sha256(f"{name}-ckpt", f"output/gguf/{name}-q8_0.gguf")
    REPORT.append(
        f"GGUF export: apply → Succeeded {took:.1f}s, q8_0 file {exported['bytes']} bytes "
        f"written in {exported['seconds']}s by the export step"
    )
    delete_job(target, name)
    target.kubectl("delete", "pvc", f"{name}-ckpt", "-n", NAMESPACE, "--wait=false")


def test_bad_s3_inputs_fail_the_job_before_any_trainer_pod(
    target: Target, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from support.s3server import s3_server

    target.kubectl("annotate", "namespace", NAMESPACE, "--overwrite",
                   "kubetune.io/allowed-secrets=s3-creds,s3-wrong")  # fmt: skip
    with s3_server(tmp_path_factory.mktemp("s3-bad"), host=target.host_address) as s3:
        s3.make_bucket("data")
        good = '{"instruction": "a", "output": "b"}\n'
        s3.client().put_object(Bucket="data", Key="bad/train.jsonl",
                               Body=(good * 3 + '{"instruction": "c", \n').encode())  # fmt: skip
        s3.client().put_object(Bucket="data", Key="ok/train.jsonl", Body=good.encode())
        right = {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
        wrong = {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
        for secret, data in (("s3-creds", right), ("s3-wrong", wrong)):
            target.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret},
                          "stringData": data})  # fmt: skip

        def store(secret: str) -> dict[str, Any]:
            return {"credentialsSecret": secret, "region": s3.region, "endpoint": s3.endpoint}

        cases = {
            "s3-denied": ("s3://data/ok/train.jsonl", "s3-wrong", "To fix"),
            "s3-missing": ("s3://data/nothing/here.jsonl", "s3-creds", "no objects under it"),
            "s3-malformed": ("s3://data/bad/train.jsonl", "s3-creds", "bad/train.jsonl:4:"),
        }
        started = time.monotonic()
        for name, (uri, secret, _) in cases.items():
            target.apply(job_doc(name, dataset={"uri": uri}, s3=store(secret)))
        took = {}
        for name, (_, _, said) in cases.items():
            s = wait_phase(target, name, "Failed", timeout=120)
            took[name] = time.monotonic() - started
            failed = next(c for c in s["conditions"] if c["type"] == "Failed")
            assert failed["reason"] == "StageInFailed", outcome(target, name)
            assert said in failed["message"], failed["message"]
            # No GPU was asked for: no trainer Job, no trainer pod, nothing accrued.
            assert target.get("job.batch", f"{name}-a1") is None
            pods = target.list("pods", f"kubetune.io/job={name}")
            assert not [p for p in pods if "kubetune.io/attempt" in p["metadata"]["labels"]]
            assert float((s.get("cost") or {}).get("accruedUSD") or 0) == 0.0
    assert max(took.values()) < 60, took
    REPORT.append(
        "bad S3 inputs → StageInFailed, no trainer pod: "
        + ", ".join(f"{name} {seconds:.1f}s" for name, seconds in took.items())
    )
    for name in cases:
        delete_job(target, name)


def test_a_job_chained_after_another_trains_on_its_merged_model(target: Target) -> None:
    """`ftj://sft` as the model: applied together, the second job waits while the first
    trains, then trains on the first one's merged model; a chain whose upstream fails ends
    naming it."""
    if not target.volumes_follow_pods:
        pytest.skip(
            f"on {target.name}, volumes are pinned to the node that wrote them: the second job "
            "reads the first one's checkpoint volume, and its plan may pick another pool's node"
        )
    first, second = "chain-sft", "chain-next"
    started = time.monotonic()
    target.apply(
        job_doc(first, steps=10, output={"mergeAdapter": True}),
        job_doc(second, steps=10, model={"uri": f"ftj://{first}"}),
    )
    wait_step(target, first, 1)
    s = status(target, second)
    assert s.get("phase") == "Pending", s
    waiting = next(c for c in s["conditions"] if c["type"] == "UpstreamReady")
    assert (waiting["status"], waiting["reason"]) == ("False", "WaitingForUpstream"), waiting
    assert f"FineTuneJob {first}" in s["message"]
    wait_phase(target, first, "Succeeded")
    s = wait_phase(target, second, "Succeeded")
    took = time.monotonic() - started
    assert s["upstream"]["modelUri"] == f"pvc://{first}-ckpt/output/merged", s["upstream"]
    runs = runs_of(train_log(target, second))
    assert runs[-1].end == "finish" and runs[-1].last == 10, runs
    outputs = target.list_volume(f"{second}-ckpt", "output")
    assert "adapter/adapter_config.json" in outputs, outputs
    # The second adapter was trained on the first one's merged weights.
    config = json.loads(
        target.read_volume_file(f"{second}-ckpt", "output/adapter/adapter_config.json") or "{}"
    )
    assert config["base_model_name_or_path"].endswith(f"{first}-ckpt/output/merged"), config

    # An upstream that fails: its follower fails too, naming it.
    broken, after = "chain-broken", "chain-after"
    target.apply(
        job_doc(broken, steps=10, output={"mergeAdapter": True},
                dataset={"uri": f"pvc://{DATA_CLAIM}/data/no-such-file.jsonl"}),
        job_doc(after, steps=10, model={"uri": f"ftj://{broken}"}),
    )  # fmt: skip
    wait_phase(target, broken, "Failed")
    s = wait_phase(target, after, "Failed", timeout=120)
    failed = next(c for c in s["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "UpstreamFailed", outcome(target, after)
    assert f"upstream FineTuneJob {broken} failed" in failed["message"]
    REPORT.append(
        f"chained ftj://: apply both → second Succeeded {took:.1f}s, trained on "
        f"pvc://{first}-ckpt/output/merged; a failed upstream → {failed['reason']}"
    )
    for name in (first, second, broken, after):
        delete_job(target, name)
        target.kubectl("delete", "pvc", f"{name}-ckpt", "-n", NAMESPACE, "--wait=false",
                       check=False)  # fmt: skip


PAIRS_PATH = "data/pairs-tiny.jsonl"
DPO_STEPS = 24
DPO_EVERY = 2


def marker_pairs(n: int, seed: int) -> list[dict[str, Any]]:
    """Preference pairs with a format rule: both answers repeat the prompt's words and end
    with a marker word; the chosen answer's marker is the one the prompt's verb asks for
    (`repeat` → `answer`, `list` → `question`), the rejected answer has the other one. Half
    the pairs want each marker, so a model that merely favours one marker is right half the
    time: it must learn to read the verb."""
    from kubetune_trainer.tiny import WORDS

    markers = {"repeat": ("answer", "question"), "list": ("question", "answer")}
    rng = random.Random(seed)
    words = [w for w in WORDS if w not in ("answer", "question")]
    out = []
    for i in range(n):
        verb = "repeat" if i % 2 == 0 else "list"
        chosen, rejected = markers[verb]
        said = " ".join(rng.choice(words) for _ in range(rng.randint(2, 5)))
        out.append({"prompt": f"{verb} the words {said}", "chosen": f"{said} {chosen}",
                    "rejected": f"{said} {rejected}"})  # fmt: skip
    rng.shuffle(out)
    return out


def response_log_probs(model_dir: Path, pairs: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(chosen, rejected) log-probability of each pair's responses after its prompt under the
    model in `model_dir`, read as the trainer reads a standard pair: the prompt with the
    tokenizer's special tokens, each response's tokens and EOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def log_prob(prompt: list[int], response: str) -> float:
        answer = [*tok(response, add_special_tokens=False).input_ids, tok.eos_token_id]
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        picked = torch.log_softmax(logits, -1).gather(1, torch.tensor(answer)[:, None])
        return float(picked.sum())

    out = []
    for pair in pairs:
        prompt = list(tok(pair["prompt"]).input_ids)
        out.append((log_prob(prompt, pair["chosen"]), log_prob(prompt, pair["rejected"])))
    return out


def test_sft_then_dpo_learns_which_answers_are_preferred(target: Target) -> None:
    """An SFT job and a DPO job on its merged model, applied together: the DPO job waits for
    the SFT one, then learns the rule that separates chosen from rejected answers (which
    marker word ends them, by the prompt's verb: `marker_pairs`). Held-out reward accuracy
    rises to ≥ 0.8, status.progress shows the rewards, and the DPO job's merged model gives
    the chosen answers of new pairs the higher log-probability, where the SFT model it
    started from prefers them about half the time."""
    if not target.volumes_follow_pods:
        pytest.skip(
            f"on {target.name}, volumes are pinned to the node that wrote them: the DPO job "
            "reads the SFT job's checkpoint volume, and its plan may pick another pool's node; "
            "the test also loads both models from their volumes on this machine"
        )
    from kubetune_trainer.tiny import write_jsonl

    write_jsonl(target.volume_folder(DATA_CLAIM) / PAIRS_PATH, marker_pairs(200, seed=11))
    sft, dpo = "prefs-sft", "prefs-dpo"
    started = time.monotonic()
    target.apply(
        job_doc(sft, steps=10, output={"mergeAdapter": True}),
        job_doc(
            dpo,
            steps=DPO_STEPS,
            interval=DPO_EVERY,
            model={"uri": f"ftj://{sft}"},
            dataset={"uri": f"pvc://{DATA_CLAIM}/{PAIRS_PATH}", "numExamples": 200,
                     "validationSplit": 0.2},
            training={"objective": "dpo", "dpo": {"beta": 0.3}, "learningRate": 5e-3,
                      "sequenceLength": 64},
            output={"mergeAdapter": True},
        ),
    )  # fmt: skip
    wait_step(target, sft, 1)
    s = status(target, dpo)
    assert s.get("phase") == "Pending", s
    waiting = next(c for c in s["conditions"] if c["type"] == "UpstreamReady")
    assert (waiting["status"], waiting["reason"]) == ("False", "WaitingForUpstream"), waiting
    assert f"FineTuneJob {sft}" in waiting["message"], waiting
    wait_phase(target, sft, "Succeeded")
    sft_done = time.monotonic()

    # The rewards reach status.progress while the DPO job trains.
    def rewards_shown() -> dict[str, Any] | None:
        progress = status(target, dpo).get("progress") or {}
        return progress if progress.get("evalDpoRewardAccuracy") is not None else None

    shown = wait_for(f"{dpo} to show its held-out reward accuracy", rewards_shown, 300)
    s = wait_phase(target, dpo, "Succeeded")
    took = time.monotonic() - started
    sft_done_to_dpo_done = time.monotonic() - sft_done
    progress = s["progress"]
    for key in ("dpoRewardAccuracy", "dpoRewardMargin", "dpoRewardsChosen",
                "dpoRewardsRejected", "evalDpoRewardMargin"):  # fmt: skip
        assert isinstance(progress.get(key), float | int), (key, progress)
    records = train_log(target, dpo)
    evals = [r for r in records if r.get("event") == "eval"]
    (began,) = [r["time"] for r in records if r.get("event") == "start"]
    (ended,) = [r["time"] for r in records if r.get("event") == "finish"]
    curve = [(int(e["step"]), round(e["eval_dpo_reward_accuracy"], 3)) for e in evals]
    assert [step for step, _ in curve] == list(range(DPO_EVERY, DPO_STEPS + 1, DPO_EVERY)), curve
    first, last = evals[0], evals[-1]
    # What the status showed is what the trainer measured at one of its evaluations.
    assert any(
        round(e["eval_dpo_reward_accuracy"], 4) == shown["evalDpoRewardAccuracy"] for e in evals
    ), (shown, curve)
    # Rewards start at 0 (a tie: accuracy 0); a policy that favours one marker gets half
    # the held-out pairs right; only the rule gets them all.
    assert first["eval_dpo_reward_accuracy"] < 0.8 <= last["eval_dpo_reward_accuracy"], curve
    assert last["eval_dpo_reward_margin"] > max(first["eval_dpo_reward_margin"], 0), evals
    assert last["eval_loss"] < min(first["eval_loss"], math.log(2)), evals
    assert s["upstream"]["modelUri"] == f"pvc://{sft}-ckpt/output/merged", s["upstream"]
    wide = target.kubectl("get", "finetunejob", dpo, "-n", NAMESPACE, "-o", "wide").stdout
    header, row = wide.splitlines()[:2]
    assert header.split()[-2:] == ["EVAL-REWARD-ACC", "AGE"], wide  # progress has a space
    assert float(row.split()[-2]) == progress["evalDpoRewardAccuracy"], wide

    # New pairs, never trained on: the DPO model prefers their chosen answers.
    held_out = marker_pairs(48, seed=12345)
    before = response_log_probs(target.volume_folder(f"{sft}-ckpt") / "output/merged", held_out)
    after = response_log_probs(target.volume_folder(f"{dpo}-ckpt") / "output/merged", held_out)
    prefers_before = sum(c > r for c, r in before) / len(held_out)
    prefers_after = sum(c > r for c, r in after) / len(held_out)
    margin_before = sum(c - r for c, r in before) / len(held_out)
    margin_after = sum(c - r for c, r in after) / len(held_out)
    assert 0.25 <= prefers_before <= 0.75, (prefers_before, before)
    assert prefers_after >= 0.9, (prefers_before, prefers_after)
    assert margin_after > margin_before, (margin_before, margin_after)
    REPORT.append(
        f"SFT → DPO: held-out reward accuracy {first['eval_dpo_reward_accuracy']:.3f} at step "
        f"{int(first['step'])} → {last['eval_dpo_reward_accuracy']:.3f} at step "
        f"{int(last['step'])} (by step {curve}); new pairs whose chosen answer is the likelier: "
        f"{prefers_before:.2f} (SFT model) → {prefers_after:.2f} (DPO model), mean log-prob "
        f"margin {margin_before:.2f} → {margin_after:.2f}; both Succeeded in {took:.1f}s, "
        f"the DPO job {sft_done_to_dpo_done:.1f}s after the SFT one, its trainer "
        f"{ended - began:.1f}s from start to finish"
    )
    for name in (sft, dpo):
        delete_job(target, name)
        target.kubectl("delete", "pvc", f"{name}-ckpt", "-n", NAMESPACE, "--wait=false",
                       check=False)  # fmt: skip


MISSING_IMAGE = "localhost/kubetune-missing:0"
"""An image no node has (hack/kind-e2e.sh allows it as a trainer image)."""


@pytest.mark.kubelet
def test_an_image_that_cannot_be_pulled_is_shown_costs_nothing_and_fails(target: Target) -> None:
    if not target.pulls_images:
        pytest.skip(f"on {target.name}, no kubelet pulls images: the pod runner ignores them")
    name = "nopull"
    target.apply(job_doc(name, trainerImage=MISSING_IMAGE))

    def shown() -> dict[str, Any] | None:
        s = status(target, name)
        cond = next((c for c in s.get("conditions", []) if c["type"] == "Running"), {})
        return s if cond.get("reason") == "ImagePullFailed" else None

    s = wait_for("the pull failure shown", shown, 120)
    assert MISSING_IMAGE in s["message"], s["message"]
    assert float((s.get("cost") or {}).get("accruedUSD") or 0) == 0.0
    s = wait_phase(target, name, "Failed", timeout=240)
    failed = next(c for c in s["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "StartupTimeout", outcome(target, name)
    assert "To fix: check the image name" in failed["message"]
    assert float((s.get("cost") or {}).get("accruedUSD") or 0) == 0.0
    wait_for("trainer pods gone", lambda: not active_pods(target, name), 90)
    REPORT.append(f"unpullable image: {failed['message'][:160]}")
    delete_job(target, name)
    target.kubectl("delete", "pvc", f"{name}-ckpt", "-n", NAMESPACE, "--wait=false")


@pytest.mark.parametrize("retention", ["delete", "retain"])
def test_delete_mid_run_collects_children(target: Target, retention: str) -> None:
    name = f"gone-{retention}"
    target.apply(job_doc(name, steps=2000, checkpoint={"storage": {"retention": retention}}))
    wait_step(target, name, 3)
    delete_job(target, name)
    for kind, child in [
        ("job.batch", f"{name}-a1"),
        ("configmap", f"{name}-a1"),
        ("service", name),
    ]:
        wait_for(f"{kind}/{child} collected", lambda k=kind, c=child: not target.get(k, c), 90)
    wait_for("trainer pods gone", lambda: not active_pods(target, name), 90)
    pvc = f"{name}-ckpt"
    if retention == "delete":
        wait_for("checkpoint volume collected", lambda: not target.get("pvc", pvc), 90)
    else:
        # Collection is done (the batch Job, ConfigMap, Service and pods are gone). The volume
        # is still there, not being deleted, and owned by nothing that would collect it later.
        claim = target.get("pvc", pvc)
        assert claim is not None
        assert not claim["metadata"].get("deletionTimestamp"), claim["metadata"]
        assert not claim["metadata"].get("ownerReferences"), claim["metadata"]
        target.kubectl("delete", "pvc", pvc, "-n", NAMESPACE, "--wait=false")


def test_operator_restarts_lose_nothing(target: Target) -> None:
    """Kill the operator at random points while jobs run, suspend and resume."""
    rng = random.Random(7)
    names = ["chaos-a", "chaos-b"]
    for name in names:
        target.apply(job_doc(name))
    restarts = 0
    max_owners = 0
    max_batch_jobs = 0
    duplicates: list[str] = []
    suspended = resumed = False
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(1.0, 4.0))
        target.kill_operator()
        restarts += 1
        # Invariants while nobody is reconciling: one live batch Job per job, and trainer pods
        # of that one batch Job only. A second pod for the same index of the same batch Job is
        # the Job controller's doing (it creates one again when a create's answer is lost, and
        # deletes the extra once it sees both); it is recorded, with that Job's Events, not
        # counted against the operator.
        for name in names:
            pods = active_pods(target, name)
            owners = {
                tuple(o["name"] for o in p["metadata"].get("ownerReferences") or []) for p in pods
            }
            max_owners = max(max_owners, len(owners))
            if len(pods) > len(owners):
                duplicates.append(
                    "; ".join(pod_summary(p) for p in pods)
                    + f" | Events: {[event_reasons(target, o[0], 'Job') for o in owners if o]}"
                )
            live = [
                j
                for j in target.list("jobs.batch", f"kubetune.io/job={name}")
                if not j["metadata"].get("deletionTimestamp")
                and (j.get("status") or {}).get("active")
            ]
            max_batch_jobs = max(max_batch_jobs, len(live))
        if not suspended and progress_step(target, "chaos-a") >= 15:
            patch_spec(target, "chaos-a", {"suspend": True})
            suspended = True
        elif suspended and not resumed and status(target, "chaos-a").get("phase") == "Suspended":
            patch_spec(target, "chaos-a", {"suspend": False})
            resumed = True
        time.sleep(rng.uniform(0.0, 2.0))
        target.start_operator()
        done = all(status(target, n).get("phase") in ("Succeeded", "Failed") for n in names)
        if done and restarts >= 10:
            break
    wait_for("the operator up", target.operator_running, 30)
    assert resumed, "the suspend/resume during the restarts never happened"
    for name in names:
        s = wait_phase(target, name, "Succeeded", timeout=300)
        runs = runs_of(train_log(target, name))
        check_runs_are_contiguous(runs, STEPS)
        assert all(lost == 0 for lost in steps_lost(runs)), steps_lost(runs)
        # No orphan: the only batch Job left is the last attempt's.
        wait_for(
            f"{name}: only the last attempt's batch Job left",
            lambda n=name, a=s["attempt"]: (
                [
                    j["metadata"]["labels"]["kubetune.io/attempt"]
                    for j in target.list("jobs.batch", f"kubetune.io/job={n}")
                    if not j["metadata"].get("deletionTimestamp")
                ]
                == [str(a)]
            ),
            60,
        )
        assert not active_pods(target, name)
    assert restarts >= 10
    assert max_owners <= 1 and max_batch_jobs <= 1, (max_owners, max_batch_jobs, duplicates)
    REPORT.append(
        f"operator restarts: {restarts} SIGKILLs survived with 2 jobs (one suspended and "
        f"resumed in between); at most {max_batch_jobs} live batch Job and trainer pods of "
        f"{max_owners} batch Job per FineTuneJob at any look; every job Succeeded with 0 steps "
        f"lost; the Job controller made a second pod for an index {len(duplicates)} times"
        + "".join(f"\n  {d}" for d in duplicates)
    )
    for name in names:
        delete_job(target, name)
