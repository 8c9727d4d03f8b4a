"""The queue for GPUs: order, no overtaking, reservations (control/queue.py), the
operator's shared queue (controller/gpuqueue.GpuQueue) and a look's admission
(controller/admission.py)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubetune.api.v1alpha1 import FineTuneJobStatus
from kubetune.api.vocabulary import Phase, QueueWait
from kubetune.control.capacity import NodeInfo
from kubetune.control.queue import (
    Place,
    Ticket,
    Waiting,
    ahead_of,
    count_ahead,
    fits,
    free_after,
    why_wait,
)
from kubetune.control.reconcile import ControllerSettings
from kubetune.controller.admission import Admission, release_when_bound
from kubetune.controller.cache import Caches
from kubetune.controller.gpuqueue import GpuQueue
from kubetune.controller.jobloop import JobState
from kubetune.controller.reconcilers import Reconcilers
from kubetune.controller.status_writes import SMALL_MOVE_SLOWDOWN, StatusWriter, Written
from kubetune.planning.catalog import default_pools
from kubetune.sources import load_arch
from support.reconcile import Store, make_job, run, unschedulable

pytestmark = pytest.mark.unit

NAMESPACE = "team-a"


def ticket(
    name: str, *, priority: int = 0, created: str = "2026-11-24T00:00:00Z", gpus: int = 1,
    nodes: int = 1, pool: str = "a100", namespace: str = "team-a",
) -> Ticket:  # fmt: skip
    return Ticket(namespace, name, priority, created, pool, nodes, gpus)


def test_order_is_priority_then_creation_then_name() -> None:
    waiting = [
        ticket("late", created="2026-11-24T00:00:05Z"),
        ticket("urgent", priority=10, created="2026-11-24T00:00:09Z"),
        ticket("b"),
        ticket("a"),
        ticket("other-pool", pool="h100", created="2026-11-23T00:00:00Z"),
    ]
    me = ticket("me", created="2026-11-24T00:00:07Z")

    assert [t.name for t in ahead_of(me, waiting)] == ["urgent", "a", "b", "late"]


def test_a_job_never_overtakes_one_ahead_of_it() -> None:
    big = ticket("big", gpus=8, created="2026-11-24T00:00:00Z")
    small = ticket("small", gpus=1, created="2026-11-24T00:00:01Z")

    # Room for the small one only: it still waits behind the big one.
    why = why_wait(small, [big, small], free=[4])

    assert why is not None and why.startswith("position 2 in the queue of pool a100")
    assert why_wait(big, [big, small], free=[4]) == (
        "position 1 in the queue of pool a100: waiting for 8 free GPU(s) "
        "(1 node(s) with 8 free each)"
    )
    assert why_wait(big, [big, small], free=[8]) is None


def test_a_wait_says_where_the_job_waits_as_its_message_does() -> None:
    """status.queue comes from the same answer as the message: the pool, the place, and
    whether the job waits for jobs ahead or for free GPUs."""
    queue = GpuQueue()
    big = ticket("big", gpus=8, created="2026-11-24T00:00:00Z")
    small = ticket("small", gpus=1, created="2026-11-24T00:00:01Z")

    front = queue.admit(big.key, big, [4], queued=False)
    assert front is not None and front.place == Place("a100", 1, QueueWait.FREE_GPUS)
    behind = queue.admit(small.key, small, [4], queued=False)
    assert behind is not None and behind.place == Place("a100", 2, QueueWait.JOBS_AHEAD)
    assert behind.message.startswith("position 2 in the queue of pool a100: 1 job(s) ahead")
    full = queue.admit(small.key, small, [0], queued=True)
    assert full is not None and full.place == Place("a100", 2, QueueWait.FREE_GPUS)
    assert full.message.startswith("position 2 in the queue of pool a100: waiting for 1 free")
    assert full.place.status().to_wire() == {
        "pool": "a100",
        "position": 2,
        "jobsAhead": 1,
        "waitingFor": "FreeGPUs",
    }
    # A job that would move here and may not joins no queue: no place to show.
    mover = ticket("mover", gpus=8, created="2026-11-24T00:05:00Z")
    stays = queue.admit(mover.key, mover, [0], queued=True, join=False)
    assert stays is not None and stays.place is None


async def test_a_queued_job_shows_the_place_its_look_was_given() -> None:
    """The job loop puts the queue's answer of its look into status.queue; a look that did
    not ask keeps the place shown, and a job that is not Queued shows none."""
    job, _ = run(make_job())
    plan = job.status.plan  # type: ignore[union-attr]
    assert plan is not None
    view = Reconcilers(ControllerSettings(), None, load_arch, lambda *_: None).view  # type: ignore[arg-type]
    full = {plan.pool: {"freeGPUsPerNode": [0] * plan.nodes}}
    loop = asyncio.get_running_loop()

    admit = Admission(view, loop, (NAMESPACE, "q"), job, full, (0, time.monotonic()))
    status = FineTuneJobStatus(phase=Phase.QUEUED)
    admit.show(status)
    assert status.queue is None, "not asked: nothing to show yet"
    why = admit(plan, True)
    assert why is not None and why.startswith(f"position 1 in the queue of pool {plan.pool}")
    admit.show(status)
    assert status.queue is not None
    assert (status.queue.pool, status.queue.position) == (plan.pool, 1)
    assert status.queue.waiting_for == QueueWait.FREE_GPUS

    shown = status.queue
    Admission(view, loop, (NAMESPACE, "q"), job, full, (0, time.monotonic())).show(status)
    assert status.queue is shown, "a look that did not ask keeps the place"
    status.phase = Phase.RUNNING
    admit.show(status)
    assert status.queue is None


def test_reservations_take_the_best_fitting_nodes() -> None:
    reserved = [ticket("r1", gpus=2), ticket("r2", gpus=4, nodes=2)]

    assert free_after([8, 4, 2], reserved) == [4, 0, 0]
    assert free_after([8], [ticket("r", gpus=4, nodes=3)]) == [0]  # no room left: stops
    assert fits([4, 0, 0], nodes=1, gpus_per_node=4)
    assert not fits([4, 0, 0], nodes=2, gpus_per_node=1)


def test_two_jobs_never_launch_into_the_same_free_gpus() -> None:
    queue = GpuQueue()
    first, second = (
        ticket("first", gpus=8),
        ticket("second", gpus=8, created="2026-11-24T00:01:00Z"),
    )

    # Both looked at the same free node (8 GPUs) before either launched.
    assert queue.admit(("team-a", "first"), first, [8], queued=False) is None
    why = queue.admit(("team-a", "second"), second, [8], queued=False)

    assert why is not None and "waiting for 8 free GPU(s)" in why.message
    assert queue.reserved_in("a100") == [first]
    # The first one's pods hold the GPUs now: the capacity says 0 free, the reservation goes.
    assert queue.release(("team-a", "first"))
    assert queue.admit(("team-a", "second"), second, [0], queued=False) is not None
    assert queue.admit(("team-a", "second"), second, [8], queued=False) is None


def test_a_reservation_given_back_counts_for_looks_from_the_same_capacity_version() -> None:
    """kopf updates the pod index before the handler that moves the capacity version runs:
    a look at version 7 may see the first job's pod bound (and give its reservation back)
    while another look at version 7 holds capacity computed before the binding. Only a look
    from a later version (its capacity holds the pod) may take those GPUs."""
    queue = GpuQueue()
    first, second = (
        ticket("first", gpus=8),
        ticket("second", gpus=8, created="2026-11-24T00:01:00Z"),
    )
    assert queue.admit(("team-a", "first"), first, [8], queued=False, seen=6) is None
    assert queue.release(("team-a", "first"), bound_in=7)

    for seen in (6, 7):  # capacity from before the binding: 8 free that are not
        why = queue.admit(("team-a", "second"), second, [8], queued=False, seen=seen)
        assert why is not None and "waiting for 8 free GPU(s)" in why.message, seen
    assert queue.admit(("team-a", "second"), second, [0], queued=False, seen=8) is not None
    # A later version whose capacity shows 8 free: the first job's pod finished meanwhile.
    assert queue.admit(("team-a", "second"), second, [8], queued=False, seen=9) is None


def test_jobs_the_planner_queued_hold_their_place() -> None:
    queue = GpuQueue()
    old = ticket("old", gpus=8)
    new = ticket("new", gpus=1, created="2026-11-24T00:05:00Z")

    why_old = queue.admit(("team-a", "old"), old, [0], queued=True)
    why_new = queue.admit(("team-a", "new"), new, [1], queued=False)

    assert why_old is not None and why_old.message.startswith(
        "position 1 in the queue of pool a100"
    )
    assert why_new is not None and why_new.message.startswith(
        "position 2 in the queue of pool a100"
    )
    queue.stop_waiting(("team-a", "old"))  # e.g. deleted, or moved to another pool
    assert queue.admit(("team-a", "new"), new, [1], queued=False) is None
    assert queue.version == 1


def test_a_change_of_capacity_wakes_the_front_of_each_queue() -> None:
    queue = GpuQueue()
    for i in range(20):
        t = ticket(f"a{i:02d}", created=f"2026-11-24T00:00:{i:02d}Z")
        queue.admit(("team-a", t.name), t, [0], queued=True)
    late = ticket("h", pool="h100")
    queue.admit(("team-a", "h"), late, [0], queued=True)

    assert queue.heads(3) == {
        ("team-a", "a00"),
        ("team-a", "a01"),
        ("team-a", "a02"),
        ("team-a", "h"),
    }


def _looks_queued(rt: Reconcilers, i: int) -> Ticket:
    """Job q<i> looks and queues in pool a100 (the i-th created)."""
    t = ticket(f"q{i:02d}", created=f"2026-11-24T00:{i:02d}:00Z")
    rt.view.queue.admit(t.key, t, [0], queued=True)
    return t


def _waiting_runtime(jobs: int) -> tuple[Reconcilers, list[tuple[str, str]]]:
    """A runtime whose queue of pool a100 holds `jobs` jobs, each looked at once."""
    rt = Reconcilers(ControllerSettings(), None, load_arch, lambda *_: None)  # type: ignore[arg-type]
    keys = []
    for i in range(jobs):
        t = _looks_queued(rt, i)
        rt.jobs[t.key] = JobState(name=t.name)
        keys.append(t.key)
    return rt, keys


def _woken(rt: Reconcilers) -> set[str]:
    woken = {state.name for state in rt.jobs.values() if state.wake.is_set()}
    for state in rt.jobs.values():
        state.wake.clear()
    return woken


def test_jobs_deep_in_a_queue_are_woken_when_their_place_moved_by_a_tenth() -> None:
    """Deep in a queue a job looks again only when what it shows would change at once: its
    place moved by a tenth of the place it last saw, or into the first ten places."""
    rt, keys = _waiting_runtime(40)
    for key in keys[:3]:  # three leave the front: the others move up by three
        assert rt.view.queue.stop_waiting(key)
    assert not rt.view.queue.stop_waiting(keys[0])
    rt.view.queue_changed()  # no event loop: the wake pass runs at once

    # q03..q10 are the first eight now; q11..q29 saw places 12..30, of which three is a
    # tenth or more; q30..q39 saw 31..40 and wait.
    assert _woken(rt) == {f"q{i:02d}" for i in range(3, 30)}

    for i in range(3, 30):  # their looks see their new places
        _looks_queued(rt, i)
    rt.view.queue_changed()
    assert _woken(rt) == {f"q{i:02d}" for i in range(3, 11)}  # the front only

    # One joins ahead of all of them (higher priority): everyone moves back by one, which
    # only those within the first ten places show at once.
    first = ticket("urgent", priority=5, created="2026-11-24T01:00:00Z")
    rt.view.queue.admit(first.key, first, [0], queued=True)
    rt.view.queue_changed()
    assert _woken(rt) == {f"q{i:02d}" for i in range(3, 13)}
    rt.job_loop.executor.shutdown()


async def test_a_job_that_joins_ahead_wakes_those_whose_place_it_moved() -> None:
    """A job that queues ahead of jobs already waiting (a higher priority) moves each of
    them back a place: those within the first ten show that at once, so the join itself
    must wake them; nothing else might happen for minutes. A job that joins at the end moves
    nobody and wakes nobody."""
    job, _ = run(make_job())
    plan = job.status.plan  # type: ignore[union-attr]
    assert plan is not None
    rt = Reconcilers(ControllerSettings(), None, load_arch, lambda *_: None)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    full = {plan.pool: {"freeGPUsPerNode": [0] * plan.nodes}}

    async def queues(name: str, minute: int, priority: int = 0) -> None:
        meta = {
            **job.metadata,
            "name": name,
            "creationTimestamp": f"2026-11-24T00:{minute:02d}:00Z",
        }
        spec = job.spec.model_copy(
            update={"resources": job.spec.resources.model_copy(update={"priority": priority})}
        )
        one = job.model_copy(update={"metadata": meta, "spec": spec})
        admit = Admission(rt.view, loop, (NAMESPACE, name), one, full, (0, time.monotonic()))
        why = await loop.run_in_executor(rt.job_loop.executor, admit, plan, True)
        assert why is not None and "position" in why
        rt.jobs.setdefault((NAMESPACE, name), JobState(name=name))

    async def woken_after_a_burst() -> set[str]:
        await asyncio.sleep(0.7)  # the wake pass runs once per burst of changes, 0.5 s on
        return _woken(rt)

    try:
        for i in range(12):
            await queues(f"q{i:02d}", i)
        await woken_after_a_burst()
        await queues("last", 30)
        assert await woken_after_a_burst() == set(), "joining at the end moves nobody"

        await queues("urgent", 40, priority=5)
        assert rt.view.queue.position((NAMESPACE, "urgent")) == 1
        # Everyone moved back a place, which the ten that had the first ten places show at
        # once (q00..q09); q10 and q11 moved by less than a tenth (and the first eight of a
        # queue, the new job among them, are woken on any change).
        assert await woken_after_a_burst() == {"urgent", *(f"q{i:02d}" for i in range(10))}

        await queues("urgent", 40, priority=5)  # its next look: the same ticket
        assert await woken_after_a_burst() == set()
    finally:
        rt.job_loop.executor.shutdown()


def test_a_pool_nobody_waits_for_getting_free_gpus_wakes_every_waiting_job() -> None:
    """A job deep in one pool's queue may move to another pool once that one has room; the
    first of its queue may not be allowed there. Free GPUs in a pool without a queue wake the
    waiting jobs, once per rise."""
    rt, _ = _waiting_runtime(20)
    pool = default_pools()[0]
    node = NodeInfo("n1", dict(pool.spec.node_selector), 8, True)
    gpu_pods: Store = Store({"n1": [8]})
    rt.caches = Caches(
        Store(), Store(), Store({"n1": [node]}), gpu_pods, Store({pool.name: [pool]})
    )
    assert pool.name not in rt.view.queue.waiting_pools()

    rt.capacity_changed()
    assert _woken(rt) == {f"q{i:02d}" for i in range(8)}  # the pool is full: the front only
    gpu_pods["n1"] = [2]
    rt.capacity_changed()
    assert _woken(rt) == {f"q{i:02d}" for i in range(20)}  # six GPUs free up: everyone
    rt.capacity_changed()
    assert _woken(rt) == {f"q{i:02d}" for i in range(8)}  # no more than before
    gpu_pods["n1"] = []
    rt.capacity_changed()
    assert _woken(rt) == {f"q{i:02d}" for i in range(20)}  # two more
    rt.job_loop.executor.shutdown()


def test_positions_are_kept_for_the_waiting_only() -> None:
    queue = GpuQueue()
    for i in range(3):
        t = ticket(f"w{i}", created=f"2026-11-24T00:00:0{i}Z")
        queue.admit(("team-a", t.name), t, [0], queued=True)

    assert [queue.position(("team-a", f"w{i}")) for i in range(3)] == [1, 2, 3]
    queue.stop_waiting(("team-a", "w2"))
    assert queue.position(("team-a", "w2")) is None


# A put of (name, priority, second, pool), or a drop of a name.
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.sampled_from("abcdefgh"),
            st.integers(0, 2),
            st.integers(0, 9),
            st.sampled_from(["a100", "h100"]),
        ),
        st.sampled_from("abcdefgh"),
    ),
    max_size=40,
)


@given(OPS)
@settings(max_examples=300, deadline=None)
def test_the_sorted_waiting_list_counts_as_the_scan_does(ops: list[object]) -> None:
    waiting, scanned = Waiting(), {}
    for op in ops:
        if isinstance(op, str):
            waiting.drop(("team-a", op))
            scanned.pop(op, None)
        else:
            name, priority, second, pool = op  # type: ignore[misc]
            t = ticket(name, priority=priority, created=f"2026-11-24T00:00:0{second}Z", pool=pool)
            waiting.put(t)
            scanned[name] = t
        assert len(waiting) == len(scanned) and set(waiting) == {("team-a", n) for n in scanned}
        for probe in [*scanned.values(), ticket("a", priority=1, pool="h100")]:
            assert waiting.ahead(probe) == count_ahead(probe, scanned.values())
        for pool in ("a100", "h100"):
            front = sorted((t for t in scanned.values() if t.pool == pool), key=Ticket.order)
            assert {k for k in waiting.heads(2) if scanned[k[1]].pool == pool} == {
                t.key for t in front[:2]
            }


def test_a_job_that_would_move_takes_free_gpus_but_joins_no_queue() -> None:
    queue = GpuQueue()
    mover = ticket("mover", gpus=8)

    assert queue.admit(("team-a", "mover"), mover, [8], queued=False, join=False) is None
    assert queue.reserved_in("a100") == [mover], "a move reserves its GPUs as a launch does"

    # The GPUs are taken now: the next mover is told no and is not put in the queue.
    other = ticket("other", gpus=8, created="2026-11-24T00:01:00Z")
    assert queue.admit(("team-a", "other"), other, [8], queued=False, join=False) is not None
    assert queue.admit(("team-a", "other"), other, [0], queued=True, join=False) is not None
    assert ("team-a", "other") not in queue.waiting_keys()
    assert queue.position(("team-a", "other")) is None


def test_a_job_that_would_move_does_not_overtake_the_queue() -> None:
    queue = GpuQueue()
    waiting = ticket("waiting", gpus=8, created="2026-11-24T00:00:00Z")
    queue.admit(("team-a", "waiting"), waiting, [0], queued=True)
    mover = ticket("mover", gpus=1, created="2026-11-24T00:05:00Z")

    assert queue.admit(("team-a", "mover"), mover, [8], queued=False, join=False) is not None
    assert queue.reserved_in("a100") == [] and queue.waiting_keys() == {("team-a", "waiting")}


async def test_a_look_from_older_capacity_counts_a_reservation_given_back_since() -> None:
    """A look starts from the capacity of its start; by the time it admits, another job may
    have launched, got its node and given its reservation back. The look must count that
    job's GPUs as held, although its own snapshot shows them free; a look that began after
    the pods were seen bound counts them from the capacity itself."""
    job, _ = run(make_job())
    plan = job.status.plan  # type: ignore[union-attr]
    assert plan is not None and plan.nodes == 1
    pool = next(p for p in default_pools() if p.name == plan.pool)
    node = NodeInfo("n1", dict(pool.spec.node_selector), plan.gpus_per_node, True)
    gpu_pods: Store = Store()
    rt = Reconcilers(ControllerSettings(), None, load_arch, lambda *_: None)  # type: ignore[arg-type]
    pools = Store({pool.name: [pool]})
    rt.caches = Caches(Store(), Store(), Store({"n1": [node]}), gpu_pods, pools)
    loop = asyncio.get_running_loop()
    first, second = (NAMESPACE, "first"), (NAMESPACE, "second")

    def look() -> Admission:
        """What a look captures at its start, then admits with later (in a worker thread)."""
        version, _ = rt.view.view_version
        _, capacity = rt.view.live_pools()
        return Admission(rt.view, loop, second, job, capacity, (version, time.monotonic()))

    try:
        early = look()  # the second job's look starts here: all GPUs free
        admit_first = Admission(
            rt.view, loop, first, job, rt.view.live_pools()[1], (0, time.monotonic())
        )
        assert await loop.run_in_executor(rt.job_loop.executor, admit_first, plan, False) is None
        gpu_pods["n1"] = [plan.gpus_per_node]  # its pod got the node
        rt.capacity_changed()
        release_when_bound(
            rt.view,
            rt.settings,
            first,
            Phase.RUNNING,
            [{"spec": {"nodeName": "n1"}}],
            rt.view.view_version[0],
        )
        assert rt.view.queue.reserved_in(pool.name) == []

        why = await loop.run_in_executor(rt.job_loop.executor, early, plan, False)
        assert why is not None and "waiting for" in why
        late = look()
        why = await loop.run_in_executor(rt.job_loop.executor, late, plan, False)
        assert why is not None and "waiting for" in why
        assert rt.view.queue.reserved_in(pool.name) == []

        gpu_pods["n1"] = []  # the first job finished
        rt.capacity_changed()
        assert await loop.run_in_executor(rt.job_loop.executor, look(), plan, False) is None
    finally:
        rt.job_loop.executor.shutdown()


def test_a_reservation_holds_until_its_pods_are_turned_away_long_enough() -> None:
    """In a burst a job's batch Job may be created minutes after admission: its reservation
    must not lapse before its pods exist, or its GPUs go to the next job as well."""
    rt = Reconcilers(ControllerSettings(), None, load_arch, lambda *_: None)  # type: ignore[arg-type]
    key = (NAMESPACE, "late")
    rt.view.queue.admit(key, ticket("late", gpus=8), [8], queued=False)
    ticket_, _ = rt.view.queue.reserved[key]
    # Admitted long ago (longer than the reschedule time), no pod yet: it holds.
    long_ago = time.monotonic() - ControllerSettings().reschedule_seconds - 5
    rt.view.queue.reserved[key] = (ticket_, long_ago)
    release_when_bound(rt.view, rt.settings, key, Phase.RUNNING, [], 0)
    assert rt.view.queue.reservation(key) is not None

    refused_at = datetime.now(UTC) - timedelta(seconds=ControllerSettings().reschedule_seconds)
    release_when_bound(
        rt.view,
        rt.settings,
        key,
        Phase.RUNNING,
        [unschedulable("late-0", refused_at + timedelta(seconds=30))],
        0,
    )
    assert rt.view.queue.reservation(key) is not None, "turned away, but not for long yet"
    refused = unschedulable("late-0", refused_at - timedelta(seconds=5))
    release_when_bound(rt.view, rt.settings, key, Phase.RUNNING, [refused], 0)
    assert rt.view.queue.reservation(key) is None
    rt.job_loop.executor.shutdown()


class _StatusWrites:
    """The status subresource of a Kube, recording each patch."""

    def __init__(self) -> None:
        self.patches: list[dict[str, object]] = []

    async def patch_status(self, namespace: str, name: str, patch: dict[str, object]) -> str:
        self.patches.append(patch)
        return str(len(self.patches))


def _queued(position: int) -> FineTuneJobStatus:
    where = f"position {position} in the queue of pool a100"
    return FineTuneJobStatus.model_validate(
        {
            "phase": "Queued",
            "message": f"{where}: {position - 1} job(s) ahead (higher priority, or created "
            "earlier) go first",
            "queue": {
                "pool": "a100",
                "position": position,
                "jobsAhead": position - 1,
                "waitingFor": "JobsAhead",
            },
        }
    )


async def test_a_deep_position_is_written_after_every_tenth_of_the_way() -> None:
    """Each admission moves every job behind it by one place: written each time, a queue of
    N jobs costs N status writes per admission. A job deep in a queue writes a move of less
    than a tenth ten times less often; a larger move, and any move near the front, at the
    usual pace."""
    settings = ControllerSettings()
    writes = _StatusWrites()
    writer = StatusWriter(settings, writes, lambda *_: None)  # type: ignore[arg-type]
    written = Written()

    async def write(shown: int, now: int, seconds_ago: float) -> bool:
        """Whether the job, its status showing position `shown`, writes position `now`
        `seconds_ago` after its last write."""
        written.at = time.monotonic() - seconds_ago
        before = len(writes.patches)
        old = _queued(shown).to_wire()
        assert await writer.write(written, NAMESPACE, "deep", old, _queued(now).to_wire(), {})
        return len(writes.patches) > before

    pace = settings.progress_write_seconds
    assert not await write(200, 199, pace + 1)  # one place: waits
    assert not await write(200, 181, pace + 1)  # less than a tenth: waits
    assert await write(200, 181, pace * SMALL_MOVE_SLOWDOWN + 1)  # ... until ten paces passed
    assert await write(200, 180, pace + 1)  # a tenth: the usual pace
    assert not await write(200, 180, pace - 1)
    assert await write(10, 9, pace + 1)  # within the first ten every move, at the usual pace
    assert writes.patches[-1]["message"] == _queued(9).message
    assert not await write(11, 10, pace + 1)
