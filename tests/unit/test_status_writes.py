"""What a job's loop writes of its status, and which changes may wait
(controller/status_writes.py).

The throttle reads structured fields only: a queued job's place is status.queue, a running
stage-in is the StagedIn condition with status.stageIn. The messages people read say the
same, and may say it in any words: the tests below change them freely.
"""

from __future__ import annotations

from typing import Any

import pytest

from kubetune.controller.status_writes import merge_patch, only_volatile, small_move

pytestmark = pytest.mark.unit


def queued(position: int, *, pool: str = "a100", waiting_for: str = "JobsAhead") -> dict[str, Any]:
    """A Queued job's status at `position` of its pool's queue (wire form)."""
    where = f"position {position} in the queue of pool {pool}"
    return {
        "phase": "Queued",
        "message": f"{where}: {position - 1} job(s) ahead (higher priority, or created "
        "earlier) go first",
        "conditions": [
            {
                "type": "Planned",
                "status": "True",
                "reason": "PlanReady",
                "lastTransitionTime": "2026-11-22T12:00:00Z",
            },
            {
                "type": "Queued",
                "status": "True",
                "reason": "InsufficientCapacity",
                "message": where,
                "lastTransitionTime": "2026-11-22T12:00:00Z",
            },
        ],
        "queue": {
            "pool": pool,
            "position": position,
            "jobsAhead": position - 1,
            "waitingFor": waiting_for,
        },
    }


def staging(**stage_in: Any) -> dict[str, Any]:
    """A Planning job whose stage-in step runs (wire form)."""
    return {
        "phase": "Planning",
        "message": "staging in: 1.0 GB of 4.0 GB, 1 of 7 files",
        "conditions": [
            {
                "type": "StagedIn",
                "status": "False",
                "reason": "StagingIn",
                "message": "fetching s3://models/m into the namespace's cache",
                "lastTransitionTime": "2026-11-22T12:00:00Z",
            }
        ],
        "stageIn": {"bytesDone": 10**9, "bytesTotal": 4 * 10**9, **stage_in},
    }


# ---------------------------------------------------------------------- the patch


def test_the_status_patch_carries_what_changed_and_nulls_what_went() -> None:
    old = {
        "phase": "Queued",
        "plan": {"pool": "a100", "chunkedCrossEntropy": True, "rejected": [{"pool": "l4"}]},
        "cost": {"accruedUSD": 0.0, "updatedAt": "12:00"},
    }
    # A re-plan that no longer chunks the loss: the stored plan must lose that field, which a
    # merge patch of the whole plan object would leave in place.
    replanned = {
        "phase": "Queued",
        "plan": {"pool": "a100", "rejected": []},
        "cost": {"accruedUSD": 0.0, "updatedAt": "12:01"},
    }
    assert merge_patch(old, replanned) == {
        "plan": {"chunkedCrossEntropy": None, "rejected": []},
        "cost": {"updatedAt": "12:01"},
    }
    assert merge_patch(old, old) == {}
    assert merge_patch(old, {"phase": "Running"}) == {
        "phase": "Running",
        "plan": None,
        "cost": None,
    }
    assert merge_patch({}, {"plan": {}}) == {"plan": {}}


# ---------------------------------------------------------------------- a queued job


def test_a_queued_jobs_new_position_alone_waits_like_progress() -> None:
    old = queued(7)
    moved = merge_patch(old, queued(3))
    assert set(moved) == {"message", "conditions", "queue"}
    assert only_volatile(old, moved)
    assert only_volatile(old, {"progress": {"step": 3}})
    # At the front it waits for GPUs, not for jobs: that is news, written at once.
    front = merge_patch(old, queued(1, waiting_for="FreeGPUs"))
    assert not only_volatile(old, front)
    assert not only_volatile(old, {**moved, "phase": "Running"})
    assert not only_volatile(old, {**moved, "plan": {"pool": "h100"}})
    # A running job's message is never throttled.
    assert not only_volatile({**old, "phase": "Running"}, moved)


