"""The queue for GPUs that every job's loop shares (control/queue.py has its rules).

A look asks it whether its job may launch; a launch reserves the GPUs of its plan until the
job's pods hold them, so that two looks never launch into the same free GPUs. What changes
here wakes loops: controller/capacity_view.py decides whom.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kubetune.control.queue import (
    Ticket,
    Wait,
    Waiting,
    free_after,
    full_pool_wait,
    no_room_wait,
    queue_wait,
    small_place_move,
)
from kubetune.controller.cache import JobKey

RELEASED_KEPT_SECONDS = 120.0
"""How long the queue remembers a reservation given back (its pods got nodes) for looks that
began from older capacity; a look older than this when it admits looks again instead."""


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
    ) -> Wait | None:
        """None: launch now (GPUs reserved); otherwise the job waits: why, and where.

        `free_per_node` is the pool's capacity as of capacity version `seen` (None: current):
        reservations given back by looks that began from this version or a later one still
        count (`released`).

        `join=False` asks without joining the pool's queue: a job that runs elsewhere and
        would move here (its pods found no room) takes these GPUs only when nobody waits
        ahead of it and they are free after every reservation, and otherwise stays where it
        is, out of this queue."""
        with self._lock:
            if queued and not join:
                return no_room_wait(ticket)
            if queued:
                position = self.positions[key] = self._join(ticket)
                return full_pool_wait(ticket, position)
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
            why = queue_wait(ticket, ahead, free_after(free_per_node, others))
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
