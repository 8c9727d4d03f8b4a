"""The operator's Kubernetes API calls, in one place (lightkube, async).

Reconciles read the cluster from watch-fed caches (controller/cache.py); what goes through
here are the writes (`create_if_absent`, `delete_batch_job`, `patch_status`, ...), the one
read that resolves a create conflict (`existing`), the launch preflight's reads of the
claims and Secret a job names (`missing_inputs`) and the trainer metrics scrape.
Every call retries what a retry can fix (throttling, server errors, lost connections, and
for status writes conflicts) a few times, with jittered exponential back-off (tenacity,
controller/backoff.py) so that calls which failed together do not all try again together,
before it gives up; `patch_status` raises `StatusRejected` for what it cannot (the
apiserver's 422).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import urllib.request
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import httpx2
from lightkube import AsyncClient, codecs
from lightkube.core.exceptions import ApiError
from lightkube.generic_resource import create_global_resource, create_namespaced_resource
from lightkube.resources.batch_v1 import Job
from lightkube.resources.core_v1 import ConfigMap, PersistentVolumeClaim, Secret, Service
from lightkube.resources.networking_v1 import NetworkPolicy
from lightkube.types import CascadeType, PatchType
from prometheus_client.parser import text_string_to_metric_families
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt

from kubetune.api.v1alpha1 import GROUP, VERSION, FineTuneJob
from kubetune.api.vocabulary import ANNOTATION_RETENTION, COMPLETION_INDEX_ANNOTATION
from kubetune.control.build.storage import InputRef
from kubetune.control.ownership import Existing, Owner
from kubetune.control.pods import PodPhase
from kubetune.control.reconcile import MissingInput
from kubetune.controller.backoff import RANDOM, Backoff, BackoffWait

log = logging.getLogger("kubetune")

FineTuneJobResource = create_namespaced_resource(GROUP, VERSION, "FineTuneJob", "finetunejobs")
GPUPoolResource = create_global_resource(GROUP, VERSION, "GPUPool", "gpupools")

_KINDS: dict[str, Any] = {
    "Job": Job,
    "Service": Service,
    "ConfigMap": ConfigMap,
    "PersistentVolumeClaim": PersistentVolumeClaim,
    "NetworkPolicy": NetworkPolicy,
}

TRANSIENT_CODES = frozenset({429, 500, 502, 503, 504})
"""Answers every call is retried on: throttling, the server's trouble."""
RETRY_CODES = TRANSIENT_CODES | {409}
"""Answers a status write is retried on: those and a conflict."""
RETRIES = 5
"""Attempts of one call after its first; the reconcile loop tries the call again later if
all of them fail."""
RETRY_WAITS = Backoff(first=0.3, cap=5.0)
"""Waits between the attempts: at most 0.3, 0.6, 1.2, 2.4 and 4.8 s, each at least half that
(5 to 9 s in all)."""

T = TypeVar("T")


class StatusRejected(Exception):
    """The apiserver refused a status write as invalid (422): retrying cannot help."""

    def __init__(self, message: str, fields: list[str]) -> None:
        super().__init__(message)
        self.fields = fields


class Fenced(Exception):
    """This replica may not write (it does not hold the leader lease)."""


def _rejected_fields(exc: ApiError) -> list[str]:
    details = exc.status.details
    causes = (details.causes if details else None) or []
    return [str(cause.field) for cause in causes if cause.field]


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


def _retryable(exc: BaseException, codes: frozenset[int]) -> bool:
    """Whether a retry may fix what `exc` says: an answer with one of `codes` (with a
    Kubernetes Status body or without one, e.g. a load balancer's HTML 503), or a lost
    connection."""
    if isinstance(exc, ApiError):
        return exc.status.code in codes
    if isinstance(exc, httpx2.HTTPStatusError):
        return exc.response.status_code in codes
    return isinstance(exc, httpx2.TransportError)


