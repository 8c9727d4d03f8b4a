"""The operator's view of the cluster: watch-fed indexes instead of LIST calls.

kopf watches FineTuneJobs' children (batch Jobs, pods and claims labelled `kubetune.io/job`), all
pods that hold GPUs, Nodes, GPUPools, Namespaces (what each allows its jobs) and
StorageClasses (which allow volume expansion), and keeps
one in-memory index per kind (`@kopf.index` in controller/handlers.py, fed by the functions
below). kopf fills every index from its initial LIST before any other handler runs, then
keeps it current from the watch, so a reconcile reads only memory: it makes no API call to
look.

Why kopf indexes rather than an informer layer of our own: they ride on the watches kopf
already runs (one stream per kind, reconnected and resumed by kopf), and kopf's start-up
barrier (handlers wait until every index is filled) is exactly the guarantee a reconcile
needs not to mistake an unfilled cache for a missing child.

The index values are small: the fields the pure core reads, not whole objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from pydantic import ValidationError

from kubetune.api.tenancy import Tenant
from kubetune.api.v1alpha1 import FineTuneJob, GPUPool, GPUPoolStatus
from kubetune.api.vocabulary import LABEL_ATTEMPT, LABEL_JOB, LABEL_JOB_UID, LABEL_STEP, StepKind
from kubetune.control.build.names import child_names, label_value
from kubetune.control.capacity import NodeInfo, gpus_held, pool_capacity
from kubetune.control.conditions import now_rfc3339
from kubetune.control.reach import Term, VolumeReach, volume_reach
from kubetune.control.reconcile import Observed

JobKey = tuple[str, str]
"""(namespace, value of the `kubetune.io/job` label): how children find their job."""


class Store(Protocol):
    """What kopf's index lookups return: the values of every object under one key."""

    def __iter__(self) -> Any: ...


class Index(Protocol):
    def get(self, key: Any, default: Any = None) -> Any: ...
    def values(self) -> Any: ...
    def items(self) -> Any: ...
    def __len__(self) -> int: ...


def job_key_of(meta: Mapping[str, Any]) -> JobKey:
    """The key of a FineTuneJob from its metadata (the label value its children carry)."""
    return (str(meta.get("namespace") or "default"), label_value(str(meta.get("name") or "")))


def job_key(job: FineTuneJob) -> JobKey:
    return job_key_of(job.metadata)


def child_key(body: Mapping[str, Any]) -> JobKey | None:
    meta = body.get("metadata") or {}
    value = (meta.get("labels") or {}).get(LABEL_JOB)
    if not value:
        return None
    return (str(meta.get("namespace") or "default"), str(value))


# ---------------------------------------------------------------------- index values


_META_KEEP = (
    "name",
    "namespace",
    "uid",
    "labels",
    "annotations",
    "ownerReferences",
    "creationTimestamp",
    "deletionTimestamp",
)


def _meta(body: Mapping[str, Any]) -> dict[str, Any]:
    meta = body.get("metadata") or {}
    return {k: meta[k] for k in _META_KEEP if k in meta}


def trimmed_pod(body: Mapping[str, Any]) -> dict[str, Any]:
    """A trainer pod as the reconcile reads it: metadata, the node it is bound to, status."""
    node = (body.get("spec") or {}).get("nodeName")
    return {
        "metadata": _meta(body),
        "spec": {"nodeName": node} if node else {},
        "status": dict(body.get("status") or {}),
    }


def trimmed_batch_job(body: Mapping[str, Any]) -> dict[str, Any]:
    return {"metadata": _meta(body), "status": dict(body.get("status") or {})}


def trimmed_claim(body: Mapping[str, Any]) -> dict[str, Any]:
    """A job's PersistentVolumeClaim as the reconcile reads it: access modes, request,
    class and what was bound."""
    spec = body.get("spec") or {}
    keep = ("accessModes", "resources", "storageClassName", "volumeName")
    return {
        "metadata": _meta(body),
        "spec": {k: spec[k] for k in keep if k in spec},
        "status": dict(body.get("status") or {}),
    }


def gpu_usage(body: Mapping[str, Any]) -> dict[str, int] | None:
    """{node: GPUs} for a pod that holds GPUs; None (not indexed) otherwise."""
    held = gpus_held(body)
    return None if held is None else {held[0]: held[1]}


def tenant_of(body: Mapping[str, Any]) -> Tenant:
    """A Namespace as the reconcile reads it: its labels and the Secrets it allows."""
    meta = body.get("metadata") or {}
    return Tenant.of(
        str(meta.get("name") or ""), meta.get("labels") or {}, meta.get("annotations") or {}
    )


