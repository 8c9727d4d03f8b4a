"""Who gets a pool's free GPUs next (pure).

Jobs that wait for GPUs queue per pool, in a stated order: higher `spec.resources.priority`
first, then earlier creation, then namespace and name. A job may launch only when no job
ahead of it waits for the same pool (no overtaking, so a large job is never starved by a
stream of small ones) and when its layout fits in the pool's free GPUs after the GPUs
reserved for jobs that were admitted but whose pods are not bound to nodes yet. The
reservation is what keeps two jobs from launching into the same free GPUs.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from kubetune.api.v1alpha1 import QueueStatus
from kubetune.api.vocabulary import QueueWait


@dataclass(frozen=True)
class Ticket:
    """A job's place in the queue of one pool, for one layout."""

    namespace: str
    name: str
    priority: int
    created: str
    """creationTimestamp (RFC 3339 in UTC, so it sorts as text)."""
    pool: str
    nodes: int
    gpus_per_node: int

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    def order(self) -> tuple[int, str, str, str]:
        return (-self.priority, self.created, self.namespace, self.name)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


class Waiting:
    """The jobs that wait, each pool's in queue order, so that how many go before a job is
    a bisection (`ahead`) and the front of a queue a slice (`heads`), not a scan of every
    waiting job: a burst of N jobs asks both N times. Same answers as `count_ahead`."""

    def __init__(self) -> None:
        self._tickets: dict[tuple[str, str], Ticket] = {}
        self._orders: dict[str, list[tuple[int, str, str, str]]] = {}
        """Per pool, the waiting tickets' `Ticket.order()`, sorted (unique: it ends with the
        namespace and name)."""

    def put(self, ticket: Ticket) -> None:
        """The job waits with this ticket (replacing the one it had)."""
        self.drop(ticket.key)
        self._tickets[ticket.key] = ticket
        insort(self._orders.setdefault(ticket.pool, []), ticket.order())

    def drop(self, key: tuple[str, str]) -> None:
        ticket = self._tickets.pop(key, None)
        if ticket is None:
            return
        orders = self._orders[ticket.pool]
        del orders[bisect_left(orders, ticket.order())]
        if not orders:
            del self._orders[ticket.pool]

    def ticket(self, key: tuple[str, str]) -> Ticket | None:
        """The ticket the job waits with, if it waits."""
        return self._tickets.get(key)

    def length(self, pool: str) -> int:
        """How many jobs wait for the pool."""
        return len(self._orders.get(pool, ()))

    def ahead(self, ticket: Ticket) -> int:
        """How many waiting jobs of the ticket's pool go before it (itself never counted)."""
        mine = ticket.order()
        count = bisect_left(self._orders.get(ticket.pool, []), mine)
        own = self._tickets.get(ticket.key)
        if own is not None and own.pool == ticket.pool and own.order() < mine:
            count -= 1  # its own older ticket (e.g. before its priority was raised)
        return count

    def heads(self, per_pool: int) -> set[tuple[str, str]]:
        """The first `per_pool` waiting jobs of each pool's queue."""
        return {
            (namespace, name)
            for orders in self._orders.values()
            for _, _, namespace, name in orders[:per_pool]
        }

    def places(self) -> Iterator[tuple[tuple[str, str], int]]:
        """Each waiting job with its place (1 first) in its pool's queue."""
        for orders in self._orders.values():
            for place, (_, _, namespace, name) in enumerate(orders, start=1):
                yield (namespace, name), place

    def pools(self) -> set[str]:
        """The pools somebody waits for."""
        return set(self._orders)

    def __contains__(self, key: object) -> bool:
        return key in self._tickets

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self._tickets)

    def __len__(self) -> int:
        return len(self._tickets)

    def tickets(self) -> list[Ticket]:
        return list(self._tickets.values())


