"""What every loop sees of the cluster's GPUs, and whom a change of them wakes.

The pools with their live capacity less the GPUs reserved for admitted jobs (what the planner
sees) are computed once per change of nodes, pods or reservations, for every pool at once.
A change wakes the pools' loops (they rewrite their capacity) and, once per burst of
changes, the queued jobs it may concern: not every job of a long queue.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from kubetune.api.v1alpha1 import GPUPool
from kubetune.control.queue import free_after
from kubetune.controller.cache import Caches, JobKey, with_capacity
from kubetune.controller.gpuqueue import GpuQueue

log = logging.getLogger("kubetune")

WAKE_PER_POOL = 8
"""How many jobs at the front of a pool's queue a change of capacity wakes at once."""


class Wakeable(Protocol):
    """A job's loop, as far as waking it goes."""

    @property
    def wake(self) -> asyncio.Event: ...


class CapacityView:
    """The pools as the planner sees them, the GPU queue, and the wake-ups after changes
    (one per operator process, shared by every loop)."""

    def __init__(self, jobs: Mapping[JobKey, Wakeable]) -> None:
        self.jobs = jobs
        """Each running job loop, by job (the job loop's own table)."""
        self.caches: Caches | None = None
        self.queue = GpuQueue()
        self.queued: set[JobKey] = set()
        """Jobs whose last look left them Queued, or Planning for want of any pool."""
        self.pool_wakers: dict[str, asyncio.Event] = {}
        self.capacity_version = 0
        self._pools: tuple[Any, list[GPUPool], dict[str, dict[str, Any]]] | None = None
        self._wake_pending = False
        self._idle_free: dict[str, int] = {}
        """Free GPUs of each pool nobody waited for, at the last wake pass."""

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
