"""The loop of each FineTuneJob: observe, decide, carry out, and sleep until the next wake.

Each job's loop (started and stopped by controller/loops.py) looks at its job over and over:
it reads the job and its children from the caches (controller/observe.py), lets the pure
`reconcile()` decide in a worker thread (admitted by the GPU queue, controller/admission.py),
carries the decision out (controller/carry_out.py, which writes the status through
controller/status_writes.py), and sleeps until the decision's `requeue_after`, a change of one
of its children or of its spec wakes it, or the slow resync comes round. A look that fails
is tried again with backoff: the loop never ends on an error.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from kubetune.api.v1alpha1 import FineTuneJob, FineTuneJobStatus
from kubetune.api.vocabulary import TERMINAL_PHASES, EventType, Phase, Reason
from kubetune.control.lifecycle import failed
from kubetune.control.reconcile import ControllerSettings, Decision, reconcile
from kubetune.controller import metrics
from kubetune.controller.admission import Admission, release_when_bound
from kubetune.controller.backoff import RANDOM, spread
from kubetune.controller.cache import JobKey, job_key_of
from kubetune.controller.capacity_view import WAKE_PER_POOL, CapacityView
from kubetune.controller.carry_out import CarryOut
from kubetune.controller.kube import Fenced, Kube
from kubetune.controller.memo import ARCH_FAILURE_SECONDS, ArchCache, PlanMemo
from kubetune.controller.observe import Look, Observer
from kubetune.controller.slots import LookPriority, PrioritySlots
from kubetune.controller.status_writes import PostEvent, StatusWriter, Written
from kubetune.controller.waiting import Stopped, backoff, wait
from kubetune.planning.arch import ModelArch

log = logging.getLogger("kubetune")

QUEUE_RETRY_SPREAD = 0.1
"""A waiting job's next look at its queue retry comes up to this fraction of the period
sooner or later: jobs that queued together (a burst of submissions, the operator's restart)
do not all re-plan at the same moment, every period."""


@dataclass
class JobState:
    """What a job's loop keeps between its looks."""

    name: str
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    written: Written = field(default_factory=Written)
    created: dict[str, float] = field(default_factory=dict)
    """Children created by this process ("Kind/name" → monotonic time)."""
    due_at: float | None = None
    """When the next look is due (monotonic); None while the job waits only for events."""
    failures: int = 0
    generation: Any = None
    outdated: bool = False
    """The job has fields this operator does not know, and it said so."""
    validated: tuple[dict[str, Any], FineTuneJob] | None = None
    """The job as last validated, and what it was made of."""
    seen_batch_jobs: set[str] = field(default_factory=set)
    """Names of the job's batch Jobs (trainer, stage-in, export, stage-out) this loop has seen
    in the cache."""


class JobLoop:
    """Every FineTuneJob's loop, and what they share (one per operator process)."""

    def __init__(
        self,
        settings: ControllerSettings,
        kube: Kube,
        view: CapacityView,
        jobs: dict[JobKey, JobState],
        load_arch: Callable[[str], ModelArch],
        post_event: PostEvent,
    ) -> None:
        self.settings = settings
        self.kube = kube
        self.view = view
        self.jobs = jobs
        """Each running loop's state, by job (the view wakes them through it)."""
        self.post_event = post_event
        self.arch = ArchCache(load_arch, ARCH_FAILURE_SECONDS)
        self.plans = PlanMemo()
        self.executor = ThreadPoolExecutor(
            max_workers=settings.planner_workers, thread_name_prefix="reconcile"
        )
        # One slot per thread, taken before submitting: the pool's own queue stays empty and
        # first looks go ahead of the rest (controller/slots.py).
        self.slots = PrioritySlots(settings.planner_workers)
        self.rng = RANDOM
        """Draws the waits after failures and the queue retries' spread."""
        self.observer = Observer(settings, kube, view)
        self.writer = StatusWriter(settings, kube, post_event, self.rng)
        self.carry_out = CarryOut(settings, kube, view, self.writer, post_event)
        self.last_success = time.monotonic()

    async def run(self, body: Mapping[str, Any], stopped: Stopped) -> None:
        """The loop of one FineTuneJob, until it is stopped (the job is deleted, or the
        operator exits). It never ends on an error: a failed look is retried with backoff."""
        meta = body["metadata"]
        key = job_key_of(meta)
        state = JobState(name=str(meta.get("name")))
        self.jobs[key] = state
        if not (body.get("status") or {}).get("phase"):  # new: never looked at before
            metrics.loop_started(meta.get("creationTimestamp"))
        try:
            while not stopped:
                state.wake.clear()
                delay = await self.look(key, state, body)
                if not (state.wake.is_set() or stopped):
                    await wait(state.wake, stopped, delay)
        finally:
            if self.jobs.get(key) is state:
                del self.jobs[key]
                self.observer.cache_users.pop(key, None)
            self.view.queued.discard(key)
            if self.view.queue.stop_waiting(key):
                self.view.queue_changed()
            if self.view.queue.release(key):
                self.view.capacity_changed()
            self.plans.forget(str(meta.get("uid")))

    async def look(self, key: JobKey, state: JobState, body: Mapping[str, Any]) -> float | None:
        """One reconcile; returns the time until the next look (None: wait for events)."""
        started = time.monotonic()
        try:
            with metrics.reconcile_timer("finetunejob"):
                delay = await self.reconcile_job(key, state, body)
        except Fenced:
            log.error("not the leader any more: %s/%s is left alone", key[0], state.name)
            return self.settings.resync_seconds
        except Exception:
            state.failures += 1
            pause = backoff(state.failures, self.rng)
            log.exception(
                "reconcile of %s/%s failed (%d in a row); next try in %.0fs",
                key[0],
                state.name,
                state.failures,
                pause,
            )
            state.due_at = started + pause
            return pause
        state.failures = 0
        self.last_success = time.monotonic()
        state.due_at = None if delay is None else self.last_success + delay
        return delay

    async def reconcile_job(
        self, key: JobKey, state: JobState, body: Mapping[str, Any]
    ) -> float | None:
        """One look at a job: observe → decide → carry out → next wake."""
        meta = dict(body["metadata"])
        state.generation = meta.get("generation")
        old_status = state.written.latest(body)
        raw = {"metadata": meta, "spec": dict(body.get("spec") or {}), "status": old_status}
        try:
            job = validated(state, raw)
        except ValidationError as exc:
            return await self._invalid(state, body, raw, exc)
        look = await self.observer.observe(key, job, state.seen_batch_jobs)
        decision, now = await self._decide(key, job, look)
        if await self._deleted_meanwhile(state, decision, meta):
            namespace, name = meta.get("namespace"), meta.get("name")
            log.info("%s/%s is gone: its children are not created again", namespace, name)
            return self.settings.poll_seconds
        written, wire = await self.carry_out.apply(
            job, state.created, state.written, decision, body, now, old_status or {}
        )
        metrics.observe_job(raw, wire)
        finished = self._settle(key, job, decision, look, written)
        return self._next_wake(key, state, decision, finished, written)

    async def _decide(self, key: JobKey, job: FineTuneJob, look: Look) -> tuple[Decision, datetime]:
        """`reconcile()` in a worker thread, admitted by the GPU queue; the decision shows
        where a queued job waits (status.queue)."""
        submitted = time.monotonic()
        uid, generation = str(job.metadata.get("uid")), job.metadata.get("generation")
        plan = self.plans.planner(uid, generation, look.version)
        loop = asyncio.get_running_loop()
        admit = Admission(self.view, loop, key, job, look.capacity, look.seen)

        def decide() -> tuple[Decision, datetime]:
            # The decision's time (condition transitions, events) is when it is made: on a
            # busy operator a look may wait for a worker a while.
            metrics.reconcile_waited(time.monotonic() - submitted)
            at = datetime.now(UTC)
            decision = reconcile(
                job,
                look.observed,
                self.settings,
                now=at,
                load_arch=self.arch,
                plan=plan,
                admit=admit,
            )
            return decision, at

        async with self.slots.hold(self._priority(key, job)):
            decision, now = await loop.run_in_executor(self.executor, decide)
        admit.show(decision.status)
        return decision, now

    def _settle(
        self, key: JobKey, job: FineTuneJob, decision: Decision, look: Look, written: bool
    ) -> bool:
        """Where the job stands now in the queue and the metrics; whether it is finished
        (its status says so, and its last write landed)."""
        phase = decision.status.phase
        if phase == Phase.QUEUED or (phase == Phase.PLANNING and not look.observed.pools):
            self.view.queued.add(key)
        else:
            self.view.queued.discard(key)
            if self.view.queue.stop_waiting(key):
                self.view.queue_changed()
        release_when_bound(self.view, self.settings, key, phase, look.observed.pods, look.seen[0])
        # A job is finished once its status says so; until its last write lands it is not.
        finished = phase in TERMINAL_PHASES and written
        namespace, name = str(job.metadata.get("namespace")), str(job.metadata.get("name"))
        metrics.reconciled(namespace, name, None if finished else time.time())
        return finished

    def _next_wake(
        self, key: JobKey, state: JobState, decision: Decision, finished: bool, written: bool
    ) -> float | None:
        """Seconds until the next look (None: only events wake the job)."""
        delay = decision.requeue_after
        if delay is None and not finished:
            delay = self.settings.resync_seconds
        elif delay is not None and delay == self.settings.queue_retry_seconds:
            # Waiting: queued, or for pools, inputs or an upstream job.
            delay = spread(delay, QUEUE_RETRY_SPREAD, self.rng)
        position = self.view.queue.position(key)
        if delay is not None and position is not None and position > WAKE_PER_POOL:
            # Deep in a queue nothing lets it in but the jobs ahead leaving, and nothing
            # changes what it shows but its place moving: both wake it (the capacity view's
            # wake pass) when the move shows at once, and so does a pool it might move to
            # getting free GPUs. A smaller move is shown after SMALL_MOVE_SLOWDOWN progress
            # writes: it looks that often (at the defaults, the resync period).
            delay = min(self.settings.resync_seconds, self.writer.small_move_write_seconds)
        held = state.written.held_until
        if delay is not None and held is not None:
            # A status write held back is written when due.
            delay = min(delay, max(held - time.monotonic(), 0.0))
        if not written:
            delay = min(
                math.inf if delay is None else delay, self.writer.after_rejection(state.written)
            )
        return delay

    async def _invalid(
        self,
        state: JobState,
        body: Mapping[str, Any],
        raw: dict[str, Any],
        exc: ValidationError,
    ) -> float | None:
        """A job that does not validate: left alone when only fields this operator does
        not know are the matter, failed otherwise."""
        unknown = [e for e in exc.errors() if e["type"] == "extra_forbidden"]
        if len(unknown) == len(exc.errors()):
            # The CRD is newer than this operator (CRDs applied before the operator is
            # upgraded): leave the job as it is, do not fail a run over it.
            self._outdated(state, body, unknown)
            return self.settings.resync_seconds
        # Admission normally catches this; an older CRD or a hand-edited status may not.
        meta = raw["metadata"]
        namespace, name = str(meta.get("namespace")), str(meta.get("name"))
        message = f"invalid FineTuneJob: {exc.errors()[0]['msg']} at {exc.errors()[0]['loc']}"
        now = datetime.now(UTC)
        wire = failed(FineTuneJobStatus(), Reason.INVALID_SPEC, message, now).to_wire()
        self.post_event(body, EventType.WARNING, Reason.INVALID_SPEC, message)
        old = raw["status"] or {}
        written = await self.writer.write(state.written, namespace, name, old, wire, body)
        metrics.observe_job(raw, wire)
        return None if written else self.writer.after_rejection(state.written)

    def _outdated(self, state: JobState, body: Mapping[str, Any], unknown: Sequence[Any]) -> None:
        """Say once per job that it has fields this operator does not know."""
        if state.outdated:
            return
        state.outdated = True
        fields = ", ".join(".".join(str(p) for p in e["loc"]) for e in unknown)
        message = (
            f"this operator does not know {fields}: the FineTuneJob CRD is newer than the "
            "operator. The job is left as it is until the operator is upgraded (helm upgrade "
            "applies both)"
        )
        log.warning("%s/%s: %s", body["metadata"].get("namespace"), state.name, message)
        self.post_event(body, EventType.WARNING, Reason.OPERATOR_OUTDATED, message)

    async def _deleted_meanwhile(
        self, state: JobState, decision: Decision, meta: Mapping[str, Any]
    ) -> bool:
        """Whether the job was deleted while this look thought it was there, judged when the
        look would create again a batch Job it has seen: no finalizer holds a deleted job
        (controller/loops.py), so the garbage collector may delete its children before its
        loop hears of the deletion, and a batch Job created again would start a trainer for
        a job that is gone. One read of the job decides; one that fails counts as gone for
        this look (the next look asks again)."""
        again = [
            m
            for m in decision.create
            if m["kind"] == "Job" and m["metadata"]["name"] in state.seen_batch_jobs
        ]
        if not again:
            return False
        namespace, name = str(meta.get("namespace")), str(meta.get("name"))
        log.info(
            "%s/%s: batch Job %s is gone; reading the job before creating it again",
            namespace,
            name,
            again[0]["metadata"]["name"],
        )
        found = await self.kube.read_finetunejob(namespace, name)
        if found is None or found[0] is None:
            return True
        live = found[0].metadata
        return live.get("uid") != meta.get("uid") or bool(live.get("deletionTimestamp"))

    def _priority(self, key: JobKey, job: FineTuneJob) -> LookPriority:
        """First looks (no plan yet) and the front of a GPU queue go first: both are on a
        job's way to its first pod; a running job's progress and a deep queue can wait."""
        if job.status is None or job.status.plan is None:
            return LookPriority.FIRST
        position = self.view.queue.position(key)
        if position is not None and position <= WAKE_PER_POOL:
            return LookPriority.FIRST
        return LookPriority.LATER

    def stalled(self, now: float | None = None) -> list[str]:
        """Jobs overdue by more than `stall_seconds`, when no reconcile at all succeeded in
        that time (liveness fails then: the operator is wedged, a restart helps)."""
        now = time.monotonic() if now is None else now
        limit = self.settings.stall_seconds
        if now - self.last_success <= limit:
            return []
        return sorted(
            f"{key[0]}/{state.name}"
            for key, state in self.jobs.items()
            if state.due_at is not None and now - state.due_at > limit
        )


def validated(state: JobState, raw: dict[str, Any]) -> FineTuneJob:
    """The job as a model, validated again only when what it is made of changed: most
    looks of a running job see the same object and status. (Comparing the two dicts
    costs a small part of validating them; a reconcile does not change the job it is
    given, it decides on a copy of its status.)"""
    if state.validated is not None and state.validated[0] == raw:
        return state.validated[1]
    job = FineTuneJob.model_validate(raw)
    state.validated = (raw, job)
    return job
