"""The job loop and the pool loop against KMock's API emulator.

A `Reconcilers` talks real HTTP to the in-memory emulator (tests/support/emulated.py seeds
what a cluster would show); each look refreshes the caches from the emulator as the watches
would, then observes, decides, carries out and says when it looks next.
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import replace
from datetime import datetime, timedelta, tzinfo
from functools import partial
from types import SimpleNamespace
from typing import Any

import httpx2
import kmock
import pytest

from kubetune.api.tenancy import Tenant
from kubetune.api.v1alpha1 import FineTuneJob, StageInStatus
from kubetune.api.vocabulary import ConditionType, EventType, Reason
from kubetune.control.build.names import child_names
from kubetune.control.build.settings import BuildSettings
from kubetune.control.queue import Ticket
from kubetune.control.reconcile import ControllerSettings
from kubetune.controller import (
    admission,
    carry_out,
    gpuqueue,
    jobloop,
    memo,
    observe,
    status_writes,
)
from kubetune.controller import kube as kube_module
from kubetune.controller.backoff import Backoff
from kubetune.controller.cache import Caches
from kubetune.controller.jobloop import QUEUE_RETRY_SPREAD, JobState, validated
from kubetune.controller.kube import Kube
from kubetune.controller.reconcilers import Reconcilers
from kubetune.controller.status_writes import SMALL_MOVE_SLOWDOWN
from kubetune.sources import load_arch
from support import emulated
from support.emulated import (
    CONFIGMAPS,
    DEMO_CLAIM,
    FTJ,
    JOBS,
    NAMESPACE,
    NETWORKPOLICIES,
    POOLS,
    PVCS,
    SECRETS,
    SERVICES,
    STATUS_PATH,
    T0,
    UID,
    caches_from,
    capacity_cluster,
    children,
    claim,
    condition,
    example_cluster,
    example_pools,
    first_attempt,
    invalid,
    pod,
    pool,
    pool_nodes,
    requests,
    seed,
    stored,
    tiny_job,
)
from support.kmock_apiserver import ApiServerEmulator
from support.reconcile import make_job

pytestmark = [
    pytest.mark.unit,
    # KMock's bundled resource list is read with a deprecated importlib call.
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),
]


# ---------------------------------------------------------------------- the emulator

apiserver = emulated.apiserver
kube = emulated.kube


# ---------------------------------------------------------------------- the job loop


class Clock(datetime):
    """The loops' wall clock, set by the test."""

    current = T0

    @classmethod
    def now(cls, tz: tzinfo | None = None) -> Clock:
        return cls.current  # type: ignore[return-value]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> type[Clock]:
    monkeypatch.setattr(Clock, "current", T0)
    for module in (jobloop, admission):
        monkeypatch.setattr(module, "datetime", Clock)
    return Clock


class Loop:
    """One job's loop state in `Reconcilers` pointed at the emulator; each `look()` refreshes
    the caches from the emulator (as the watches would) and runs one reconcile."""

    def __init__(self, server: ApiServerEmulator, kube: Kube, **settings: Any) -> None:
        self.server = server
        self.events: list[tuple[str, str, str]] = []
        self.reconcilers = Reconcilers(
            ControllerSettings(**settings),
            kube,
            partial(load_arch, allow_network=False, local_files=False),
            lambda _body, type_, reason, message: self.events.append(
                (str(type_), str(reason), message)
            ),
        )
        self.state = JobState(name="tiny-cpu-lora")
        self.key = ("team-a", "tiny-cpu-lora")

    def body(self) -> dict[str, Any]:
        return copy.deepcopy(dict(self.server.objects[FTJ, NAMESPACE, "tiny-cpu-lora"]))

    async def look(self) -> float | None:
        self.reconcilers.caches = caches_from(self.server)
        self.reconcilers.capacity_changed()
        return await self.reconcilers.job_loop.look(self.key, self.state, self.body())

    def status(self) -> dict[str, Any]:
        return dict(self.body().get("status") or {})

    def status_patches(self) -> list[dict[str, Any]]:
        return [r.data["status"] for r in self.server if r.method == "PATCH" and r.subresource]


