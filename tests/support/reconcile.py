"""Replaying reconciles without a cluster: a job, what the cluster shows, and one step of the
control loop (`run`), which applies the decision's status through the wire format as the
handler does. tests/unit/test_reconcile.py and test_lifecycle.py build on these."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from kubetune.api.v1alpha1 import FineTuneJob, FineTuneJobStatus, GPUPool
from kubetune.api.vocabulary import StepKind
from kubetune.control.reconcile import ControllerSettings, Decision, Observed, reconcile
from kubetune.planning.catalog import default_pools
from kubetune.sources import load_arch

T0 = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)
SETTINGS = ControllerSettings(poll_seconds=10, queue_retry_seconds=15)


class Store(dict[Any, list[Any]]):
    """A kopf index as the operator's caches read it (controller/cache.Caches): key → the
    values of every object under it."""


def make_job(**spec_over: Any) -> FineTuneJob:
    spec: dict[str, Any] = {
        # A model on a claim, sized by its name: launched without a stage-in step (a hub
        # model is fetched by one first; tests/unit/test_stage_in.py).
        "model": {"uri": "pvc://models/qwen", "architecture": "Qwen/Qwen2.5-7B"},
        "dataset": {"uri": "pvc://data/train.jsonl", "numExamples": 20000},
        "method": "lora",
        "training": {"sequenceLength": 2048, "globalBatchSize": 32},
    }
    for key, value in spec_over.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return FineTuneJob.model_validate(
        {
            "metadata": {"name": "demo", "namespace": "team-a", "uid": "uid-1", "generation": 1},
            "spec": spec,
        }
    )


def run(
    job: FineTuneJob,
    observed: Observed | None = None,
    now: datetime = T0,
    pools: list[GPUPool] | None = None,
    settings: ControllerSettings = SETTINGS,
) -> tuple[FineTuneJob, Decision]:
    obs = observed or Observed(pools=pools if pools is not None else default_pools())
    d = reconcile(job, obs, settings, now=now, load_arch=load_arch)
    status = FineTuneJobStatus.model_validate(d.status.to_wire())
    return job.model_copy(update={"status": status}), d


def batch_job(*conds: str, active: int = 0, ready: int = 0) -> dict[str, Any]:
    return {
        "metadata": {"name": "demo-a1"},
        "status": {
            "active": active,
            "ready": ready,
            "conditions": [{"type": t, "status": "True"} for t in conds],
        },
    }


def pod(
    name: str,
    exit_code: int | None = None,
    disrupted: bool = False,
    msg: str = "",
    reason: str | None = None,
) -> dict[str, Any]:
    """A trainer pod; with `exit_code`, Failed with that code, the termination message `msg`
    and the runtime's `reason` (`Error`, `OOMKilled`) when given."""
    status: dict[str, Any] = {"phase": "Failed" if exit_code else "Running", "conditions": []}
    if disrupted:
        status["conditions"].append({"type": "DisruptionTarget", "status": "True"})
    if exit_code is not None:
        terminated: dict[str, Any] = {"exitCode": exit_code, "message": msg}
        if reason is not None:
            terminated["reason"] = reason
        status["containerStatuses"] = [{"name": "trainer", "state": {"terminated": terminated}}]
    return {"metadata": {"name": name}, "status": status}


def observed(job_obj: dict[str, Any] | None, pods: list[dict[str, Any]] | None = None) -> Observed:
    return Observed(pools=default_pools(), batch_job=job_obj, pods=pods or [])


def busy(pools: list[GPUPool], free: int) -> list[GPUPool]:
    out = []
    for p in pools:
        status = {
            "nodes": p.spec.max_nodes,
            "allocatableGPUs": p.spec.max_nodes * p.spec.gpus_per_node,
            "freeGPUs": free * p.spec.max_nodes,
            "freeGPUsPerNode": [free] * p.spec.max_nodes,
            "updatedAt": "2026-11-22T12:00:00Z",
        }
        out.append(GPUPool.model_validate({**p.model_dump(by_alias=True), "status": status}))
    return out


def unschedulable(name: str, since: datetime) -> dict[str, Any]:
    stamp = since.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "metadata": {"name": name},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "lastTransitionTime": stamp,
                }
            ],
        },
    }


def step_job(kind: StepKind, *conditions: str) -> dict[str, Any]:
    """The batch Job of the demo job's CPU step (`demo-stagein`, `demo-stageout`), with
    these conditions (`Complete`, `Failed`) true."""
    return {
        "metadata": {"name": f"demo-{kind.value.replace('-', '')}"},
        "status": {"conditions": [{"type": t, "status": "True"} for t in conditions]},
    }


def step_pod(kind: StepKind, code: int | None, message: str = "") -> dict[str, Any]:
    """The CPU step's pod: running (`code` None), or ended with `code` and the termination
    message."""
    state: dict[str, Any] = {"running": {}}
    if code is not None:
        state = {"terminated": {"exitCode": code, "message": message, "finishedAt": "t"}}
    return {
        "metadata": {"name": f"demo-{kind.value.replace('-', '')}-x1"},
        "status": {
            "phase": "Running" if code is None else ("Succeeded" if code == 0 else "Failed"),
            "containerStatuses": [{"name": kind.value, "state": state}],
        },
    }
