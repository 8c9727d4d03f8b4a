"""A cluster in KMock's API emulator, as the handler and job-loop tests seed and read it.

The emulator and a Kube client of it (fixtures); the objects (the example pools with a node
each, the tiny job, pods holding GPUs); the indexes kopf would build from them
(`caches_from`); and what the tests read back.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from lightkube import AsyncClient, KubeConfig
from lightkube.config.models import Cluster, User

from kubetune.control.build.names import child_names
from kubetune.control.capacity import node_info
from kubetune.controller.cache import (
    Caches,
    child_key,
    gpu_usage,
    parse_pool,
    trimmed_batch_job,
    trimmed_pod,
)
from kubetune.controller.kube import Kube
from support.kmock_apiserver import ApiServerEmulator, declare_resources

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "team-a"
UID = "0b5c6a9e-5f0e-4c1e-9a59-3c2f6d1e7a10"
T0 = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)

FTJ = "kubetune.io/v1alpha1/finetunejobs"
POOLS = "kubetune.io/v1alpha1/gpupools"
NODES = "v1/nodes"
PODS = "v1/pods"
JOBS = "batch/v1/jobs"
PVCS = "v1/persistentvolumeclaims"
CONFIGMAPS = "v1/configmaps"
SECRETS = "v1/secrets"
SERVICES = "v1/services"
NETWORKPOLICIES = "networking.k8s.io/v1/networkpolicies"
EVENTS = "v1/events"
STATUS_PATH = f"/apis/kubetune.io/v1alpha1/namespaces/{NAMESPACE}/finetunejobs/tiny-cpu-lora/status"

PLURALS = {
    "FineTuneJob": FTJ,
    "GPUPool": POOLS,
    "Node": NODES,
    "Pod": PODS,
    "Job": JOBS,
    "PersistentVolumeClaim": PVCS,
    "ConfigMap": CONFIGMAPS,
    "Service": SERVICES,
}


def client(server: kmock.RawHandler) -> AsyncClient:
    # lightkube needs a user entry; the emulator accepts any token.
    config = KubeConfig.from_one(cluster=Cluster(server=str(server.url)), user=User(token="t"))
    return AsyncClient(config=config, trust_env=False)


# Fixtures: a test module takes them by assignment (`apiserver = emulated.apiserver`).


@pytest.fixture
async def apiserver() -> AsyncIterator[ApiServerEmulator]:
    async with ApiServerEmulator() as emulator, kmock.Server(emulator):
        declare_resources(emulator)
        yield emulator


@pytest.fixture
async def kube(apiserver: ApiServerEmulator) -> AsyncIterator[Kube]:
    api = client(apiserver)
    yield Kube(api)
    await api.close()


# ---------------------------------------------------------------------- objects


def seed(server: kmock.KubernetesEmulator, *manifests: dict[str, Any]) -> None:
    """Put objects into the emulator as if they had been created earlier."""
    for manifest in manifests:
        meta = manifest["metadata"]
        # kopf patches with a JSON-patch `test` of the resourceVersion it saw.
        meta.setdefault("resourceVersion", "1")
        server.objects[PLURALS[manifest["kind"]], meta.get("namespace"), meta["name"]] = manifest


def stored(server: kmock.KubernetesEmulator, resource: str, namespace: str | None) -> list[str]:
    """Names of the live objects of one resource in one namespace."""
    return sorted(
        name
        for (res, ns, name), obj in server.objects.items()
        if res == kmock.resource(resource) and ns == namespace and not obj.deleted
    )


def example_pools() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((ROOT / "examples" / "gpupools.yaml").read_text()) if d]


def pool_nodes() -> list[dict[str, Any]]:
    """One ready node per example pool, with its labels and GPUs."""
    nodes = []
    for p in example_pools():
        n = node(f"{p['metadata']['name']}-0", p["metadata"]["name"], gpus=p["spec"]["gpusPerNode"])
        n["metadata"]["labels"] = dict(p["spec"]["nodeSelector"])
        nodes.append(n)
    return nodes


DEMO_CLAIM = "kubetune-demo"
"""The claim examples/tiny-cpu-lora.yaml reads its model and data from."""


def claim(name: str, namespace: str = NAMESPACE) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }


def example_cluster() -> list[dict[str, Any]]:
    """The example GPUPools with a free node each, and the claim the tiny job reads."""
    return [*example_pools(), *pool_nodes(), claim(DEMO_CLAIM)]


def pool(name: str) -> dict[str, Any]:
    return next(p for p in example_pools() if p["metadata"]["name"] == name)


def node(
    name: str,
    pool_name: str,
    gpus: int = 8,
    ready: bool = True,
    unschedulable: bool = False,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"unschedulable": True} if unschedulable else {}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubetune.io/pool": pool_name}},
        "spec": spec,
        "status": {
            "allocatable": {"cpu": "96", "memory": "1Ti", "nvidia.com/gpu": str(gpus)},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def pod(
    name: str,
    *,
    node_name: str | None = None,
    gpus: tuple[int, ...] = (),
    phase: str = "Running",
    namespace: str = NAMESPACE,
    pod_labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    containers = [
        {"name": f"c{i}", "image": "trainer", "resources": {"limits": {"nvidia.com/gpu": str(n)}}}
        for i, n in enumerate(gpus)
    ] or [{"name": "c0", "image": "sidecar"}]
    spec: dict[str, Any] = {"containers": containers}
    if node_name:
        spec["nodeName"] = node_name
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": pod_labels or {}},
        "spec": spec,
        "status": {"phase": phase},
    }


def tiny_job() -> dict[str, Any]:
    """examples/tiny-cpu-lora.yaml as the apiserver would hand it to the operator."""
    job: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-cpu-lora.yaml").read_text())
    job["metadata"].update(namespace=NAMESPACE, uid=UID, generation=1, resourceVersion="1")
    return job


def requests(
    server: kmock.RawHandler, action: kmock.action, resource: str | None = None
) -> list[kmock.Request]:
    """The requests the emulator served, of one action (and resource)."""
    wanted = kmock.resource(resource) if resource else None
    return [r for r in server if r.action == action and (wanted is None or r.resource == wanted)]


def invalid(field: str) -> kmock.KubernetesError:
    """The apiserver's 422 for a status that breaks the CRD schema."""
    return kmock.KubernetesError(
        422,
        "Invalid",
        f'FineTuneJob.kubetune.io "tiny-cpu-lora" is invalid: {field}: Invalid value',
        {"causes": [{"reason": "FieldValueInvalid", "field": field}]},
    )


