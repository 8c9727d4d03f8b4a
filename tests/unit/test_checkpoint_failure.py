"""The operator's side of the trainer's exit 45 (EXIT_CHECKPOINT_FAILED): a checkpoint that
cannot be written or loaded ends the job with reason CheckpointFailed, never a relaunch loop.
The batch Job's podFailurePolicy rule (FailJob on 45) is checked in test_builders."""

from __future__ import annotations

import pytest

from kubetune.api.vocabulary import ConditionType, Reason
from kubetune.control import conditions as c
from kubetune.control import pods as p
from kubetune_trainer.contract import EXIT_CHECKPOINT_FAILED, EXIT_SUPERSEDED
from support.reconcile import batch_job, make_job, observed, pod, run

pytestmark = pytest.mark.unit

NO_ROOM = (
    "checkpoint_failed not enough space for checkpoint step-400 in /checkpoints: needs about "
    "9.10 GiB (the size of step-300), 2.00 GiB free; the save was not started and step-300 is "
    "kept. To fix: raise spec.checkpoint.storage.size or lower spec.checkpoint.keep"
)


def test_exit_45_ends_the_batch_job_and_is_the_telling_exit() -> None:
    assert EXIT_CHECKPOINT_FAILED == 45
    assert EXIT_CHECKPOINT_FAILED in p.JOB_ENDING_EXITS
    pods = [
        pod("demo-a1-1", 1, msg="segfault"),
        pod("demo-a1-0", EXIT_CHECKPOINT_FAILED, msg=NO_ROOM),
    ]
    end = p.trainer_exit(pods)
    assert end.code == EXIT_CHECKPOINT_FAILED and "To fix: raise" in end.detail
    # Not counted as a pod failure to relaunch: the batch Job's failure handling takes it.
    look = p.ended_pods(pods[1:], ["demo-a1-0"], [], attempt=1, job_failed_count=1)
    assert look.ended == []


def test_checkpoint_failure_fails_the_job_with_its_reason() -> None:
    job, _ = run(make_job())
    failed = observed(batch_job("Failed"), [pod("demo-a1-0", EXIT_CHECKPOINT_FAILED, msg=NO_ROOM)])
    job, d = run(job, failed)
    s = job.status
    assert s is not None and s.phase == "Failed"
    cond = c.get_condition(s.conditions, ConditionType.FAILED)
    assert cond is not None and cond.reason == Reason.CHECKPOINT_FAILED == "CheckpointFailed"
    assert "could not write or load a checkpoint" in (s.message or "")
    assert "spec.checkpoint.storage.size" in (s.message or "")
    assert d.create == [] and s.restarts == 0  # no relaunch


def test_a_superseded_current_attempt_fails_the_job_with_the_fix() -> None:
    """Exit 46 on the current attempt: the folder names a later attempt of this job, which
    happens only when the job's status was reset. Never a relaunch (it would exit 46 again)."""
    assert EXIT_SUPERSEDED in p.JOB_ENDING_EXITS
    msg = (
        "rank=0 /checkpoints is written by attempt 5 of job uid u1, not by this attempt 1 of "
        "job uid u1: ... To fix, only if no later attempt of this job runs (its status was "
        "reset): delete writer.json from the checkpoint folder and resume the job"
    )
    job, _ = run(make_job())
    job, d = run(job, observed(batch_job("Failed"), [pod("demo-a1-0", EXIT_SUPERSEDED, msg=msg)]))
    s = job.status
    assert s is not None and s.phase == "Failed"
    cond = c.get_condition(s.conditions, ConditionType.FAILED)
    assert cond is not None and cond.reason == Reason.CHECKPOINT_FAILED
    assert "claimed by a later attempt" in (s.message or "")
    assert "delete writer.json" in (s.message or "")
    assert d.create == [] and s.restarts == 0
