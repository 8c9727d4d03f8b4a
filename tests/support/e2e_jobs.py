"""What the e2e scenarios share: a FineTuneJob document for the tiny model, reading its
status and the trainer's own log (`train-log.jsonl` on the checkpoint volume), and waiting on
them."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from support.e2e_targets import DATA_CLAIM, DATASET_PATH, MODEL_PATH, NAMESPACE, Target
from support.waiting import wait_for

STEPS = 60
INTERVAL = 10
LOSS_TOLERANCE = 1e-3
"""Final-loss difference allowed between an interrupted and an uninterrupted run. Resume
is exact on CPU (the trainer tier measures 0.0), so this only absorbs float formatting."""


FAULTS = "kubetune.io/test-faults"
STEP_SECONDS = 0.25
"""Least time per training step (the trainer waits out the rest). A tiny model trains a step in
well under that in a real container, and a scenario must catch the run mid-way: looking at
progress, finding the pod and acting on it takes a few round trips to the API server."""


def job_doc(
    name: str,
    *,
    steps: int = STEPS,
    interval: int = INTERVAL,
    annotations: dict[str, str] | None = None,
    **over: Any,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"uri": f"pvc://{DATA_CLAIM}/{MODEL_PATH}", "architecture": "Qwen/Qwen2.5-0.5B"},
        "dataset": {
            "uri": f"pvc://{DATA_CLAIM}/{DATASET_PATH}",
            "format": "alpaca",
            "numExamples": 256,
            "avgTokensPerExample": 64,
        },
        "method": "lora",
        "lora": {"rank": 8, "alpha": 16, "targetModules": ["q_proj", "v_proj"]},
        "training": {
            "maxSteps": steps,
            "sequenceLength": 128,
            "globalBatchSize": 8,
            "microBatchSize": 4,
            "gradientCheckpointing": False,
        },
        "resources": {"gpus": 1},
        "checkpoint": {"intervalSteps": interval, "keep": 2},
    }
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    faults = json.loads((annotations or {}).get(FAULTS, "{}"))
    faults.setdefault("stepSeconds", STEP_SECONDS)
    metadata: dict[str, Any] = {
        "name": name,
        "annotations": {**(annotations or {}), FAULTS: json.dumps(faults)},
    }
    return {
        "apiVersion": "kubetune.io/v1alpha1",
        "kind": "FineTuneJob",
        "metadata": metadata,
        "spec": spec,
    }


def status(target: Target, name: str) -> dict[str, Any]:
    return dict(((target.get("finetunejob", name) or {}).get("status")) or {})


def wait_phase(target: Target, name: str, *phases: str, timeout: float = 300) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        s = status(target, name)
        if s.get("phase") in phases:
            return s
        if s.get("phase") == "Failed" and "Failed" not in phases:
            recoveries = [(r.get("reason"), r.get("attempt"), r.get("message")) for r in
                          s.get("recoveries") or []]  # fmt: skip
            raise AssertionError(f"{name} failed: {s.get('message')}; recoveries {recoveries}")
        return None

    return dict(wait_for(f"{name} in {phases}", probe, timeout))


def train_log(target: Target, name: str) -> list[dict[str, Any]]:
    text = target.read_volume_file(f"{name}-ckpt", "train-log.jsonl") or ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def last_step(target: Target, name: str) -> int:
    steps = [r["step"] for r in train_log(target, name) if r.get("event") == "step"]
    return max(steps, default=0)


def progress_step(target: Target, name: str) -> int:
    """Steps trained so far: the job's status (the operator reads the trainer's metrics every
    poll), or the training log where the target reads volumes cheaply and exactly."""
    step = int((status(target, name).get("progress") or {}).get("step") or 0)
    if target.cheap_volume_reads:
        step = max(step, last_step(target, name))
    return step


def wait_step(target: Target, name: str, step: int, timeout: float = 240) -> int:
    return int(
        wait_for(
            f"{name} to train step {step}",
            lambda: (s := progress_step(target, name)) >= step and s,
            timeout,
        )
    )


def active_pods(target: Target, name: str) -> list[dict[str, Any]]:
    return [
        p
        for p in target.list("pods", f"kubetune.io/job={name}")
        if (p.get("status") or {}).get("phase") in ("Pending", "Running")
    ]


def pod_summary(pod: dict[str, Any]) -> str:
    """One line on a pod: enough to tell who made it, where it runs and what state it is in."""
    meta, status = pod["metadata"], pod.get("status") or {}
    states = [next(iter(c.get("state") or {"?": 0})) for c in status.get("containerStatuses") or []]
    return (
        f"{meta['name']} created {meta.get('creationTimestamp')} phase {status.get('phase')} "
        f"node {(pod.get('spec') or {}).get('nodeName')} deleting {meta.get('deletionTimestamp')} "
        f"containers {states} owner {[o.get('name') for o in meta.get('ownerReferences') or []]}"
    )


def running_pod(target: Target, name: str) -> str:
    pods = wait_for(
        f"a running trainer pod of {name}",
        lambda: [
            p
            for p in active_pods(target, name)
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
        ],
        120,
    )
    return str(pods[0]["metadata"]["name"])


def event_reasons(target: Target, name: str, kind: str = "FineTuneJob") -> list[str]:
    out = target.kubectl(
        "get",
        "events",
        "-n",
        NAMESPACE,
        "--field-selector",
        f"involvedObject.name={name},involvedObject.kind={kind}",
        "-o",
        "jsonpath={.items[*].reason}",
    )
    return out.stdout.split()


def patch_spec(target: Target, name: str, spec: dict[str, Any]) -> None:
    target.kubectl(
        "patch",
        "finetunejob",
        name,
        "-n",
        NAMESPACE,
        "--type=merge",
        "-p",
        json.dumps({"spec": spec}),
    )


def delete_job(target: Target, name: str) -> None:
    """Delete a FineTuneJob and wait until it is gone (no finalizer left behind)."""
    target.kubectl("delete", "finetunejob", name, "-n", NAMESPACE, "--wait=false", check=False)
    try:
        wait_for(f"{name} deleted", lambda: target.get("finetunejob", name) is None, 120, 1.0)
    except AssertionError as exc:
        left = (target.get("finetunejob", name) or {}).get("metadata", {}).get("finalizers")
        raise AssertionError(f"{exc}; finalizers left: {left}") from None


@dataclass
class Run:
    """One start of the trainer, as its log tells it."""

    resumed_from: int
    steps: list[int] = field(default_factory=list)
    end: str | None = None  # finish | preempted | stopped | oom | None (killed)
    losses: dict[int, float] = field(default_factory=dict)

    @property
    def last(self) -> int:
        return max(self.steps, default=self.resumed_from)


def runs_of(records: list[dict[str, Any]]) -> list[Run]:
    runs: list[Run] = []
    for r in records:
        kind = r.get("event")
        if kind == "start":
            match = re.search(r"step-(\d+)", r.get("resumed_from") or "")
            runs.append(Run(resumed_from=int(match.group(1)) if match else 0))
        elif runs and kind == "step":
            runs[-1].steps.append(int(r["step"]))
            runs[-1].losses[int(r["step"])] = float(r["loss"])
        elif runs and kind in ("finish", "preempted", "stopped", "oom"):
            runs[-1].end = kind
    return runs


def steps_lost(runs: list[Run]) -> list[int]:
    """Per restart: steps trained before the interruption that the next run trained again."""
    return [before.last - after.resumed_from for before, after in itertools.pairwise(runs)]


def check_runs_are_contiguous(runs: list[Run], total: int) -> None:
    """Each run trains consecutive steps from where it resumed; the last one ends at total."""
    for run in runs:
        expected = list(range(run.resumed_from + 1, run.resumed_from + 1 + len(run.steps)))
        assert run.steps == expected, f"steps out of order in a run: {run.steps[:5]}…"
    assert runs and runs[-1].end == "finish" and runs[-1].last == total, runs


def final_loss(runs: list[Run], total: int) -> float:
    return runs[-1].losses[total]


def outcome(target: Target, name: str) -> str:
    s = status(target, name)
    cond = next((c for c in s.get("conditions", []) if c["type"] == "Failed"), {})
    return f"{s.get('phase')}/{cond.get('reason')}: {s.get('message')}"
