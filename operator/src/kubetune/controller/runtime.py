"""How the operator runs its reconciles: one loop per object, woken by events, reading caches.

Each FineTuneJob gets a loop (started and stopped by controller/loops.py; each GPUPool's is a
kopf daemon, controller/handlers.py) that does, over and over: read the job and its children
from the caches → `reconcile()` (pure, in a worker thread) → create/delete children → write
the status itself → sleep until the decision's `requeue_after`, a change of one of its
children or of its spec wakes it, or the slow resync comes round. Nothing here LISTs: the
caches are watch-fed (controller/cache.py).

The loop owns its status writes (a merge patch of the status subresource, retried on
conflicts, throttling, server errors and lost connections) instead of handing a patch to
kopf: a write that fails is tried again on the next look and can never stop the loop. A
write the apiserver rejects as invalid (422) is logged with its fields and reported on the
job (a Warning Event and `status.message`), and the job is looked at again soon
(`REJECTED_RETRY_SECONDS`, backing off), even when the rejected write was its last.
Progress and cost alone are written at most every `progress_write_seconds`, a queued job's
position that moved by less than a tenth `SMALL_MOVE_SLOWDOWN` times less often; any other
change of the status is written at once.

GPUPools get a loop too: it writes a pool's live capacity when it changed, and marks a pool
the operator cannot read (condition Valid=False) without letting it affect any job.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from typing import Any, Protocol

from lightkube.core.exceptions import ApiError
from pydantic import ValidationError

from kubetune.api.v1alpha1 import (
    CHAIN_SCHEME,
    FineTuneJob,
    FineTuneJobSpec,
    FineTuneJobStatus,
    GPUPool,
    PlanStatus,
)
from kubetune.api.vocabulary import TERMINAL_PHASES, EventType, Phase, PoolConditionType, Reason
from kubetune.control.build.storage import input_refs
from kubetune.control.conditions import now_rfc3339
from kubetune.control.lifecycle import failed, is_finished
from kubetune.control.pods import unschedulable_since
from kubetune.control.queue import Ticket, Waiting, free_after, small_place_move, wait_reason
from kubetune.control.reconcile import (
    ControllerSettings,
    Decision,
    chained,
    may_create_stage_in,
    needs_preflight,
    reconcile,
)
from kubetune.controller import metrics
from kubetune.controller.cache import Caches, JobKey, job_key, job_key_of, parse_pool, with_capacity
from kubetune.controller.kube import Fenced, Kube, StatusRejected
from kubetune.controller.slots import LookPriority, PrioritySlots
from kubetune.planning.arch import ModelArch
from kubetune.planning.planner import Plan, PlannerSettings, plan_job

log = logging.getLogger("kubetune")

VOLATILE = frozenset({"progress", "cost"})
"""Status fields that change on every look of a running job; written at most every
`progress_write_seconds` unless something else changed too (so is a queued job's position:
`only_volatile`)."""

WAKE_PER_POOL = 8
"""How many jobs at the front of a pool's queue a change of capacity wakes at once."""

SMALL_MOVE_SLOWDOWN = 10.0
"""A queued job's position that moved by less than a tenth of the one shown is written this
many `progress_write_seconds` apart (a move by more, or any within the first ten places, at
the usual pace). Each admission moves every job behind it in its queue by one: written at
once, a queue of N jobs costs N status writes per admission; this way a job deep in it
writes after every tenth of its way, and the front stays exact."""

REJECTED_RETRY_SECONDS = 5.0
"""A job whose status write was rejected is looked at again after this long, doubling with
each rejection in a row up to the resync period: finished or not, its status must land."""

RELEASED_KEPT_SECONDS = 120.0
"""How long the queue remembers a reservation given back (its pods got nodes) for looks that
began from older capacity; a look older than this when it admits looks again instead."""

ARCH_FAILURE_SECONDS = 300.0
"""An architecture that could not be loaded (e.g. a hub fetch that failed) is not tried
again for this long."""


