"""How the operator's API layer and reconcile loop take a misbehaving apiserver.

`Kube` retries what a retry can fix (throttling, server errors, lost connections) on every
call, not only on status writes; a create whose answer was lost and that finds its own
object on the retry counts as already there. A status write the apiserver rejects (422)
brings the job back for another look soon, even when that write was the job's last.
(tests/integration/test_api_faults.py drills the same against a real apiserver.)
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from functools import partial
from typing import Any

import httpx2
import pytest
from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import Status, StatusCause, StatusDetails

from kubetune.api.vocabulary import Reason
from kubetune.control.ownership import Existing
from kubetune.control.reconcile import ControllerSettings
from kubetune.controller import kube as kube_module
from kubetune.controller.backoff import Backoff
from kubetune.controller.cache import Caches
from kubetune.controller.jobloop import JobState
from kubetune.controller.kube import Kube, StatusRejected
from kubetune.controller.reconcilers import Reconcilers
from kubetune.controller.status_writes import REJECTED_RETRY_SECONDS, Written
from kubetune.planning.catalog import default_pools
from kubetune.sources import load_arch
from support.reconcile import Store

pytestmark = pytest.mark.unit

NAMESPACE = "team-a"


def api_error(code: int, field: str | None = None) -> ApiError:
    causes = [StatusCause(field=field, reason="FieldValueInvalid")] if field else None
    details = StatusDetails(causes=causes) if causes else None
    return ApiError(status=Status(code=code, message=f"answered {code}", details=details))


class Answers:
    """A stand-in for lightkube's AsyncClient: each call takes the next planned answer
    (an exception is raised, anything else returned) and is recorded."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.calls: list[str] = []

    async def _answer(self, what: str) -> Any:
        self.calls.append(what)
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def create(self, obj: Any) -> Any:
        return await self._answer("create")

    async def get(self, kind: Any, name: str, namespace: str | None = None) -> Any:
        return await self._answer("get")

    async def delete(self, kind: Any, name: str, **_: Any) -> Any:
        return await self._answer("delete")

    async def patch(self, kind: Any, name: str, body: Any, **_: Any) -> Any:
        return await self._answer("patch")


class Patched:
    """What lightkube returns from a patch or get, as far as `Kube` reads it."""

    class metadata:
        resourceVersion = "7"
        ownerReferences = None
        labels = None
        annotations = None


CONFIGMAP = {
    "apiVersion": "v1",
    "kind": "ConfigMap",
    "metadata": {"name": "demo-a1", "namespace": NAMESPACE},
    "data": {"config.json": "{}"},
}
LOST = httpx2.ReadError("connection lost")


RETRY_WAITS = kube_module.RETRY_WAITS
"""The production waits (the tests below wait none)."""


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube_module, "RETRY_WAITS", Backoff(0.0, 0.0))


# ---------------------------------------------------------------------- Kube


async def test_create_is_retried_through_throttling_and_server_errors() -> None:
    client = Answers(api_error(429), api_error(503), LOST, None)
    assert await Kube(client).create_if_absent(CONFIGMAP) is True  # type: ignore[arg-type]
    assert client.calls == ["create"] * 4


async def test_a_create_whose_answer_was_lost_finds_its_object_on_the_retry() -> None:
    client = Answers(LOST, api_error(409))
    assert await Kube(client).create_if_absent(CONFIGMAP) is False  # type: ignore[arg-type]


async def test_retries_give_up_after_the_last_delay() -> None:
    client = Answers(*[api_error(500)] * 6)
    with pytest.raises(ApiError) as err:
        await Kube(client).create_if_absent(CONFIGMAP)  # type: ignore[arg-type]
    assert err.value.status.code == 500
    assert len(client.calls) == 6