def parse_pool(body: Mapping[str, Any]) -> GPUPool | str:
    """The GPUPool, or why it cannot be read (it then takes part in no plan)."""
    try:
        return GPUPool.model_validate(
            {"metadata": dict(body.get("metadata") or {}), "spec": dict(body.get("spec") or {})}
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"spec.{where}: {first['msg']}"


# ---------------------------------------------------------------------- reads


def first(store: Iterable[Any] | None) -> Any:
    for value in store or ():
        return value
    return None


class Caches:
    """Reads over kopf's indexes (live views: they change between awaits)."""

    def __init__(
        self,
        pods: Index,
        batch_jobs: Index,
        nodes: Index,
        gpu_pods: Index,
        pools: Index,
        namespaces: Index | None = None,
        claims: Index | None = None,
        storage_classes: Index | None = None,
        volumes: Index | None = None,
    ) -> None:
        self.pods = pods
        self.batch_jobs = batch_jobs
        self.nodes = nodes
        self.gpu_pods = gpu_pods
        self.pools = pools
        self.namespaces = namespaces
        self.claims = claims
        """PersistentVolumeClaims labelled with a job, by (namespace, name)."""
        self.storage_classes = storage_classes
        """Whether each StorageClass allows volume expansion, by name."""
        self.volumes = volumes
        """The node affinity of each PersistentVolume that has one, by name."""

    def tenant(self, namespace: str) -> Tenant | None:
        """What `namespace` allows its jobs; a namespace missing from the index allows no
        Secret and has no labels. None when namespaces are not indexed at all."""
        if self.namespaces is None:
            return None
        return first(self.namespaces.get(namespace)) or Tenant(namespace)

    def valid_pools(self) -> list[GPUPool]:
        out = []
        for store in self.pools.values():
            pool = first(store)
            if isinstance(pool, GPUPool):
                out.append(pool)
        return sorted(out, key=lambda pool: pool.name)

    def node_infos(self) -> list[NodeInfo]:
        return [info for store in self.nodes.values() if (info := first(store)) is not None]

    def used_gpus(self) -> dict[str, int]:
        return {node: sum(store) for node, store in self.gpu_pods.items()}

    def capacities(self, pools: Iterable[GPUPool]) -> dict[str, dict[str, Any]]:
        nodes = self.node_infos()
        used = self.used_gpus()
        return {
            pool.name: pool_capacity(dict(pool.spec.node_selector), nodes, used) for pool in pools
        }

    def has_batch_job(self, key: JobKey, name: str, uid: str) -> bool:
        """Whether the cache holds batch Job `name` owned by the job with `uid`."""
        for batch in self.batch_jobs.get(key) or ():
            meta = batch.get("metadata") or {}
            owners = {ref.get("uid") for ref in meta.get("ownerReferences") or []}
            if meta.get("name") == name and uid in owners:
                return True
        return False

    def observe(self, job: FineTuneJob, pools: list[GPUPool]) -> Observed:
        """What `reconcile` needs about one job, from memory only."""
        key = job_key(job)
        uid = job.metadata.get("uid")
        by_attempt: dict[int, dict[str, Any]] = {}
        for batch in self.batch_jobs.get(key) or ():
            meta = batch.get("metadata") or {}
            raw = str((meta.get("labels") or {}).get(LABEL_ATTEMPT, ""))
            owners = {ref.get("uid") for ref in meta.get("ownerReferences") or []}
            # Only this object's children: a job deleted and created again under the same
            # name must not pick up the old one's (still terminating) batch Jobs.
            if raw.isdigit() and uid in owners:
                by_attempt[int(raw)] = batch
        status = job.status
        attempt = max([status.attempt if status else 0, *by_attempt])
        others = sorted(
            a
            for a, batch in by_attempt.items()
            if a != attempt and not (batch.get("metadata") or {}).get("deletionTimestamp")
        )
        tenant = self.tenant(key[0])
        steps = self._steps(key, uid)
        claim = steps["checkpoint_claim"] = self.checkpoint_claim(job)
        steps["checkpoint_class_expands"] = self.class_expands(claim)
        steps["checkpoint_reach"] = self.reach(claim, pools)
        if not attempt:
            return Observed(pools=pools, other_attempts=others, tenant=tenant, **steps)
        mine = [pod for pod in self.pods.get(key) or () if _of_job(pod, str(uid))]
        pods = [pod for pod in mine if _attempt_of(pod) == attempt]
        earlier = [pod for pod in mine if 0 < _attempt_of(pod) < attempt]
        return Observed(
            pools=pools,
            batch_job=by_attempt.get(attempt),
            pods=sorted(pods, key=lambda pod: str(pod["metadata"].get("name"))),
            lost_nodes=self.lost_nodes(pods),
            attempt=attempt,
            other_attempts=others,
            earlier_pods=sorted(earlier, key=lambda pod: str(pod["metadata"].get("name"))),
            tenant=tenant,
            **steps,
        )

    def lost_nodes(self, pods: Iterable[Mapping[str, Any]]) -> dict[str, str]:
        """The nodes of `pods` that are not Ready, and since when."""
        out: dict[str, str] = {}
        for pod in pods:
            node = (pod.get("spec") or {}).get("nodeName")
            info: NodeInfo | None = first(self.nodes.get(node)) if node else None
            if info is not None and info.not_ready_since is not None:
                out[str(node)] = info.not_ready_since
        return out

    def checkpoint_claim(self, job: FineTuneJob) -> dict[str, Any] | None:
        """The job's checkpoint volume claim, if the cache holds it. Any claim of that name
        counts, owned or not: one kept by `retention: retain` from an earlier job of the
        same name is the one the pods would mount."""
        if self.claims is None or not job.metadata.get("name"):
            return None
        name = child_names(str(job.metadata["name"]), 1).pvc
        claim: dict[str, Any] | None = first(self.claims.get((job_key(job)[0], name)))
        return claim

    def class_expands(self, claim: Mapping[str, Any] | None) -> bool | None:
        """Whether the claim's StorageClass allows volume expansion; None: not known."""
        if claim is None or self.storage_classes is None:
            return None
        name = (claim.get("spec") or {}).get("storageClassName")
        expands: bool | None = first(self.storage_classes.get(name)) if name else None
        return expands

    def reach(self, claim: Mapping[str, Any] | None, pools: list[GPUPool]) -> VolumeReach | None:
        """The pools that can mount the claim's bound volume; None when it is not bound, or
        its PersistentVolume may be mounted on any node (or is not known)."""
        volume = (claim or {}).get("spec", {}).get("volumeName")
        if not volume or self.volumes is None:
            return None
        terms: tuple[Term, ...] | None = first(self.volumes.get(volume))
        if not terms:
            return None
        return volume_reach(str(volume), terms, pools, (n.labels for n in self.node_infos()))

    def _steps(self, key: JobKey, uid: Any) -> dict[str, Any]:
        """The job's CPU steps' Jobs (owned by this object) and pods, as Observed fields."""
        stage_in_job, stage_in_pods = self._step(key, uid, StepKind.STAGE_IN)
        export_job, export_pods = self._step(key, uid, StepKind.EXPORT)
        stage_out_job, stage_out_pods = self._step(key, uid, StepKind.STAGE_OUT)
        return {
            "stage_in_job": stage_in_job,
            "stage_in_pods": stage_in_pods,
            "export_job": export_job,
            "export_pods": export_pods,
            "stage_out_job": stage_out_job,
            "stage_out_pods": stage_out_pods,
        }

    def _step(
        self, key: JobKey, uid: Any, kind: StepKind
    ) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        def step_of(obj: Mapping[str, Any]) -> Any:
            return ((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_STEP)

        batch = None
        for candidate in self.batch_jobs.get(key) or ():
            owners = {r.get("uid") for r in candidate["metadata"].get("ownerReferences") or []}
            if step_of(candidate) == kind.value and uid in owners:
                batch = candidate
        pods = [pod for pod in self.pods.get(key) or () if step_of(pod) == kind.value]
        return batch, pods


def with_capacity(pool: GPUPool, capacity: Mapping[str, Any], generation: Any) -> GPUPool:
    """The pool with its status replaced by live numbers (what the planner reads)."""
    status = GPUPoolStatus.model_validate(
        {**capacity, "observedGeneration": generation, "updatedAt": now_rfc3339()}
    )
    return pool.model_copy(update={"status": status})


def _of_job(pod: Mapping[str, Any], uid: str) -> bool:
    """Whether `pod` is one of this job's (`uid`), not one of an earlier job of the same
    name whose pods may still be terminating (a pod of an older operator, without the uid
    label, is taken as this job's)."""
    pod_labels = (pod.get("metadata") or {}).get("labels") or {}
    return pod_labels.get(LABEL_JOB_UID) in (None, uid)


def _attempt_of(pod: Mapping[str, Any]) -> int:
    """The attempt a trainer pod belongs to (0: not a trainer attempt's pod)."""
    raw = str(((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_ATTEMPT, ""))
    return int(raw) if raw.isdigit() else 0