class Stopped(Protocol):
    """A loop's stop flag: controller/loops.py's for a job, kopf's for a pool's daemon."""

    def __bool__(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> Any: ...


PostEvent = Callable[[Mapping[str, Any], EventType, Reason, str], None]


def resource_version(meta: Mapping[str, Any]) -> int | None:
    """The resourceVersion as a number (etcd's revision), or None when it is not one."""
    raw = str(meta.get("resourceVersion") or "")
    return int(raw) if raw.isdigit() else None


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7396) turning `old` into `new`: what changed, objects
    compared field by field (a merge patch merges them; lists it replaces whole), and None
    for each field `new` no longer has. A nested field left out of a patch would stay:
    a re-plan that drops `plan.chunkedCrossEntropy` must send it as null, or the stored
    plan keeps it and differs from every later one."""
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            inner = merge_patch(before, value)
            if inner:
                patch[key] = inner
        elif key not in old or before != value:
            patch[key] = value
    for key in old:
        if key not in new:
            patch[key] = None
    return patch


_QUEUE_NUMBERS = re.compile(r"position \d+ in the queue|\d+ job\(s\) ahead")


def only_volatile(old: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
    """True when the patch changes only what moves on every look: a running job's progress
    and cost, a queued job's position in its queue (in the message and the Queued
    condition). Such a patch may wait for `progress_write_seconds`."""
    if set(patch) <= VOLATILE:
        return True
    if _only_stage_in_progress(old, patch):
        return True
    if old.get("phase") != "Queued" or not set(patch) <= VOLATILE | {"message", "conditions"}:
        return False

    def masked(value: Any) -> str:
        return _QUEUE_NUMBERS.sub("#", json.dumps(value, sort_keys=True))

    return all(masked(patch[k]) == masked(old.get(k)) for k in patch if k not in VOLATILE)


_POSITION = re.compile(r"position (\d+) in the queue")


def small_move(old: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
    """True when the patch moves a queued job's position by less than a tenth of the one
    its status shows (never within the first ten places)."""
    shown = _POSITION.search(str(old.get("message") or ""))
    moved = _POSITION.search(str(patch.get("message") or ""))
    if shown is None or moved is None:
        return False
    return small_place_move(int(shown.group(1)), int(moved.group(1)))


def _only_stage_in_progress(old: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
    """A running stage-in's bytes and files so far (status.stageIn without a result yet, the
    message and the Progress column that say them)."""
    if old.get("phase") != "Planning" or not set(patch) <= VOLATILE | {"message", "stageIn"}:
        return False
    staged = old.get("stageIn")
    if isinstance(patch.get("stageIn"), Mapping):
        staged = {**(staged if isinstance(staged, Mapping) else {}), **patch["stageIn"]}
    message = str(patch.get("message", old.get("message")) or "")
    return (
        isinstance(staged, Mapping)
        and staged.get("modelPath") is None
        and message.startswith("staging in: ")
        and str(old.get("message") or "").startswith("staging in: ")
    )


async def _wait(wake: asyncio.Event, stopped: Stopped, delay: float | None) -> None:
    """Until `wake` is set, kopf stops the loop, or `delay` seconds pass (None: no limit)."""
    woken = asyncio.ensure_future(wake.wait())
    stop = asyncio.ensure_future(stopped.wait())
    try:
        await asyncio.wait({woken, stop}, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
    finally:
        woken.cancel()
        stop.cancel()


def _backoff(failures: int) -> float:
    """Seconds before the next try after `failures` failed looks in a row (2, 4, … 60)."""
    return min(60.0, 2.0 ** min(failures, 6))


# ---------------------------------------------------------------------- caches of work


class ArchCache:
    """Architectures by model id: found ones for good, failures for a while (thread-safe)."""

    def __init__(self, load: Callable[[str], ModelArch], failure_seconds: float) -> None:
        self._load = load
        self._failure_seconds = failure_seconds
        self._lock = threading.Lock()
        self._found: dict[str, ModelArch] = {}
        self._failed: dict[str, tuple[float, Exception]] = {}

    def __call__(self, model_id: str) -> ModelArch:
        with self._lock:
            if model_id in self._found:
                return self._found[model_id]
            failure = self._failed.get(model_id)
            if failure and time.monotonic() - failure[0] < self._failure_seconds:
                raise failure[1]
        try:
            arch = self._load(model_id)
        except Exception as exc:
            with self._lock:
                self._failed[model_id] = (time.monotonic(), exc)
            raise
        with self._lock:
            self._found[model_id] = arch
            self._failed.pop(model_id, None)
        return arch


class PlanMemo:
    """The last plan (or planning error) of each job, reused while nothing it depends on
    changed: the job's spec generation, the pools and their capacity, the planner
    settings (which carry what out-of-memory re-plans learned)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, tuple[Any, Plan | Exception]] = {}

    def planner(self, uid: str, generation: Any, view_version: Any) -> Callable[..., Plan]:
        def plan(
            spec: FineTuneJobSpec,
            pools: Sequence[GPUPool],
            arch: ModelArch,
            settings: PlannerSettings,
        ) -> Plan:
            key = (generation, view_version, tuple(p.name for p in pools), arch, settings)
            with self._lock:
                last = self._last.get(uid)
            if last is not None and last[0] == key:
                if isinstance(last[1], Exception):
                    raise last[1]
                return last[1]
            try:
                result: Plan | Exception = plan_job(spec, pools, arch, settings)
            except Exception as exc:
                result = exc
            with self._lock:
                self._last[uid] = (key, result)
            if isinstance(result, Exception):
                raise result
            return result

        return plan

    def forget(self, uid: str) -> None:
        with self._lock:
            self._last.pop(uid, None)


