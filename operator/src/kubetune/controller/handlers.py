"""kopf handlers: thin glue between kopf and `kubetune.controller.reconcilers`.

Run with `kopf run -m kubetune.controller.handlers --all-namespaces` (or `kubetune operator`).

What is registered here:
- indexes (watch-fed caches, controller/cache.py) of FineTuneJobs' batch Jobs, pods and
  PersistentVolumeClaims (the checkpoint volume's access modes bound a re-plan, its size
  may grow with one), and of StorageClasses (which allow volume expansion),
  of pods holding GPUs, of Nodes and of GPUPools; kopf fills them before any loop starts;
- event handlers that wake the loop a change concerns: a child's change wakes its job, a
  change of a job's spec wakes the job, a change of capacity wakes queued jobs and pools;
- the reconcile loops (controller/reconcilers.py): one per FineTuneJob, started by the job's
  first event and stopped by its deletion (controller/loops.py, no finalizer on the job), and
  one per GPUPool, a kopf daemon.

kopf's daemons need a finalizer on each object to stop cleanly; a GPUPool carries one,
named `kubetune.io/finalizer`, which kopf removes as soon as the pool is deleted while the
operator runs (docs/configuration.md says how to remove it when the operator is gone).
FineTuneJobs created under an earlier version of the operator carry it too: kopf removes
it at the first event it sees of each.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from functools import partial
from typing import Any

import kopf
from lightkube import AsyncClient

from kubetune.api.tenancy import Tenant
from kubetune.api.v1alpha1 import GROUP, VERSION
from kubetune.api.vocabulary import LABEL_JOB, EventType, Reason
from kubetune.control.capacity import NodeInfo, node_info
from kubetune.control.reach import volume_terms
from kubetune.controller import leader, metrics
from kubetune.controller.cache import (
    Caches,
    child_key,
    gpu_usage,
    job_key_of,
    parse_pool,
    tenant_of,
    trimmed_batch_job,
    trimmed_claim,
    trimmed_pod,
)
from kubetune.controller.kube import Kube
from kubetune.controller.loops import JobLoops
from kubetune.controller.reconcilers import Reconcilers
from kubetune.controller.settings import settings_from_env
from kubetune.sources import load_arch

log = logging.getLogger("kubetune")

FTJ = (GROUP, VERSION, "finetunejobs")
POOLS = (GROUP, VERSION, "gpupools")
PODS = ("", "v1", "pods")
BATCH_JOBS = ("batch", "v1", "jobs")
NODES = ("", "v1", "nodes")
NAMESPACES = ("", "v1", "namespaces")
CLAIMS = ("", "v1", "persistentvolumeclaims")
STORAGE_CLASSES = ("storage.k8s.io", "v1", "storageclasses")
VOLUMES = ("", "v1", "persistentvolumes")
CHILD = {LABEL_JOB: kopf.PRESENT}
LOOP_STOP_SECONDS = 10.0
"""How long the job loops get to end their looks when the operator exits."""


class _State:
    reconcilers: Reconcilers | None = None
    loops: JobLoops | None = None
    loop_lag: asyncio.Task[None] | None = None
    nodes: dict[str, NodeInfo] = {}  # noqa: RUF012 - the operator's one process-wide view
    gpu_pods: dict[str, Any] = {}  # noqa: RUF012


def _post_event(body: Mapping[str, Any], type_: EventType, reason: Reason, message: str) -> None:
    target = body if isinstance(body, kopf.Body) else kopf.Body(dict(body))  # type: ignore[arg-type]
    kopf.event(target, type=str(type_), reason=str(reason), message=message)


def _forget_job(body: Mapping[str, Any]) -> None:
    meta = body.get("metadata") or {}
    metrics.forget_job(str(meta.get("namespace")), str(meta.get("name")))


def _reconcilers() -> Reconcilers:
    if _State.reconcilers is None:
        raise kopf.TemporaryError("the operator is still starting", delay=1)
    return _State.reconcilers


def _caches(kwargs: Mapping[str, Any]) -> Caches:
    return Caches(
        pods=kwargs["ftj_pods"],
        batch_jobs=kwargs["ftj_batch_jobs"],
        nodes=kwargs["nodes"],
        gpu_pods=kwargs["gpu_pods"],
        pools=kwargs["pools"],
        namespaces=kwargs["namespaces"],
        claims=kwargs["ftj_claims"],
        storage_classes=kwargs["storage_classes"],
        volumes=kwargs["volumes"],
    )


class NoDiffBase(kopf.AnnotationsDiffBaseStorage):
    """No diff base: this operator has no change handlers (on.create/update/delete/field);
    its loops compare generations themselves, and its event handlers only wake them. kopf
    still builds a diff base for every event of every watched object (a deep copy, pods
    included), which was a tenth of the operator's event-loop time at 1,000 jobs; nothing
    reads it. `test_handlers` keeps the registry free of change handlers."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Keep kopf's bookkeeping in annotations: our status schema is strict and would prune it.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = NoDiffBase(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # Our own Events go through kopf.event; kopf's log lines stay out of the event stream.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    # A deleted job waits until its loop has stopped; kopf checks on it every 60 s by
    # default, which made `kubectl delete ftj` hang for a minute.
    settings.background.cancellation_polling = 1.0
    controller = settings_from_env()
    # Every write asks the Lease elector first (always yes without leader election).
    kube = Kube(
        AsyncClient(), metrics_port=controller.build.metrics_port, may_write=leader.may_write
    )
    loader = partial(load_arch, allow_network=controller.allow_network, local_files=False)
    _State.reconcilers = Reconcilers(controller, kube, loader, _post_event)
    _State.loops = JobLoops(_State.reconcilers.run_job, forget=_forget_job)
    _State.loop_lag = asyncio.get_running_loop().create_task(metrics.sample_loop_lag())
    try:
        port = metrics.start_server()
    except OSError as exc:  # a taken port must not stop the operator
        log.warning("operator metrics not served: %s", exc)
    else:
        if port >= 0:
            log.info("operator metrics on :%d/metrics", port)


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account first, then the kubeconfig (read at login, not import)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.cleanup()
async def close_client(**_: Any) -> None:
    if _State.loop_lag is not None:
        _State.loop_lag.cancel()
        _State.loop_lag = None
    if _State.loops is not None:
        await _State.loops.stop_all(timeout=LOOP_STOP_SECONDS)
        _State.loops = None
    if _State.reconcilers is not None:
        await _State.reconcilers.close()
        _State.reconcilers = None