def free_after(per_node_free: Sequence[int], reserved: Iterable[Ticket]) -> list[int]:
    """Free GPUs per node once each reservation took its nodes (best fit: the node with
    the fewest free GPUs that still holds one of its pods)."""
    free = list(per_node_free)
    for ticket in reserved:
        for _ in range(ticket.nodes):
            fitting = [i for i, f in enumerate(free) if f >= ticket.gpus_per_node]
            if not fitting:
                break
            i = min(fitting, key=lambda i: free[i])
            free[i] -= ticket.gpus_per_node
    return free


def fits(free: Sequence[int], nodes: int, gpus_per_node: int) -> bool:
    return sum(1 for f in free if f >= gpus_per_node) >= nodes


def ahead_of(ticket: Ticket, waiting: Iterable[Ticket]) -> list[Ticket]:
    """The jobs waiting for the same pool that go before `ticket`, in queue order."""
    return sorted(
        (
            t
            for t in waiting
            if t.pool == ticket.pool and t.key != ticket.key and t.order() < ticket.order()
        ),
        key=Ticket.order,
    )


def count_ahead(ticket: Ticket, waiting: Iterable[Ticket]) -> int:
    """How many jobs waiting for the same pool go before `ticket` (linear, no sorting)."""
    mine = ticket.order()
    return sum(
        1 for t in waiting if t.pool == ticket.pool and t.key != ticket.key and t.order() < mine
    )


def why_wait(ticket: Ticket, waiting: Iterable[Ticket], free: Sequence[int]) -> str | None:
    """None when the job may launch now; otherwise what it waits for, with its position."""
    return wait_reason(ticket, count_ahead(ticket, waiting), free)


def small_place_move(shown: int, now: int) -> bool:
    """Whether a queued job's move from place `shown` to `now` is by less than a tenth of
    the place shown (never so within the first ten places): such a move need not be shown
    at once."""
    return now != shown and abs(now - shown) * 10 < shown


@dataclass(frozen=True)
class Place:
    """Where a job waits: its pool's queue, its place in it (1 first), and what it waits for
    (status.queue once the job is Queued)."""

    pool: str
    position: int
    waiting_for: QueueWait

    def status(self) -> QueueStatus:
        return QueueStatus(
            pool=self.pool,
            position=self.position,
            jobs_ahead=self.position - 1,
            waiting_for=self.waiting_for,
        )


@dataclass(frozen=True)
class Wait:
    """Why a job may not launch now: what its status says, and where it waits (None: it
    joined no queue)."""

    message: str
    place: Place | None = None


def queue_wait(ticket: Ticket, ahead: int, free: Sequence[int]) -> Wait | None:
    """`wait_reason`, with the job's place."""
    if ahead:
        return Wait(
            f"position {ahead + 1} in the queue of pool {ticket.pool}: "
            f"{ahead} job(s) ahead (higher priority, or created earlier) go first",
            Place(ticket.pool, ahead + 1, QueueWait.JOBS_AHEAD),
        )
    if not fits(free, ticket.nodes, ticket.gpus_per_node):
        return Wait(
            f"position 1 in the queue of pool {ticket.pool}: waiting for {ticket.gpus} free "
            f"GPU(s) ({ticket.nodes} node(s) with {ticket.gpus_per_node} free each)",
            Place(ticket.pool, 1, QueueWait.FREE_GPUS),
        )
    return None


def wait_reason(ticket: Ticket, ahead: int, free: Sequence[int]) -> str | None:
    """`why_wait` for a job with `ahead` jobs before it in its pool's queue."""
    wait = queue_wait(ticket, ahead, free)
    return None if wait is None else wait.message


def full_pool_wait(ticket: Ticket, position: int) -> Wait:
    """A job the planner found no room for: it waits at `position` of its pool's queue."""
    return Wait(
        f"position {position} in the queue of pool {ticket.pool}: waiting for "
        f"{ticket.gpus} free GPU(s); re-planning as capacity changes",
        Place(ticket.pool, position, QueueWait.FREE_GPUS),
    )


def no_room_wait(ticket: Ticket) -> Wait:
    """A job that would move to the ticket's pool (its pods found no room where they are),
    which has no room for it either: it stays where it is, in no queue."""
    return Wait(f"pool {ticket.pool} has no {ticket.gpus} free GPU(s)")
