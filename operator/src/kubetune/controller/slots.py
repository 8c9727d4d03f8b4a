"""Who gets the next planning thread: first looks before the rest.

The operator decides (plans, reconciles) on a few worker threads (`planner_workers`). A
thread pool serves submissions first come, first served, so on a busy operator a new job's
first look waits behind every queued job's periodic look again: at 5,000 jobs, of which
4,700 were queued, a burst of new jobs waited up to 89 s to be planned
(benchmarks/results/operator-scale-2026-11-25.md). `PrioritySlots` hands out as many slots as
there are threads, lowest priority number first, in arrival order within a priority; a look
takes a slot before it submits to the pool, so the pool's own queue stays empty and the order
is this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator
from enum import IntEnum


class LookPriority(IntEnum):
    """The order looks get a thread in (lower first)."""

    FIRST = 0
    """A job on its way to its first pod: no plan yet, or at the front of a GPU queue."""
    LATER = 1
    """Everything else: progress of running jobs, queued jobs deep in a queue, resyncs."""


class PrioritySlots:
    """At most `size` holders at once; waiters get a slot by priority, then arrival."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self._free = size
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    @property
    def waiting(self) -> int:
        """Looks waiting for a slot (cancelled ones not yet skipped included)."""
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def hold(self, priority: int) -> AsyncIterator[None]:
        if self._free > 0 and not self._waiters:
            self._free -= 1
        else:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiters, (priority, next(self._arrivals), future))
            try:
                await future
            except asyncio.CancelledError:
                if future.done() and not future.cancelled():
                    self._release()  # the slot was handed over as the waiter was cancelled
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiters:
            _, _, future = heapq.heappop(self._waiters)
            if not future.done():  # skip the ones cancelled while waiting
                future.set_result(None)  # hand this slot straight over
                return
        self._free += 1