@kopf.on.probe(id="reconciles")
def reconciles(**_: Any) -> dict[str, Any]:
    """Liveness: fails when reconciliation stalled for every job (Reconcilers.health)."""
    return _reconcilers().health()


# ---------------------------------------------------------------------- caches
# An index function returns {} (never None) for an object that no longer belongs in the
# index: kopf keeps an object's previous values when its function returns None, so a pod
# that finished would hold its GPUs in the cache until it is deleted.
#
# The index functions and the wake-up handlers below are coroutines although none awaits:
# kopf runs a plain function in a worker thread, one hop per function per watch event
# (several per pod event), and the wake-ups touch the loop's state (asyncio Events, the
# debounced wake pass), which only the loop's own thread may.


@kopf.index(*BATCH_JOBS, labels=CHILD)
async def ftj_batch_jobs(body: kopf.Body, **_: Any) -> dict[Any, Any]:
    key = child_key(body)
    return {} if key is None else {key: trimmed_batch_job(body)}


@kopf.index(*PODS, labels=CHILD)
async def ftj_pods(body: kopf.Body, **_: Any) -> dict[Any, Any]:
    key = child_key(body)
    return {} if key is None else {key: trimmed_pod(body)}


@kopf.index(*CLAIMS, labels=CHILD)
async def ftj_claims(body: kopf.Body, **_: Any) -> dict[Any, Any]:
    meta = body.get("metadata") or {}
    key = (str(meta.get("namespace") or "default"), str(meta.get("name") or ""))
    return {key: trimmed_claim(body)}


@kopf.index(*STORAGE_CLASSES)
async def storage_classes(body: kopf.Body, **_: Any) -> dict[str, bool]:
    return {str(body.metadata.name): body.get("allowVolumeExpansion") is True}


@kopf.index(*VOLUMES)
async def volumes(body: kopf.Body, **_: Any) -> dict[str, Any]:
    """PersistentVolumes with a node affinity (zonal disks): where a job's bound checkpoint
    volume can be mounted, which keeps its re-plans to pools there (control/reach.py)."""
    terms = volume_terms(body)
    return {} if terms is None else {str(body.metadata.name): terms}