@pytest.fixture
def loop(apiserver: ApiServerEmulator, kube: Kube, clock: type[Clock]) -> Loop:
    loop = Loop(apiserver, kube)
    loop.reconcilers.job_loop.rng = random.Random(20260101)  # waits drawn the same every run
    return loop


def about_the_queue_retry(delay: float | None) -> bool:
    """A waiting job's next look: its queue retry, give or take the spread."""
    period = ControllerSettings().queue_retry_seconds
    return delay is not None and abs(delay - period) <= QUEUE_RETRY_SPREAD * period


async def test_new_job_is_planned_and_launched(apiserver: ApiServerEmulator, loop: Loop) -> None:
    seed(apiserver, *example_cluster(), tiny_job())

    delay = await loop.look()

    names = child_names("tiny-cpu-lora", 1)
    assert children(apiserver) == first_attempt()
    owner = {
        "apiVersion": "kubetune.io/v1alpha1",
        "kind": "FineTuneJob",
        "name": "tiny-cpu-lora",
        "uid": UID,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    for resource, name in [
        (CONFIGMAPS, names.config_map),
        (SERVICES, names.service),
        (JOBS, names.job),
    ]:
        assert apiserver.objects[resource, NAMESPACE, name]["metadata"]["ownerReferences"] == [
            owner
        ]
    # The checkpoint volume outlives the job by default (retention: retain): no owner,
    # only a note of whose it is.
    pvc = apiserver.objects[PVCS, NAMESPACE, names.pvc]
    assert "ownerReferences" not in pvc["metadata"]
    assert pvc["metadata"]["annotations"]["kubetune.io/job-uid"] == UID

    status = loop.status()
    assert status["phase"] == "Running"
    assert status["attempt"] == 1
    assert status["observedGeneration"] == 1
    assert status["message"] == "launched attempt 1"
    assert "queue" not in status
    assert status["startTime"] == "2026-11-22T12:00:00Z"
    plan = status["plan"]
    assert plan["method"] == "lora"
    assert plan["nodes"] * plan["gpusPerNode"] == 1
    # The trainer goes where the plan says.
    trainer = apiserver.objects[JOBS, NAMESPACE, names.job]
    assert trainer["metadata"]["labels"]["kubetune.io/attempt"] == "1"
    assert trainer["spec"]["completionMode"] == "Indexed"
    pod_spec = trainer["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"] == pool(plan["pool"])["spec"]["nodeSelector"]
    assert condition(status, ConditionType.PLANNED)["status"] == "True"
    assert condition(status, ConditionType.PLANNED)["reason"] == Reason.PLAN_READY
    assert condition(status, ConditionType.RUNNING)["status"] == "False"
    assert condition(status, ConditionType.RUNNING)["reason"] == Reason.PODS_STARTING
    assert status["cost"]["estimatedUSD"] == plan["estimatedCostUSD"]

    assert [(t, r) for t, r, _ in loop.events] == [
        ("Normal", Reason.PLAN_READY),
        ("Normal", "Launched"),
    ]
    assert loop.events[1][2] == f"Attempt 1 on pool {plan['pool']}"
    # The next look comes from the decision: a running job's poll interval.
    assert delay == ControllerSettings().poll_seconds
    # One status write, through the status subresource, with only what changed.
    assert len(loop.status_patches()) == 1


async def test_the_plan_is_written_before_the_batch_job_is_created(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    seed(apiserver, *example_cluster(), tiny_job())

    await loop.look()

    # On a busy API server every round trip is seconds: the status carrying the plan goes
    # out with the first creates, and the batch Job, whose pods mount them, after both.
    served = [(r.method, r.resource, bool(r.subresource)) for r in apiserver]
    status_write = served.index(("PATCH", kmock.resource(FTJ), True))
    batch_job = served.index(("POST", kmock.resource(JOBS), False))
    assert status_write < batch_job
    assert {r for r in served[:batch_job] if r[0] == "POST"} == {
        ("POST", kmock.resource(resource), False)
        for resource in (PVCS, CONFIGMAPS, SERVICES, NETWORKPOLICIES)
    }


async def test_a_status_write_that_fails_launches_no_trainer(
    apiserver: ApiServerEmulator, loop: Loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(apiserver, *example_cluster(), tiny_job())
    monkeypatch.setattr(kube_module, "RETRIES", 1)
    monkeypatch.setattr(kube_module, "RETRY_WAITS", Backoff(0.0, 0.0))
    apiserver[f"patch {STATUS_PATH}"][:2] << kmock.KubernetesError(500, "InternalError", "down")

    delay = await loop.look()

    # The look failed and is retried; nothing says attempt 1 started, so no batch Job does.
    assert delay is not None and 1.0 <= delay <= 2.0
    assert children(apiserver)["job"] == []

    await loop.look()

    assert loop.status()["attempt"] == 1
    assert children(apiserver)["job"] == [child_names("tiny-cpu-lora", 1).job]
    assert len(requests(apiserver, kmock.action.CREATE, JOBS)) == 1


async def test_looking_again_creates_nothing_and_writes_the_cost_clock_only_when_due(
    apiserver: ApiServerEmulator, loop: Loop, clock: type[Clock]
) -> None:
    seed(apiserver, *example_cluster(), tiny_job())
    await loop.look()
    launched = children(apiserver)
    creates = len(requests(apiserver, kmock.action.CREATE))
    first = loop.status()
    del loop.events[:]
    clock.current += timedelta(minutes=1)

    await loop.look()

    # Children are created once per attempt: no POST answered 409.
    assert children(apiserver) == launched
    assert len(requests(apiserver, kmock.action.CREATE)) == creates
    assert loop.events == []
    # Only the cost clock moved: that waits for the progress write interval.
    assert len(loop.status_patches()) == 1

    loop.state.written.at -= ControllerSettings().progress_write_seconds
    await loop.look()

    # No trainer pod runs here (no kubelet): the clock moves, the cost does not, and the
    # patch carries what changed only.
    assert first["cost"]["updatedAt"] != "2026-11-22T12:01:00Z"
    assert loop.status_patches()[-1] == {"cost": {"updatedAt": "2026-11-22T12:01:00Z"}}
    assert loop.status()["cost"] == {**first["cost"], "updatedAt": "2026-11-22T12:01:00Z"}


async def test_a_batch_job_deleted_behind_the_operator_is_created_again(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    seed(apiserver, *example_cluster(), tiny_job())
    await loop.look()
    launched = children(apiserver)
    names = child_names("tiny-cpu-lora", 1)
    apiserver.objects[JOBS, NAMESPACE, names.job].delete()
    assert children(apiserver)["job"] == []
    # The batch Job was created by this loop a moment ago; after a resync period, a
    # missing one is created again.
    loop.state.created = {
        k: v - loop.reconcilers.settings.resync_seconds - 1 for k, v in loop.state.created.items()
    }

    await loop.look()

    assert children(apiserver) == launched


async def test_a_batch_job_collected_with_its_deleted_job_is_not_created_again(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    """No finalizer holds a deleted job: the garbage collector may delete its batch Job
    before the job's loop hears of the deletion. The loop must not start a trainer again for
    a job that is gone (nor for another job created since under its name)."""
    seed(apiserver, *example_cluster(), tiny_job())
    await loop.look()
    names = child_names("tiny-cpu-lora", 1)
    await loop.look()  # the batch Job is in the cache now
    assert names.job in loop.state.seen_batch_jobs
    stale = loop.body()
    apiserver.objects[JOBS, NAMESPACE, names.job].delete()
    apiserver.objects[FTJ, NAMESPACE, "tiny-cpu-lora"].delete()
    loop.state.created = {
        k: v - loop.reconcilers.settings.resync_seconds - 1 for k, v in loop.state.created.items()
    }
    loop.reconcilers.caches = caches_from(apiserver)

    await loop.reconcilers.job_loop.look(loop.key, loop.state, stale)

    assert children(apiserver)["job"] == []
    assert len(requests(apiserver, kmock.action.CREATE, JOBS)) == 1

    # Created again under the same name: another uid, still not this loop's to launch.
    seed(apiserver, {**tiny_job(), "metadata": {**tiny_job()["metadata"], "uid": "another"}})
    await loop.reconcilers.job_loop.look(loop.key, loop.state, stale)

    assert children(apiserver)["job"] == []


async def test_a_child_owned_by_someone_else_fails_the_job(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    names = child_names("tiny-cpu-lora", 1)
    foreign = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": names.service, "namespace": NAMESPACE, "uid": "someone-else"},
    }
    seed(apiserver, *example_cluster(), tiny_job(), foreign)

    await loop.look()

    status = loop.status()
    assert status["phase"] == "Failed"
    assert condition(status, ConditionType.FAILED)["reason"] == Reason.CHILD_CONFLICT
    assert f"a Service named {names.service} already exists" in status["message"]
    assert "To fix:" in status["message"]
    assert [(t, r) for t, r, _ in loop.events] == [("Warning", Reason.CHILD_CONFLICT)]
    # The batch Job comes after the objects its pods use: with one of them foreign, no
    # trainer is started.
    assert children(apiserver)["job"] == []


@pytest.mark.parametrize("uptime", [30.0, 100_000.0])
async def test_children_are_created_whatever_the_machine_uptime(
    apiserver: ApiServerEmulator, loop: Loop, monkeypatch: pytest.MonkeyPatch, uptime: float
) -> None:
    """The monotonic clock counts from boot: on a node up for less than the resync period,
    "never created" must not read as "created a moment ago" (an operator on a new node
    would create no child for its first ten minutes)."""
    start = time.monotonic()
    young = SimpleNamespace(monotonic=lambda: time.monotonic() - start + uptime, time=time.time)
    for module in (admission, carry_out, gpuqueue, jobloop, memo, observe, status_writes):
        monkeypatch.setattr(module, "time", young)
    seed(apiserver, *example_cluster(), tiny_job())

    await loop.look()

    assert children(apiserver) == first_attempt()
    assert len(loop.status_patches()) == 1  # and the status went out at once


async def test_job_with_no_pools_waits_for_them(apiserver: ApiServerEmulator, loop: Loop) -> None:
    seed(apiserver, tiny_job(), claim(DEMO_CLAIM))

    delay = await loop.look()

    assert children(apiserver) == {"pvc": [], "configmap": [], "service": [], "job": []}
    status = loop.status()
    assert status["phase"] == "Planning"
    assert status["attempt"] == 0
    assert condition(status, ConditionType.PLANNED)["reason"] == Reason.NO_POOLS
    assert status["message"].startswith("no GPUPool exists yet")
    assert loop.events == []
    # Waiting for pools counts as queued: a new pool wakes it; otherwise it retries.
    assert loop.key in loop.reconcilers.view.queued
    assert about_the_queue_retry(delay)
    # Each retry is spread around the period: jobs that queued together do not look
    # again together.
    again = await loop.look()
    assert about_the_queue_retry(again) and again != delay


async def test_a_job_deep_in_a_queue_waits_for_events(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    """At the front of a queue a job looks again at its queue retry; further back nothing
    but its place moving can change what it does or shows, and that wakes it: it sleeps
    until the resync, or until a status write it held back is due."""
    busy = [
        pod(f"holds-{n['metadata']['name']}", node_name=n["metadata"]["name"], gpus=(8,))
        for n in pool_nodes()
    ]
    seed(apiserver, *example_cluster(), *busy, tiny_job())
    settings = ControllerSettings()

    assert about_the_queue_retry(await loop.look())
    status = loop.status()
    assert status["phase"] == "Queued" and "position 1 in the queue" in status["message"]
    place = {"pool": status["plan"]["pool"], "waitingFor": "FreeGPUs"}
    assert status["queue"] == {**place, "position": 1, "jobsAhead": 0}

    # Ten go before it (the job has no creationTimestamp here: same time, earlier names).
    pool_name = status["plan"]["pool"]
    ahead = [Ticket(NAMESPACE, f"early-{i:02d}", 0, "", pool_name, 1, 1) for i in range(10)]
    for t in ahead:
        loop.reconcilers.view.queue.admit(t.key, t, [0], queued=True)
    pace = settings.progress_write_seconds

    # Its new place alone is written at the progress pace: the look comes back when due.
    delay = await loop.look()
    assert delay is not None and pace - 5 < delay <= pace
    assert "position 1 in the queue" in loop.status()["message"]
    loop.state.written.at -= pace
    assert await loop.look() == settings.resync_seconds
    assert "position 11 in the queue" in loop.status()["message"]
    assert loop.status()["queue"] == {**place, "position": 11, "jobsAhead": 10}

    # Two leave: a move by two of eleven is shown at once, at the progress pace.
    for t in ahead[:2]:
        loop.reconcilers.view.queue.stop_waiting(t.key)
    delay = await loop.look()
    assert delay is not None and pace - 5 < delay <= pace
    loop.state.written.at -= pace
    assert await loop.look() == settings.resync_seconds
    assert "position 9 in the queue" in loop.status()["message"]


async def test_a_small_move_deep_in_a_queue_is_shown_after_ten_progress_writes(
    apiserver: ApiServerEmulator, kube: Kube, clock: type[Clock]
) -> None:
    """A move by less than a tenth of a deep place wakes nobody, yet the status must show it
    in time: a job deep in a queue looks every SMALL_MOVE_SLOWDOWN progress writes (never
    less often than the resync; at the defaults both are ten minutes)."""
    loop = Loop(apiserver, kube, progress_write_seconds=2.0)
    busy = [
        pod(f"holds-{n['metadata']['name']}", node_name=n["metadata"]["name"], gpus=(8,))
        for n in pool_nodes()
    ]
    seed(apiserver, *example_cluster(), *busy, tiny_job())
    await loop.look()
    pool_name = loop.status()["plan"]["pool"]
    ahead = [Ticket(NAMESPACE, f"early-{i:02d}", 0, "", pool_name, 1, 1) for i in range(21)]
    for t in ahead[:20]:
        loop.reconcilers.view.queue.admit(t.key, t, [0], queued=True)
    loop.state.written.at -= 2.0
    assert await loop.look() == SMALL_MOVE_SLOWDOWN * 2.0
    assert "position 21 in the queue" in loop.status()["message"]

    loop.reconcilers.view.queue.admit(ahead[20].key, ahead[20], [0], queued=True)  # 21 → 22
    assert loop.key not in loop.reconcilers.view.queue.moved()  # too small to wake it
    delay = await loop.look()  # the look it makes anyway, one such period later
    assert delay is not None and delay <= SMALL_MOVE_SLOWDOWN * 2.0
    loop.state.written.at -= SMALL_MOVE_SLOWDOWN * 2.0
    await loop.look()
    assert "position 22 in the queue" in loop.status()["message"]


async def test_a_job_whose_claim_is_missing_is_held_until_it_exists(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    seed(apiserver, *example_pools(), *pool_nodes(), tiny_job())

    delay = await loop.look()

    assert children(apiserver) == {"pvc": [], "configmap": [], "service": [], "job": []}
    status = loop.status()
    assert status["phase"] == "Pending"
    held = condition(status, ConditionType.INPUTS_READY)
    assert (held["status"], held["reason"]) == ("False", Reason.MISSING_VOLUME)
    assert (
        f"PersistentVolumeClaim {DEMO_CLAIM!r} (spec.model.uri) does not exist" in held["message"]
    )
    assert [(t, r) for t, r, _ in loop.events] == [("Warning", Reason.MISSING_VOLUME)]
    assert about_the_queue_retry(delay)

    seed(apiserver, claim(DEMO_CLAIM))
    await loop.look()

    status = loop.status()
    assert status["phase"] == "Running"
    assert condition(status, ConditionType.INPUTS_READY)["reason"] == Reason.INPUTS_FOUND
    assert children(apiserver)["job"] == [child_names("tiny-cpu-lora", 1).job]


async def test_a_secret_the_operator_may_not_read_is_not_checked(
    apiserver: ApiServerEmulator, loop: Loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = tiny_job()
    job["spec"]["model"]["tokenSecretRef"] = {"name": "hf", "key": "token"}
    seed(apiserver, *example_cluster(), job)
    consented = Tenant(NAMESPACE, allowed_secrets=frozenset({"hf"}))
    monkeypatch.setattr(Caches, "tenant", lambda self, namespace: consented)
    apiserver[f"get /api/v1/namespaces/{NAMESPACE}/secrets/hf"] << kmock.KubernetesError(
        403, "Forbidden", "secrets is forbidden"
    )

    await loop.look()

    # The preflight asked, was refused (no rbac.secretPreflight rule) and let the job go:
    # the pods' errors tell of a missing Secret instead.
    asked = [r for r in apiserver if r.method == "GET" and r.resource == kmock.resource(SECRETS)]
    assert len(asked) == 1
    assert loop.status()["phase"] == "Running"


async def test_a_job_from_a_newer_crd_is_left_alone_with_a_warning(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    """CRDs applied before the operator is upgraded: a field the operator does not know must
    not fail the job (a running one would lose its run); it waits for the new operator."""
    body = tiny_job()
    body["spec"]["recovery"] = {"maxRestarts": 3, "somethingNewer": 2}
    body["status"] = {"phase": "Running", "attempt": 1}
    seed(apiserver, body)

    delay = await loop.look()
    await loop.look()

    assert loop.status() == {"phase": "Running", "attempt": 1}  # untouched
    assert [(t, r) for t, r, _ in loop.events] == [("Warning", Reason.OPERATOR_OUTDATED)]
    assert "spec.recovery.somethingNewer" in loop.events[0][2]
    assert delay == ControllerSettings().resync_seconds
    assert children(apiserver) == {"pvc": [], "configmap": [], "service": [], "job": []}


async def test_invalid_job_fails_with_a_warning(apiserver: ApiServerEmulator, loop: Loop) -> None:
    body = tiny_job()
    body["spec"]["method"] = "full"  # with spec.lora set: admission would have refused it
    seed(apiserver, body)

    delay = await loop.look()

    status = loop.status()
    assert status["phase"] == "Failed"
    assert condition(status, ConditionType.FAILED)["reason"] == Reason.INVALID_SPEC
    assert [(t, r) for t, r, _ in loop.events] == [("Warning", Reason.INVALID_SPEC)]
    assert delay is None  # finished: no further look until an event


async def test_a_rejected_status_write_does_not_stop_the_job(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    seed(apiserver, *example_cluster(), tiny_job())
    apiserver[kmock.method.PATCH][:1] << invalid("status.plan")

    delay = await loop.look()

    # The launch happened; its status write was refused as invalid; the job got the
    # reason and the loop carries on.
    assert children(apiserver)["job"] == [child_names("tiny-cpu-lora", 1).job]
    assert (str(EventType.WARNING), Reason.STATUS_REJECTED) in [(t, r) for t, r, _ in loop.events]
    assert "status.plan" in loop.status()["message"]
    assert delay is not None

    await loop.look()

    # The next look writes the whole status (the adopted launch) without trouble.
    assert loop.status()["phase"] == "Running"
    assert loop.status()["attempt"] == 1


async def test_a_failed_look_is_retried_with_growing_backoff(
    apiserver: ApiServerEmulator, loop: Loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(apiserver, *example_cluster(), tiny_job())

    async def down(*_: Any, **__: Any) -> str:
        raise httpx2.ConnectError("connection refused")

    monkeypatch.setattr(loop.reconcilers.kube, "patch_status", down)

    delays = [await loop.look() for _ in range(4)]

    # At most 2, 4, 8 and 16 s, each at least half that: growing, and jittered.
    for delay, ceiling in zip(delays, [2.0, 4.0, 8.0, 16.0], strict=True):
        assert delay is not None and ceiling / 2 <= delay <= ceiling
    assert delays == sorted(delays)
    assert loop.state.failures == 4
    # Another loop failing at the same moment waits another time.
    other = JobState(name="tiny-cpu-lora")
    first = await loop.reconcilers.job_loop.look(loop.key, other, loop.body())
    assert first is not None and 1.0 <= first <= 2.0 and first != delays[0]
    # Whatever failed, the job stays due: liveness sees it once nothing succeeds.
    assert loop.state.due_at is not None


async def test_the_latest_written_status_wins_over_a_stale_cache(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    seed(apiserver, *example_cluster(), tiny_job())
    stale = loop.body()  # what the watch still shows while the first write travels
    stale["metadata"]["resourceVersion"] = "0"  # older than anything written
    await loop.look()

    loop.reconcilers.caches = caches_from(apiserver)
    await loop.reconcilers.job_loop.look(loop.key, loop.state, stale)

    # Seen through the stale body, the job would be planned and launched again.
    assert [(t, r) for t, r, _ in loop.events].count(("Normal", "Launched")) == 1
    assert len(stored(apiserver, JOBS, NAMESPACE)) == 1


def test_a_job_is_validated_again_only_when_what_it_is_made_of_changed() -> None:
    """Most looks of a running job see the same object and status: the model made of them
    is reused, and made anew from whatever changed."""
    state = JobState(name="tiny")
    body = tiny_job()
    first = validated(state, body)
    assert validated(state, copy.deepcopy(body)) is first
    # The spec changed: a new model, with the change.
    changed = copy.deepcopy(body)
    changed["metadata"].update(resourceVersion="2", generation=2)
    changed["spec"]["suspend"] = True
    second = validated(state, changed)
    assert second is not first and second.spec.suspend
    # Only the status changed (the status this loop wrote, before the watch delivers it).
    written = {**changed, "status": {"phase": "Running"}}
    third = validated(state, written)
    assert third is not second and third.status is not None and third.status.phase == "Running"
    assert validated(state, copy.deepcopy(written)) is third


# ---------------------------------------------------------------------- health


def test_a_stage_in_keeps_what_other_unfinished_jobs_read_from_the_cache(kube: Kube) -> None:
    def job(model: str, phase: str = "Running") -> FineTuneJob:
        staged = StageInStatus(model_path=model).model_dump()
        body = make_job().model_dump(by_alias=True)
        return FineTuneJob.model_validate({**body, "status": {"phase": phase, "stageIn": staged}})

    observer = Reconcilers(ControllerSettings(), kube, load_arch, lambda *_: None).job_loop.observer
    observer.note_cache_use(("a", "x"), job("/cache/models/x"))
    observer.note_cache_use(("a", "y"), job("/cache/models/y"))
    observer.note_cache_use(("b", "z"), job("/cache/models/z"))
    observer.note_cache_use(("a", "done"), job("/cache/models/old", phase="Succeeded"))
    # the namespace's cache: only its own unfinished jobs count, never the asking job
    assert observer.cache_in_use(("a", "x")) == ("/cache/models/y",)
    assert observer.cache_in_use(("a", "new")) == ("/cache/models/x", "/cache/models/y")
    # a job that finished stops holding its entries
    observer.note_cache_use(("a", "y"), job("/cache/models/y", phase="Failed"))
    assert observer.cache_in_use(("a", "new")) == ("/cache/models/x",)
    # one cache for the cluster: every namespace's jobs read it
    shared = BuildSettings(cache_volume={"persistentVolumeClaim": {"claimName": "cache"}})
    observer.settings = replace(observer.settings, build=shared)
    assert observer.cache_in_use(("a", "new")) == ("/cache/models/x", "/cache/models/z")


def test_liveness_fails_only_when_every_due_job_stalled(kube: Kube) -> None:
    reconcilers = Reconcilers(
        ControllerSettings(stall_seconds=60), kube, load_arch, lambda *_: None
    )
    now = reconcilers.job_loop.last_success
    reconcilers.jobs[("a", "x")] = JobState(name="x", due_at=now + 10)
    reconcilers.jobs[("a", "idle")] = JobState(name="idle", due_at=None)

    assert reconcilers.job_loop.stalled(now + 30) == []
    # overdue 90 s, nothing succeeded for 100 s
    assert reconcilers.job_loop.stalled(now + 100) == ["a/x"]
    assert reconcilers.health() == {"jobs": 2, "queued": 0}

    reconcilers.job_loop.last_success -= 100
    reconcilers.jobs[("a", "x")].due_at = now - 90
    with pytest.raises(RuntimeError, match="no reconcile succeeded for 60s; 1 job"):
        reconcilers.health()


# ---------------------------------------------------------------------- the pool loop


async def test_pool_capacity_is_written_only_when_it_changed(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    body = pool("h100")
    body["metadata"]["generation"] = 3
    # The product alone: the status shows the memory the planner takes for it.
    body["spec"]["gpu"] = {"product": body["spec"]["gpu"]["product"]}
    seed(apiserver, *capacity_cluster(), body)
    loop.reconcilers.caches = caches_from(apiserver)

    await loop.reconcilers.pool_loop.reconcile_pool(
        copy.deepcopy(dict(apiserver.objects[POOLS, None, "h100"]))
    )

    status = dict(apiserver.objects[POOLS, None, "h100"]["status"])
    assert status.pop("updatedAt")
    (valid,) = status.pop("conditions")
    assert (valid["type"], valid["status"], valid["reason"]) == ("Valid", "True", "Accepted")
    assert status == {
        "nodes": 2,
        "allocatableGPUs": 16,
        "freeGPUs": 9,
        "freeGPUsPerNode": [2, 7],
        "nodeMemoryGiB": 1024.0,
        "observedGeneration": 3,
        "gpuMemoryGiB": 80.0,
    }
    writes = len([r for r in apiserver if r.method == "PATCH"])

    await loop.reconcilers.pool_loop.reconcile_pool(
        copy.deepcopy(dict(apiserver.objects[POOLS, None, "h100"]))
    )

    assert len([r for r in apiserver if r.method == "PATCH"]) == writes


async def test_pools_that_select_the_same_nodes_say_so(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    """Two pools with one nodeSelector count the same GPUs: the status says which pool
    shares which nodes, with the fix; a pool alone carries no such condition."""
    again = copy.deepcopy(pool("h100"))
    again["metadata"]["name"] = "h100-again"
    seed(apiserver, *capacity_cluster(), pool("h100"), again)
    loop.reconcilers.caches = caches_from(apiserver)

    await loop.reconcilers.pool_loop.reconcile_pool(
        copy.deepcopy(dict(apiserver.objects[POOLS, None, "h100"]))
    )

    conditions = {
        c["type"]: c for c in apiserver.objects[POOLS, None, "h100"]["status"]["conditions"]
    }
    shared = conditions["Overlapping"]
    assert (shared["status"], shared["reason"]) == ("True", "PoolsOverlap")
    assert shared["message"].startswith("pool h100-again selects h100-0, h100-1 as well")
    assert "To fix:" in shared["message"] and conditions["Valid"]["status"] == "True"


async def test_an_unreadable_pool_gets_a_condition(
    apiserver: ApiServerEmulator, loop: Loop
) -> None:
    body = pool("h100")
    body["spec"]["gpusPerNode"] = "eight"
    seed(apiserver, body)
    loop.reconcilers.caches = caches_from(apiserver)

    await loop.reconcilers.pool_loop.reconcile_pool(
        copy.deepcopy(dict(apiserver.objects[POOLS, None, "h100"]))
    )

    (valid,) = apiserver.objects[POOLS, None, "h100"]["status"]["conditions"]
    assert (valid["type"], valid["status"], valid["reason"]) == ("Valid", "False", "InvalidSpec")
    assert "spec.gpusPerNode" in valid["message"] and "To fix:" in valid["message"]
