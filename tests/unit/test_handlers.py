"""The handlers and the Kubernetes I/O layer against KMock's API emulator.

Everything goes through real HTTP: lightkube's AsyncClient (and, in the last tests, kopf
itself) talks to an in-memory Kubernetes emulator on a loopback port. No controllers run
there, so nothing schedules pods or updates Job status: the tests seed what a cluster
would show and check what the operator reads and writes.

`ApiServerEmulator` (tests/support/kmock_apiserver.py) closes two gaps between KMock 0.8's
`KubernetesEmulator` and a real kube-apiserver that kubetune depends on; the tests in "The
stock emulator" show both.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta, tzinfo
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx2
import kmock
import kopf
import pytest
import yaml
from kopf.testing import KopfRunner
from lightkube import AsyncClient, KubeConfig, codecs
from lightkube.config.models import Cluster, User
from lightkube.core.exceptions import ApiError, ConfigError
from lightkube.resources.core_v1 import Node

from kubetune.api.tenancy import Tenant
from kubetune.api.v1alpha1 import FineTuneJob, GPUPool, StageInStatus
from kubetune.api.vocabulary import ConditionType, EventType, Reason
from kubetune.control.build.names import child_names, labels, owner_reference
from kubetune.control.build.settings import BuildSettings
from kubetune.control.capacity import node_info
from kubetune.control.queue import Ticket
from kubetune.control.reconcile import ControllerSettings
from kubetune.controller import handlers
from kubetune.controller import kube as kube_module
from kubetune.controller import runtime as runtime_module
from kubetune.controller.cache import (
    Caches,
    child_key,
    gpu_usage,
    parse_pool,
    trimmed_batch_job,
    trimmed_pod,
)
from kubetune.controller.kube import Fenced, FineTuneJobResource, Kube, StatusRejected
from kubetune.controller.runtime import SMALL_MOVE_SLOWDOWN, Runtime, _JobState
from kubetune.sources import load_arch
from support.kmock_apiserver import ApiServerEmulator, declare_resources
from support.reconcile import make_job

pytestmark = [
    pytest.mark.unit,
    # KMock's bundled resource list is read with a deprecated importlib call.
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),
]

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


# ---------------------------------------------------------------------- the emulator


@pytest.fixture
async def apiserver() -> AsyncIterator[ApiServerEmulator]:
    async with ApiServerEmulator() as emulator, kmock.Server(emulator):
        declare_resources(emulator)
        yield emulator


@pytest.fixture
async def stock_apiserver() -> AsyncIterator[kmock.KubernetesEmulator]:
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator):
        declare_resources(emulator)
        yield emulator


def _client(server: kmock.RawHandler) -> AsyncClient:
    # lightkube needs a user entry; the emulator accepts any token.
    config = KubeConfig.from_one(cluster=Cluster(server=str(server.url)), user=User(token="t"))
    return AsyncClient(config=config, trust_env=False)


@pytest.fixture
async def kube(apiserver: ApiServerEmulator) -> AsyncIterator[Kube]:
    client = _client(apiserver)
    yield Kube(client)
    await client.close()


@pytest.fixture
async def stock_kube(stock_apiserver: kmock.KubernetesEmulator) -> AsyncIterator[Kube]:
    client = _client(stock_apiserver)
    yield Kube(client)
    await client.close()


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


# ---------------------------------------------------------------------- create / delete


async def test_create_if_absent_creates_then_treats_conflict_as_done(
    apiserver: ApiServerEmulator, kube: Kube
) -> None:
    manifest = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "demo-a1", "namespace": NAMESPACE},
        "data": {"config.json": "{}"},
    }
    assert await kube.create_if_absent(manifest) is True
    changed = copy.deepcopy(manifest)
    changed["data"] = {"config.json": '{"changed": true}'}

    assert await kube.create_if_absent(changed) is False

    assert stored(apiserver, CONFIGMAPS, NAMESPACE) == ["demo-a1"]
    # The first object stays: create-if-absent never overwrites.
    assert apiserver.objects[CONFIGMAPS, NAMESPACE, "demo-a1"]["data"] == manifest["data"]
    assert len(requests(apiserver, kmock.action.CREATE)) == 2


async def test_create_if_absent_raises_other_api_errors(
    apiserver: ApiServerEmulator, kube: Kube
) -> None:
    apiserver[kmock.action.CREATE] << kmock.KubernetesError(403, "Forbidden", "no RBAC")
    manifest = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "demo", "namespace": NAMESPACE},
    }

    with pytest.raises(ApiError) as err:
        await kube.create_if_absent(manifest)

    assert err.value.status.code == 403


async def test_delete_batch_job_tolerates_an_absent_job(
    apiserver: ApiServerEmulator, kube: Kube
) -> None:
    await kube.delete_batch_job(NAMESPACE, "demo-a1")
    await kube.delete_finetunejob(NAMESPACE, "demo")

    deletes = requests(apiserver, kmock.action.DELETE)
    assert [(r.resource, r.name) for r in deletes] == [
        (kmock.resource(JOBS), "demo-a1"),
        (kmock.resource(FTJ), "demo"),
    ]
    assert [getattr(e, "status", None) for e in apiserver.errors] == [404, 404]


async def test_delete_batch_job_deletes_in_the_background(
    apiserver: ApiServerEmulator, kube: Kube
) -> None:
    seed(
        apiserver,
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "demo-a1", "namespace": NAMESPACE},
        },
    )
    await kube.delete_batch_job(NAMESPACE, "demo-a1")

    assert stored(apiserver, JOBS, NAMESPACE) == []
    (delete,) = requests(apiserver, kmock.action.DELETE)
    # Background propagation: the Job goes at once, its pods get SIGTERM afterwards.
    assert delete.params == {"propagationPolicy": "Background"}


# ---------------------------------------------------------------------- status writes


async def test_patch_status_merges_into_the_status_subresource(
    apiserver: ApiServerEmulator, kube: Kube
) -> None:
    seed(apiserver, tiny_job())

    rv = await kube.patch_status(NAMESPACE, "tiny-cpu-lora", {"phase": "Planning"})

    assert rv is not None
    (patch,) = [r for r in apiserver if r.method == "PATCH"]
    assert patch.subresource == "status"
    assert patch.headers["Content-Type"] == "application/merge-patch+json"
    assert patch.data == {"status": {"phase": "Planning"}}


async def test_patch_status_retries_throttling_and_server_errors(
    apiserver: ApiServerEmulator, kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(apiserver, tiny_job())
    monkeypatch.setattr(kube_module, "RETRY_DELAYS", (0.0, 0.0, 0.0))
    apiserver[kmock.method.PATCH][:2] << kmock.KubernetesError(503, "ServiceUnavailable", "busy")

    rv = await kube.patch_status(NAMESPACE, "tiny-cpu-lora", {"phase": "Planning"})

    assert rv is not None
    assert len([r for r in apiserver if r.method == "PATCH"]) == 3


async def test_patch_status_gives_up_after_its_retries(
    apiserver: ApiServerEmulator, kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(apiserver, tiny_job())
    monkeypatch.setattr(kube_module, "RETRY_DELAYS", (0.0, 0.0))
    apiserver[kmock.method.PATCH] << kmock.KubernetesError(500, "InternalError", "down")

    with pytest.raises(ApiError) as err:
        await kube.patch_status(NAMESPACE, "tiny-cpu-lora", {"phase": "Planning"})

    assert err.value.status.code == 500
    assert len([r for r in apiserver if r.method == "PATCH"]) == 3


async def test_patch_status_reports_a_rejection_with_its_fields(
    apiserver: ApiServerEmulator, kube: Kube
) -> None:
    seed(apiserver, tiny_job())
    apiserver[kmock.method.PATCH] << invalid("status.progress.percent")

    with pytest.raises(StatusRejected) as err:
        await kube.patch_status(NAMESPACE, "tiny-cpu-lora", {"progress": {"percent": 101}})

    assert err.value.fields == ["status.progress.percent"]
    assert len([r for r in apiserver if r.method == "PATCH"]) == 1  # not retried


def invalid(field: str) -> kmock.KubernetesError:
    """The apiserver's 422 for a status that breaks the CRD schema."""
    return kmock.KubernetesError(
        422,
        "Invalid",
        f'FineTuneJob.kubetune.io "tiny-cpu-lora" is invalid: {field}: Invalid value',
        {"causes": [{"reason": "FieldValueInvalid", "field": field}]},
    )


