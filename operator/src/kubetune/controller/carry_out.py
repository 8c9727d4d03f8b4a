"""Carrying out a decision: its status, its children, its deletions and its Events.

`reconcile` decides and touches nothing; this is where its `Decision` reaches the API
server, in an order that never starts a trainer the status does not know of: the status and
the objects the trainer's pods use first, the batch Job last.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from lightkube.core.exceptions import ApiError

from kubetune.api.v1alpha1 import FineTuneJob
from kubetune.api.vocabulary import EventType, Reason
from kubetune.control.lifecycle import failed
from kubetune.control.ownership import Claim, judge
from kubetune.control.reconcile import ControllerSettings, Decision
from kubetune.controller.cache import job_key
from kubetune.controller.capacity_view import CapacityView
from kubetune.controller.kube import Kube
from kubetune.controller.status_writes import PostEvent, StatusWriter, Written

log = logging.getLogger(__name__)

Conflict = tuple[Reason, str]
"""Why a child could not be created: the reason the job fails with, and its message."""


@dataclass(frozen=True)
class Held:
    """A child not created yet, for a reason that passes (an earlier job's object the
    garbage collector has yet to remove): the launch waits for a later look."""

    why: str


Outcome = Conflict | Held | None


class CarryOut:
    """Carries out the decisions of every job's loop (one per operator process)."""

    def __init__(
        self,
        settings: ControllerSettings,
        kube: Kube,
        view: CapacityView,
        writer: StatusWriter,
        post_event: PostEvent,
    ) -> None:
        self.settings = settings
        self.kube = kube
        self.view = view
        self.writer = writer
        self.post_event = post_event

    async def apply(
        self,
        job: FineTuneJob,
        created: dict[str, float],
        written: Written,
        d: Decision,
        body: Mapping[str, Any],
        now: datetime,
        old: Mapping[str, Any],
    ) -> tuple[bool, dict[str, Any]]:
        """Write the decision's status and create its children; whether the status landed,
        and the status written (wire form). `created` holds the children this process
        created ("Kind/name" → monotonic time), `written` what it knows of its writes, `old`
        the status the look began from.

        The status goes out together with the objects the trainer's pods use (volume,
        config, Service), in one round trip: on a busy API server a user sees the plan as
        soon as it is made, not after every create. The batch Job comes last, once those
        exist and none conflicts. A status write that fails creates no batch Job (the next
        look decides again); one the apiserver rejects (422) does not hold the launch back,
        and the next look follows the batch Job (`adopt_lost_launch`). A conflict fails the
        job with a second write.
        """
        namespace, name = str(job.metadata["namespace"]), str(job.metadata["name"])
        first = [m for m in d.create if m["kind"] != "Job"]
        last = [m for m in d.create if m["kind"] == "Job"]
        wire = d.status.to_wire()
        write = self.writer.write(written, namespace, name, old, wire, body)
        landed, conflict = await asyncio.gather(
            write, self._create_children(job, created, first), return_exceptions=True
        )
        # Both have finished: neither is left running behind an error.
        if isinstance(landed, BaseException):
            raise landed
        if isinstance(conflict, BaseException):
            raise conflict
        if conflict is None and last:
            conflict = await self._create_children(job, created, last)
        if isinstance(conflict, Held):  # no batch Job yet: a later look creates it
            log.info("%s/%s: launch held: %s", namespace, name, conflict.why)
        elif conflict is not None:
            landed, wire = await self._fail(job, written, d, body, now, conflict)
        await self._follow_up(namespace, name, d, body)
        return bool(landed), wire

    async def _fail(
        self,
        job: FineTuneJob,
        written: Written,
        d: Decision,
        body: Mapping[str, Any],
        now: datetime,
        conflict: Conflict,
    ) -> tuple[bool, dict[str, Any]]:
        """Fail the job over a child it cannot have (its Events then are this one alone)."""
        namespace, name = str(job.metadata["namespace"]), str(job.metadata["name"])
        reason, message = conflict
        d.status = failed(d.status, reason, message, now)
        d.events.clear()
        self.post_event(body, EventType.WARNING, reason, message)
        wire = d.status.to_wire()
        old = written.latest(body) or {}
        return await self.writer.write(written, namespace, name, old, wire, body), wire

    async def _follow_up(
        self, namespace: str, name: str, d: Decision, body: Mapping[str, Any]
    ) -> None:
        """The decision's deletions, claim expansions and releases and Events, after its
        writes (a release before the job's own deletion)."""
        for batch_job in d.delete_jobs:
            await self.kube.delete_batch_job(namespace, batch_job)
        for claim, storage in d.resize_claims:
            try:
                await self.kube.resize_claim(namespace, claim, storage)
            except ApiError as exc:  # e.g. a class that shrugged off expansion after all
                d.events = [e for e in d.events if e.reason != Reason.CHECKPOINT_VOLUME_EXPANDED]
                self.post_event(
                    body,
                    EventType.WARNING,
                    Reason.CHECKPOINT_VOLUME_SMALL,
                    f"{claim} could not be expanded to {storage}: {exc.status.message}; the "
                    "trainer may run out of room when it saves",
                )
        for claim in d.release_claims:
            await self.kube.release_claim(namespace, claim)
        for event in d.events:
            self.post_event(body, event.type, event.reason, event.message)
        if d.delete_self:
            await self.kube.delete_finetunejob(namespace, name)

    async def _create_children(
        self, job: FineTuneJob, created: dict[str, float], manifests: Sequence[Mapping[str, Any]]
    ) -> Outcome:
        """Create each child once, together; the first conflict found, else the first
        child held back, if any.

        A name taken by an object that is not this job's is a conflict (control/ownership.py
        says whose it is; one an earlier job of this name left for the garbage collector
        holds the launch back instead), and so is a child Kubernetes refuses (400, 422): the
        spec passed admission but makes an object that cannot exist (a Secret or
        StorageClass name, a volume size), and retrying cannot help.
        A child counts as created when the cache holds it (batch Jobs) or when this process
        created it in the last resync period; only then is it POSTed again (a child deleted
        behind the operator's back comes back within one resync).
        """
        try:
            found = await asyncio.gather(*(self._create_child(job, created, m) for m in manifests))
        except ApiError as exc:
            if exc.status.code not in (400, 422):
                raise
            return (
                Reason.INVALID_SPEC,
                f"Kubernetes rejected an object built from this job's spec: "
                f"{exc.status.message}. To fix: correct the spec field it names and create "
                "the job again",
            )
        conflicts = [c for c in found if c is not None and not isinstance(c, Held)]
        return conflicts[0] if conflicts else next((c for c in found if c is not None), None)

    async def _create_child(
        self, job: FineTuneJob, created: dict[str, float], manifest: Mapping[str, Any]
    ) -> Outcome:
        caches = self.view.caches
        assert caches is not None
        uid = str(job.metadata.get("uid"))
        kind = str(manifest["kind"])
        name = str(manifest["metadata"]["name"])
        ident = f"{kind}/{name}"
        at = created.get(ident)
        if at is not None and time.monotonic() - at < self.settings.resync_seconds:
            return None
        if kind == "Job" and caches.has_batch_job(job_key(job), name, uid):
            created[ident] = time.monotonic()
            return None
        if not await self.kube.create_if_absent(manifest):
            existing = await self.kube.existing(manifest)
            if existing is None:
                return Held(f"{ident} was removed as it was created; creating it again")
            verdict = judge(manifest, existing, str(job.metadata["name"]), uid)
            if verdict.claim is Claim.WAIT:
                return Held(verdict.message)
            if verdict.claim is Claim.CONFLICT:
                return (Reason.CHILD_CONFLICT, verdict.message)
        created[ident] = time.monotonic()
        return None
