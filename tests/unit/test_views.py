"""The CLI's tables of jobs and pools (kubetune/cli/views.py), and what `watch` and `logs`
print while they follow a job (kubetune/cli/follow.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
import yaml

from kubetune.cli.follow import ObjectWatcher, Watcher, log_sources, outcome
from kubetune.cli.views import age, describe_job, job_table, pool_table

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)


def job(name: str, namespace: str = "team-a", **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": namespace,
                     "creationTimestamp": "2026-11-24T10:30:00Z"},
        "status": status,
    }  # fmt: skip


def test_jobs_show_plan_progress_eta_and_cost() -> None:
    running = job(
        "llama-8b-support-bot-with-a-long-name",
        phase="Running",
        plan={"pool": "h100-spot", "totalGPUs": 8},
        progress={"step": 40, "totalSteps": 100, "percent": 40, "eta": "1h20m"},
        cost={"accruedUSD": 3.5, "estimatedUSD": 9.1},
    )
    queued = job("waits", phase="Queued", plan={"pool": "l40s", "totalGPUs": 2})
    text = job_table([queued, running, job("new")], now=NOW)
    header, *rows = text.splitlines()
    assert header.split() == ["NAME", "PHASE", "POOL", "GPUS", "PROGRESS", "ETA", "COST", "AGE"]
    assert rows[0].split() == [
        "llama-8b-support-bot-with-a-long-name", "Running", "h100-spot", "8",
        "40%", "(40/100)", "1h20m", "$3.50", "of", "$9.10", "90m",
    ]  # fmt: skip
    assert rows[1].split() == ["new", "Pending", "-", "-", "-", "-", "-", "90m"]
    assert rows[2].split()[:4] == ["waits", "Queued", "l40s", "2"]
    # Every column starts where its header does, however long the name.
    start = header.index("PHASE")
    assert all(row[start - 2 : start] == "  " for row in rows)


def test_all_namespaces_adds_the_namespace_first() -> None:
    text = job_table([job("b", "z"), job("a", "y")], now=NOW, namespaces=True)
    assert [ln.split()[:2] for ln in text.splitlines()] == [
        ["NAMESPACE", "NAME"], ["y", "a"], ["z", "b"],
    ]  # fmt: skip


def test_ages_read_like_kubectls() -> None:
    assert [age(t, NOW) for t in (
        "2026-11-24T11:59:15Z", "2026-11-24T11:48:00Z", "2026-11-24T09:00:00Z",
        "2026-11-20T12:00:00Z", None,
    )] == ["45s", "12m", "3h", "4d", "-"]  # fmt: skip


def pool(name: str, gpu: dict[str, Any], status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {"gpu": gpu, "gpusPerNode": 8, "maxNodes": 4, "pricePerGPUHour": 2.5},
        "status": status or {},
    }


def test_pools_show_capacity_price_and_whether_the_operator_reads_them() -> None:
    valid = {"type": "Valid", "status": "True", "reason": "Accepted"}
    seen = {"updatedAt": "2026-11-24T11:00:00Z", "nodes": 2, "freeGPUs": 9, "conditions": [valid]}
    text = pool_table([
        pool("h200-reserved", {"product": "NVIDIA-H200"}, seen),
        pool("b200", {"product": "NVIDIA-B200"}),
        pool("fresh", {"product": "NVIDIA-L4"}),
    ])  # fmt: skip
    header, *rows = text.splitlines()
    assert "FREE GPUS" in header and "STATE" in header
    b200, fresh, h200 = rows
    assert h200.split() == [
        "h200-reserved",
        "NVIDIA-H200",
        "141",
        "8",
        "2/4",
        "9",
        "2.50",
        "no",
        "all",
        "ok",
    ]
    assert fresh.split()[2] == "24" and fresh.endswith("not seen by the operator")
    fenced = pool("fenced", {"product": "NVIDIA-L4"})
    fenced["spec"]["namespaceSelector"] = {"matchLabels": {"team": "vision"}}
    assert pool_table([fenced]).splitlines()[1].split()[8] == "team=vision"
    assert "unreadable:" in b200 and "bf16TFLOPS" in b200


def test_describe_tells_the_plan_its_alternatives_and_what_happened() -> None:
    plan = {
        "revision": 2, "reason": "OOMReplan", "method": "lora", "pool": "l40s",
        "gpuProduct": "NVIDIA-L40S", "gpuMemoryGiB": 48, "nodes": 1, "gpusPerNode": 2,
        "totalGPUs": 2, "sharding": "full", "precision": "bf16", "optimizer": "adamw",
        "microBatchSize": 1, "gradientAccumulation": 32, "gradientCheckpointing": True,
        "perGPUMemoryGiB": 39.6, "memoryBreakdownGiB": {"weights": 6.75, "activations": 20.1},
        "estimatedDurationSeconds": 10440, "estimatedCostUSD": 4.51,
        "alternatives": [{"pool": "h100", "method": "lora", "totalGPUs": 2, "nodes": 1,
                          "perGPUMemoryGiB": 69.6, "estimatedDurationSeconds": 3240,
                          "estimatedCostUSD": 4.8}],
        "rejected": [{"pool": "l4", "reason": "needs 52 GiB per GPU, has 24"}],
    }  # fmt: skip
    described = job(
        "mistral",
        phase="Running",
        attempt=2,
        message="attempt 2 training",
        plan=plan,
        progress={"step": 40, "totalSteps": 100, "percent": 40, "loss": 1.2345, "eta": "1h20m"},
        cost={"accruedUSD": 3.5, "estimatedUSD": 9.1, "rateUSDPerHour": 1.58},
        checkpoint={"latestStep": 40, "time": "2026-11-24T11:55:00Z"},
        recoveries=[{"reason": "OOM", "time": "2026-11-24T11:00:00Z", "step": 20}],
        conditions=[{"type": "Planned", "status": "True", "reason": "PlanReady",
                     "lastTransitionTime": "2026-11-24T11:00:00Z", "message": "lora on 1×2"}],
    )  # fmt: skip
    described["spec"] = {"model": {"uri": "mistralai/Mistral-7B-v0.3"}, "method": "lora",
                         "resources": {"maxCostUSD": 20}}  # fmt: skip
    events = [
        {"type": "Normal", "reason": "Launched", "message": "Attempt 2 on pool l40s",
         "lastTimestamp": "2026-11-24T11:01:00Z"},
        {"type": "Warning", "reason": "OutOfMemory", "message": "rank 0 ran out of memory",
         "lastTimestamp": "2026-11-24T11:00:00Z"},
    ]  # fmt: skip

    text = describe_job(described, events, now=NOW)

    lines = text.splitlines()
    assert "Phase:       Running, attempt 2: attempt 2 training" in lines
    assert (
        "Plan:        r2 (OOMReplan): lora on 1×2 NVIDIA-L40S (pool l40s), ~2.9h, ~$4.51" in lines
    )
    assert "  memory:    39.6 of 48 GiB per GPU: weights 6.75, activations 20.10" in lines
    assert "  instead:   h100: lora on 2 GPU(s), 69.6 GiB/GPU, ~54m, ~$4.80" in lines
    assert "  not:       l4: needs 52 GiB per GPU, has 24" in lines
    assert "Progress:    40% (40/100 steps), loss 1.234, ETA 1h20m" in lines
    assert "Cost:        $3.50 spent of ~$9.10 at $1.58/h; budget $20.00" in lines
    assert "Checkpoint:  step 40, 5m ago" in lines
    assert "Recovered:   OOM 60m ago, resumed from step 20" in lines
    # Events oldest first, as kubectl describe shows them.
    events_at = lines.index("Events:")
    assert [ln.split()[2] for ln in lines[events_at + 2 :]] == ["OutOfMemory", "Launched"]


def test_describe_of_a_new_job_says_what_it_does_not_have_yet() -> None:
    text = describe_job(job("fresh"), [], now=NOW)
    assert "Phase:       Pending" in text and "Events:      none" in text
    assert "Plan:" not in text and "Cost:" not in text
    assert "DPO rewards:" not in text


def test_describe_of_a_dpo_job_shows_its_rewards_train_and_held_out() -> None:
    progress = {"step": 30, "totalSteps": 60, "percent": 50, "loss": 0.41,
                "dpoRewardAccuracy": 0.875, "dpoRewardMargin": 0.4123,
                "dpoRewardsChosen": 0.2, "dpoRewardsRejected": -0.2123,
                "evalDpoRewardAccuracy": 0.9, "evalDpoRewardMargin": 0.38}  # fmt: skip
    text = describe_job(job("prefs", phase="Running", progress=progress), [], now=NOW)
    assert (
        "DPO rewards: accuracy 0.88 (eval 0.90), margin 0.41 (eval 0.38), chosen 0.20, "
        "rejected -0.21"
    ) in text.splitlines()
    # Before the first evaluation: the training numbers alone.
    early = {"step": 1, "totalSteps": 60, "dpoRewardAccuracy": 0.0, "dpoRewardMargin": 0.0}
    text = describe_job(job("prefs", phase="Running", progress=early), [], now=NOW)
    assert "DPO rewards: accuracy 0.00, margin 0.00" in text.splitlines()
    # An SFT job has none of them.
    sft = {"step": 1, "totalSteps": 60, "loss": 2.0}
    assert "DPO" not in describe_job(job("sft", phase="Running", progress=sft), [], now=NOW)


def test_events_of_the_same_second_keep_the_order_they_were_stored_in() -> None:
    at = "2026-11-24T11:59:40Z"
    events = [
        {"reason": "Training", "lastTimestamp": at, "metadata": {"resourceVersion": "912"}},
        {"reason": "PlanReady", "lastTimestamp": at, "metadata": {"resourceVersion": "97"}},
        {"reason": "Launched", "lastTimestamp": at, "metadata": {"resourceVersion": "900"}},
    ]
    lines = describe_job(job("x"), events, now=NOW).splitlines()
    shown = lines[lines.index("Events:") + 2 :]
    assert [ln.split()[1] for ln in shown] == ["PlanReady", "Launched", "Training"]


# ---------------------------------------------------------------------- logs and watch


def trainer_pod(
    name: str, index: int, gpus: int = 2, created: str = "2026-11-24T10:00:00Z"
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "creationTimestamp": created,
            "annotations": {"batch.kubernetes.io/job-completion-index": str(index)},
        },
        "spec": {
            "containers": [
                {"name": "trainer", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}
            ]
        },
    }


def test_logs_of_several_nodes_come_in_node_order_with_prefixes() -> None:
    pods = [trainer_pod("j-a2-1-x", 1), trainer_pod("j-a2-0-y", 0)]
    sources = log_sources(pods, attempt=2)
    assert [(s.pod, s.prefix) for s in sources] == [
        ("j-a2-0-y", "[a2/node0] "),
        ("j-a2-1-x", "[a2/node1] "),
    ]
    (alone,) = log_sources(pods[:1], attempt=2)
    assert alone.prefix == ""  # one pod: its lines as they are


def test_a_rank_selects_the_pod_that_runs_it_and_its_lines() -> None:
    pods = [trainer_pod("node0", 0), trainer_pod("node1", 1)]  # two ranks per node
    (source,) = log_sources(pods, attempt=1, rank=3)
    assert source.pod == "node1" and source.rank == 3
    assert source.keep("2026-11-24 10:00:01,000 rank3 WARNING kubetune_trainer: slow")
    assert not source.keep("2026-11-24 10:00:01,000 rank2 INFO kubetune_trainer: step 4")
    assert source.keep("[W1124 torchrun] rendezvous done")  # names no rank: kept
    with pytest.raises(ValueError, match="no pod of attempt 1 runs rank 4"):
        log_sources(pods, attempt=1, rank=4)


def running(step: int, revision: int = 1, **extra: Any) -> dict[str, Any]:
    plan = {
        "revision": revision, "method": "lora", "totalGPUs": 2, "gpuProduct": "NVIDIA-L4",
        "pool": "l4", "perGPUMemoryGiB": 9.5, "totalSteps": 20, "microBatchSize": 2,
        "gradientAccumulation": 4, "estimatedDurationSeconds": 600, "estimatedCostUSD": 0.2,
    }  # fmt: skip
    return {
        "metadata": {"name": "j"},
        "status": {
            "phase": "Running", "attempt": revision, "plan": plan,
            "progress": {"step": step, "totalSteps": 20, "loss": 1.25, "eta": "4m"},
            "cost": {"accruedUSD": 0.01}, **extra,
        },
    }  # fmt: skip


def test_watch_prints_each_plan_once_and_progress_when_it_changes() -> None:
    watcher = Watcher()
    assert watcher.update({"metadata": {"name": "j"}}) == ["Pending"]  # not seen yet
    first = watcher.update(running(3))
    assert len(first) == 2 and first[0].startswith("plan r1: lora on 2× NVIDIA-L4 (pool l4)")
    assert "step 3/20" in first[1] and "loss 1.2500" in first[1] and "ETA 4m" in first[1]
    assert watcher.update(running(3)) == []  # nothing new: nothing printed
    costlier = running(3)
    costlier["status"]["cost"] = {"accruedUSD": 0.02}
    assert watcher.update(costlier) == []  # the cost alone is no news
    assert [line.split()[4] for line in watcher.update(running(4))] == ["4/20"]
    replanned = watcher.update(running(4, revision=2))
    assert replanned[0].startswith("plan r2:") and "attempt 2" in replanned[1]
    done = running(20, revision=2, checkpoint={"latestStep": 20})
    done["status"].update(phase="Succeeded", message="trained 20 steps")
    assert outcome(done) == "Succeeded" and outcome(running(5)) is None
    (last,) = watcher.update(done)
    assert last.startswith("Succeeded") and "checkpoint step 20" in last
    assert last.endswith("cost $0.0100  - trained 20 steps")


def test_watch_prints_events_between_the_plan_and_the_progress_once_each() -> None:
    watcher = Watcher()
    event = {"metadata": {"uid": "e1"}, "type": "Normal", "reason": "Launched", "message": "a1"}
    lines = watcher.update(running(1), [event])
    assert lines[0].startswith("plan r1") and lines[1] == "event Normal Launched: a1"
    assert lines[2].startswith("Running")
    assert watcher.update(running(1), [event]) == []
    assert watcher.update(running(1), [{**event, "count": 2}]) == ["event Normal Launched: a1"]


def test_watch_as_objects_prints_each_version_once() -> None:
    watcher = ObjectWatcher("json")
    first = {"metadata": {"name": "j", "resourceVersion": "7"}, "status": {"phase": "Running"}}
    (printed,) = watcher.update(first)
    assert json.loads(printed) == first
    assert watcher.update(first) == []
    newer = {**first, "metadata": {"name": "j", "resourceVersion": "8"}}
    (doc,) = ObjectWatcher("yaml").update(newer)
    assert doc.startswith("---\n") and yaml.safe_load(doc) == newer