async def test_a_fenced_replica_writes_nothing(apiserver: ApiServerEmulator, kube: Kube) -> None:
    fenced = Kube(kube.client, may_write=lambda: False)

    with pytest.raises(Fenced):
        await fenced.patch_status(NAMESPACE, "tiny-cpu-lora", {"phase": "Planning"})
    with pytest.raises(Fenced):
        await fenced.create_if_absent({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {}})
    with pytest.raises(Fenced):
        await fenced.delete_batch_job(NAMESPACE, "x")

    assert list(apiserver) == []


# ---------------------------------------------------------------------- the caches


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


def batch_job_of(job: FineTuneJob, attempt: int, **extra: Any) -> dict[str, Any]:
    """A batch Job as the builders make it for `attempt`: labels and owner reference."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": child_names(job.metadata["name"], attempt).job,
            "namespace": NAMESPACE,
            "labels": labels(job, attempt),
            "ownerReferences": [owner_reference(job)],
        },
        **extra,
    }


def test_observe_before_launch_sees_only_the_pools(apiserver: ApiServerEmulator) -> None:
    seed(apiserver, *example_pools())
    job = FineTuneJob.model_validate(tiny_job())
    caches = caches_from(apiserver)

    observed = caches.observe(job, caches.valid_pools())

    assert [p.name for p in observed.pools] == sorted(
        p["metadata"]["name"] for p in example_pools()
    )
    assert all(isinstance(p, GPUPool) for p in observed.pools)
    assert observed.batch_job is None
    assert observed.pods == []
    assert observed.attempt == 0 and list(observed.other_attempts) == []


def test_observe_sees_the_batch_job_and_pods_of_the_current_attempt(
    apiserver: ApiServerEmulator,
) -> None:
    body = tiny_job()
    body["status"] = {"phase": "Running", "attempt": 2}
    job = FineTuneJob.model_validate(body)
    name = body["metadata"]["name"]
    a1, a2 = child_names(name, 1).job, child_names(name, 2).job
    seed(
        apiserver,
        pool("l4"),
        batch_job_of(job, 1),
        batch_job_of(job, 2, status={"active": 1}),
        pod(f"{a1}-0-old", pod_labels=labels(job, 1), phase="Failed"),
        pod(f"{a2}-0-abcde", pod_labels=labels(job, 2)),
        pod(f"{a2}-1-fghij", pod_labels=labels(job, 2)),
        # Same labels, other namespace: not this job's pod.
        pod(f"{a2}-0-zzzzz", pod_labels=labels(job, 2), namespace="team-b"),
        pod("unrelated", pod_labels={"app": "web"}),
    )
    caches = caches_from(apiserver)

    observed = caches.observe(job, caches.valid_pools())

    assert [p.name for p in observed.pools] == ["l4"]
    assert observed.batch_job is not None
    assert observed.batch_job["metadata"]["name"] == a2
    assert observed.batch_job["status"] == {"active": 1}
    assert observed.attempt == 2 and list(observed.other_attempts) == [1]
    assert [p["metadata"]["name"] for p in observed.pods] == [f"{a2}-0-abcde", f"{a2}-1-fghij"]


def test_observe_names_the_nodes_of_its_pods_that_are_not_ready(
    apiserver: ApiServerEmulator,
) -> None:
    body = tiny_job()
    body["status"] = {"phase": "Running", "attempt": 1}
    job = FineTuneJob.model_validate(body)
    a1 = child_names(body["metadata"]["name"], 1).job
    gone = node("gpu-2", "l4", ready=False)
    gone["status"]["conditions"][0]["lastTransitionTime"] = "2026-11-22T12:03:00Z"
    seed(
        apiserver,
        node("gpu-1", "l4"),
        gone,
        node("gpu-3", "l4", ready=False),  # not ready, but none of this job's pods is there
        batch_job_of(job, 1, status={"active": 2}),
        pod(f"{a1}-0-abcde", pod_labels=labels(job, 1), node_name="gpu-1"),
        pod(f"{a1}-1-fghij", pod_labels=labels(job, 1), node_name="gpu-2"),
    )

    observed = caches_from(apiserver).observe(job, [])

    assert observed.lost_nodes == {"gpu-2": "2026-11-22T12:03:00Z"}


def test_observe_finds_the_pods_of_a_job_with_a_long_name(apiserver: ApiServerEmulator) -> None:
    body = tiny_job()
    body["metadata"]["name"] = "nightly-" * 8 + "qwen2-5-0-5b"  # 76 characters, a valid name
    body["status"] = {"phase": "Running", "attempt": 1}
    job = FineTuneJob.model_validate(body)
    names = child_names(body["metadata"]["name"], 1)
    seed(apiserver, batch_job_of(job, 1), pod(f"{names.job}-0-abcde", pod_labels=labels(job, 1)))

    observed = caches_from(apiserver).observe(job, [])

    assert observed.batch_job is not None
    assert [p["metadata"]["name"] for p in observed.pods] == [f"{names.job}-0-abcde"]


def test_observe_finds_a_launch_the_status_never_recorded(apiserver: ApiServerEmulator) -> None:
    body = tiny_job()
    body["status"] = {"phase": "Running", "attempt": 1}
    job = FineTuneJob.model_validate(body)
    other = FineTuneJob.model_validate({**tiny_job(), "metadata": {**body["metadata"], "uid": "x"}})
    seed(
        apiserver,
        batch_job_of(job, 1),
        batch_job_of(job, 2, status={"active": 1}),
        # A predecessor of the same name (deleted, its children still terminating).
        {**batch_job_of(other, 3), "metadata": {**batch_job_of(other, 3)["metadata"], "name": "x"}},
        pod(f"{child_names(job.metadata['name'], 2).job}-0-abcde", pod_labels=labels(job, 2)),
    )

    observed = caches_from(apiserver).observe(job, [])

    assert observed.attempt == 2
    assert observed.batch_job is not None and observed.batch_job["status"] == {"active": 1}
    assert list(observed.other_attempts) == [1]
    assert len(observed.pods) == 1


def test_observe_finds_no_batch_job_when_it_is_gone(apiserver: ApiServerEmulator) -> None:
    body = tiny_job()
    body["status"] = {"phase": "Running", "attempt": 1}

    observed = caches_from(apiserver).observe(FineTuneJob.model_validate(body), [])

    assert observed.batch_job is None
    assert observed.pods == []


def test_a_finished_pod_leaves_the_gpu_index() -> None:
    # kopf keeps an object's earlier values when its index function returns None; {} clears.
    running = pod("p", node_name="h100-0", gpus=(8,))
    done = pod("p", node_name="h100-0", gpus=(8,), phase="Succeeded")

    assert asyncio.run(handlers.gpu_pods(body=kopf.Body(running))) == {"h100-0": 8}
    assert asyncio.run(handlers.gpu_pods(body=kopf.Body(done))) == {}
    assert asyncio.run(handlers.ftj_pods(body=kopf.Body(pod("unlabelled")))) == {}
    assert asyncio.run(handlers.ftj_batch_jobs(body=kopf.Body(pod("unlabelled")))) == {}


def test_the_wake_ups_run_on_the_event_loop_as_kopf_calls_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kopf runs a plain function in a worker thread; the wake-ups set asyncio Events and
    debounce their pass with the loop's timers, which only the loop's thread may touch. Each
    is called here the way kopf calls a handler, and reports where it ran."""
    from kopf._core.actions.invocation import invoke

    where: list[tuple[str, bool]] = []

    def noted(what: str) -> Callable[..., None]:
        def note(*_: Any) -> None:
            try:
                asyncio.get_running_loop()
                where.append((what, True))
            except RuntimeError:
                where.append((what, False))

        return note

    job = tiny_job()
    key = (job["metadata"]["namespace"], job["metadata"]["name"])
    state = SimpleNamespace(generation=0, wake=SimpleNamespace(set=noted("job wake")))
    runtime = SimpleNamespace(
        wake=noted("wake"),
        capacity_changed=noted("capacity_changed"),
        pool_generations={},
        jobs={key: state},
        caches=object(),
    )
    monkeypatch.setattr(handlers._State, "runtime", runtime)
    # The job's loop runs already: its new spec wakes it.
    monkeypatch.setattr(handlers._State, "loops", SimpleNamespace(observe=lambda *_, **__: False))
    monkeypatch.setattr(handlers._State, "gpu_pods", {})
    monkeypatch.setattr(handlers._State, "nodes", {})
    bound = pod("p", node_name="h100-0", gpus=(8,))
    bound["metadata"]["labels"] = labels(FineTuneJob.model_validate(job))
    node = {"metadata": {"name": "h100-0", "labels": {}}, "status": {"allocatable": {}}}
    pool = {"metadata": {"name": "h100", "generation": 1}, "spec": {}}

    async def deliver() -> None:
        for fn, body in (
            (handlers.child_changed, bound),
            (handlers.pod_changed, bound),
            (handlers.node_changed, node),
            (handlers.pool_changed, pool),
            (handlers.finetunejob_changed, job),
        ):
            await invoke(fn, kwargs={"body": kopf.Body(body), "type": "ADDED"})

    asyncio.run(deliver())
    assert where == [
        ("wake", True),
        ("capacity_changed", True),
        ("capacity_changed", True),
        ("capacity_changed", True),
        ("job wake", True),
    ]


