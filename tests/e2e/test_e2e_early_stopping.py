"""End to end: a job with spec.training.earlyStopping whose validation loss stops improving
ends Succeeded with reason EarlyStopped, at the step the trainer stopped, and says which
step's weights the output holds.

The plateau needs no fault: a minDelta no change of the loss can beat makes the first
evaluation the best, so with patience 2 and a checkpoint (an evaluation) every 5 steps the
trainer stops at step 15 of 60 and exports step 5's adapter.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from support.e2e_jobs import job_doc, status
from support.e2e_targets import NAMESPACE, REPORT, Target
from support.waiting import wait_for

pytestmark = pytest.mark.e2e

STEPS, INTERVAL = 60, 5


def test_a_job_whose_validation_loss_stops_improving_ends_early_stopped(target: Target) -> None:
    name = "early-stop"
    out = target.kubectl(
        "apply",
        "-n",
        NAMESPACE,
        "-f",
        "-",
        input=json.dumps(
            job_doc(
                name,
                steps=STEPS,
                interval=INTERVAL,
                dataset={"validationSplit": 0.1},
                training={"earlyStopping": {"patience": 2, "minDelta": 10}},
                checkpoint={"keep": 1},
            )
        ),
    )
    assert out.returncode == 0, out.stderr

    def done() -> dict[str, Any] | None:
        s = status(target, name)
        if s.get("phase") == "Failed":
            raise AssertionError(f"{name} failed: {s.get('message')}")
        return s if s.get("phase") == "Succeeded" else None

    s = wait_for(f"{name} Succeeded", done, 300)
    succeeded = next(c for c in s["conditions"] if c["type"] == "Succeeded")
    assert succeeded["reason"] == "EarlyStopped", succeeded
    stopped = s["earlyStopped"]
    assert (stopped["step"], stopped["bestStep"], stopped["metric"]) == (15, 5, "eval_loss")
    assert stopped["patience"] == 2 and stopped["value"] > 0
    assert "stopped early at step 15 of 60" in s["message"], s["message"]
    assert s["progress"]["step"] == 15 and s["progress"]["percent"] == 25
    assert s["checkpoint"]["latestStep"] == 15
    events = target.kubectl(
        "get", "events", "-n", NAMESPACE, "--field-selector",
        f"involvedObject.name={name},involvedObject.kind=FineTuneJob",
        "-o", "jsonpath={.items[*].reason}",
    ).stdout.split()  # fmt: skip
    assert "EarlyStopped" in events and "Completed" not in events, events

    log = target.read_volume_file(f"{name}-ckpt", "train-log.jsonl") or ""
    records = [json.loads(line) for line in log.splitlines() if line.strip()]
    steps = [r["step"] for r in records if r.get("event") == "step"]
    assert max(steps) == 15, max(steps)
    (event,) = [r for r in records if r.get("event") == "early_stopped"]
    assert event["best_step"] == 5 and event["stopped_at_step"] == 15
    outputs = target.list_volume(f"{name}-ckpt", "output")
    assert any(p.startswith("adapter/adapter_model") for p in outputs), outputs
    summary = json.loads(target.read_volume_file(f"{name}-ckpt", "output/trainer_summary.json"))
    assert summary["early_stopping"]["output_step"] == 5
    REPORT.append(
        f"early stopping: stopped at step 15 of {STEPS}, best step 5 "
        f"(eval_loss {stopped['value']:.4f}), output from step 5"
    )