def test_the_queue_throttle_reads_the_place_not_the_message() -> None:
    """Whatever the message says, the place in status.queue decides: a new wording with the
    same place is news; a move is a move whether or not the words carry numbers."""
    old = {**queued(40), "message": "waiting in line"}
    moved = merge_patch(old, {**queued(38), "message": "still waiting in line"})
    assert only_volatile(old, moved)
    reworded = merge_patch(old, {**queued(40), "message": "position 39 in the queue"})
    assert set(reworded) == {"message"}
    assert not only_volatile(old, reworded)


def test_another_pool_or_another_wait_is_news() -> None:
    old = queued(40)
    assert not only_volatile(old, merge_patch(old, queued(38, pool="h100")))
    assert not only_volatile(old, merge_patch(old, queued(38, waiting_for="FreeGPUs")))
    # A status without a place (written before status.queue existed) shows it at once.
    unplaced = {k: v for k, v in old.items() if k != "queue"}
    assert not only_volatile(unplaced, merge_patch(unplaced, queued(38)))
    # A queued job that no longer has a place (its look saw other capacity) says so at once.
    assert not only_volatile(old, merge_patch(old, unplaced))


def test_a_condition_other_than_the_place_is_news() -> None:
    old = queued(40)
    new = queued(38)
    new["conditions"][0] = {**new["conditions"][0], "status": "False", "reason": "Infeasible"}
    assert not only_volatile(old, merge_patch(old, new))
    new = queued(38)
    new["conditions"][1] = {**new["conditions"][1], "reason": "CapacityAvailable"}
    assert not only_volatile(old, merge_patch(old, new))


def test_a_small_move_is_read_from_the_place() -> None:
    deep = queued(200)
    assert small_move(deep, merge_patch(deep, queued(199)))
    assert small_move(deep, merge_patch(deep, queued(181)))
    assert not small_move(deep, merge_patch(deep, queued(180)))  # a tenth
    assert not small_move(queued(10), merge_patch(queued(10), queued(9)))  # the first ten
    # The message alone says nothing about the place.
    assert not small_move(deep, {"message": "position 199 in the queue of pool a100"})
    assert not small_move({"message": "position 200 in the queue"}, {"queue": None})


# ---------------------------------------------------------------------- a stage-in


def test_stage_in_progress_alone_waits_like_progress() -> None:
    old = staging()
    more = {
        "message": "staging in: 2.0 GB of 4.0 GB, 3 of 7 files",
        "stageIn": {"bytesDone": 2 * 10**9},
        "progress": {"summary": "stage-in 2.0 GB/4.0 GB"},
    }
    assert only_volatile(old, more)
    # Its result, a failure or the plan is news, written at once.
    assert not only_volatile(old, {**more, "stageIn": {"modelPath": "/cache/models/m"}})
    assert not only_volatile(old, {**more, "phase": "Failed"})
    assert not only_volatile(old, {**more, "plan": {"pool": "h100"}})
    pending = {"message": "staging in: pod demo-stagein-x1 is pending", "conditions": []}
    assert not only_volatile(old, pending)


def test_a_stage_in_whose_result_is_known_is_not_progress_alone() -> None:
    done = staging(bytesDone=4 * 10**9, modelPath="/cache/models/m")
    # The patch carries only the field that moved; the result stored before still counts.
    assert not only_volatile(done, {"stageIn": {"bytesDone": 5 * 10**9}})


def test_a_stage_in_runs_while_its_condition_says_so_whatever_the_message() -> None:
    more = {"message": "1.5 GB so far", "stageIn": {"bytesDone": 15 * 10**8}}
    assert only_volatile({**staging(), "message": "fetching"}, more)
    # Without the StagedIn condition saying the step runs, the same words are news.
    assert not only_volatile({**staging(), "conditions": []}, more)
    finished = staging()
    finished["conditions"][0] = {**finished["conditions"][0], "status": "True"}
    assert not only_volatile(finished, more)