def test_observe_reads_the_checkpoint_claim_from_its_index() -> None:
    """The claim index (kopf's, fed by `handlers.ftj_claims`) gives the reconcile the job's
    checkpoint volume: its access modes bound every later plan."""
    job = FineTuneJob.model_validate(tiny_job())
    name = child_names(job.metadata["name"], 1).pvc
    claim = {
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels(job)},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "1Gi"}},
            "volumeMode": "Filesystem",
        },
        "status": {"phase": "Bound", "capacity": {"storage": "1Gi"}},
    }
    indexed = asyncio.run(handlers.ftj_claims(body=kopf.Body(claim)))
    assert list(indexed) == [(NAMESPACE, name)]
    caches = Caches({}, {}, {}, {}, {}, claims={k: [v] for k, v in indexed.items()})

    observed = caches.observe(job, [])
    seen, seen_class = observed.checkpoint_claim, observed.checkpoint_class_expands

    assert seen is not None
    assert seen["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert seen["spec"]["resources"] == {"requests": {"storage": "1Gi"}}
    assert "volumeMode" not in seen["spec"]
    assert seen_class is None  # StorageClasses not indexed: not known
    assert Caches({}, {}, {}, {}, {}).observe(job, []).checkpoint_claim is None
    assert Caches({}, {}, {}, {}, {}, claims={}).observe(job, []).checkpoint_claim is None
    # Whether the claim's StorageClass allows expansion, from the StorageClass index.
    claim["spec"]["storageClassName"] = "fast"
    claims = {k: [v] for k, v in asyncio.run(handlers.ftj_claims(body=kopf.Body(claim))).items()}
    for allow, expected in ((True, True), (False, False), (None, False)):
        storage_class = {"metadata": {"name": "fast"}, "provisioner": "example.com/csi"}
        if allow is not None:
            storage_class["allowVolumeExpansion"] = allow
        classes = {
            k: [v]
            for k, v in asyncio.run(handlers.storage_classes(body=kopf.Body(storage_class))).items()
        }
        caches = Caches({}, {}, {}, {}, {}, claims=claims, storage_classes=classes)
        assert caches.observe(job, []).checkpoint_class_expands is expected
    caches = Caches({}, {}, {}, {}, {}, claims=claims, storage_classes={})
    assert caches.observe(job, []).checkpoint_class_expands is None


def test_an_unreadable_pool_is_left_out_of_planning(apiserver: ApiServerEmulator) -> None:
    broken = pool("h100")
    broken["metadata"]["name"] = "broken"
    broken["spec"]["gpusPerNode"] = "eight"
    seed(apiserver, pool("l4"), broken)

    caches = caches_from(apiserver)

    assert [p.name for p in caches.valid_pools()] == ["l4"]
    assert "spec.gpusPerNode" in caches.pools["broken"][0]


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


def capacity(server: kmock.KubernetesEmulator, pool_name: str) -> dict[str, Any]:
    return caches_from(server).capacities([GPUPool.model_validate(pool(pool_name))])[pool_name]


def test_capacity_counts_ready_nodes_and_gpus_held_by_live_pods(
    apiserver: ApiServerEmulator,
) -> None:
    seed(apiserver, *capacity_cluster())

    assert capacity(apiserver, "h100") == {
        "nodes": 2,
        "allocatableGPUs": 16,
        "freeGPUs": 9,
        "freeGPUsPerNode": [2, 7],  # h100-0: 8 - 4 - 2; h100-1: 8 - 1
        "nodeMemoryGiB": 1024.0,
    }


def test_capacity_of_a_pool_without_nodes(apiserver: ApiServerEmulator) -> None:
    seed(apiserver, *capacity_cluster())

    assert capacity(apiserver, "l40s") == {
        "nodes": 0,
        "allocatableGPUs": 0,
        "freeGPUs": 0,
        "freeGPUsPerNode": [],
        "nodeMemoryGiB": None,
    }


def test_capacity_never_goes_below_zero(apiserver: ApiServerEmulator) -> None:
    # A device plugin restart can shrink allocatable below what bound pods hold.
    seed(apiserver, node("h100-0", "h100", gpus=4), pod("big", node_name="h100-0", gpus=(8,)))

    assert capacity(apiserver, "h100")["freeGPUs"] == 0
    assert capacity(apiserver, "h100")["freeGPUsPerNode"] == [0]


# ---------------------------------------------------------------------- the stock emulator
# What `ApiServerEmulator` corrects. Should a KMock release fix either, or kube.py start
# filtering on the client side, these fail and the correction can go.


async def test_stock_emulator_errors_do_not_reach_kubetune_as_api_errors(
    stock_kube: Kube,
) -> None:
    manifest = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "demo-a1", "namespace": NAMESPACE},
    }
    assert await stock_kube.create_if_absent(manifest) is True

    # The 409 comes as `application/json; charset=utf-8`; lightkube wants `application/json`.
    with pytest.raises(httpx2.HTTPStatusError) as err:
        await stock_kube.create_if_absent(manifest)

    assert not isinstance(err.value, ApiError)
    assert err.value.response.status_code == 409