async def test_retries_wait_longer_each_time_and_not_in_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After an API-server blip every call that failed tries again: each waits a little
    longer each time (about 5 to 9 s in all), and two calls that failed together do not
    try again together."""
    monkeypatch.setattr(kube_module, "RETRY_WAITS", RETRY_WAITS)
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    rng = random.Random(20260101)
    for _ in range(2):
        client = Answers(*[api_error(503)] * 6)
        with pytest.raises(ApiError):
            await Kube(client, rng=rng).create_if_absent(CONFIGMAP)  # type: ignore[arg-type]
    first, second = waits[:5], waits[5:]
    ceilings = [0.3, 0.6, 1.2, 2.4, 4.8]
    for series in (first, second):
        assert series == sorted(series)
        assert all(c / 2 <= w <= c for w, c in zip(series, ceilings, strict=True)), series
        assert 4.6 <= sum(series) <= 9.3
    assert all(a != b for a, b in zip(first, second, strict=True))


async def test_errors_a_retry_cannot_fix_are_raised_at_once() -> None:
    client = Answers(api_error(403))
    with pytest.raises(ApiError):
        await Kube(client).create_if_absent(CONFIGMAP)  # type: ignore[arg-type]
    assert client.calls == ["create"]


async def test_deletes_and_reads_are_retried_too() -> None:
    client = Answers(
        api_error(503), api_error(404), LOST, api_error(404), api_error(429), Patched()
    )
    kube = Kube(client)  # type: ignore[arg-type]
    await kube.delete_batch_job(NAMESPACE, "demo-a1")
    await kube.delete_finetunejob(NAMESPACE, "demo")
    assert await kube.existing(CONFIGMAP) == Existing()
    assert client.calls == ["delete", "delete", "delete", "delete", "get", "get"]


async def test_status_write_retries_conflicts_and_rejects_invalid() -> None:
    client = Answers(api_error(409), LOST, Patched())
    assert await Kube(client).patch_status(NAMESPACE, "demo", {"phase": "Running"}) == "7"  # type: ignore[arg-type]
    client = Answers(api_error(503), api_error(422, field="status.phase"))
    with pytest.raises(StatusRejected) as err:
        await Kube(client).patch_status(NAMESPACE, "demo", {"phase": "Running"})  # type: ignore[arg-type]
    assert err.value.fields == ["status.phase"]
    assert await Kube(Answers(api_error(404))).patch_status(NAMESPACE, "gone", {}) is None  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the reconcile loop


class RejectingKube:
    """Status writes that set a phase are rejected while `rejecting`; others succeed."""

    def __init__(self) -> None:
        self.rejecting = True
        self.writes: list[tuple[str, dict[str, Any]]] = []

    async def patch_status(
        self, namespace: str | None, name: str, patch: Mapping[str, Any], **_: Any
    ) -> str | None:
        self.writes.append((name, dict(patch)))
        if self.rejecting and "phase" in patch:
            raise StatusRejected("injected", ["status.phase"])
        return str(len(self.writes))


def reconcilers(kube: RejectingKube, events: list[Reason]) -> Reconcilers:
    settings = ControllerSettings(resync_seconds=120.0)
    loader = partial(load_arch, allow_network=False, local_files=False)
    rt = Reconcilers(settings, kube, loader, lambda body, type_, reason, msg: events.append(reason))  # type: ignore[arg-type]
    pools = Store({p.name: [p] for p in default_pools()[:2]})
    rt.caches = Caches(Store(), Store(), Store(), Store(), pools)
    return rt


def body(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "uid": f"uid-{name}",
            "generation": 1,
            "resourceVersion": "1",
        },
        "spec": {
            "model": {"uri": "meta-llama/Llama-3.1-405B"},
            "dataset": {"uri": "/data/train.jsonl"},
            "method": "full",
            "resources": {"gpus": 1},
            **spec,
        },
    }


async def test_a_rejected_final_status_write_is_tried_again() -> None:
    kube, events = RejectingKube(), []
    rt = reconcilers(kube, events)
    job = body("unplannable")
    state = JobState(name="unplannable")
    key = (NAMESPACE, "unplannable")

    delays = [await rt.job_loop.reconcile_job(key, state, job) for _ in range(3)]

    # The job fits no pool: its decision is Failed, which the apiserver keeps refusing.
    assert kube.writes[0][1]["phase"] == "Failed"
    # Doubling waits, each drawn from the upper half of its step (jitter).
    ceilings = [REJECTED_RETRY_SECONDS, 2 * REJECTED_RETRY_SECONDS, 4 * REJECTED_RETRY_SECONDS]
    assert all(
        delay is not None and top / 2 <= delay <= top
        for delay, top in zip(delays, ceilings, strict=True)
    ), delays
    assert events.count(Reason.STATUS_REJECTED) == 3
    assert state.written.rejections == 3

    kube.rejecting = False
    delay = await rt.job_loop.reconcile_job(key, state, job)
    assert delay is None, "a finished job whose status landed waits for events only"
    assert kube.writes[-1][1]["phase"] == "Failed"
    assert state.written.rejections == 0
    rt.job_loop.executor.shutdown()


async def test_the_retry_after_rejections_is_capped_by_the_resync_period() -> None:
    rt = reconcilers(RejectingKube(), [])
    assert 60.0 <= rt.job_loop.writer.after_rejection(Written(rejections=30)) <= 120.0


async def test_an_invalid_spec_whose_failed_status_is_rejected_is_tried_again() -> None:
    kube, events = RejectingKube(), []
    rt = reconcilers(kube, events)
    job = body("broken", method="not-a-method")
    delay = await rt.job_loop.reconcile_job((NAMESPACE, "broken"), JobState(name="broken"), job)
    assert delay is not None and REJECTED_RETRY_SECONDS / 2 <= delay <= REJECTED_RETRY_SECONDS
    assert Reason.INVALID_SPEC in events and Reason.STATUS_REJECTED in events
