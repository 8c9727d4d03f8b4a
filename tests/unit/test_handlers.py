"""The handlers and the Kubernetes I/O layer against KMock's API emulator.

Everything goes through real HTTP: lightkube's AsyncClient (and, in the last tests, kopf
itself) talks to an in-memory Kubernetes emulator on a loopback port. No controllers run
there, so nothing schedules pods or updates Job status: the tests seed what a cluster
would show and check what the operator reads and writes.

`ApiServerEmulator` (tests/support/kmock_apiserver.py) closes two gaps between KMock 0.8's
`KubernetesEmulator` and a real kube-apiserver that kubetune depends on; the tests in "The
stock emulator" show both. The job and pool loops against the same emulator are in
test_jobloop.py.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx2
import kmock
import kopf
import pytest
from kopf.testing import KopfRunner
from lightkube import KubeConfig, codecs
from lightkube.core.exceptions import ApiError, ConfigError
from lightkube.resources.core_v1 import Node

from kubetune.api.v1alpha1 import FineTuneJob, GPUPool
from kubetune.api.vocabulary import ConditionType, Reason
from kubetune.control.builders import child_names, labels, owner_reference
from kubetune.controller import handlers
from kubetune.controller import kube as kube_module
from kubetune.controller.cache import Caches
from kubetune.controller.kube import Fenced, FineTuneJobResource, Kube, StatusRejected
from support import emulated
from support.emulated import (
    CONFIGMAPS,
    EVENTS,
    FTJ,
    JOBS,
    NAMESPACE,
    STATUS_PATH,
    caches_from,
    capacity_cluster,
    children,
    client,
    condition,
    example_cluster,
    example_pools,
    first_attempt,
    invalid,
    node,
    pod,
    pool,
    requests,
    seed,
    stored,
    tiny_job,
)
from support.kmock_apiserver import ApiServerEmulator, declare_resources

pytestmark = [
    pytest.mark.unit,
    # KMock's bundled resource list is read with a deprecated importlib call.
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),
]


# ---------------------------------------------------------------------- the emulator

apiserver = emulated.apiserver
kube = emulated.kube


@pytest.fixture
async def stock_apiserver() -> AsyncIterator[kmock.KubernetesEmulator]:
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator):
        declare_resources(emulator)
        yield emulator


@pytest.fixture
async def stock_kube(stock_apiserver: kmock.KubernetesEmulator) -> AsyncIterator[Kube]:
    api = client(stock_apiserver)
    yield Kube(api)
    await api.close()


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
    reconcilers = SimpleNamespace(
        wake=noted("wake"),
        capacity_changed=noted("capacity_changed"),
        pool_generations={},
        jobs={key: state},
        caches=object(),
    )
    monkeypatch.setattr(handlers._State, "reconcilers", reconcilers)
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
    monkeypatch.setattr(handlers._State, "reconcilers", None)
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
