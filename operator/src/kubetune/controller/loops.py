"""The FineTuneJob loops' lives: each starts with its job's first event and stops with the
job's deletion.

kopf's daemons would do this, but kopf stops a daemon only when it sees its object being
deleted, so it puts a finalizer on every object a daemon runs for: one more write of each
job when it is created (kopf adds the finalizer) and one when it is deleted (kopf removes
it). A FineTuneJob write costs the API server four times a ConfigMap's
(benchmarks/results/apiserver-write-cost-2026-11-29.md), and at 1,000 jobs created at once
those finalizers were a sixth of the burst's writes. A job's loop needs no finalizer: the
job's children are owned by it (the garbage collector deletes them), and all its loop has to
do at the end is stop, which the watch's DELETED event or a deletionTimestamp says. A job
deleted while no operator runs leaves nothing behind; the next operator never sees it.

Kept free of kopf: controller/handlers.py feeds each FineTuneJob event to `JobLoops.observe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kubetune")

RESTART_SECONDS = 10.0
"""A loop that ended on an error (a bug: a look's own errors are retried inside it) starts
again after this long, unless its job was deleted meanwhile."""

CANCEL_AFTER_SECONDS = 15.0
"""A stopped loop ends after the look it is in; one still running this long after its job was
deleted is cancelled (a look waits at most for the API server's timeouts)."""


class StopFlag:
    """Set once a loop must stop (the `Stopped` of controller/waiting.py)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def __bool__(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        self._event.set()

    async def wait(self, timeout: float | None = None) -> bool:
        """Until set (True) or `timeout` seconds pass (False)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)
        return self._event.is_set()


@dataclass
class _Loop:
    name: str
    body: dict[str, Any]
    """The job as last seen: replaced in place at every event, so the loop reads the newest."""
    stopped: StopFlag
    task: asyncio.Task[None] | None = None
    deleted: bool = False


RunLoop = Callable[[dict[str, Any], StopFlag], Coroutine[Any, Any, None]]
Forget = Callable[[Mapping[str, Any]], None]


class JobLoops:
    """One loop task per FineTuneJob (by uid), running `run(body, stopped)`; `forget(body)`
    is called once the loop of a deleted job has ended (what it recorded last, a metric
    series, may have come after the deletion was seen)."""

    def __init__(self, run: RunLoop, forget: Forget | None = None) -> None:
        self._run = run
        self._forget = forget
        self._loops: dict[str, _Loop] = {}
        self._closing = False

    def __len__(self) -> int:
        return len(self._loops)

    def __contains__(self, uid: object) -> bool:
        return uid in self._loops

    def observe(self, body: Mapping[str, Any], deleted: bool = False) -> bool:
        """Keep the loop of the job in `body` in step with it: start one for a job seen for
        the first time, hand a running one the newest body, stop it once the job is deleted
        (`deleted`: the watch's DELETED event; or a deletionTimestamp, e.g. while the
        garbage collector deletes its children first). True when a loop was started."""
        meta = body.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        loop = self._loops.get(uid)
        if deleted or meta.get("deletionTimestamp"):
            if loop is not None:
                loop.deleted = True
                self._stop(loop)
            return False
        if loop is not None:
            loop.body.clear()
            loop.body.update(body)
            return False
        if self._closing or not uid:
            return False
        loop = _Loop(
            name=f"{meta.get('namespace')}/{meta.get('name')}", body=dict(body), stopped=StopFlag()
        )
        self._loops[uid] = loop
        self._spawn(uid, loop)
        return True

    def _spawn(self, uid: str, loop: _Loop) -> None:
        task = asyncio.get_running_loop().create_task(
            self._run(loop.body, loop.stopped), name=f"loop {loop.name}"
        )
        loop.task = task
        task.add_done_callback(lambda t: self._ended(uid, loop, t))

    def _stop(self, loop: _Loop) -> None:
        if loop.stopped:
            return
        loop.stopped.set()
        task = loop.task
        if task is not None and not task.done():
            asyncio.get_running_loop().call_later(CANCEL_AFTER_SECONDS, task.cancel)

    def _ended(self, uid: str, loop: _Loop, task: asyncio.Task[None]) -> None:
        error = None if task.cancelled() else task.exception()
        if error is not None and not loop.stopped and not self._closing:
            log.error(
                "the loop of %s ended on an error; it starts again in %.0fs",
                loop.name,
                RESTART_SECONDS,
                exc_info=error,
            )
            asyncio.get_running_loop().call_later(RESTART_SECONDS, self._restart, uid, loop)
            return
        if error is not None:
            log.error("the loop of %s ended on an error", loop.name, exc_info=error)
        self._remove(uid, loop)

    def _remove(self, uid: str, loop: _Loop) -> None:
        if self._loops.get(uid) is loop:
            del self._loops[uid]
            if loop.deleted and self._forget is not None:
                self._forget(loop.body)

    def _restart(self, uid: str, loop: _Loop) -> None:
        if loop.stopped or self._closing or self._loops.get(uid) is not loop:
            self._remove(uid, loop)
            return
        self._spawn(uid, loop)

    async def stop_all(self, timeout: float) -> None:
        """Stop every loop (the operator exits): each ends after its look, and those still
        running after `timeout` seconds are cancelled."""
        self._closing = True
        loops = list(self._loops.values())
        for loop in loops:
            loop.stopped.set()
        tasks = [loop.task for loop in loops if loop.task is not None and not loop.task.done()]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