class GpuQueue:
    """The queue for GPUs (control/queue.py has the rules), shared by every job's loop.

    `waiting` holds the jobs that wait for a pool; `reserved` the jobs admitted whose pods
    are not all bound to nodes yet: their GPUs count as taken until the pods hold them.
    Loops call in from worker threads, hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waiting = Waiting()
        self.reserved: dict[JobKey, tuple[Ticket, float]] = {}
        self.released: dict[JobKey, tuple[Ticket, int, float]] = {}
        """Reservations given back because their pods got nodes: (ticket, the capacity
        version of the look that saw them bound, monotonic time). A look that began from
        that version or an older one counts the reservation still: its capacity may predate
        the pods' binding, since kopf updates the pod index before the handler that moves
        the capacity version runs (with awaits between, where other looks begin)."""
        self.positions: dict[JobKey, int] = {}
        """Each waiting job's place in its pool's queue, as of its last look."""
        self.version = 0
        """Changes whenever reservations change (part of what a plan depends on)."""
        self.pushed_back = 0
        """Counts the joins that moved jobs already waiting: a job joined a queue ahead of
        some, or its ticket changed (another pool, another priority) and the jobs behind its
        old place moved up. Their statuses show their old places until they look again."""

    def admit(
        self,
        key: JobKey,
        ticket: Ticket,
        free_per_node: Sequence[int],
        queued: bool,
        join: bool = True,
        seen: int | None = None,
    ) -> str | None:
        """None: launch now (GPUs reserved); otherwise the job waits, and why.

        `free_per_node` is the pool's capacity as of capacity version `seen` (None: current):
        reservations given back by looks that began from this version or a later one still
        count (`released`).

        `join=False` asks without joining the pool's queue: a job that runs elsewhere and
        would move here (its pods found no room) takes these GPUs only when nobody waits
        ahead of it and they are free after every reservation, and otherwise stays where it
        is, out of this queue."""
        with self._lock:
            if queued and not join:
                return f"pool {ticket.pool} has no {ticket.gpus} free GPU(s)"
            if queued:
                position = self.positions[key] = self._join(ticket)
                return (
                    f"position {position} in the queue of pool {ticket.pool}: waiting for "
                    f"{ticket.gpus} free GPU(s); re-planning as capacity changes"
                )
            others = [
                t for k, (t, _) in self.reserved.items() if k != key and t.pool == ticket.pool
            ]
            if seen is not None:
                others += [
                    t
                    for k, (t, bound_in, _) in self.released.items()
                    if k != key and t.pool == ticket.pool and bound_in >= seen
                ]
            ahead = self.waiting.ahead(ticket)
            why = wait_reason(ticket, ahead, free_after(free_per_node, others))
            if why is None:
                self.waiting.drop(key)
                self.positions.pop(key, None)
                self.reserved[key] = (ticket, time.monotonic())
                self.version += 1
            elif join:
                self.positions[key] = self._join(ticket)
            return why

    def _join(self, ticket: Ticket) -> int:
        """The job waits with this ticket; its place (1 first). Counts in `pushed_back`
        when that moved jobs already waiting."""
        old = self.waiting.ticket(ticket.key)
        self.waiting.put(ticket)
        place = self.waiting.ahead(ticket) + 1
        if old != ticket and (old is not None or place < self.waiting.length(ticket.pool)):
            self.pushed_back += 1
        return place

    def position(self, key: JobKey) -> int | None:
        with self._lock:
            return self.positions.get(key) if key in self.waiting else None

    def heads(self, per_pool: int) -> set[JobKey]:
        """The first `per_pool` waiting jobs of each pool's queue: the only ones a change of
        capacity can let in (nobody overtakes them)."""
        with self._lock:
            return self.waiting.heads(per_pool)

    def waiting_keys(self) -> set[JobKey]:
        with self._lock:
            return set(self.waiting)

    def waiting_pools(self) -> set[str]:
        with self._lock:
            return self.waiting.pools()

    def moved(self) -> set[JobKey]:
        """Waiting jobs whose place moved since their last look by as much as their status
        shows at once (`small_place_move`): jobs ahead left, or one joined ahead."""
        with self._lock:
            return {
                key
                for key, place in self.waiting.places()
                if (last := self.positions.get(key)) is not None
                and last != place
                and not small_place_move(last, place)
            }

    def reserved_in(self, pool: str) -> list[Ticket]:
        with self._lock:
            return [t for t, _ in self.reserved.values() if t.pool == pool]

    def release(self, key: JobKey, bound_in: int | None = None) -> bool:
        """Give the job's reservation back; `bound_in`: the capacity version in which its
        pods were seen bound (kept for looks that began from older capacity)."""
        with self._lock:
            held = self.reserved.pop(key, None)
            if held is None:
                return False
            now = time.monotonic()
            if bound_in is not None:
                self.released[key] = (held[0], bound_in, now)
            for old in [
                k for k, (_, _, at) in self.released.items() if now - at > RELEASED_KEPT_SECONDS
            ]:
                del self.released[old]
            self.version += 1
            return True

    def reservation(self, key: JobKey) -> tuple[Ticket, float] | None:
        with self._lock:
            return self.reserved.get(key)

    def stop_waiting(self, key: JobKey) -> bool:
        """The job waits no more; True when it did (the jobs behind it moved)."""
        with self._lock:
            self.positions.pop(key, None)
            if key not in self.waiting:
                return False
            self.waiting.drop(key)
            return True


# ---------------------------------------------------------------------- per-job state


@dataclass
class _JobState:
    name: str
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    written_rv: int | None = None
    written_status: dict[str, Any] | None = None
    """The status this loop last wrote, until the watch delivers a version that has it."""
    written_at: float = -math.inf
    """When this loop last wrote the status (monotonic; the clock starts at boot, so "never"
    must not be a number a young machine's clock may be near)."""
    created: dict[str, float] = field(default_factory=dict)
    """Children created by this process ("Kind/name" → monotonic time)."""
    due_at: float | None = None
    """When the next look is due (monotonic); None while the job waits only for events."""
    held_until: float | None = None
    """When a status write held back (progress, a queue position) is due; None: none is."""
    failures: int = 0
    rejections: int = 0
    """Status writes the apiserver rejected in a row."""
    generation: Any = None
    outdated: bool = False
    """The job has fields this operator does not know, and it said so."""
    validated: tuple[dict[str, Any], FineTuneJob] | None = None
    """The job as last validated, and what it was made of."""
    seen_batch_jobs: set[str] = field(default_factory=set)
    """Names of the job's batch Jobs (trainer, stage-in, export, stage-out) this loop has seen
    in the cache."""


class Runtime:
    """The operator's reconcile loops and what they share (one per operator process)."""

    def __init__(
        self,
        settings: ControllerSettings,
        kube: Kube,
        load_arch: Callable[[str], ModelArch],
        post_event: PostEvent,
    ) -> None:
        self.settings = settings
        self.kube = kube
        self.post_event = post_event
        self.arch = ArchCache(load_arch, ARCH_FAILURE_SECONDS)
        self.plans = PlanMemo()
        self.executor = ThreadPoolExecutor(
            max_workers=settings.planner_workers, thread_name_prefix="reconcile"
        )
        # One slot per thread, taken before submitting: the pool's own queue stays empty and
        # first looks go ahead of the rest (controller/slots.py).
        self.slots = PrioritySlots(settings.planner_workers)
        self.scrapes = asyncio.Semaphore(settings.scrape_concurrency)
        self.caches: Caches | None = None
        self.jobs: dict[JobKey, _JobState] = {}
        self.cache_users: dict[JobKey, tuple[str, ...]] = {}
        """Cache entries (status.stageIn paths) each unfinished job reads: the stage-in step
        of another job of the namespace never evicts them."""
        self.queued: set[JobKey] = set()
        self.queue = GpuQueue()
        self.pool_wakers: dict[str, asyncio.Event] = {}
        self.pool_generations: dict[str, Any] = {}
        self.capacity_version = 0
        self._pools: tuple[Any, list[GPUPool], dict[str, dict[str, Any]]] | None = None
        self._wake_pending = False
        self._idle_free: dict[str, int] = {}
        """Free GPUs of each pool nobody waited for, at the last wake pass."""
        self.last_success = time.monotonic()

    # ------------------------------------------------------------------ cache changes

    def capacity_changed(self) -> None:
        """Nodes, GPU-holding pods or pools changed: pools rewrite their capacity, queued
        jobs look again (once per burst of changes)."""
        self.capacity_version += 1
        self.queue_changed()

    def queue_changed(self) -> None:
        """Capacity changed or a job left a queue: wake whom it concerns (once per burst)."""
        if self._wake_pending:
            return
        self._wake_pending = True
        try:
            asyncio.get_running_loop().call_later(0.5, self._wake_after_change)
        except RuntimeError:  # no loop: called outside the operator (tests)
            self._wake_after_change()

    def _wake_after_change(self) -> None:
        """Pools rewrite their capacity. Of the queued jobs look again: the first few of each
        pool's queue (nobody behind them can go), those whose place moved by as much as
        their status shows at once, every job waiting for any pool at all, and every waiting
        job when a pool nobody waits for has more free GPUs than before (a job may re-plan
        onto it). The rest of a queue waits for these events and the resync."""
        self._wake_pending = False
        for event in self.pool_wakers.values():
            event.set()
        waiting = self.queue.waiting_keys()
        wake = self.queue.heads(WAKE_PER_POOL) | self.queue.moved() | (self.queued - waiting)
        grew = self._idle_pools_grown()
        if waiting and grew:
            log.info(
                "free GPUs in %s, which no job waits for: the %d queued jobs look again",
                ", ".join(sorted(grew)),
                len(waiting),
            )
            wake |= waiting
        for key in wake:
            self.wake(key)

    def _idle_pools_grown(self) -> list[str]:
        """The pools nobody waits for that have more free GPUs (after reservations) than at
        the last wake pass."""
        if self.caches is None:
            return []
        live, _ = self.live_pools()
        queued = self.queue.waiting_pools()
        before = self._idle_free
        self._idle_free = {
            pool.name: pool.status.free_gpus
            for pool in live
            if pool.name not in queued and pool.status is not None
        }
        return [name for name, free in self._idle_free.items() if free > before.get(name, 0)]

    def wake(self, key: JobKey) -> None:
        state = self.jobs.get(key)
        if state is not None:
            state.wake.set()

    @property
    def small_move_write_seconds(self) -> float:
        """How often a queued job's position that moved by less than a tenth is written
        (and a job deep in a queue looks again, so that it is)."""
        return SMALL_MOVE_SLOWDOWN * self.settings.progress_write_seconds

    @property
    def view_version(self) -> tuple[int, int]:
        """Changes whenever what the planner sees changes: capacity or reservations."""
        return (self.capacity_version, self.queue.version)

    def live_pools(self) -> tuple[list[GPUPool], dict[str, dict[str, Any]]]:
        """Valid pools with their status replaced by live capacity, less the GPUs reserved
        for admitted jobs (what the planner sees), and each pool's capacity before
        reservations (what admission starts from and the pool's status shows)."""
        assert self.caches is not None
        cached = self._pools
        version = self.view_version
        if cached is not None and cached[0] == version:
            return cached[1], cached[2]
        pools = self.caches.valid_pools()
        capacity = self.caches.capacities(pools)
        live = []
        for pool in pools:
            numbers = dict(capacity[pool.name])
            reserved = self.queue.reserved_in(pool.name)
            if reserved:
                free = free_after(numbers["freeGPUsPerNode"], reserved)
                numbers.update(freeGPUsPerNode=free, freeGPUs=sum(free))
            live.append(with_capacity(pool, numbers, pool.metadata.get("generation")))
        self._pools = (version, live, capacity)
        return live, capacity

    # ------------------------------------------------------------------ job loops

    async def run_job(self, body: Mapping[str, Any], stopped: Stopped) -> None:
        """The loop of one FineTuneJob, until kopf stops it (the job is deleted, or the
        operator exits). It never ends on an error: a failed look is retried with backoff."""
        meta = body["metadata"]
        key = job_key_of(meta)
        state = _JobState(name=str(meta.get("name")))
        self.jobs[key] = state
        if not (body.get("status") or {}).get("phase"):  # new: never looked at before
            metrics.loop_started(meta.get("creationTimestamp"))
        try:
            while not stopped:
                state.wake.clear()
                delay = await self._look(key, state, body)
                await self._sleep(state, stopped, delay)
        finally:
            if self.jobs.get(key) is state:
                del self.jobs[key]
                self.cache_users.pop(key, None)
            self.queued.discard(key)
            if self.queue.stop_waiting(key):
                self.queue_changed()
            if self.queue.release(key):
                self.capacity_changed()
            self.plans.forget(str(meta.get("uid")))

    async def _sleep(self, state: _JobState, stopped: Stopped, delay: float | None) -> None:
        if not (state.wake.is_set() or stopped):
            await _wait(state.wake, stopped, delay)

    async def _look(self, key: JobKey, state: _JobState, body: Mapping[str, Any]) -> float | None:
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
            backoff = _backoff(state.failures)
            log.exception(
                "reconcile of %s/%s failed (%d in a row); next try in %.0fs",
                key[0],
                state.name,
                state.failures,
                backoff,
            )
            state.due_at = started + backoff
            return backoff
        state.failures = 0
        self.last_success = time.monotonic()
        state.due_at = None if delay is None else self.last_success + delay
        return delay

    def _outdated(self, state: _JobState, body: Mapping[str, Any], unknown: Sequence[Any]) -> None:
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

    @staticmethod
    def _validated(state: _JobState, raw: dict[str, Any]) -> FineTuneJob:
        """The job as a model, validated again only when what it is made of changed: most
        looks of a running job see the same object and status. (Comparing the two dicts
        costs a small part of validating them; a reconcile does not change the job it is
        given, it decides on a copy of its status.)"""
        if state.validated is not None and state.validated[0] == raw:
            return state.validated[1]
        job = FineTuneJob.model_validate(raw)
        state.validated = (raw, job)
        return job

    def _status_of(self, state: _JobState, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """The job's latest status: the live object's, or what this loop wrote last when the
        watch has not delivered that version yet."""
        live = dict(body.get("status") or {}) or None
        if state.written_status is None:
            return live
        seen = resource_version(body["metadata"])
        if seen is not None and state.written_rv is not None and seen >= state.written_rv:
            state.written_status = None
            return live
        return state.written_status

    async def reconcile_job(
        self, key: JobKey, state: _JobState, body: Mapping[str, Any]
    ) -> float | None:
        assert self.caches is not None
        meta = dict(body["metadata"])
        namespace, name = str(meta.get("namespace")), str(meta.get("name"))
        state.generation = meta.get("generation")
        old_status = self._status_of(state, body)
        raw = {"metadata": meta, "spec": dict(body.get("spec") or {}), "status": old_status}
        now = datetime.now(UTC)
        try:
            job = self._validated(state, raw)
        except ValidationError as exc:
            unknown = [e for e in exc.errors() if e["type"] == "extra_forbidden"]
            if len(unknown) == len(exc.errors()):
                # The CRD is newer than this operator (CRDs applied before the operator is
                # upgraded): leave the job as it is, do not fail a run over it.
                self._outdated(state, body, unknown)
                return self.settings.resync_seconds
            # Admission normally catches this; an older CRD or a hand-edited status may not.
            message = f"invalid FineTuneJob: {exc.errors()[0]['msg']} at {exc.errors()[0]['loc']}"
            wire = failed(FineTuneJobStatus(), Reason.INVALID_SPEC, message, now).to_wire()
            self.post_event(body, EventType.WARNING, Reason.INVALID_SPEC, message)
            written = await self._write_status(namespace, name, state, old_status or {}, wire, body)
            metrics.observe_job(raw, wire)
            return None if written else self._after_rejection(state)
        version = self.view_version
        pools, capacity = self.live_pools()
        observed = self.caches.observe(job, pools)
        for seen_job in (
            observed.batch_job,
            observed.stage_in_job,
            observed.export_job,
            observed.stage_out_job,
        ):
            if seen_job is not None:
                state.seen_batch_jobs.add(str(seen_job["metadata"].get("name")))
        seen = (version[0], time.monotonic())
        self.note_cache_use(key, job)
        if may_create_stage_in(job, observed, self.settings):
            observed = replace(observed, cache_in_use=self.cache_in_use(key))
        upstream = job.status.upstream if job.status is not None else None
        chain = job.spec.model.uri
        finished = job.status is not None and is_finished(job.status)
        if chain.startswith(CHAIN_SCHEME) and upstream is None and not finished:
            found = await self.kube.read_finetunejob(namespace, chain[len(CHAIN_SCHEME) :])
            if found is not None:
                observed = replace(observed, upstream=found[0], upstream_read=True)
        preflight = input_refs(chained(job, upstream)) if needs_preflight(job) else []
        refs = [
            ref
            for ref in preflight
            # A Secret is read only once its namespace consented to it (api/tenancy.py).
            if ref.kind != "Secret"
            or (observed.tenant is not None and observed.tenant.allows_secret(ref.name))
        ]
        if refs:
            missing = await self.kube.missing_inputs(namespace, refs)
            observed = replace(observed, missing_inputs=missing)
        if job.status and job.status.phase == Phase.RUNNING and observed.pods:
            async with self.scrapes:
                scraped = await self.kube.trainer_metrics(observed.pods)
            observed = replace(observed, trainer_metrics=scraped)
        if observed.stage_in_pods and observed.stage_in_job is not None:
            async with self.scrapes:
                progress = await self.kube.stage_in_progress(observed.stage_in_pods)
            observed = replace(observed, stage_in_metrics=progress)
        submitted = time.monotonic()
        plan = self.plans.planner(str(meta.get("uid")), meta.get("generation"), version)
        admit = partial(self._admit, asyncio.get_running_loop(), key, job, capacity, seen)

        def decide() -> tuple[Decision, datetime]:
            # The decision's time (condition transitions, events) is when it is made: on a
            # busy operator a look may wait for a worker a while.
            metrics.reconcile_waited(time.monotonic() - submitted)
            at = datetime.now(UTC)
            return reconcile(
                job, observed, self.settings, now=at, load_arch=self.arch, plan=plan, admit=admit
            ), at

        async with self.slots.hold(self._priority(key, job)):
            decision, now = await asyncio.get_running_loop().run_in_executor(self.executor, decide)
        if await self._deleted_meanwhile(state, decision, meta):
            log.info("%s/%s is gone: its children are not created again", namespace, name)
            return self.settings.poll_seconds
        written, wire = await self._carry_out(job, state, decision, body, now, old_status or {})
        metrics.observe_job(raw, wire)
        phase = decision.status.phase
        if phase == Phase.QUEUED or (phase == Phase.PLANNING and not observed.pools):
            self.queued.add(key)
        else:
            self.queued.discard(key)
            if self.queue.stop_waiting(key):
                self.queue_changed()
        self._release_when_bound(key, phase, observed.pods, seen[0])
        # A job is finished once its status says so; until its last write lands it is not.
        finished = phase in TERMINAL_PHASES and written
        metrics.reconciled(namespace, name, None if finished else time.time())
        delay = decision.requeue_after
        if delay is None and not finished:
            delay = self.settings.resync_seconds
        position = self.queue.position(key)
        if delay is not None and position is not None and position > WAKE_PER_POOL:
            # Deep in a queue nothing lets it in but the jobs ahead leaving, and nothing
            # changes what it shows but its place moving: both wake it (_wake_after_change)
            # when the move shows at once, and so does a pool it might move to getting free
            # GPUs. A smaller move is shown after SMALL_MOVE_SLOWDOWN progress writes: it
            # looks that often (at the defaults, the resync period).
            delay = min(self.settings.resync_seconds, self.small_move_write_seconds)
        if delay is not None and state.held_until is not None:
            # A status write held back is written when due.
            delay = min(delay, max(state.held_until - time.monotonic(), 0.0))
        if not written:
            delay = min(math.inf if delay is None else delay, self._after_rejection(state))
        return delay

    async def _deleted_meanwhile(
        self, state: _JobState, decision: Decision, meta: Mapping[str, Any]
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
        position = self.queue.position(key)
        if position is not None and position <= WAKE_PER_POOL:
            return LookPriority.FIRST
        return LookPriority.LATER

    def _after_rejection(self, state: _JobState) -> float:
        """When to look again at a job whose status write was rejected."""
        backoff = REJECTED_RETRY_SECONDS * 2.0 ** min(state.rejections - 1, 6)
        return min(backoff, self.settings.resync_seconds)

    def _admit(
        self,
        loop: asyncio.AbstractEventLoop,
        key: JobKey,
        job: FineTuneJob,
        capacity: Mapping[str, Mapping[str, Any]],
        seen: tuple[int, float],
        plan: PlanStatus,
        queued: bool,
        join: bool = True,
    ) -> str | None:
        """Admission for `reconcile` (runs in a worker thread), against the capacity the
        look began from: `seen` is its capacity version and when it was read."""
        ticket = Ticket(
            namespace=key[0],
            name=str(job.metadata.get("name")),
            priority=job.spec.resources.priority,
            created=str(job.metadata.get("creationTimestamp") or ""),
            pool=plan.pool,
            nodes=plan.nodes,
            gpus_per_node=plan.gpus_per_node,
        )
        version, read_at = seen
        if time.monotonic() - read_at > RELEASED_KEPT_SECONDS:
            # Older than what the queue remembers of reservations given back: look again.
            loop.call_soon_threadsafe(self.wake, key)
            return f"capacity of pool {plan.pool} changed while this look waited; looking again"
        free = (capacity.get(plan.pool) or {}).get("freeGPUsPerNode", [])
        pushed_back = self.queue.pushed_back
        why = self.queue.admit(key, ticket, free, queued, join, seen=version)
        if why is None:
            # The next job in the queue may go now (or once this one's pods hold the GPUs).
            loop.call_soon_threadsafe(self.capacity_changed)
        elif self.queue.pushed_back != pushed_back:
            # It joined ahead of jobs that wait (or left their queue for another): those
            # whose status now shows a wrong place look again (_wake_after_change).
            loop.call_soon_threadsafe(self.queue_changed)
        return why

    def _release_when_bound(
        self, key: JobKey, phase: Phase, pods: Sequence[Mapping[str, Any]], seen: int
    ) -> None:
        """Give back a reservation once the job's pods hold their GPUs (or it stopped, or
        its pods were turned away for longer than the reschedule time).

        The reschedule time counts from the scheduler's refusal, not from admission: in a
        burst a job's batch Job may be created minutes after it was admitted, and a
        reservation lapsed by then gives its GPUs to the next job, whose pods and this one's
        then compete for them. A reservation whose pods never appear lapses after the resync
        period."""
        held = self.queue.reservation(key)
        if held is None:
            return
        ticket, since = held
        bound = sum(1 for pod in pods if (pod.get("spec") or {}).get("nodeName"))
        refused = [at for pod in pods if (at := unschedulable_since(pod)) is not None]
        now = datetime.now(UTC)
        stale = (
            bool(refused)
            and (now - min(refused)).total_seconds() > self.settings.reschedule_seconds
        ) or time.monotonic() - since > self.settings.resync_seconds
        if phase != Phase.RUNNING or bound >= ticket.nodes or stale:
            self.queue.release(key, bound_in=seen if bound else None)
            self.capacity_changed()

    async def _carry_out(
        self,
        job: FineTuneJob,
        state: _JobState,
        d: Decision,
        body: Mapping[str, Any],
        now: datetime,
        old_status: Mapping[str, Any],
    ) -> tuple[bool, dict[str, Any]]:
        """Write the decision's status and create its children; whether the status landed,
        and the status written (wire form).

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
        write = self._write_status(namespace, name, state, old_status, wire, body)
        written, conflict = await asyncio.gather(
            write, self._create_children(job, state, first), return_exceptions=True
        )
        # Both have finished: neither is left running behind an error.
        if isinstance(written, BaseException):
            raise written
        if isinstance(conflict, BaseException):
            raise conflict
        if conflict is None and last:
            conflict = await self._create_children(job, state, last)
        if conflict is not None:
            reason, message = conflict
            d.status = failed(d.status, reason, message, now)
            d.events.clear()
            self.post_event(body, EventType.WARNING, reason, message)
            wire = d.status.to_wire()
            written = await self._write_status(
                namespace, name, state, self._status_of(state, body) or {}, wire, body
            )
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
        for event in d.events:
            self.post_event(body, event.type, event.reason, event.message)
        if d.delete_self:
            await self.kube.delete_finetunejob(namespace, name)
        return bool(written), wire

    async def _create_children(
        self, job: FineTuneJob, state: _JobState, manifests: Sequence[Mapping[str, Any]]
    ) -> tuple[Reason, str] | None:
        """Create each child once, together; the first conflict found, if any.

        A child owned by someone else is a conflict, and so is one Kubernetes refuses
        (400, 422): the spec passed admission but makes an object that cannot exist (a
        Secret or StorageClass name, a volume size), and retrying cannot help.
        A child counts as created when the cache holds it (batch Jobs) or when this process
        created it in the last resync period; only then is it POSTed again (a child deleted
        behind the operator's back comes back within one resync).
        """
        try:
            found = await asyncio.gather(*(self._create_child(job, state, m) for m in manifests))
        except ApiError as exc:
            if exc.status.code not in (400, 422):
                raise
            return (
                Reason.INVALID_SPEC,
                f"Kubernetes rejected an object built from this job's spec: "
                f"{exc.status.message}. To fix: correct the spec field it names and create "
                "the job again",
            )
        return next((c for c in found if c is not None), None)

    async def _create_child(
        self, job: FineTuneJob, state: _JobState, manifest: Mapping[str, Any]
    ) -> tuple[Reason, str] | None:
        assert self.caches is not None
        uid = str(job.metadata.get("uid"))
        kind = str(manifest["kind"])
        name = str(manifest["metadata"]["name"])
        ident = f"{kind}/{name}"
        created = state.created.get(ident)
        if created is not None and time.monotonic() - created < self.settings.resync_seconds:
            return None
        if kind == "Job" and self.caches.has_batch_job(job_key(job), name, uid):
            state.created[ident] = time.monotonic()
            return None
        if not await self.kube.create_if_absent(manifest) and kind != "PersistentVolumeClaim":
            # A retained checkpoint volume of an earlier job of the same name is meant to
            # be taken over (docs/runbook.md); any other child must be ours.
            owners = await self.kube.owner_uids(manifest)
            if owners is not None and uid not in owners:
                return (
                    Reason.CHILD_CONFLICT,
                    f"a {kind} named {name} already exists in namespace "
                    f"{manifest['metadata'].get('namespace')} and does not belong to this "
                    f"FineTuneJob. To fix: delete or rename that {kind}, or create this "
                    "job under another name",
                )
        state.created[ident] = time.monotonic()
        return None

    async def _write_status(
        self,
        namespace: str,
        name: str,
        state: _JobState,
        old: Mapping[str, Any],
        new: dict[str, Any],
        body: Mapping[str, Any],
    ) -> bool:
        """Write what changed of the status (`new` in wire form); False when the apiserver
        rejected it (422)."""
        patch = merge_patch(old, new)
        state.held_until = None
        if not patch:
            state.rejections = 0
            return True
        if only_volatile(old, patch):
            every = (
                self.small_move_write_seconds
                if small_move(old, patch)
                else self.settings.progress_write_seconds
            )
            if time.monotonic() - state.written_at < every:
                state.held_until = state.written_at + every
                return True
        try:
            rv = await self.kube.patch_status(namespace, name, patch)
        except StatusRejected as exc:
            metrics.status_write("rejected")
            fields = ", ".join(exc.fields) or "unknown fields"
            log.error("status of %s/%s rejected (%s): %s", namespace, name, fields, exc)
            message = (
                f"the operator's status update was rejected by the API server ({fields}): "
                f"{exc}; it keeps reconciling the job"
            )
            self.post_event(body, EventType.WARNING, Reason.STATUS_REJECTED, message)
            try:
                await self.kube.patch_status(namespace, name, {"message": message[:1000]})
            except (StatusRejected, ApiError):
                log.error("could not record the rejection on %s/%s", namespace, name)
            state.written_at = time.monotonic()
            state.rejections += 1
            return False
        except Exception:
            metrics.status_write("failed")
            raise
        metrics.status_write("ok")
        state.written_at = time.monotonic()
        state.rejections = 0
        if rv is not None:
            state.written_rv = resource_version({"resourceVersion": rv})
            state.written_status = new
        return True

    # ------------------------------------------------------------------ pool loops

    async def run_pool(self, body: Mapping[str, Any], stopped: Stopped) -> None:
        """The loop of one GPUPool: write its capacity whenever it changed."""
        name = str(body["metadata"]["name"])
        wake = self.pool_wakers[name] = asyncio.Event()
        failures = 0
        try:
            while not stopped:
                wake.clear()
                try:
                    with metrics.reconcile_timer("gpupool"):
                        await self.reconcile_pool(body)
                    failures = 0
                    delay = self.settings.resync_seconds
                except Fenced:
                    delay = self.settings.resync_seconds
                except Exception:
                    failures += 1
                    delay = _backoff(failures)
                    log.exception(
                        "GPUPool %s: capacity not written; next try in %.0fs", name, delay
                    )
                await _wait(wake, stopped, delay)
                # Capacity changes come in bursts (a job's pods bind one by one): write at
                # most about once a second.
                await asyncio.sleep(1.0)
        finally:
            if self.pool_wakers.get(name) is wake:
                del self.pool_wakers[name]

    async def reconcile_pool(self, body: Mapping[str, Any]) -> None:
        assert self.caches is not None
        meta = body["metadata"]
        name = str(meta["name"])
        old = dict(body.get("status") or {})
        parsed = parse_pool(body)
        if isinstance(parsed, str):
            message = (
                f"the operator cannot read this GPUPool ({parsed}); no job is planned onto it. "
                "To fix: correct the field and apply the pool again"
            )
            condition = _pool_condition(old, False, Reason.INVALID_SPEC, message)
            if condition is not None:
                log.error("GPUPool %s is invalid: %s", name, parsed)
                await self._write_pool(name, {"conditions": [condition]})
            return
        # Computed once per change of nodes, pods or reservations, for every pool at once.
        _, live = self.live_pools()
        capacity = dict(live.get(name) or self.caches.capacities([parsed])[name])
        capacity["observedGeneration"] = meta.get("generation")
        capacity["gpuMemoryGiB"] = parsed.spec.gpu.memory_gib  # the product's when not given
        patch = {k: v for k, v in capacity.items() if old.get(k) != v}
        condition = _pool_condition(old, True, Reason.POOL_ACCEPTED, "the operator reads this pool")
        if condition is not None:
            patch["conditions"] = [condition]
        if patch or not old.get("updatedAt"):
            patch["updatedAt"] = now_rfc3339()
            await self._write_pool(name, patch)
        metrics.observe_pool(body, capacity)

    async def _write_pool(self, name: str, patch: Mapping[str, Any]) -> None:
        try:
            await self.kube.patch_status(None, name, patch, pool=True)
        except StatusRejected as exc:
            metrics.status_write("rejected")
            log.error("status of GPUPool %s rejected (%s): %s", name, exc.fields, exc)
            return
        except Exception:
            metrics.status_write("failed")
            raise
        metrics.status_write("ok")

    # ------------------------------------------------------------------ health

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

    def note_cache_use(self, key: JobKey, job: FineTuneJob) -> None:
        """Note what this job reads from its cache (nothing once it finished)."""
        staged = job.status.stage_in if job.status is not None else None
        finished = job.status is not None and job.status.phase in TERMINAL_PHASES
        paths = () if staged is None or finished else (staged.model_path, staged.dataset_path)
        used = tuple(path for path in paths if path)
        if used:
            self.cache_users[key] = used
        else:
            self.cache_users.pop(key, None)

    def cache_in_use(self, key: JobKey) -> tuple[str, ...]:
        """What the other unfinished jobs with the same cache (this job's namespace's, or
        the cluster's) read. Linear in the jobs that read a cache, so asked only when a
        stage-in step is about to be created."""
        # One cache for the cluster (`cache_volume`): every namespace's jobs read it.
        shared = self.settings.build.cache_volume is not None
        return tuple(
            sorted(
                {
                    path
                    for other, used in self.cache_users.items()
                    if (shared or other[0] == key[0]) and other != key
                    for path in used
                }
            )
        )

    def health(self) -> dict[str, Any]:
        late = self.stalled()
        if late:
            raise RuntimeError(
                f"no reconcile succeeded for {self.settings.stall_seconds:.0f}s; "
                f"{len(late)} job(s) overdue, e.g. {', '.join(late[:3])}"
            )
        return {"jobs": len(self.jobs), "queued": len(self.queued)}


def _pool_condition(
    old: Mapping[str, Any], valid: bool, reason: Reason, message: str
) -> dict[str, Any] | None:
    """The pool's Valid condition, or None when it already says so."""
    wanted = "True" if valid else "False"
    for cond in old.get("conditions") or []:
        same = cond.get("status") == wanted and cond.get("reason") == reason
        if cond.get("type") == PoolConditionType.VALID and same:
            return None
    return {
        "type": str(PoolConditionType.VALID),
        "status": wanted,
        "reason": str(reason),
        "message": message,
        "lastTransitionTime": now_rfc3339(),
    }