async def test_an_error_without_a_status_body_is_retried_too(
    stock_apiserver: kmock.KubernetesEmulator, stock_kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stock emulator's errors reach lightkube as bare HTTP errors, as a load balancer's
    # HTML 503 would: a transient code is retried all the same.
    seed(stock_apiserver, tiny_job())
    monkeypatch.setattr(kube_module, "RETRY_DELAYS", (0.0,))
    stock_apiserver[kmock.method.PATCH][:1] << kmock.KubernetesError(503, "Unavailable", "busy")

    assert await stock_kube.patch_status(NAMESPACE, "tiny-cpu-lora", {"phase": "Planning"})

    assert len([r for r in stock_apiserver if r.method == "PATCH"]) == 2


async def test_stock_emulator_ignores_label_selectors(
    stock_apiserver: kmock.KubernetesEmulator, stock_kube: Kube
) -> None:
    seed(stock_apiserver, *capacity_cluster())

    names = [
        n.metadata.name
        async for n in stock_kube.client.list(Node, labels={"kubetune.io/pool": "h100"})
        if n.metadata
    ]

    # The a100 node comes too; a real apiserver (and ApiServerEmulator) filters it out.
    assert "a100-0" in names


async def test_corrected_emulator_filters_by_label(
    apiserver: ApiServerEmulator, kube: Kube
) -> None:
    seed(apiserver, *capacity_cluster())

    names = [
        n.metadata.name
        async for n in kube.client.list(Node, labels={"kubetune.io/pool": "h100"})
        if n.metadata
    ]

    assert sorted(str(n) for n in names) == ["h100-0", "h100-1", "h100-2", "h100-3"]


# ---------------------------------------------------------------------- the job loop


class Clock(datetime):
    """The runtime's wall clock, set by the test."""

    current = T0

    @classmethod
    def now(cls, tz: tzinfo | None = None) -> Clock:
        return cls.current  # type: ignore[return-value]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> type[Clock]:
    monkeypatch.setattr(Clock, "current", T0)
    monkeypatch.setattr(runtime_module, "datetime", Clock)
    return Clock


class Loop:
    """One job's loop state in a `Runtime` pointed at the emulator; each `look()` refreshes
    the caches from the emulator (as the watches would) and runs one reconcile."""

    def __init__(self, server: ApiServerEmulator, kube: Kube, **settings: Any) -> None:
        self.server = server
        self.events: list[tuple[str, str, str]] = []
        self.runtime = Runtime(
            ControllerSettings(**settings),
            kube,
            partial(load_arch, allow_network=False, local_files=False),
            lambda _body, type_, reason, message: self.events.append(
                (str(type_), str(reason), message)
            ),
        )
        self.state = _JobState(name="tiny-cpu-lora")
        self.key = ("team-a", "tiny-cpu-lora")

    def body(self) -> dict[str, Any]:
        return copy.deepcopy(dict(self.server.objects[FTJ, NAMESPACE, "tiny-cpu-lora"]))

    async def look(self) -> float | None:
        self.runtime.caches = caches_from(self.server)
        self.runtime.capacity_changed()
        return await self.runtime._look(self.key, self.state, self.body())

    def status(self) -> dict[str, Any]:
        return dict(self.body().get("status") or {})

    def status_patches(self) -> list[dict[str, Any]]:
        return [r.data["status"] for r in self.server if r.method == "PATCH" and r.subresource]


@pytest.fixture
def loop(apiserver: ApiServerEmulator, kube: Kube, clock: type[Clock]) -> Loop:
    return Loop(apiserver, kube)


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


async def test_new_job_is_planned_and_launched(apiserver: ApiServerEmulator, loop: Loop) -> None:
    seed(apiserver, *example_cluster(), tiny_job())

    delay = await loop.look()

    names = child_names("tiny-cpu-lora", 1)
    assert children(apiserver) == first_attempt()
    owner = {
        "apiVersion": "kubetune.io/v1alpha1",
        "kind": "FineTuneJob",
        "name": "tiny-cpu-lora",
        "uid": UID,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    for resource, name in [
        (CONFIGMAPS, names.config_map),
        (SERVICES, names.service),
        (JOBS, names.job),
    ]:
        assert apiserver.objects[resource, NAMESPACE, name]["metadata"]["ownerReferences"] == [
            owner
        ]
    # The checkpoint volume outlives the job by default (retention: retain): no owner,
    # only a note of whose it is.
    pvc = apiserver.objects[PVCS, NAMESPACE, names.pvc]
    assert "ownerReferences" not in pvc["metadata"]
    assert pvc["metadata"]["annotations"]["kubetune.io/job-uid"] == UID

    status = loop.status()
    assert status["phase"] == "Running"
    assert status["attempt"] == 1
    assert status["observedGeneration"] == 1
    assert status["message"] == "launched attempt 1"
    assert status["startTime"] == "2026-11-22T12:00:00Z"
    plan = status["plan"]
    assert plan["method"] == "lora"
    assert plan["nodes"] * plan["gpusPerNode"] == 1
    # The trainer goes where the plan says.
    trainer = apiserver.objects[JOBS, NAMESPACE, names.job]
    assert trainer["metadata"]["labels"]["kubetune.io/attempt"] == "1"
    assert trainer["spec"]["completionMode"] == "Indexed"
    pod_spec = trainer["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"] == pool(plan["pool"])["spec"]["nodeSelector"]
    assert condition(status, ConditionType.PLANNED)["status"] == "True"
    assert condition(status, ConditionType.PLANNED)["reason"] == Reason.PLAN_READY
    assert condition(status, ConditionType.RUNNING)["status"] == "False"
    assert condition(status, ConditionType.RUNNING)["reason"] == Reason.PODS_STARTING
    assert status["cost"]["estimatedUSD"] == plan["estimatedCostUSD"]

    assert [(t, r) for t, r, _ in loop.events] == [
        ("Normal", Reason.PLAN_READY),
        ("Normal", "Launched"),
    ]
    assert loop.events[1][2] == f"Attempt 1 on pool {plan['pool']}"
    # The next look comes from the decision: a running job's poll interval.
    assert delay == ControllerSettings().poll_seconds
    # One status write, through the status subresource, with only what changed.
    assert len(loop.status_patches()) == 1


async def test_the_plan_is_written_before_the_batch_job_is_created(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    seed(apiserver, *example_cluster(), tiny_job())

    await loop.look()

    # On a busy API server every round trip is seconds: the status carrying the plan goes
    # out with the first creates, and the batch Job, whose pods mount them, after both.
    served = [(r.method, r.resource, bool(r.subresource)) for r in apiserver]
    status_write = served.index(("PATCH", kmock.resource(FTJ), True))
    batch_job = served.index(("POST", kmock.resource(JOBS), False))
    assert status_write < batch_job
    assert {r for r in served[:batch_job] if r[0] == "POST"} == {
        ("POST", kmock.resource(resource), False)
        for resource in (PVCS, CONFIGMAPS, SERVICES, NETWORKPOLICIES)
    }


async def test_a_status_write_that_fails_launches_no_trainer(
    apiserver: ApiServerEmulator, loop: Loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(apiserver, *example_cluster(), tiny_job())
    monkeypatch.setattr(kube_module, "RETRY_DELAYS", (0.0,))
    apiserver[f"patch {STATUS_PATH}"][:2] << kmock.KubernetesError(500, "InternalError", "down")

    delay = await loop.look()

    # The look failed and is retried; nothing says attempt 1 started, so no batch Job does.
    assert delay == 2.0
    assert children(apiserver)["job"] == []

    await loop.look()

    assert loop.status()["attempt"] == 1
    assert children(apiserver)["job"] == [child_names("tiny-cpu-lora", 1).job]
    assert len(requests(apiserver, kmock.action.CREATE, JOBS)) == 1


async def test_looking_again_creates_nothing_and_writes_the_cost_clock_only_when_due(
    apiserver: ApiServerEmulator, loop: Loop, clock: type[Clock]
) -> None:
    seed(apiserver, *example_cluster(), tiny_job())
    await loop.look()
    launched = children(apiserver)
    creates = len(requests(apiserver, kmock.action.CREATE))
    first = loop.status()
    del loop.events[:]
    clock.current += timedelta(minutes=1)

    await loop.look()

    # Children are created once per attempt: no POST answered 409.
    assert children(apiserver) == launched
    assert len(requests(apiserver, kmock.action.CREATE)) == creates
    assert loop.events == []
    # Only the cost clock moved: that waits for the progress write interval.
    assert len(loop.status_patches()) == 1

    loop.state.written_at -= ControllerSettings().progress_write_seconds
    await loop.look()

    # No trainer pod runs here (no kubelet): the clock moves, the cost does not, and the
    # patch carries what changed only.
    assert first["cost"]["updatedAt"] != "2026-11-22T12:01:00Z"
    assert loop.status_patches()[-1] == {"cost": {"updatedAt": "2026-11-22T12:01:00Z"}}
    assert loop.status()["cost"] == {**first["cost"], "updatedAt": "2026-11-22T12:01:00Z"}


async def test_a_batch_job_deleted_behind_the_operator_is_created_again(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    seed(apiserver, *example_cluster(), tiny_job())
    await loop.look()
    launched = children(apiserver)
    names = child_names("tiny-cpu-lora", 1)
    apiserver.objects[JOBS, NAMESPACE, names.job].delete()
    assert children(apiserver)["job"] == []
    # The batch Job was created by this loop a moment ago; after a resync period, a
    # missing one is created again.
    loop.state.created = {
        k: v - loop.runtime.settings.resync_seconds - 1 for k, v in loop.state.created.items()
    }

    await loop.look()

    assert children(apiserver) == launched


async def test_a_batch_job_collected_with_its_deleted_job_is_not_created_again(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    """No finalizer holds a deleted job: the garbage collector may delete its batch Job
    before the job's loop hears of the deletion. The loop must not start a trainer again for
    a job that is gone (nor for another job created since under its name)."""
    seed(apiserver, *example_cluster(), tiny_job())
    await loop.look()
    names = child_names("tiny-cpu-lora", 1)
    await loop.look()  # the batch Job is in the cache now
    assert names.job in loop.state.seen_batch_jobs
    stale = loop.body()
    apiserver.objects[JOBS, NAMESPACE, names.job].delete()
    apiserver.objects[FTJ, NAMESPACE, "tiny-cpu-lora"].delete()
    loop.state.created = {
        k: v - loop.runtime.settings.resync_seconds - 1 for k, v in loop.state.created.items()
    }
    loop.runtime.caches = caches_from(apiserver)

    await loop.runtime._look(loop.key, loop.state, stale)

    assert children(apiserver)["job"] == []
    assert len(requests(apiserver, kmock.action.CREATE, JOBS)) == 1

    # Created again under the same name: another uid, still not this loop's to launch.
    seed(apiserver, {**tiny_job(), "metadata": {**tiny_job()["metadata"], "uid": "another"}})
    await loop.runtime._look(loop.key, loop.state, stale)

    assert children(apiserver)["job"] == []


async def test_a_child_owned_by_someone_else_fails_the_job(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    names = child_names("tiny-cpu-lora", 1)
    foreign = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": names.service, "namespace": NAMESPACE, "uid": "someone-else"},
    }
    seed(apiserver, *example_cluster(), tiny_job(), foreign)

    await loop.look()

    status = loop.status()
    assert status["phase"] == "Failed"
    assert condition(status, ConditionType.FAILED)["reason"] == Reason.CHILD_CONFLICT
    assert f"a Service named {names.service} already exists" in status["message"]
    assert "To fix:" in status["message"]
    assert [(t, r) for t, r, _ in loop.events] == [("Warning", Reason.CHILD_CONFLICT)]
    # The batch Job comes after the objects its pods use: with one of them foreign, no
    # trainer is started.
    assert children(apiserver)["job"] == []


@pytest.mark.parametrize("uptime", [30.0, 100_000.0])
async def test_children_are_created_whatever_the_machine_uptime(
    apiserver: ApiServerEmulator, loop: Loop, monkeypatch: pytest.MonkeyPatch, uptime: float
) -> None:
    """The monotonic clock counts from boot: on a node up for less than the resync period,
    "never created" must not read as "created a moment ago" (an operator on a new node
    would create no child for its first ten minutes)."""
    start = time.monotonic()
    young = SimpleNamespace(monotonic=lambda: time.monotonic() - start + uptime, time=time.time)
    monkeypatch.setattr(runtime_module, "time", young)
    seed(apiserver, *example_cluster(), tiny_job())

    await loop.look()

    assert children(apiserver) == first_attempt()
    assert len(loop.status_patches()) == 1  # and the status went out at once


async def test_job_with_no_pools_waits_for_them(apiserver: ApiServerEmulator, loop: Loop) -> None:
    seed(apiserver, tiny_job(), claim(DEMO_CLAIM))

    delay = await loop.look()

    assert children(apiserver) == {"pvc": [], "configmap": [], "service": [], "job": []}
    status = loop.status()
    assert status["phase"] == "Planning"
    assert status["attempt"] == 0
    assert condition(status, ConditionType.PLANNED)["reason"] == Reason.NO_POOLS
    assert status["message"].startswith("no GPUPool exists yet")
    assert loop.events == []
    # Waiting for pools counts as queued: a new pool wakes it; otherwise it retries.
    assert loop.key in loop.runtime.queued
    assert delay == ControllerSettings().queue_retry_seconds


async def test_a_job_deep_in_a_queue_waits_for_events(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    """At the front of a queue a job looks again at its queue retry; further back nothing
    but its place moving can change what it does or shows, and that wakes it: it sleeps
    until the resync, or until a status write it held back is due."""
    busy = [
        pod(f"holds-{n['metadata']['name']}", node_name=n["metadata"]["name"], gpus=(8,))
        for n in pool_nodes()
    ]
    seed(apiserver, *example_cluster(), *busy, tiny_job())
    settings = ControllerSettings()

    assert await loop.look() == settings.queue_retry_seconds
    status = loop.status()
    assert status["phase"] == "Queued" and "position 1 in the queue" in status["message"]

    # Ten go before it (the job has no creationTimestamp here: same time, earlier names).
    pool_name = status["plan"]["pool"]
    ahead = [Ticket(NAMESPACE, f"early-{i:02d}", 0, "", pool_name, 1, 1) for i in range(10)]
    for t in ahead:
        loop.runtime.queue.admit(t.key, t, [0], queued=True)
    pace = settings.progress_write_seconds

    # Its new place alone is written at the progress pace: the look comes back when due.
    delay = await loop.look()
    assert delay is not None and pace - 5 < delay <= pace
    assert "position 1 in the queue" in loop.status()["message"]
    loop.state.written_at -= pace
    assert await loop.look() == settings.resync_seconds
    assert "position 11 in the queue" in loop.status()["message"]

    # Two leave: a move by two of eleven is shown at once, at the progress pace.
    for t in ahead[:2]:
        loop.runtime.queue.stop_waiting(t.key)
    delay = await loop.look()
    assert delay is not None and pace - 5 < delay <= pace
    loop.state.written_at -= pace
    assert await loop.look() == settings.resync_seconds
    assert "position 9 in the queue" in loop.status()["message"]


async def test_a_small_move_deep_in_a_queue_is_shown_after_ten_progress_writes(
    apiserver: ApiServerEmulator, kube: Kube, clock: type[Clock]
) -> None:
    """A move by less than a tenth of a deep place wakes nobody, yet the status must show it
    in time: a job deep in a queue looks every SMALL_MOVE_SLOWDOWN progress writes (never
    less often than the resync; at the defaults both are ten minutes)."""
    loop = Loop(apiserver, kube, progress_write_seconds=2.0)
    busy = [
        pod(f"holds-{n['metadata']['name']}", node_name=n["metadata"]["name"], gpus=(8,))
        for n in pool_nodes()
    ]
    seed(apiserver, *example_cluster(), *busy, tiny_job())
    await loop.look()
    pool_name = loop.status()["plan"]["pool"]
    ahead = [Ticket(NAMESPACE, f"early-{i:02d}", 0, "", pool_name, 1, 1) for i in range(21)]
    for t in ahead[:20]:
        loop.runtime.queue.admit(t.key, t, [0], queued=True)
    loop.state.written_at -= 2.0
    assert await loop.look() == SMALL_MOVE_SLOWDOWN * 2.0
    assert "position 21 in the queue" in loop.status()["message"]

    loop.runtime.queue.admit(ahead[20].key, ahead[20], [0], queued=True)  # 21 → 22
    assert loop.key not in loop.runtime.queue.moved()  # too small to wake it
    delay = await loop.look()  # the look it makes anyway, one such period later
    assert delay is not None and delay <= SMALL_MOVE_SLOWDOWN * 2.0
    loop.state.written_at -= SMALL_MOVE_SLOWDOWN * 2.0
    await loop.look()
    assert "position 22 in the queue" in loop.status()["message"]


async def test_a_job_whose_claim_is_missing_is_held_until_it_exists(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    seed(apiserver, *example_pools(), *pool_nodes(), tiny_job())

    delay = await loop.look()

    assert children(apiserver) == {"pvc": [], "configmap": [], "service": [], "job": []}
    status = loop.status()
    assert status["phase"] == "Pending"
    held = condition(status, ConditionType.INPUTS_READY)
    assert (held["status"], held["reason"]) == ("False", Reason.MISSING_VOLUME)
    assert (
        f"PersistentVolumeClaim {DEMO_CLAIM!r} (spec.model.uri) does not exist" in held["message"]
    )
    assert [(t, r) for t, r, _ in loop.events] == [("Warning", Reason.MISSING_VOLUME)]
    assert delay == ControllerSettings().queue_retry_seconds

    seed(apiserver, claim(DEMO_CLAIM))
    await loop.look()

    status = loop.status()
    assert status["phase"] == "Running"
    assert condition(status, ConditionType.INPUTS_READY)["reason"] == Reason.INPUTS_FOUND
    assert children(apiserver)["job"] == [child_names("tiny-cpu-lora", 1).job]


async def test_a_secret_the_operator_may_not_read_is_not_checked(
    apiserver: ApiServerEmulator, loop: Loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = tiny_job()
    job["spec"]["model"]["tokenSecretRef"] = {"name": "hf", "key": "token"}
    seed(apiserver, *example_cluster(), job)
    consented = Tenant(NAMESPACE, allowed_secrets=frozenset({"hf"}))
    monkeypatch.setattr(Caches, "tenant", lambda self, namespace: consented)
    apiserver[f"get /api/v1/namespaces/{NAMESPACE}/secrets/hf"] << kmock.KubernetesError(
        403, "Forbidden", "secrets is forbidden"
    )

    await loop.look()

    # The preflight asked, was refused (no rbac.secretPreflight rule) and let the job go:
    # the pods' errors tell of a missing Secret instead.
    asked = [r for r in apiserver if r.method == "GET" and r.resource == kmock.resource(SECRETS)]
    assert len(asked) == 1
    assert loop.status()["phase"] == "Running"


async def test_a_job_from_a_newer_crd_is_left_alone_with_a_warning(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    """CRDs applied before the operator is upgraded: a field the operator does not know must
    not fail the job (a running one would lose its run); it waits for the new operator."""
    body = tiny_job()
    body["spec"]["recovery"] = {"maxRestarts": 3, "somethingNewer": 2}
    body["status"] = {"phase": "Running", "attempt": 1}
    seed(apiserver, body)

    delay = await loop.look()
    await loop.look()

    assert loop.status() == {"phase": "Running", "attempt": 1}  # untouched
    assert [(t, r) for t, r, _ in loop.events] == [("Warning", Reason.OPERATOR_OUTDATED)]
    assert "spec.recovery.somethingNewer" in loop.events[0][2]
    assert delay == ControllerSettings().resync_seconds
    assert children(apiserver) == {"pvc": [], "configmap": [], "service": [], "job": []}


async def test_invalid_job_fails_with_a_warning(apiserver: ApiServerEmulator, loop: Loop) -> None:
    body = tiny_job()
    body["spec"]["method"] = "full"  # with spec.lora set: admission would have refused it
    seed(apiserver, body)

    delay = await loop.look()

    status = loop.status()
    assert status["phase"] == "Failed"
    assert condition(status, ConditionType.FAILED)["reason"] == Reason.INVALID_SPEC
    assert [(t, r) for t, r, _ in loop.events] == [("Warning", Reason.INVALID_SPEC)]
    assert delay is None  # finished: no further look until an event


async def test_a_rejected_status_write_does_not_stop_the_job(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    seed(apiserver, *example_cluster(), tiny_job())
    apiserver[kmock.method.PATCH][:1] << invalid("status.plan")

    delay = await loop.look()

    # The launch happened; its status write was refused as invalid; the job got the
    # reason and the loop carries on.
    assert children(apiserver)["job"] == [child_names("tiny-cpu-lora", 1).job]
    assert (str(EventType.WARNING), Reason.STATUS_REJECTED) in [(t, r) for t, r, _ in loop.events]
    assert "status.plan" in loop.status()["message"]
    assert delay is not None

    await loop.look()

    # The next look writes the whole status (the adopted launch) without trouble.
    assert loop.status()["phase"] == "Running"
    assert loop.status()["attempt"] == 1


async def test_a_failed_look_is_retried_with_growing_backoff(
    apiserver: ApiServerEmulator, loop: Loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(apiserver, *example_cluster(), tiny_job())

    async def down(*_: Any, **__: Any) -> str:
        raise httpx2.ConnectError("connection refused")

    monkeypatch.setattr(loop.runtime.kube, "patch_status", down)

    delays = [await loop.look() for _ in range(4)]

    assert delays == [2.0, 4.0, 8.0, 16.0]
    assert loop.state.failures == 4
    # Whatever failed, the job stays due: liveness sees it once nothing succeeds.
    assert loop.state.due_at is not None


async def test_the_latest_written_status_wins_over_a_stale_cache(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    seed(apiserver, *example_cluster(), tiny_job())
    stale = loop.body()  # what the watch still shows while the first write travels
    stale["metadata"]["resourceVersion"] = "0"  # older than anything written
    await loop.look()

    loop.runtime.caches = caches_from(apiserver)
    await loop.runtime._look(loop.key, loop.state, stale)

    # Seen through the stale body, the job would be planned and launched again.
    assert [(t, r) for t, r, _ in loop.events].count(("Normal", "Launched")) == 1
    assert len(stored(apiserver, JOBS, NAMESPACE)) == 1


def test_a_job_is_validated_again_only_when_what_it_is_made_of_changed() -> None:
    """Most looks of a running job see the same object and status: the model made of them
    is reused, and made anew from whatever changed."""
    state = _JobState(name="tiny")
    body = tiny_job()
    first = Runtime._validated(state, body)
    assert Runtime._validated(state, copy.deepcopy(body)) is first
    # The spec changed: a new model, with the change.
    changed = copy.deepcopy(body)
    changed["metadata"].update(resourceVersion="2", generation=2)
    changed["spec"]["suspend"] = True
    second = Runtime._validated(state, changed)
    assert second is not first and second.spec.suspend
    # Only the status changed (the status this loop wrote, before the watch delivers it).
    written = {**changed, "status": {"phase": "Running"}}
    third = Runtime._validated(state, written)
    assert third is not second and third.status is not None and third.status.phase == "Running"
    assert Runtime._validated(state, copy.deepcopy(written)) is third


# ---------------------------------------------------------------------- health


def test_a_stage_in_keeps_what_other_unfinished_jobs_read_from_the_cache(kube: Kube) -> None:
    def job(model: str, phase: str = "Running") -> FineTuneJob:
        staged = StageInStatus(model_path=model).model_dump()
        body = make_job().model_dump(by_alias=True)
        return FineTuneJob.model_validate({**body, "status": {"phase": phase, "stageIn": staged}})

    runtime = Runtime(ControllerSettings(), kube, load_arch, lambda *_: None)
    runtime.note_cache_use(("a", "x"), job("/cache/models/x"))
    runtime.note_cache_use(("a", "y"), job("/cache/models/y"))
    runtime.note_cache_use(("b", "z"), job("/cache/models/z"))
    runtime.note_cache_use(("a", "done"), job("/cache/models/old", phase="Succeeded"))
    # the namespace's cache: only its own unfinished jobs count, never the asking job
    assert runtime.cache_in_use(("a", "x")) == ("/cache/models/y",)
    assert runtime.cache_in_use(("a", "new")) == ("/cache/models/x", "/cache/models/y")
    # a job that finished stops holding its entries
    runtime.note_cache_use(("a", "y"), job("/cache/models/y", phase="Failed"))
    assert runtime.cache_in_use(("a", "new")) == ("/cache/models/x",)
    # one cache for the cluster: every namespace's jobs read it
    shared = BuildSettings(cache_volume={"persistentVolumeClaim": {"claimName": "cache"}})
    runtime.settings = replace(runtime.settings, build=shared)
    assert runtime.cache_in_use(("a", "new")) == ("/cache/models/x", "/cache/models/z")


def test_liveness_fails_only_when_every_due_job_stalled(kube: Kube) -> None:
    runtime = Runtime(ControllerSettings(stall_seconds=60), kube, load_arch, lambda *_: None)
    now = runtime.last_success
    runtime.jobs[("a", "x")] = _JobState(name="x", due_at=now + 10)
    runtime.jobs[("a", "idle")] = _JobState(name="idle", due_at=None)

    assert runtime.stalled(now + 30) == []
    assert runtime.stalled(now + 100) == ["a/x"]  # overdue 90 s, nothing succeeded for 100 s
    assert runtime.health() == {"jobs": 2, "queued": 0}

    runtime.last_success -= 100
    runtime.jobs[("a", "x")].due_at = now - 90
    with pytest.raises(RuntimeError, match="no reconcile succeeded for 60s; 1 job"):
        runtime.health()


# ---------------------------------------------------------------------- the pool loop


async def test_pool_capacity_is_written_only_when_it_changed(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    body = pool("h100")
    body["metadata"]["generation"] = 3
    # The product alone: the status shows the memory the planner takes for it.
    body["spec"]["gpu"] = {"product": body["spec"]["gpu"]["product"]}
    seed(apiserver, *capacity_cluster(), body)
    loop.runtime.caches = caches_from(apiserver)

    await loop.runtime.reconcile_pool(copy.deepcopy(dict(apiserver.objects[POOLS, None, "h100"])))

    status = dict(apiserver.objects[POOLS, None, "h100"]["status"])
    assert status.pop("updatedAt")
    (valid,) = status.pop("conditions")
    assert (valid["type"], valid["status"], valid["reason"]) == ("Valid", "True", "Accepted")
    assert status == {
        "nodes": 2,
        "allocatableGPUs": 16,
        "freeGPUs": 9,
        "freeGPUsPerNode": [2, 7],
        "nodeMemoryGiB": 1024.0,
        "observedGeneration": 3,
        "gpuMemoryGiB": 80.0,
    }
    writes = len([r for r in apiserver if r.method == "PATCH"])

    await loop.runtime.reconcile_pool(copy.deepcopy(dict(apiserver.objects[POOLS, None, "h100"])))

    assert len([r for r in apiserver if r.method == "PATCH"]) == writes


async def test_an_unreadable_pool_gets_a_condition(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    body = pool("h100")
    body["spec"]["gpusPerNode"] = "eight"
    seed(apiserver, body)
    loop.runtime.caches = caches_from(apiserver)

    await loop.runtime.reconcile_pool(copy.deepcopy(dict(apiserver.objects[POOLS, None, "h100"])))

    (valid,) = apiserver.objects[POOLS, None, "h100"]["status"]["conditions"]
    assert (valid["type"], valid["status"], valid["reason"]) == ("Valid", "False", "InvalidSpec")
    assert "spec.gpusPerNode" in valid["message"] and "To fix:" in valid["message"]


# ---------------------------------------------------------------------- the operator
# kopf itself, in a thread with its own loop, against the same emulator. The emulator has
# no resourceVersion semantics: a watch replays every object's current state, so kopf may
# handle an object twice, which the handlers must (and do) take in their stride.


@pytest.fixture
async def operator_run(
    apiserver: ApiServerEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[KopfRunner]:
    """`kopf run -m kubetune.controller.handlers` logged in to the emulator."""
    write_kubeconfig(apiserver, tmp_path, monkeypatch)
    # The operator's startup and cleanup rewrite the module state.
    monkeypatch.setattr(handlers._State, "runtime", None)
    monkeypatch.setattr(handlers._State, "loops", None)
    monkeypatch.setattr(handlers._State, "nodes", {})
    monkeypatch.setattr(handlers._State, "gpu_pods", {})
    # kopf picks its fallback login handlers when its default registry is first built,
    # long before KUBECONFIG was set here; a copy with an explicit kubeconfig login fixes
    # that without touching the registry other tests see.
    default_registry = kopf.get_default_registry()
    registry = copy.deepcopy(default_registry)
    kopf.on.login(registry=registry)(kopf.login_with_kubeconfig)
    runner = KopfRunner(
        ["run", "-m", "kubetune.controller.handlers", "--standalone", "--all-namespaces"],
        registry=registry,
        timeout=20,
    )
    # The runner blocks while it starts and stops; this loop must keep serving the emulator.
    await asyncio.to_thread(runner.__enter__)
    try:
        await eventually(lambda: requests(apiserver, kmock.action.WATCH, FTJ) != [])
        yield runner
    finally:
        await asyncio.to_thread(runner.__exit__, None, None, None)
        kopf.set_default_registry(default_registry)  # `kopf run` installs its registry
    assert runner.exit_code == 0


def write_kubeconfig(
    apiserver: ApiServerEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": {"server": str(apiserver.url)}}],
        "users": [{"name": "kmock", "user": {"token": "t"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
        "current-context": "kmock",
    }
    (tmp_path / "kubeconfig").write_text(json.dumps(kubeconfig))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    # lightkube prefers an in-cluster service account to KUBECONFIG: never reach a real
    # cluster when the tests themselves run in a pod.
    monkeypatch.setattr(KubeConfig, "from_service_account", classmethod(_not_in_cluster))


async def create(kube: Kube, *manifests: dict[str, Any]) -> None:
    for manifest in manifests:
        await kube.client.create(codecs.from_dict(copy.deepcopy(manifest)))


def _not_in_cluster(cls: type[KubeConfig], *_: Any, **__: Any) -> KubeConfig:
    raise ConfigError("these tests talk to the emulator only")


async def eventually(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"still false after {timeout}s: {condition}")


def phase(server: kmock.KubernetesEmulator) -> str | None:
    if "tiny-cpu-lora" not in stored(server, FTJ, NAMESPACE):
        return None
    return (server.objects[FTJ, NAMESPACE, "tiny-cpu-lora"].get("status") or {}).get("phase")


async def test_operator_launches_an_applied_job(
    apiserver: ApiServerEmulator, kube: Kube, operator_run: KopfRunner
) -> None:
    await create(kube, *example_cluster())  # through the API: the operator's watches see them

    await kube.client.create(FineTuneJobResource.from_dict(tiny_job()))  # kubectl apply
    await eventually(lambda: phase(apiserver) == "Running")

    status = apiserver.objects[FTJ, NAMESPACE, "tiny-cpu-lora"]["status"]
    assert status["attempt"] == 1
    assert condition(status, ConditionType.PLANNED)["status"] == "True"
    # The status goes out with the first creates; the batch Job follows them.
    await eventually(lambda: bool(children(apiserver)["job"]))
    assert children(apiserver) == first_attempt()
    # The status goes through the status subresource, as the CRD declares it.
    status_patches = [r for r in apiserver if r.method == "PATCH" and r.subresource == "status"]
    assert any(r.name == "tiny-cpu-lora" for r in status_patches)


async def test_a_job_gets_no_finalizer_and_its_loop_ends_with_it(
    apiserver: ApiServerEmulator, kube: Kube, operator_run: KopfRunner
) -> None:
    """A job's loop starts with its first event and stops with its deletion
    (controller/loops.py): nothing writes a finalizer onto the job, before or after."""
    await create(kube, *example_cluster())
    await kube.client.create(FineTuneJobResource.from_dict(tiny_job()))
    await eventually(lambda: phase(apiserver) == "Running")
    loops = handlers._State.loops
    assert loops is not None and len(loops) == 1

    stored_job = apiserver.objects[FTJ, NAMESPACE, "tiny-cpu-lora"]
    assert not stored_job["metadata"].get("finalizers")
    metadata_writes = [
        r
        for r in apiserver
        if r.method == "PATCH" and r.name == "tiny-cpu-lora" and not r.subresource
    ]
    assert metadata_writes == [], "the job was written outside its status"

    await kube.client.delete(FineTuneJobResource, "tiny-cpu-lora", namespace=NAMESPACE)
    await eventually(lambda: len(loops) == 0)
    assert "tiny-cpu-lora" not in stored(apiserver, FTJ, NAMESPACE)


async def test_operator_posts_plan_and_launch_events(
    apiserver: ApiServerEmulator, kube: Kube, operator_run: KopfRunner
) -> None:
    await create(kube, *example_cluster())

    await kube.client.create(FineTuneJobResource.from_dict(tiny_job()))
    await eventually(lambda: phase(apiserver) == "Running")

    def reasons() -> set[str]:
        return {r.data.get("reason") for r in requests(apiserver, kmock.action.CREATE, EVENTS)}

    await eventually(lambda: {Reason.PLAN_READY, "Launched"} <= reasons(), timeout=2)


def test_parse_trainer_metrics_keeps_only_trainer_samples() -> None:
    from kubetune.controller.kube import parse_trainer_metrics

    text = (
        "# HELP kubetune_trainer_step Optimizer steps completed\n"
        "# TYPE kubetune_trainer_step gauge\n"
        'kubetune_trainer_step{job="x"} 12.0\n'
        "# TYPE kubetune_trainer_loss gauge\n"
        "kubetune_trainer_loss 1.5\n"
        "# TYPE kubetune_trainer_eval_loss gauge\n"
        "kubetune_trainer_eval_loss NaN\n"
        "# TYPE process_cpu_seconds_total counter\n"
        "process_cpu_seconds_total 3.0\n"
    )
    assert parse_trainer_metrics(text) == {"step": 12.0, "loss": 1.5}


# ---------------------------------------------------------------------- why the loop writes


async def test_kopf_stops_a_timer_whose_status_patch_was_rejected(
    apiserver: ApiServerEmulator, kube: Kube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What made the operator write its own status: a kopf timer that hands kopf a status
    patch is never called again once the apiserver rejected one such patch (422)."""
    calls: list[float] = []
    registry = kopf.OperatorRegistry()

    @kopf.timer(*handlers.FTJ, interval=0.2, registry=registry)
    async def tick(patch: kopf.Patch, **_: Any) -> None:
        calls.append(asyncio.get_running_loop().time())
        patch.status["message"] = f"tick {len(calls)}"

    kopf.on.login(registry=registry)(kopf.login_with_kubeconfig)
    write_kubeconfig(apiserver, tmp_path, monkeypatch)
    await kube.client.create(FineTuneJobResource.from_dict(tiny_job()))
    apiserver[f"patch {STATUS_PATH}"][:1] << invalid("status.message")
    # kopf in this test's own event loop (no thread): the emulator serves on it too.
    stop = asyncio.Event()
    operator = asyncio.create_task(
        kopf.operator(registry=registry, standalone=True, clusterwide=True, stop_flag=stop)
    )
    try:
        await eventually(lambda: len(calls) >= 1)
        await asyncio.sleep(3.0)  # 15 intervals
    finally:
        stop.set()
        await asyncio.wait_for(operator, timeout=10)

    assert len(calls) == 1, calls


async def test_the_operator_keeps_reconciling_after_a_rejected_status_write(
    apiserver: ApiServerEmulator, kube: Kube, operator_run: KopfRunner
) -> None:
    await create(kube, *example_cluster())
    apiserver[f"patch {STATUS_PATH}"][:1] << invalid("status.plan")

    await kube.client.create(FineTuneJobResource.from_dict(tiny_job()))
    await eventually(lambda: phase(apiserver) == "Running", timeout=20)

    status_patches = [r for r in apiserver if r.method == "PATCH" and r.subresource == "status"]
    assert len(status_patches) >= 2


def test_no_change_handlers_so_no_diff_base_is_needed() -> None:
    """The operator skips kopf's diff base (NoDiffBase); that is only right while no change
    handler (on.create/update/delete/resume/field) is registered: one would see no diff."""
    registry = kopf.get_default_registry()
    assert not registry._changing._handlers, [h.id for h in registry._changing._handlers]
    # The handlers module's own handlers are there (so the registry looked at is theirs).
    assert {h.id for h in registry._spawning._handlers} == {"gpupool_loop"}
    storage = handlers.NoDiffBase(prefix="kubetune.io", key="last-handled-configuration")
    body = kopf.Body({"metadata": {"annotations": {}}, "spec": {"x": 1}})
    assert storage.build(body=body) == {}
    assert storage.fetch(body=body) is None


def test_wake_up_successes_are_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    # The quiet list is every event handler the operator registers, no more, no less.
    watching = kopf.get_default_registry()._watching._handlers
    assert {h.id for h in watching} == handlers.WAKE_HANDLERS
    logger = logging.getLogger("kopf.objects")
    with caplog.at_level(logging.INFO, logger="kopf.objects"):
        for name in sorted(handlers.WAKE_HANDLERS):
            logger.info("Handler '%s' succeeded.", name)
        logger.info("Handler 'finetunejob_loop' succeeded.")
        logger.error("Handler 'pod_changed' failed with an exception. Will retry.")
    assert [r.getMessage() for r in caplog.records] == [
        "Handler 'finetunejob_loop' succeeded.",
        "Handler 'pod_changed' failed with an exception. Will retry.",
    ]


def test_a_queued_jobs_new_position_alone_waits_like_progress() -> None:
    only_volatile = runtime_module.only_volatile
    queued = {
        "phase": "Queued",
        "message": "position 7 in the queue of pool a100: 6 job(s) ahead (higher priority, "
        "or created earlier) go first",
        "conditions": [
            {"type": "Queued", "status": "True", "message": "position 7 in the queue of pool a100"}
        ],
    }
    moved = {
        "message": "position 3 in the queue of pool a100: 2 job(s) ahead (higher priority, "
        "or created earlier) go first",
        "conditions": [
            {"type": "Queued", "status": "True", "message": "position 3 in the queue of pool a100"}
        ],
    }
    assert only_volatile(queued, moved)
    assert only_volatile(queued, {"progress": {"step": 3}})
    # At the front it waits for GPUs, not for jobs: that is news, written at once.
    front = {"message": "position 1 in the queue of pool a100: waiting for 8 free GPU(s)"}
    assert not only_volatile(queued, front)
    assert not only_volatile(queued, {**moved, "phase": "Running"})
    assert not only_volatile(queued, {**moved, "plan": {"pool": "h100"}})
    # A running job's message is never throttled.
    assert not only_volatile({**queued, "phase": "Running"}, moved)


def test_stage_in_progress_alone_waits_like_progress() -> None:
    only_volatile = runtime_module.only_volatile
    staging = {
        "phase": "Planning",
        "message": "staging in: 1.0 GB of 4.0 GB, 1 of 7 files",
        "stageIn": {"bytesDone": 10**9, "bytesTotal": 4 * 10**9},
    }
    more = {
        "message": "staging in: 2.0 GB of 4.0 GB, 3 of 7 files",
        "stageIn": {"bytesDone": 2 * 10**9, "bytesTotal": 4 * 10**9},
        "progress": {"summary": "stage-in 2.0 GB/4.0 GB"},
    }
    assert only_volatile(staging, more)
    # Its result, a failure or the plan is news, written at once.
    assert not only_volatile(staging, {**more, "stageIn": {"modelPath": "/cache/models/m"}})
    assert not only_volatile(staging, {**more, "phase": "Failed"})
    assert not only_volatile(staging, {**more, "plan": {"pool": "h100"}})
    assert not only_volatile(staging, {"message": "staging in: pod demo-stagein-x1 is pending"}
                             | {"conditions": []})  # fmt: skip


def test_the_status_patch_carries_what_changed_and_nulls_what_went() -> None:
    merge_patch = runtime_module.merge_patch
    old = {
        "phase": "Queued",
        "plan": {"pool": "a100", "chunkedCrossEntropy": True, "rejected": [{"pool": "l4"}]},
        "cost": {"accruedUSD": 0.0, "updatedAt": "12:00"},
    }
    # A re-plan that no longer chunks the loss: the stored plan must lose that field, which a
    # merge patch of the whole plan object would leave in place.
    replanned = {
        "phase": "Queued",
        "plan": {"pool": "a100", "rejected": []},
        "cost": {"accruedUSD": 0.0, "updatedAt": "12:01"},
    }
    assert merge_patch(old, replanned) == {
        "plan": {"chunkedCrossEntropy": None, "rejected": []},
        "cost": {"updatedAt": "12:01"},
    }
    assert merge_patch(old, old) == {}
    assert merge_patch(old, {"phase": "Running"}) == {
        "phase": "Running",
        "plan": None,
        "cost": None,
    }
    assert merge_patch({}, {"plan": {}}) == {"plan": {}}


def test_a_stage_in_whose_result_is_known_is_not_progress_alone() -> None:
    only_volatile = runtime_module.only_volatile
    done = {
        "phase": "Planning",
        "message": "staging in: 4.0 GB of 4.0 GB",
        "stageIn": {"bytesDone": 4 * 10**9, "modelPath": "/cache/models/m"},
    }
    # The patch carries only the field that moved; the result stored before still counts.
    assert not only_volatile(done, {"stageIn": {"bytesDone": 5 * 10**9}})
