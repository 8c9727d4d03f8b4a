"""FineTuneJob loops started by a job's first event and stopped by its deletion
(kubetune.controller.loops), without a finalizer."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kubetune.controller import loops as loops_module
from kubetune.controller.loops import JobLoops, StopFlag

pytestmark = pytest.mark.unit


def job(uid: str = "u1", generation: int = 1, **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": "team",
            "name": "ft",
            "uid": uid,
            "generation": generation,
            **meta,
        },
        "spec": {"x": generation},
    }


class Recorder:
    """A loop that records the bodies it sees until it is stopped."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.seen: list[int] = []
        self.ended: list[str] = []
        self.poke = asyncio.Event()

    async def run(self, body: dict[str, Any], stopped: StopFlag) -> None:
        uid = body["metadata"]["uid"]
        self.started.append(uid)
        try:
            while not stopped:
                self.seen.append(body["metadata"]["generation"])
                self.poke.clear()
                woken = asyncio.ensure_future(self.poke.wait())
                stop = asyncio.ensure_future(stopped.wait())
                await asyncio.wait({woken, stop}, return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
                stop.cancel()
        finally:
            self.ended.append(uid)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_first_event_starts_one_loop_and_later_ones_hand_it_the_newest_body() -> None:
    rec = Recorder()
    loops = JobLoops(rec.run)
    assert loops.observe(job())
    assert not loops.observe(job())  # the listing after a watch restart: the same job
    await settle()
    assert rec.started == ["u1"] and len(loops) == 1
    assert not loops.observe(job(generation=2))
    rec.poke.set()
    await settle()
    assert rec.seen[-1] == 2, "the loop reads the body it was given, updated in place"


async def test_deletion_stops_the_loop_and_forgets_it() -> None:
    rec = Recorder()
    forgotten: list[str] = []
    loops = JobLoops(rec.run, forget=lambda body: forgotten.append(body["metadata"]["uid"]))
    loops.observe(job())
    await settle()
    loops.observe(job(), deleted=True)
    assert forgotten == [], "what the loop records last may come after the deletion"
    await settle()
    assert rec.ended == ["u1"] and "u1" not in loops and len(loops) == 0
    assert forgotten == ["u1"]
    # A job created again under the same name is another object: a loop of its own.
    assert loops.observe(job(uid="u2"))
    await settle()
    assert rec.started == ["u1", "u2"]


async def test_a_deletion_timestamp_stops_the_loop_before_the_object_is_gone() -> None:
    # Foreground deletion: the job stays, with a deletionTimestamp, until the garbage
    # collector deleted its children; its loop must not create them again meanwhile.
    rec = Recorder()
    loops = JobLoops(rec.run)
    loops.observe(job())
    await settle()
    assert not loops.observe(job(deletionTimestamp="2026-11-29T04:00:00Z"))
    await settle()
    assert rec.ended == ["u1"]
    assert not loops.observe(job(deletionTimestamp="2026-11-29T04:00:00Z"))
    await settle()
    assert rec.started == ["u1"], "a job being deleted gets no new loop"


async def test_a_deleted_job_seen_first_gets_no_loop() -> None:
    rec = Recorder()
    loops = JobLoops(rec.run)
    assert not loops.observe(job(), deleted=True)
    await settle()
    assert rec.started == [] and len(loops) == 0


async def test_a_loop_that_fails_starts_again_unless_its_job_is_deleted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(loops_module, "RESTART_SECONDS", 0.01)
    runs: list[str] = []

    async def flaky(body: dict[str, Any], stopped: StopFlag) -> None:
        runs.append(body["metadata"]["uid"])
        if len(runs) == 1:
            raise RuntimeError("a bug in the loop")
        await stopped.wait()

    loops = JobLoops(flaky)
    loops.observe(job())
    await asyncio.sleep(0.1)
    assert runs == ["u1", "u1"] and "u1" in loops
    assert "ended on an error; it starts again" in caplog.text
    loops.observe(job(), deleted=True)
    await settle()
    assert len(loops) == 0

    # Deleted while waiting to start again: it stays stopped.
    runs.clear()
    loops.observe(job(uid="u3"))
    await settle()
    loops.observe(job(uid="u3"), deleted=True)
    await asyncio.sleep(0.1)
    assert runs == ["u3"] and len(loops) == 0


async def test_a_deleted_jobs_loop_stuck_in_a_look_is_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loops_module, "CANCEL_AFTER_SECONDS", 0.01)
    cancelled = asyncio.Event()

    async def stuck(body: dict[str, Any], stopped: StopFlag) -> None:
        try:
            await asyncio.sleep(3600)  # a look that ignores the flag
        except asyncio.CancelledError:
            cancelled.set()
            raise

    loops = JobLoops(stuck)
    loops.observe(job())
    await settle()
    loops.observe(job(), deleted=True)
    await asyncio.wait_for(cancelled.wait(), 1)
    await settle()
    assert len(loops) == 0


async def test_stop_all_ends_every_loop_and_starts_no_more() -> None:
    rec = Recorder()
    forgotten: list[str] = []
    loops = JobLoops(rec.run, forget=lambda body: forgotten.append(body["metadata"]["uid"]))
    for uid in ("a", "b", "c"):
        loops.observe(job(uid=uid))
    await settle()
    await loops.stop_all(timeout=1)
    assert sorted(rec.ended) == ["a", "b", "c"] and len(loops) == 0
    assert forgotten == [], "jobs that were not deleted keep their series"
    assert not loops.observe(job(uid="d"))


async def test_stop_flag_wait_says_whether_it_was_set() -> None:
    flag = StopFlag()
    assert not flag and not await flag.wait(0.01)
    flag.set()
    assert flag and await flag.wait()
