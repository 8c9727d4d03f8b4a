"""How a job's loop writes its status: what changed, at once or at a slower pace.

The loop owns its status writes (a merge patch of the status subresource, retried on
conflicts, throttling, server errors and lost connections) instead of handing a patch to
kopf: a write that fails is tried again on the next look and can never stop the loop. A
write the apiserver rejects as invalid (422) is logged with its fields and reported on the
job (a Warning Event and `status.message`), and the job is looked at again soon
(`REJECTED_RETRY_SECONDS`, backing off with jitter), even when the rejected write was its
last.

Progress and cost alone are written at most every `progress_write_seconds`, and so are a
running stage-in's bytes so far and a queued job's new place in its queue; a place that
moved by less than a tenth `SMALL_MOVE_SLOWDOWN` times less often. Any other change of the
status is written at once. Which change is which is read from structured fields
(status.queue, status.stageIn, the StagedIn condition), never from the messages people read.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lightkube.core.exceptions import ApiError

from kubetune.api.vocabulary import ConditionType, EventType, Phase, Reason
from kubetune.control.queue import small_place_move
from kubetune.control.reconcile import ControllerSettings
from kubetune.controller import metrics
from kubetune.controller.backoff import RANDOM, Backoff
from kubetune.controller.kube import Kube, StatusRejected

log = logging.getLogger("kubetune")

VOLATILE = frozenset({"progress", "cost"})
"""Status fields that change on every look of a running job; written at most every
`progress_write_seconds` unless something else changed too (`only_volatile` has the other
changes that may wait as long)."""

SMALL_MOVE_SLOWDOWN = 10.0
"""A queued job's position that moved by less than a tenth of the one shown is written this
many `progress_write_seconds` apart (a move by more, or any within the first ten places, at
the usual pace). Each admission moves every job behind it in its queue by one: written at
once, a queue of N jobs costs N status writes per admission; this way a job deep in it
writes after every tenth of its way, and the front stays exact."""

REJECTED_RETRY_SECONDS = 5.0
"""A job whose status write was rejected is looked at again after at most this long, doubling
with each rejection in a row up to 64 times this or the resync period (each wait at least
half of that, controller/backoff.py): finished or not, its status must land."""

PostEvent = Callable[[Mapping[str, Any], EventType, Reason, str], None]

_PLACE = frozenset({"position", "jobsAhead"})
"""The fields of status.queue that move when jobs ahead leave or join."""


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


def only_volatile(old: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
    """True when the patch changes only what moves on every look: a running job's progress
    and cost, a running stage-in's bytes so far, a queued job's place in its queue. Such a
    patch may wait for `progress_write_seconds`."""
    return set(patch) <= VOLATILE or _stage_in_progress(old, patch) or _queue_move(old, patch)


def small_move(old: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
    """True when the patch moves a queued job's position by less than a tenth of the one
    its status shows (never within the first ten places)."""
    shown = (old.get("queue") or {}).get("position")
    moved = (patch.get("queue") or {}).get("position")
    if not isinstance(shown, int) or not isinstance(moved, int):
        return False
    return small_place_move(shown, moved)


def _queue_move(old: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
    """A queued job's place moved, and nothing else it shows: status.queue keeps its pool
    and what it waits for, and of the rest only the message and the Queued condition's
    message change, which say the place."""
    if old.get("phase") != Phase.QUEUED or not set(patch) <= VOLATILE | {
        "message",
        "conditions",
        "queue",
    }:
        return False
    shown, moved = old.get("queue"), patch.get("queue")
    if not isinstance(shown, Mapping) or not isinstance(moved, Mapping):
        return False
    if not set(moved) <= _PLACE or None in moved.values():
        return False
    conditions = patch.get("conditions", old.get("conditions"))
    return _without_queued_message(conditions) == _without_queued_message(old.get("conditions"))


def _without_queued_message(conditions: Any) -> list[Any]:
    return [
        {k: v for k, v in c.items() if k != "message"}
        if isinstance(c, Mapping) and c.get("type") == ConditionType.QUEUED
        else c
        for c in conditions or []
    ]


def _stage_in_progress(old: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
    """A running stage-in's bytes and files so far: status.stageIn without a result yet (no
    modelPath), and the message and the Progress column that say them, while the StagedIn
    condition says the step runs."""
    if old.get("phase") != Phase.PLANNING or not set(patch) <= VOLATILE | {"message", "stageIn"}:
        return False
    staged = old.get("stageIn")
    if isinstance(patch.get("stageIn"), Mapping):
        staged = {**(staged if isinstance(staged, Mapping) else {}), **patch["stageIn"]}
    running = any(
        c.get("type") == ConditionType.STAGED_IN
        and c.get("status") == "False"
        and c.get("reason") == Reason.STAGING_IN
        for c in old.get("conditions") or []
    )
    return running and isinstance(staged, Mapping) and staged.get("modelPath") is None


@dataclass
class Written:
    """What a job's loop knows of its own status writes."""

    rv: int | None = None
    status: dict[str, Any] | None = None
    """The status this loop last wrote, until the watch delivers a version that has it."""
    at: float = -math.inf
    """When this loop last wrote the status (monotonic; the clock starts at boot, so "never"
    must not be a number a young machine's clock may be near)."""
    held_until: float | None = None
    """When a status write held back (progress, a queue position) is due; None: none is."""
    rejections: int = 0
    """Status writes the apiserver rejected in a row."""

    def latest(self, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """The job's latest status: the live object's, or what this loop wrote last when the
        watch has not delivered that version yet."""
        live = dict(body.get("status") or {}) or None
        if self.status is None:
            return live
        seen = resource_version(body["metadata"])
        if seen is not None and self.rv is not None and seen >= self.rv:
            self.status = None
            return live
        return self.status


class StatusWriter:
    """Writes a job's status for its loop: what changed, when it is due."""

    def __init__(
        self,
        settings: ControllerSettings,
        kube: Kube,
        post_event: PostEvent,
        rng: random.Random = RANDOM,
    ) -> None:
        self.settings = settings
        self.kube = kube
        self.post_event = post_event
        self.rng = rng
        """Draws the waits after rejections."""

    @property
    def small_move_write_seconds(self) -> float:
        """How often a queued job's position that moved by less than a tenth is written
        (and a job deep in a queue looks again, so that it is)."""
        return SMALL_MOVE_SLOWDOWN * self.settings.progress_write_seconds

    def after_rejection(self, written: Written) -> float:
        """When to look again at a job whose status write was rejected."""
        cap = min(REJECTED_RETRY_SECONDS * 2.0**6, self.settings.resync_seconds)
        return Backoff(REJECTED_RETRY_SECONDS, cap).delay(written.rejections, self.rng)

    async def write(
        self,
        written: Written,
        namespace: str,
        name: str,
        old: Mapping[str, Any],
        new: dict[str, Any],
        body: Mapping[str, Any],
    ) -> bool:
        """Write what changed of the status (`new` in wire form); False when the apiserver
        rejected it (422)."""
        patch = merge_patch(old, new)
        written.held_until = None
        if not patch:
            written.rejections = 0
            return True
        if only_volatile(old, patch):
            every = (
                self.small_move_write_seconds
                if small_move(old, patch)
                else self.settings.progress_write_seconds
            )
            if time.monotonic() - written.at < every:
                written.held_until = written.at + every
                return True
        try:
            rv = await self.kube.patch_status(namespace, name, patch)
        except StatusRejected as exc:
            await self._rejected(namespace, name, exc, body)
            written.at = time.monotonic()
            written.rejections += 1
            return False
        except Exception:
            metrics.status_write("failed")
            raise
        metrics.status_write("ok")
        written.at = time.monotonic()
        written.rejections = 0
        if rv is not None:
            written.rv = resource_version({"resourceVersion": rv})
            written.status = new
        return True

    async def _rejected(
        self, namespace: str, name: str, exc: StatusRejected, body: Mapping[str, Any]
    ) -> None:
        """Say on the job (an Event, status.message) that its status write was rejected."""
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
