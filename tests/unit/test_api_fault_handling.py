"""How the operator's API layer and reconcile loop take a misbehaving apiserver.

`Kube` retries what a retry can fix (throttling, server errors, lost connections) on every
call, not only on status writes; a create whose answer was lost and that finds its own
object on the retry counts as already there.
"""

from __future__ import annotations

from typing import Any

import httpx2
import pytest
from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import Status, StatusCause, StatusDetails

from kubetune.controller import kube as kube_module
from kubetune.controller.kube import Kube, StatusRejected

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


CONFIGMAP = {
    "apiVersion": "v1",
    "kind": "ConfigMap",
    "metadata": {"name": "demo-a1", "namespace": NAMESPACE},
    "data": {"config.json": "{}"},
}
LOST = httpx2.ReadError("connection lost")


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube_module, "RETRY_DELAYS", (0.0, 0.0, 0.0, 0.0, 0.0))


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
    assert await kube.owner_uids(CONFIGMAP) == set()
    assert client.calls == ["delete", "delete", "delete", "delete", "get", "get"]


async def test_status_write_retries_conflicts_and_rejects_invalid() -> None:
    client = Answers(api_error(409), LOST, Patched())
    assert await Kube(client).patch_status(NAMESPACE, "demo", {"phase": "Running"}) == "7"  # type: ignore[arg-type]
    client = Answers(api_error(503), api_error(422, field="status.phase"))
    with pytest.raises(StatusRejected) as err:
        await Kube(client).patch_status(NAMESPACE, "demo", {"phase": "Running"})  # type: ignore[arg-type]
    assert err.value.fields == ["status.phase"]
    assert await Kube(Answers(api_error(404))).patch_status(NAMESPACE, "gone", {}) is None  # type: ignore[arg-type]