def caches_from(server: kmock.KubernetesEmulator) -> Caches:
    """The indexes kopf would hold for what the emulator stores, made by the same index
    functions the operator registers (controller/handlers.py)."""
    index: dict[str, defaultdict[Any, list[Any]]] = {
        name: defaultdict(list) for name in ("pods", "jobs", "nodes", "gpus", "pools")
    }
    for (resource, _, name), obj in list(server.objects.items()):
        if obj.deleted:
            continue
        body = copy.deepcopy(dict(obj))
        key = child_key(body)
        if resource == kmock.resource(PODS):
            if key is not None:
                index["pods"][key].append(trimmed_pod(body))
            for node_name, gpus in (gpu_usage(body) or {}).items():
                index["gpus"][node_name].append(gpus)
        elif resource == kmock.resource(JOBS) and key is not None:
            index["jobs"][key].append(trimmed_batch_job(body))
        elif resource == kmock.resource(NODES):
            index["nodes"][name].append(node_info(body))
        elif resource == kmock.resource(POOLS):
            index["pools"][name].append(parse_pool(body))
    return Caches(
        pods=dict(index["pods"]),
        batch_jobs=dict(index["jobs"]),
        nodes=dict(index["nodes"]),
        gpu_pods=dict(index["gpus"]),
        pools=dict(index["pools"]),
    )


def capacity_cluster() -> list[dict[str, Any]]:
    """Four h100 nodes (two usable) and one a100 node, with pods in every state."""
    return [
        node("h100-0", "h100"),
        node("h100-1", "h100"),
        node("h100-2", "h100", ready=False),
        node("h100-3", "h100", unschedulable=True),
        node("a100-0", "a100-80gb"),
        # Hold GPUs: running and bound-but-pending pods, all containers, all namespaces.
        pod("train-0", node_name="h100-0", gpus=(2, 2)),
        pod("starting", node_name="h100-0", gpus=(2,), phase="Pending"),
        pod("other-team", node_name="h100-1", gpus=(1,), namespace="team-b"),
        # Hold none: finished, unscheduled, without GPUs, or on nodes outside the pool.
        pod("done", node_name="h100-1", gpus=(8,), phase="Succeeded"),
        pod("crashed", node_name="h100-1", gpus=(8,), phase="Failed"),
        pod("queued", gpus=(8,), phase="Pending"),
        pod("cpu-only", node_name="h100-1"),
        pod("notready-node", node_name="h100-2", gpus=(8,)),
        pod("a100-user", node_name="a100-0", gpus=(8,)),
    ]


def children(server: kmock.KubernetesEmulator) -> dict[str, list[str]]:
    return {
        "pvc": [name for name in stored(server, PVCS, NAMESPACE) if name != DEMO_CLAIM],
        "configmap": stored(server, CONFIGMAPS, NAMESPACE),
        "service": stored(server, SERVICES, NAMESPACE),
        "job": stored(server, JOBS, NAMESPACE),
    }


def first_attempt() -> dict[str, list[str]]:
    """`children` once the tiny job's first attempt launched."""
    names = child_names("tiny-cpu-lora", 1)
    return {
        "pvc": [names.pvc],
        "configmap": [names.config_map],
        "service": [names.service],
        "job": [names.job],
    }


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(x for x in status["conditions"] if x["type"] == type_)