@kopf.index(*PODS)
async def gpu_pods(body: kopf.Body, **_: Any) -> dict[str, int]:
    return gpu_usage(body) or {}


@kopf.index(*NODES)
async def nodes(body: kopf.Body, **_: Any) -> dict[str, NodeInfo]:
    return {str(body.metadata.name): node_info(body)}


@kopf.index(*POOLS)
async def pools(body: kopf.Body, **_: Any) -> dict[str, Any]:
    return {str(body.metadata.name): parse_pool(body)}


@kopf.index(*NAMESPACES)
async def namespaces(body: kopf.Body, **_: Any) -> dict[str, Tenant]:
    return {str(body.metadata.name): tenant_of(body)}


# ---------------------------------------------------------------------- wake-ups

WAKE_HANDLERS = frozenset(
    {"child_changed", "pod_changed", "node_changed", "pool_changed", "finetunejob_changed"}
)


class QuietWakeUps(logging.Filter):
    """Drops kopf's "Handler 'pod_changed' succeeded." line for the wake-up handlers below:
    they run on every watch event of every pod, node, batch Job and job (thousands a second
    on a busy cluster) and do nothing worth a line. Their failures are still logged."""

    QUIET = frozenset(f"Handler '{name}' succeeded." for name in WAKE_HANDLERS)

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.QUIET


logging.getLogger("kopf.objects").addFilter(QuietWakeUps())


@kopf.on.event(*BATCH_JOBS, labels=CHILD)
@kopf.on.event(*PODS, labels=CHILD)
async def child_changed(body: kopf.Body, **_: Any) -> None:
    key = child_key(body)
    if key is not None and _State.reconcilers is not None:
        _State.reconcilers.wake(key)


@kopf.on.event(*PODS)
async def pod_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    uid = str(body.metadata.uid)
    held = None if type == "DELETED" else gpu_usage(body)
    if _State.gpu_pods.get(uid) != held:
        if held is None:
            _State.gpu_pods.pop(uid, None)
        else:
            _State.gpu_pods[uid] = held
        if _State.reconcilers is not None:
            _State.reconcilers.capacity_changed()


@kopf.on.event(*NODES)
async def node_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    name = str(body.metadata.name)
    info = None if type == "DELETED" else node_info(body)
    if _State.nodes.get(name) != info:
        if info is None:
            _State.nodes.pop(name, None)
        else:
            _State.nodes[name] = info
        if _State.reconcilers is not None:
            _State.reconcilers.capacity_changed()


@kopf.on.event(*POOLS)
async def pool_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    if type == "DELETED":
        metrics.forget_pool(str(body.metadata.name))
    reconcilers = _State.reconcilers
    if reconcilers is None:
        return
    # Its own status writes come back here too; only a new spec or a deletion matters.
    generation = (type, body.metadata.get("generation"))
    if reconcilers.pool_generations.get(str(body.metadata.name)) != generation:
        reconcilers.pool_generations[str(body.metadata.name)] = generation
        reconcilers.capacity_changed()


@kopf.on.event(*FTJ)
async def finetunejob_changed(body: kopf.Body, type: str | None, **kwargs: Any) -> None:
    """The job's first event starts its loop and its deletion stops it (controller/loops.py);
    a new spec (generation) wakes it; status writes do not."""
    deleted = type == "DELETED"
    if deleted:
        metrics.forget_job(str(body.metadata.namespace), str(body.metadata.name))
    reconcilers, loops = _State.reconcilers, _State.loops
    if reconcilers is None or loops is None:
        return
    if reconcilers.caches is None:
        reconcilers.caches = _caches(kwargs)
    if loops.observe(body, deleted=deleted) or deleted:
        return
    key = job_key_of(body.metadata)
    state = reconcilers.jobs.get(key)
    if state is None:
        return
    # A deletionTimestamp needs no wake-up here: `observe` set the loop's stop flag, which
    # ends its wait.
    if body.metadata.get("generation") != state.generation:
        state.wake.set()


# ---------------------------------------------------------------------- loops


@kopf.daemon(*POOLS, cancellation_backoff=5.0, cancellation_timeout=10.0)
async def gpupool_loop(body: kopf.Body, stopped: kopf.DaemonStopped, **kwargs: Any) -> None:
    reconcilers = _reconcilers()
    if reconcilers.caches is None:
        reconcilers.caches = _caches(kwargs)
    await reconcilers.run_pool(body, stopped)
