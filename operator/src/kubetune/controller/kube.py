"""All Kubernetes API calls of the operator, in one place (lightkube, async).

Handlers read through `observe_job`/`list_pools`, and write through `create_if_absent`,
`delete_batch_job` and friends. Creates are create-if-absent: a 409 means another
reconcile (or an earlier, interrupted one) already made the object, which is success.
"""

from __future__ import annotations

import asyncio
import math
import urllib.request
from collections.abc import Mapping
from typing import Any

from lightkube import AsyncClient, codecs
from lightkube.core.exceptions import ApiError
from lightkube.generic_resource import create_global_resource, create_namespaced_resource
from lightkube.operators import not_in
from lightkube.resources.batch_v1 import Job
from lightkube.resources.core_v1 import Node, Pod
from lightkube.types import CascadeType
from prometheus_client.parser import text_string_to_metric_families

from kubetune.api.v1alpha1 import GROUP, VERSION, FineTuneJob, GPUPool
from kubetune.control.builders import (
    COMPLETION_INDEX_ANNOTATION,
    GPU_RESOURCE,
    LABEL_ATTEMPT,
    LABEL_JOB,
    labels,
)
from kubetune.control.pods import POD_DONE, PodPhase
from kubetune.control.reconcile import Observed

FineTuneJobResource = create_namespaced_resource(GROUP, VERSION, "FineTuneJob", "finetunejobs")
GPUPoolResource = create_global_resource(GROUP, VERSION, "GPUPool", "gpupools")


def _as_dict(obj: Any) -> dict[str, Any]:
    data = obj.to_dict()
    return dict(data)


TRAINER_PREFIX = "kubetune_trainer_"


