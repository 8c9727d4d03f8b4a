"""The Lease elector's decisions against a real kube-apiserver.

Each test drives `LeaseElector`s one round at a time (`try_acquire_or_renew`) on a Lease of
its own, with short timings; a candidate's clock is a `FakeClock` where the test must move
time past a deadline without waiting for it. The drill with whole operator processes is
tests/integration/test_failover.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from lightkube import AsyncClient, KubeConfig
from lightkube.resources.coordination_v1 import Lease

from kubetune.controller.leader import LeaderSettings, LeadershipLost, LeaseElector
from kubetune_dev.cluster import LocalCluster

pytestmark = pytest.mark.integration


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def client(local_cluster: LocalCluster) -> AsyncIterator[AsyncClient]:
    api = AsyncClient(config=KubeConfig.from_file(local_cluster.kubeconfig))
    yield api
    await api.close()


@pytest.fixture
def lease_name() -> str:
    return f"lease-{uuid.uuid4().hex[:8]}"


Make = Callable[..., tuple[LeaseElector, list[str]]]


@pytest.fixture
def make(client: AsyncClient, namespace: str, lease_name: str) -> Make:
    """A candidate named `name`; the list collects why it lost the lease."""

    def candidate(
        name: str, clock: Callable[[], float] = time.monotonic, **timings: Any
    ) -> tuple[LeaseElector, list[str]]:
        settings = LeaderSettings(
            enabled=True,
            lease_name=lease_name,
            lease_namespace=namespace,
            identity=name,
            **{"lease_duration_s": 2, "renew_deadline_s": 1.5, "retry_period_s": 0.5, **timings},
        ).validate()
        lost: list[str] = []
        return LeaseElector(client, settings, on_lost=lost.append, clock=clock), lost

    return candidate


async def holder(client: AsyncClient, namespace: str, name: str) -> tuple[str, int]:
    lease = await client.get(Lease, name, namespace=namespace)
    assert lease.spec is not None
    return lease.spec.holderIdentity or "", lease.spec.leaseTransitions or 0


async def test_the_first_candidate_creates_the_lease_and_the_next_waits(
    make: Make, client: AsyncClient, namespace: str, lease_name: str
) -> None:
    a, _ = make("a")
    b, _ = make("b")
    assert await a.try_acquire_or_renew()
    assert a.is_leader and a.may_write()
    assert await holder(client, namespace, lease_name) == ("a", 0)
    first = (await client.get(Lease, lease_name, namespace=namespace)).spec
    assert not await b.try_acquire_or_renew()
    assert b.holder == "a" and not b.may_write()
    # Renewing keeps the holder and the acquire time and moves the renew time.
    await asyncio.sleep(0.01)
    assert await a.try_acquire_or_renew()
    again = (await client.get(Lease, lease_name, namespace=namespace)).spec
    assert first is not None and again is not None
    assert again.holderIdentity == "a" and again.leaseTransitions == 0
    assert again.acquireTime == first.acquireTime
    assert again.renewTime is not None and first.renewTime is not None
    assert again.renewTime > first.renewTime
    assert again.leaseDurationSeconds == 2


async def test_a_lease_not_renewed_for_its_duration_is_taken_over(
    make: Make, client: AsyncClient, namespace: str, lease_name: str
) -> None:
    a, a_lost = make("a")
    clock = FakeClock()
    b, _ = make("b", clock=clock)
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()  # b starts its own count now
    clock.now += 1.9
    assert not await b.try_acquire_or_renew(), "taken over before the lease's duration"
    clock.now += 0.2
    assert await b.try_acquire_or_renew()
    assert await holder(client, namespace, lease_name) == ("b", 1)
    # The old leader's renewal was decided on a stale version: the API server refuses it,
    # and once it reads the lease again it sees the new holder and gives up.
    assert not await a.try_acquire_or_renew()
    assert a_lost == []
    assert not await a.try_acquire_or_renew()
    assert len(a_lost) == 1 and "b holds it now" in a_lost[0]
    assert not a.is_leader and not a.may_write()


async def test_a_renewed_lease_is_never_taken_over(make: Make) -> None:
    a, _ = make("a")
    clock = FakeClock()
    b, _ = make("b", clock=clock)
    assert await a.try_acquire_or_renew()
    for _ in range(4):
        assert not await b.try_acquire_or_renew()
        clock.now += 1.5  # less than the lease's 2 s between two of a's renewals
        assert await a.try_acquire_or_renew()
    assert b.holder == "a"


async def test_a_conflict_means_another_candidate_won(
    make: Make, client: AsyncClient, namespace: str, lease_name: str
) -> None:
    """Two standbys see the same expired lease; the API server lets only one write."""
    a, _ = make("a")
    assert await a.try_acquire_or_renew()
    clocks = [FakeClock(), FakeClock()]
    b, _ = make("b", clock=clocks[0])
    c, _ = make("c", clock=clocks[1])
    assert not await b.try_acquire_or_renew()
    assert not await c.try_acquire_or_renew()
    stale = await client.get(Lease, lease_name, namespace=namespace)
    for clock in clocks:
        clock.now += 5
    assert await b.try_acquire_or_renew()
    # c decides on the version it read before b's write (as if both read at once).
    reads = []

    async def stale_read() -> Lease:
        reads.append(1)
        return stale

    c._read = stale_read  # type: ignore[method-assign]
    assert not await c.try_acquire_or_renew()
    assert reads and not c.is_leader
    assert await holder(client, namespace, lease_name) == ("b", 1)


async def test_two_candidates_racing_for_a_free_lease_end_with_one_leader(
    make: Make, client: AsyncClient, namespace: str, lease_name: str
) -> None:
    candidates = [make(f"r{i}")[0] for i in range(4)]
    won = await asyncio.gather(*(c.try_acquire_or_renew() for c in candidates))
    assert sum(won) == 1, won
    (winner,) = [c for c, w in zip(candidates, won, strict=True) if w]
    assert await holder(client, namespace, lease_name) == (winner.identity, 0)


async def test_release_lets_a_standby_take_over_at_once(
    make: Make, client: AsyncClient, namespace: str, lease_name: str
) -> None:
    a, a_lost = make("a")
    b, _ = make("b")
    assert await a.acquire()
    assert not await b.try_acquire_or_renew()
    await a.release()
    assert not a.is_leader and not a.may_write() and a_lost == []
    assert await holder(client, namespace, lease_name) == ("", 0)
    assert await b.try_acquire_or_renew()
    assert await holder(client, namespace, lease_name) == ("b", 1)
    await b.release()


async def test_writes_stop_at_the_renew_deadline_and_the_watchdog_fences(make: Make) -> None:
    clock = FakeClock()
    a, lost = make("a", clock=clock)
    assert await a.acquire()
    a.raise_unless_leader()
    clock.now += 1.4
    assert a.may_write()
    clock.now += 0.1  # the renew deadline, 1.5 s after the last renewal was sent
    assert not a.may_write()
    with pytest.raises(LeadershipLost, match="must not write"):
        a.raise_unless_leader()
    # The watchdog thread notices without the event loop's help.
    deadline = time.monotonic() + 2
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost and "no renewal for 1.5s" in lost[0]
    assert not a.is_leader


async def test_keep_renewing_holds_the_lease(
    make: Make, client: AsyncClient, namespace: str, lease_name: str
) -> None:
    a, lost = make("a", lease_duration_s=2, renew_deadline_s=1, retry_period_s=0.2)
    assert await a.acquire()
    renewing = asyncio.create_task(a.keep_renewing())
    before = (await client.get(Lease, lease_name, namespace=namespace)).spec
    await asyncio.sleep(1.5)  # past the renew deadline: only renewals keep a writing
    assert a.may_write() and lost == []
    after = (await client.get(Lease, lease_name, namespace=namespace)).spec
    assert before is not None and after is not None
    assert after.renewTime is not None and before.renewTime is not None
    assert after.renewTime > before.renewTime
    renewing.cancel()
    await a.release()
