"""kopf handlers: thin glue between kopf, the Kubernetes API and `kubetune.control.reconcile`.

Run with `kopf run -m kubetune.controller.handlers --all-namespaces` (or `kubetune operator`).

Every FineTuneJob handler does the same four things: validate the body with the pydantic
models → observe the cluster → `reconcile()` (pure) → carry out the decision and patch the
status. Domain errors become `kopf.PermanentError`/`TemporaryError` only here. Children carry
owner references, so the garbage collector removes them (the checkpoint volume only when its
retention policy says so). kopf's timers need a finalizer on each object to stop cleanly; it
is named `kubetune.io/finalizer` and kopf removes it as soon as the object is deleted while
the operator runs (docs/configuration.md says how to remove it when the operator is gone).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from datetime import UTC, datetime
from functools import partial
from typing import Any, ClassVar

import kopf
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from pydantic import ValidationError

from kubetune.api.v1alpha1 import GROUP, VERSION, FineTuneJob, FineTuneJobStatus, GPUPool
from kubetune.api.vocabulary import EventType, Reason
from kubetune.control.conditions import now_rfc3339
from kubetune.control.lifecycle import failed
from kubetune.control.reconcile import ControllerSettings, Decision, reconcile
from kubetune.controller import metrics
from kubetune.controller.kube import Kube
from kubetune.controller.settings import settings_from_env
from kubetune.sources import load_arch

log = logging.getLogger("kubetune")

FTJ = (GROUP, VERSION, "finetunejobs")
POOLS = (GROUP, VERSION, "gpupools")


class _State:
    settings: ControllerSettings = settings_from_env()
    kube: Kube | None = None
    locks: ClassVar[defaultdict[str, asyncio.Lock]] = defaultdict(asyncio.Lock)


def _kube() -> Kube:
    if _State.kube is None:
        _State.kube = Kube(AsyncClient(), metrics_port=_State.settings.build.metrics_port)
    return _State.kube


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Keep kopf's bookkeeping in annotations: our status schema is strict and would prune it.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # Our own Events go through kopf.event; kopf's log lines stay out of the event stream.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    # A deleted job waits until its timer has stopped; kopf checks on it every 60 s by
    # default, which made `kubectl delete ftj` hang for a minute while a tick ran.
    settings.background.cancellation_polling = 1.0
    _State.settings = settings_from_env()
    _State.kube = Kube(AsyncClient(), metrics_port=_State.settings.build.metrics_port)
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
    if _State.kube is not None:
        await _State.kube.client.close()
        _State.kube = None


def status_patch(old: dict[str, Any], new: FineTuneJobStatus) -> dict[str, Any]:
    """A JSON merge patch turning `old` into `new` (None removes a field)."""
    wire = new.to_wire()
    patch: dict[str, Any] = {k: v for k, v in wire.items() if old.get(k) != v}
    for key in old:
        if key not in wire:
            patch[key] = None
    return patch


async def _reconcile_job(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger) -> None:
    key = f"{body.metadata.namespace}/{body.metadata.name}"
    async with _State.locks[key]:
        with metrics.reconcile_timer("finetunejob"):
            await _reconcile_locked(body, patch, logger)


async def _reconcile_locked(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger) -> None:
    raw = {
        "metadata": dict(body.metadata),
        "spec": dict(body.spec),
        "status": dict(body.status) or None,
    }
    try:
        job = FineTuneJob.model_validate(raw)
    except ValidationError as exc:
        # Admission normally catches this; an older CRD or a hand-edited status may not.
        message = f"invalid FineTuneJob: {exc.errors()[0]['msg']} at {exc.errors()[0]['loc']}"
        status = failed(FineTuneJobStatus(), Reason.INVALID_SPEC, message, datetime.now(UTC))
        patch.status.update(status_patch(dict(body.status), status))
        kopf.event(body, type=EventType.WARNING, reason=Reason.INVALID_SPEC, message=message)
        metrics.observe_job(raw, status.to_wire())
        return
    kube = _kube()
    settings = _State.settings
    observed = await kube.observe_job(job)
    loader = partial(load_arch, allow_network=settings.allow_network, local_files=False)
    now = datetime.now(UTC)
    decision = reconcile(job, observed, settings, now=now, load_arch=loader)
    try:
        await _carry_out(kube, job, decision, body)
    except ApiError as exc:
        if exc.status.code not in (400, 422):
            raise
        # The spec passed admission but makes a child Kubernetes refuses (a Secret or
        # StorageClass name, a volume size): retrying cannot help.
        message = (
            f"Kubernetes rejected an object built from this job's spec: {exc.status.message}. "
            "To fix: correct the spec field it names and create the job again"
        )
        decision.status = failed(decision.status, Reason.INVALID_SPEC, message, now)
        kopf.event(body, type=EventType.WARNING, reason=Reason.INVALID_SPEC, message=message)
    patch.status.update(status_patch(dict(body.status), decision.status))
    metrics.observe_job(raw, decision.status.to_wire())
    if decision.requeue_after is not None:
        logger.debug("next look in %.0fs", decision.requeue_after)


async def _carry_out(kube: Kube, job: FineTuneJob, d: Decision, body: kopf.Body) -> None:
    namespace = str(job.metadata["namespace"])
    for manifest in d.create:
        await kube.create_if_absent(manifest)
    for name in d.delete_jobs:
        await kube.delete_batch_job(namespace, name)
    for event in d.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    if d.delete_self:
        await kube.delete_finetunejob(namespace, str(job.metadata["name"]))


@kopf.on.create(*FTJ)
@kopf.on.resume(*FTJ)
@kopf.on.update(*FTJ, field="spec")
async def finetunejob_changed(
    body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any
) -> None:
    await _reconcile_job(body, patch, logger)


@kopf.timer(*FTJ, interval=_State.settings.poll_seconds, initial_delay=1.0)
async def finetunejob_tick(
    body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any
) -> None:
    await _reconcile_job(body, patch, logger)


@kopf.timer(*POOLS, interval=_State.settings.poll_seconds)
async def gpupool_capacity(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    try:
        pool = GPUPool.model_validate({"metadata": dict(body.metadata), "spec": dict(body.spec)})
    except ValidationError as exc:
        raise kopf.PermanentError(f"invalid GPUPool: {exc}") from exc
    with metrics.reconcile_timer("gpupool"):
        capacity = await _kube().pool_capacity(pool)
    capacity["observedGeneration"] = body.metadata.get("generation")
    changed = {k: v for k, v in capacity.items() if body.status.get(k) != v}
    if changed or not body.status.get("updatedAt"):
        patch.status.update(capacity)
        patch.status["updatedAt"] = now_rfc3339()
    metrics.observe_pool(body, capacity)


@kopf.on.delete(*FTJ, optional=True)
def finetunejob_deleted(body: kopf.Body, **_: Any) -> None:
    """Drop a deleted job's series (optional: never blocks deletion with a finalizer)."""
    metrics.forget_job(str(body.metadata.namespace), str(body.metadata.name))


@kopf.on.delete(*POOLS, optional=True)
def gpupool_deleted(body: kopf.Body, **_: Any) -> None:
    metrics.forget_pool(str(body.metadata.name))
