"""Helpers for tests against the local control plane: kubectl wrappers, FineTuneJobs."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from kubetune_dev.cluster import LocalCluster, process_alive
from support.apiserver import RESOURCES, Api
from support.waiting import wait_for

OPERATOR_UP = "Initial authentication has finished."
"""What kopf logs once its startup handlers ran and it logged in; its watches start next."""

FAST_OPERATOR = {
    "KUBETUNE_POLL_SECONDS": "1",
    "KUBETUNE_QUEUE_RETRY_SECONDS": "2",
    "KUBETUNE_PROGRESS_WRITE_SECONDS": "2",
    "KUBETUNE_TRAINER_IMAGE": "kubetune/trainer:test",
    "KUBETUNE_STAGE_IN_HUB": "false",
}
"""The operator settings of the integration tier: it polls fast so tests are quick. Its jobs
name hub models (sized from the built-in table) that kwok's pods never download: they are
planned and launched directly, as the trainer would fetch them; the stage-in step of hub
sources is covered by the unit, trainer and e2e tiers."""


def start_operator(
    local: LocalCluster,
    settings: Mapping[str, str] = FAST_OPERATOR,
    kubeconfig: Path | None = None,
    timeout: float = 60,
) -> int:
    """Start the operator as its own process (component `operator`) and wait until it has
    logged in to the API server; its pid."""
    log = local.logs / "operator.log"
    start = log.stat().st_size if log.exists() else 0
    pid = local.start_operator(settings, kubeconfig=kubeconfig)

    def logged_in() -> bool:
        assert process_alive(pid), log.read_text(errors="replace")[-3000:]
        return OPERATOR_UP in log.read_bytes()[start:].decode(errors="replace")

    wait_for("the operator to log in to the API server", logged_in, timeout=timeout, interval=0.1)
    return pid


class Cluster:
    """Test-facing helpers around a running LocalCluster."""

    def __init__(self, local: LocalCluster) -> None:
        self.local = local

    @functools.cached_property
    def api(self) -> Api:
        """Reads of the kinds in RESOURCES, without a kubectl process each."""
        return Api(self.local)

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self.local.kubectl(*args, input=input, check=check)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        if kind in RESOURCES:
            return self.api.get(kind, name, namespace)
        args = ["get", kind, name, "-o", "json"]
        if namespace:
            args += ["-n", namespace]
        out = self.kubectl(*args, check=False)
        if out.returncode != 0:
            if "NotFound" in out.stderr:
                return None
            raise AssertionError(out.stderr)
        return dict(json.loads(out.stdout))

    def list(
        self, kind: str, namespace: str | None = None, selector: str | None = None
    ) -> list[dict[str, Any]]:
        if kind in RESOURCES:
            return self.api.list(kind, namespace, selector)
        args = ["get", kind, "-o", "json"]
        args += ["-n", namespace] if namespace else ["-A"]
        if selector:
            args += ["-l", selector]
        return list(json.loads(self.kubectl(*args).stdout)["items"])

    def apply(
        self, *docs: dict[str, Any], namespace: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        text = "---\n".join(yaml.safe_dump(d) for d in docs)
        args = ["apply", "-f", "-"]
        if namespace:
            args += ["-n", namespace]
        return self.kubectl(*args, input=text, check=False)


def job_doc(name: str, **spec_over: Any) -> dict[str, Any]:
    """A small LoRA FineTuneJob for the simulated pools; `spec_over` merges into its spec."""
    spec: dict[str, Any] = {
        "model": {"uri": "Qwen/Qwen2.5-0.5B"},
        "dataset": {
            "uri": "/data/train.jsonl",
            "numExamples": 2000,
            "avgTokensPerExample": 200,
        },
        "method": "lora",
        "training": {"maxSteps": 20, "sequenceLength": 512, "globalBatchSize": 8},
    }
    for key, value in spec_over.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return {
        "apiVersion": "kubetune.io/v1alpha1",
        "kind": "FineTuneJob",
        "metadata": {"name": name},
        "spec": spec,
    }


def private_pool(name: str, nodes: int) -> dict[str, Any]:
    """A GPUPool a test keeps to itself: A100 nodes of 8 GPUs selected by `kubetune.io/pool:
    NAME`, priced so that no other test's job is planned onto it (pair it with
    `kubetune_dev.cluster.simulated_nodes` for its kwok nodes)."""
    return {
        "apiVersion": "kubetune.io/v1alpha1",
        "kind": "GPUPool",
        "metadata": {"name": name},
        "spec": {
            "gpu": {"product": "NVIDIA-A100-SXM4-80GB", "memoryGiB": 80, "bf16TFLOPS": 312},
            "gpusPerNode": 8,
            "maxNodes": nodes,
            "pricePerGPUHour": 99.0,
            "nodeSelector": {"kubetune.io/pool": name},
        },
    }


def wait_phase(
    cluster: Cluster, name: str, ns: str, *wanted: str, timeout: float = 60
) -> dict[str, Any]:
    """The FineTuneJob once its status.phase is one of `wanted`."""

    def probe() -> dict[str, Any] | None:
        obj = cluster.get("finetunejob", name, ns)
        if obj and (obj.get("status") or {}).get("phase") in wanted:
            return obj
        return None

    return dict(wait_for(f"{ns}/{name} in {wanted}", probe, timeout=timeout))


@contextlib.contextmanager
def operators_paused(local: LocalCluster) -> Iterator[None]:
    """Pause the session's operator (if a test started it) so that only the test's act.

    It watches every namespace; SIGSTOP freezes it (watches included) until SIGCONT.
    """
    pid = local.state.pids.get("operator")
    paused = pid is not None and process_alive(pid)
    if paused:
        os.kill(pid, signal.SIGSTOP)  # type: ignore[arg-type]
    try:
        yield
    finally:
        if paused:
            os.kill(pid, signal.SIGCONT)  # type: ignore[arg-type]