def _log_retry(what: str, state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    if isinstance(exc, ApiError):
        log.info("%s answered %s; retrying", what, exc.status.code)
    elif isinstance(exc, httpx2.HTTPStatusError):
        log.info("%s answered %s; retrying", what, exc.response.status_code)
    else:
        log.info("%s failed (%s); retrying", what, exc)


def _fetch_text(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return str(response.read(4 * 1024 * 1024).decode("utf-8", errors="replace"))


class Kube:
    def __init__(
        self,
        client: AsyncClient,
        metrics_port: int = 9400,
        scrape_timeout_s: float = 1.0,
        may_write: Callable[[], bool] = lambda: True,
        rng: random.Random = RANDOM,
    ) -> None:
        self.client = client
        self.metrics_port = metrics_port
        self.scrape_timeout_s = scrape_timeout_s
        self.may_write = may_write
        """Asked before every write; False (the leader lease is lost) stops it with `Fenced`."""
        self.rng = rng
        """Draws the retries' waits."""
        self._unreadable_warned: set[int] = set()

    def _check_fence(self) -> None:
        if not self.may_write():
            raise Fenced("this operator replica does not hold the leader lease")

    # ------------------------------------------------------------------ reads

    async def trainer_metrics(self, pods: Sequence[Mapping[str, Any]]) -> dict[str, float] | None:
        """Scrape the rank-0 trainer's Prometheus endpoint; None when it is not reachable."""
        for pod in pods:
            annotations = (pod.get("metadata") or {}).get("annotations") or {}
            status = pod.get("status") or {}
            rank0 = annotations.get(COMPLETION_INDEX_ANNOTATION) == "0"
            if not rank0 or status.get("phase") != PodPhase.RUNNING:
                continue
            return await self._scrape(status)
        return None

    async def stage_in_progress(self, pods: Sequence[Mapping[str, Any]]) -> dict[str, float] | None:
        """The running stage-in pod's progress gauges (`bytes_done`, `bytes_total`,
        `files_done`, `files_total`); None when none is reachable."""
        for pod in pods:
            status = pod.get("status") or {}
            if status.get("phase") != PodPhase.RUNNING:
                continue
            scraped = await self._scrape(status)
            if scraped is None:
                return None
            prefix = "stagein_"
            return {k.removeprefix(prefix): v for k, v in scraped.items() if k.startswith(prefix)}
        return None

    async def _scrape(self, status: Mapping[str, Any]) -> dict[str, float] | None:
        """A pod's `kubetune_trainer_*` samples from its metrics port."""
        ip = status.get("podIP")
        if not ip:
            return None
        url = f"http://{ip}:{self.metrics_port}/metrics"
        try:
            # A blocking read with socket timeouts, in a worker thread: it always ends,
            # even when a process exits halfway through answering.
            text = await asyncio.to_thread(_fetch_text, url, self.scrape_timeout_s)
        except (OSError, ValueError):
            return None
        return parse_trainer_metrics(text)

    async def existing(self, manifest: Mapping[str, Any]) -> Existing | None:
        """The owners, labels and annotations of the live object a manifest names; None
        when it does not exist."""
        meta = manifest.get("metadata") or {}
        kind = _KINDS.get(str(manifest.get("kind")))
        if kind is None:
            raise ValueError(f"no reader for kind {manifest.get('kind')!r}")
        try:
            obj = await self._retrying(
                f"read of {kind.__name__} {meta.get('namespace')}/{meta['name']}",
                lambda: self.client.get(kind, name=meta["name"], namespace=meta.get("namespace")),
                write=False,
            )
        except ApiError as exc:
            if exc.status.code == 404:
                return None
            raise
        live = obj.metadata
        if live is None:
            return Existing()
        return Existing(
            owners=tuple(Owner(r.kind, r.name, r.uid) for r in live.ownerReferences or ()),
            labels=dict(live.labels or {}),
            annotations=dict(live.annotations or {}),
        )

    async def missing_inputs(self, namespace: str, refs: Sequence[InputRef]) -> list[MissingInput]:
        """Which of `refs` do not exist in `namespace` (a Secret also when it lacks the key).
        What cannot be read (no RBAC permission, the API server's trouble) counts as present:
        the pods' own errors tell of it after the launch."""
        missing = []
        for ref in refs:
            kind: Any = Secret if ref.kind == "Secret" else PersistentVolumeClaim

            async def read(kind: Any = kind, name: str = ref.name) -> Any:
                return await self.client.get(kind, name=name, namespace=namespace)

            try:
                obj = await self._retrying(
                    f"read of {ref.kind} {namespace}/{ref.name}", read, write=False
                )
            except ApiError as exc:
                code = exc.status.code or 0
                if code == 404:
                    missing.append(MissingInput(ref, "does not exist"))
                elif code not in self._unreadable_warned:
                    self._unreadable_warned.add(code)
                    log.warning(
                        "cannot read %s %s/%s before a launch (HTTP %s); not checking it",
                        ref.kind,
                        namespace,
                        ref.name,
                        code,
                    )
                continue
            except (httpx2.HTTPError, OSError) as exc:
                log.info("cannot read %s %s/%s (%s); not checking it", ref.kind, namespace,
                         ref.name, exc)  # fmt: skip
                continue
            if ref.key is not None and isinstance(obj, Secret):
                keys = set(obj.data or {}) | set(obj.stringData or {})
                if ref.key not in keys:
                    missing.append(MissingInput(ref, f"has no key {ref.key!r}"))
        return missing

    async def _retrying(
        self,
        what: str,
        call: Callable[[], Awaitable[T]],
        codes: frozenset[int] = TRANSIENT_CODES,
        write: bool = True,
    ) -> T:
        """`call()`, tried again after RETRY_WAITS while it is answered with one of `codes`
        or loses its connection, RETRIES times; then the last error is raised. A write checks
        the fence before each attempt. (A create retried after a lost answer may find its own
        object: the caller's 409 handling covers that.)"""

        async def attempt() -> T:
            if write:
                self._check_fence()
            return await call()

        retrying = AsyncRetrying(
            stop=stop_after_attempt(RETRIES + 1),
            wait=BackoffWait(RETRY_WAITS, self.rng),
            retry=retry_if_exception(lambda exc: _retryable(exc, codes)),
            before_sleep=lambda state: _log_retry(what, state),
            sleep=asyncio.sleep,
            reraise=True,
        )
        result: T = await retrying(attempt)
        return result

    # ------------------------------------------------------------------ writes

    async def patch_status(
        self, namespace: str | None, name: str, patch: Mapping[str, Any], *, pool: bool = False
    ) -> str | None:
        """Merge-patch the status of a FineTuneJob (or, with `pool`, a GPUPool); the new
        resourceVersion, or None when the object is gone.

        Retried on conflicts, throttling, server errors and lost connections (RETRY_WAITS);
        a 422 raises `StatusRejected` naming the fields; the last error of a failed series is
        raised for the caller to try again later.
        """
        body = {"status": dict(patch)}

        async def write() -> Any:
            if pool:
                return await self.client.patch(
                    GPUPoolResource.Status, name, body, patch_type=PatchType.MERGE
                )
            return await self.client.patch(
                FineTuneJobResource.Status,
                name,
                body,
                namespace=namespace,
                patch_type=PatchType.MERGE,
            )

        try:
            obj = await self._retrying(f"status write of {namespace}/{name}", write, RETRY_CODES)
        except ApiError as exc:
            code = exc.status.code
            if code == 404:
                return None
            if code == 422:
                raise StatusRejected(str(exc.status.message), _rejected_fields(exc)) from exc
            raise
        return str(obj.metadata.resourceVersion) if obj.metadata else ""

    async def create_if_absent(self, manifest: Mapping[str, Any]) -> bool:
        """Create the object; False when it already existed."""
        obj = codecs.from_dict(dict(manifest))
        meta = manifest.get("metadata") or {}
        what = f"create of {manifest.get('kind')} {meta.get('namespace')}/{meta.get('name')}"
        try:
            await self._retrying(what, lambda: self.client.create(obj))
        except ApiError as exc:
            if exc.status.code == 409:
                return False
            raise
        return True

    async def resize_claim(self, namespace: str, name: str, storage: str) -> None:
        """Raise a PersistentVolumeClaim's storage request (its StorageClass allows it)."""
        patch = {"spec": {"resources": {"requests": {"storage": storage}}}}
        await self._patch_claim(namespace, name, patch, "resize")

    async def release_claim(self, namespace: str, name: str) -> None:
        """Take a PersistentVolumeClaim from its owner: garbage collection no longer deletes
        it with the job (its retention annotation says so). A claim already gone is no error."""
        patch = {
            "metadata": {"ownerReferences": None, "annotations": {ANNOTATION_RETENTION: "retain"}}
        }
        try:
            await self._patch_claim(namespace, name, patch, "release")
        except ApiError as exc:
            if exc.status.code != 404:
                raise

    async def _patch_claim(
        self, namespace: str, name: str, patch: Mapping[str, Any], what: str
    ) -> None:
        await self._retrying(
            f"{what} of PersistentVolumeClaim {namespace}/{name}",
            lambda: self.client.patch(
                PersistentVolumeClaim, name, patch, namespace=namespace, patch_type=PatchType.MERGE
            ),
        )

    async def delete_batch_job(self, namespace: str, name: str) -> None:
        """Delete a batch Job and (in the background) its pods, which get SIGTERM first."""
        try:
            await self._retrying(
                f"delete of Job {namespace}/{name}",
                lambda: self.client.delete(
                    Job, name=name, namespace=namespace, cascade=CascadeType.BACKGROUND
                ),
            )
        except ApiError as exc:
            if exc.status.code != 404:
                raise

    async def read_finetunejob(self, namespace: str, name: str) -> tuple[FineTuneJob | None] | None:
        """A FineTuneJob by name: `(job,)`, `(None,)` when it does not exist, None when it
        could not be read (no permission, the API server's trouble)."""
        try:
            obj = await self._retrying(
                f"read of FineTuneJob {namespace}/{name}",
                lambda: self.client.get(FineTuneJobResource, name=name, namespace=namespace),
                write=False,
            )
        except ApiError as exc:
            return (None,) if exc.status.code == 404 else None
        except (httpx2.HTTPError, OSError):
            return None
        try:
            return (FineTuneJob.model_validate(obj.to_dict()),)  # type: ignore[no-untyped-call]
        except ValueError:
            return None

    async def delete_finetunejob(self, namespace: str, name: str) -> None:
        try:
            await self._retrying(
                f"delete of FineTuneJob {namespace}/{name}",
                lambda: self.client.delete(FineTuneJobResource, name=name, namespace=namespace),
            )
        except ApiError as exc:
            if exc.status.code != 404:
                raise
