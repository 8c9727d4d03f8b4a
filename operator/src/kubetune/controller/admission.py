"""A look's questions to the GPU queue, and giving its reservation back.

`reconcile` asks `admit(plan, queued, join)` before a plan launches and takes the answer's
message; the queue's answer also says where the job waits, which the job loop shows as
status.queue (`Admission.show`). A launch's reservation is given back once the job's pods
hold their GPUs (`release_when_bound`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from kubetune.api.v1alpha1 import FineTuneJob, FineTuneJobStatus, PlanStatus
from kubetune.api.vocabulary import Phase
from kubetune.control.pods import unschedulable_since
from kubetune.control.queue import Place, Ticket, Wait
from kubetune.control.reconcile import ControllerSettings
from kubetune.controller.cache import JobKey
from kubetune.controller.capacity_view import CapacityView
from kubetune.controller.gpuqueue import RELEASED_KEPT_SECONDS


class Admission:
    """Admission for one look's `reconcile` (it runs in a worker thread), against the
    capacity the look began from: `seen` is its capacity version and when it was read."""

    def __init__(
        self,
        view: CapacityView,
        loop: asyncio.AbstractEventLoop,
        key: JobKey,
        job: FineTuneJob,
        capacity: Mapping[str, Mapping[str, Any]],
        seen: tuple[int, float],
    ) -> None:
        self.view = view
        self.loop = loop
        self.key = key
        self.job = job
        self.capacity = capacity
        self.seen = seen
        self.asked = False
        """Whether the job asked to join a queue in this look."""
        self.place: Place | None = None
        """Where the last answer to that put it (None: launch, or no place to show)."""

    def __call__(self, plan: PlanStatus, queued: bool, join: bool = True) -> str | None:
        ticket = Ticket(
            namespace=self.key[0],
            name=str(self.job.metadata.get("name")),
            priority=self.job.spec.resources.priority,
            created=str(self.job.metadata.get("creationTimestamp") or ""),
            pool=plan.pool,
            nodes=plan.nodes,
            gpus_per_node=plan.gpus_per_node,
        )
        version, read_at = self.seen
        if time.monotonic() - read_at > RELEASED_KEPT_SECONDS:
            # Older than what the queue remembers of reservations given back: look again.
            self.loop.call_soon_threadsafe(self.view.wake, self.key)
            why: Wait | None = Wait(
                f"capacity of pool {plan.pool} changed while this look waited; looking again"
            )
        else:
            why = self._ask(ticket, plan, queued, join, version)
        if join:
            self.asked = True
            self.place = None if why is None else why.place
        return None if why is None else why.message

    def _ask(
        self, ticket: Ticket, plan: PlanStatus, queued: bool, join: bool, version: int
    ) -> Wait | None:
        queue = self.view.queue
        free = (self.capacity.get(plan.pool) or {}).get("freeGPUsPerNode", [])
        pushed_back = queue.pushed_back
        why = queue.admit(self.key, ticket, free, queued, join, seen=version)
        if why is None:
            # The next job in the queue may go now (or once this one's pods hold the GPUs).
            self.loop.call_soon_threadsafe(self.view.capacity_changed)
        elif queue.pushed_back != pushed_back:
            # It joined ahead of jobs that wait (or left their queue for another): those
            # whose status now shows a wrong place look again (the capacity view's wake
            # pass).
            self.loop.call_soon_threadsafe(self.view.queue_changed)
        return why

    def show(self, status: FineTuneJobStatus) -> None:
        """status.queue: where a Queued job waits, as the queue answered this look; kept as
        it was when this look did not ask (the job is held for another reason), and gone
        once the job is not Queued."""
        if status.phase != Phase.QUEUED:
            status.queue = None
        elif self.asked:
            status.queue = None if self.place is None else self.place.status()


def release_when_bound(
    view: CapacityView,
    settings: ControllerSettings,
    key: JobKey,
    phase: Phase,
    pods: Sequence[Mapping[str, Any]],
    seen: int,
) -> None:
    """Give back a reservation once the job's pods hold their GPUs (or it stopped, or
    its pods were turned away for longer than the reschedule time).

    The reschedule time counts from the scheduler's refusal, not from admission: in a
    burst a job's batch Job may be created minutes after it was admitted, and a
    reservation lapsed by then gives its GPUs to the next job, whose pods and this one's
    then compete for them. A reservation whose pods never appear lapses after the resync
    period."""
    held = view.queue.reservation(key)
    if held is None:
        return
    ticket, since = held
    bound = sum(1 for pod in pods if (pod.get("spec") or {}).get("nodeName"))
    refused = [at for pod in pods if (at := unschedulable_since(pod)) is not None]
    now = datetime.now(UTC)
    stale = (
        bool(refused) and (now - min(refused)).total_seconds() > settings.reschedule_seconds
    ) or time.monotonic() - since > settings.resync_seconds
    if phase != Phase.RUNNING or bound >= ticket.nodes or stale:
        view.queue.release(key, bound_in=seen if bound else None)
        view.capacity_changed()