def parse_trainer_metrics(text: str) -> dict[str, float]:
    """`kubetune_trainer_*` samples of a Prometheus text exposition, prefix removed."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # NaN means "not measured yet" (e.g. eval loss before the first evaluation);
            # it is not valid JSON and must never reach a status patch.
            if sample.name.startswith(TRAINER_PREFIX) and math.isfinite(sample.value):
                out[sample.name.removeprefix(TRAINER_PREFIX)] = float(sample.value)
    return out


def _fetch_text(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return str(response.read(4 * 1024 * 1024).decode("utf-8", errors="replace"))


class Kube:
    def __init__(
        self, client: AsyncClient, metrics_port: int = 9400, scrape_timeout_s: float = 1.0
    ) -> None:
        self.client = client
        self.metrics_port = metrics_port
        self.scrape_timeout_s = scrape_timeout_s

    # ------------------------------------------------------------------ reads

    async def list_pools(self) -> list[GPUPool]:
        pools = []
        async for obj in self.client.list(GPUPoolResource):
            pools.append(GPUPool.model_validate(_as_dict(obj)))
        return pools

    async def list_pods(self, namespace: str, labels: Mapping[str, str]) -> list[Mapping[str, Any]]:
        pods: list[Mapping[str, Any]] = []
        async for pod in self.client.list(Pod, namespace=namespace, labels=dict(labels)):
            pods.append(_as_dict(pod))
        return pods

    async def list_batch_jobs(
        self, namespace: str, labels: Mapping[str, str]
    ) -> list[dict[str, Any]]:
        jobs: list[dict[str, Any]] = []
        async for obj in self.client.list(Job, namespace=namespace, labels=dict(labels)):
            jobs.append(_as_dict(obj))
        return jobs

    async def observe_job(self, job: FineTuneJob) -> Observed:
        pools = await self.list_pools()
        namespace = str(job.metadata["namespace"])
        # Select with the label values the builders wrote (long names are shortened there).
        selector = {LABEL_JOB: labels(job, 1)[LABEL_JOB]}
        by_attempt: dict[int, dict[str, Any]] = {}
        for batch in await self.list_batch_jobs(namespace, selector):
            meta = batch.get("metadata") or {}
            raw = (meta.get("labels") or {}).get(LABEL_ATTEMPT, "")
            owners = {ref.get("uid") for ref in meta.get("ownerReferences") or []}
            # Only this object's children: a job deleted and created again under the same
            # name must not pick up the old one's (still terminating) batch Jobs.
            if raw.isdigit() and job.metadata.get("uid") in owners:
                by_attempt[int(raw)] = batch
        status = job.status
        attempt = max([status.attempt if status else 0, *by_attempt])
        others = sorted(
            a
            for a, batch in by_attempt.items()
            if a != attempt and not (batch.get("metadata") or {}).get("deletionTimestamp")
        )
        if not attempt:
            return Observed(pools=pools, other_attempts=others)
        pods = await self.list_pods(namespace, {**selector, LABEL_ATTEMPT: str(attempt)})
        metrics = await self.trainer_metrics(pods)
        return Observed(
            pools=pools,
            batch_job=by_attempt.get(attempt),
            pods=pods,
            trainer_metrics=metrics,
            attempt=attempt,
            other_attempts=others,
        )

    async def trainer_metrics(self, pods: list[Mapping[str, Any]]) -> dict[str, float] | None:
        """Scrape the rank-0 trainer's Prometheus endpoint; None when it is not reachable."""
        for pod in pods:
            annotations = (pod.get("metadata") or {}).get("annotations") or {}
            status = pod.get("status") or {}
            rank0 = annotations.get(COMPLETION_INDEX_ANNOTATION) == "0"
            if not rank0 or status.get("phase") != PodPhase.RUNNING:
                continue
            ip = status.get("podIP")
            if not ip:
                return None
            url = f"http://{ip}:{self.metrics_port}/metrics"
            try:
                # A blocking read with socket timeouts, in a worker thread: it always ends,
                # even when a trainer exits halfway through answering.
                text = await asyncio.to_thread(_fetch_text, url, self.scrape_timeout_s)
            except (OSError, ValueError):
                return None
            return parse_trainer_metrics(text)
        return None

    # ------------------------------------------------------------------ writes

    async def create_if_absent(self, manifest: Mapping[str, Any]) -> bool:
        """Create the object; False when it already existed."""
        obj = codecs.from_dict(dict(manifest))
        try:
            await self.client.create(obj)
        except ApiError as exc:
            if exc.status.code == 409:
                return False
            raise
        return True

    async def delete_batch_job(self, namespace: str, name: str) -> None:
        """Delete a batch Job and (in the background) its pods, which get SIGTERM first."""
        try:
            await self.client.delete(
                Job, name=name, namespace=namespace, cascade=CascadeType.BACKGROUND
            )
        except ApiError as exc:
            if exc.status.code != 404:
                raise

    async def delete_finetunejob(self, namespace: str, name: str) -> None:
        try:
            await self.client.delete(FineTuneJobResource, name=name, namespace=namespace)
        except ApiError as exc:
            if exc.status.code != 404:
                raise

    # ------------------------------------------------------------------ pools

    async def pool_capacity(self, pool: GPUPool) -> dict[str, Any]:
        """Nodes, allocatable and free GPUs of a pool, from live Nodes and the pods on them."""
        selector: dict[str, Any] = dict(pool.spec.node_selector)
        nodes: dict[str, int] = {}
        async for node in self.client.list(Node, labels=selector or None):
            data = _as_dict(node)
            if not _node_ready(data) or (data.get("spec") or {}).get("unschedulable"):
                continue
            allocatable = (data.get("status") or {}).get("allocatable") or {}
            nodes[data["metadata"]["name"]] = int(allocatable.get(GPU_RESOURCE, 0) or 0)
        used = dict.fromkeys(nodes, 0)
        if nodes:
            # Pods that finished hold no GPUs; Pending ones bound to a node already do.
            holding: dict[str, Any] = {"status.phase": not_in(sorted(POD_DONE))}
            async for pod in self.client.list(Pod, namespace="*", fields=holding):
                _count_gpu_pod(_as_dict(pod), used)
        free = [max(0, nodes[n] - used[n]) for n in sorted(nodes)]
        return {
            "nodes": len(nodes),
            "allocatableGPUs": sum(nodes.values()),
            "freeGPUs": sum(free),
            "freeGPUsPerNode": free,
        }


def _node_ready(node: Mapping[str, Any]) -> bool:
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def _count_gpu_pod(pod: Mapping[str, Any], used: dict[str, int]) -> None:
    node = (pod.get("spec") or {}).get("nodeName")
    if node not in used or (pod.get("status") or {}).get("phase") in POD_DONE:
        return
    for container in (pod.get("spec") or {}).get("containers") or []:
        limits = (container.get("resources") or {}).get("limits") or {}
        used[node] += int(limits.get(GPU_RESOURCE, 0) or 0)
