"""The trainer's result as the operator reads it: a `TrainerResult` (JSON, contract 2) from
the termination message of the pod that finished, or the `key=value` words a version 1
trainer wrote; and the final status takes its numbers from it, not from the last scrape."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from kubetune.api.v1alpha1 import FineTuneJobStatus, ProgressStatus
from kubetune.control import pods as p
from kubetune.control import progress
from kubetune_trainer.contract import (
    CONTRACT_VERSION,
    EARLY_STOPPED,
    EarlyStoppingResult,
    TrainerResult,
)
from support.reconcile import T0, make_job, run

pytestmark = pytest.mark.unit

FINISHED = TrainerResult(
    outcome="completed", step=40, total_steps=40, loss=6.17871, eval_loss=6.3, tokens_seen=81920
)


def finished_pod(name: str, message: str, code: int = 0) -> dict[str, Any]:
    terminated = {"exitCode": code, "message": message}
    return {
        "metadata": {"name": name},
        "status": {
            "phase": "Succeeded" if code == 0 else "Failed",
            "containerStatuses": [{"name": "trainer", "state": {"terminated": terminated}}],
        },
    }


def test_the_finished_trainers_result_is_read_as_a_typed_object() -> None:
    pods = [finished_pod("demo-a1-1", ""), finished_pod("demo-a1-0", FINISHED.model_dump_json())]
    result = p.trainer_result(pods)
    assert result == FINISHED and result.contract_version == CONTRACT_VERSION
    assert p.early_stopped(pods) is None  # it trained to the end


def test_no_result_without_a_pod_that_exited_0_with_one() -> None:
    assert p.trainer_result([]) is None
    assert p.trainer_result([finished_pod("demo-a1-0", "")]) is None
    failed = finished_pod("demo-a1-0", FINISHED.model_dump_json(), code=1)
    assert p.trainer_result([failed]) is None
    assert p.parse_trainer_result('{"outcome": "completed"') is None  # cut short
    assert p.parse_trainer_result('{"outcome": "done", "step": 1}') is None  # not a result


def test_a_line_the_kubelet_cut_is_skipped_for_a_whole_one() -> None:
    """The kubelet keeps the file's last 4096 bytes: the first line may be cut anywhere."""
    whole = FINISHED.model_dump_json()
    assert p.parse_trainer_result(f"{whole[40:]}\n{whole}\n") == FINISHED
    assert p.parse_trainer_result(f"{whole}\n{whole[:-10]}") == FINISHED


def test_version_1_words_are_read_into_the_same_type() -> None:
    words = (
        f"{EARLY_STOPPED} step=120 best_step=80 metric=eval_loss value=1.23456789 patience=3 "
        "evaluations_without_improvement=3\n"
    )
    result = p.trainer_result([finished_pod("demo-a1-0", words)])
    assert result is not None and result.outcome == EARLY_STOPPED and result.step == 120
    assert result.early_stopping == EarlyStoppingResult(
        stopped_early=True,
        best_step=80,
        metric="eval_loss",
        best_value=1.23456789,
        patience=3,
        evaluations_without_improvement=3,
    )
    assert result.total_steps is None and result.loss is None  # version 1 did not say
    completed = p.parse_trainer_result("completed step=400 best_step=380 metric=eval_loss")
    assert completed is not None and completed.outcome == "completed"
    assert completed.early_stopping is not None and not completed.early_stopping.stopped_early
    assert p.parse_trainer_result(f"{EARLY_STOPPED} step=x") is None


def test_the_early_stop_reads_the_same_from_json_and_from_words() -> None:
    es = EarlyStoppingResult(
        stopped_early=True,
        best_step=80,
        metric="eval_loss",
        best_value=1.23456789,
        patience=3,
        evaluations_without_improvement=3,
    )
    result = TrainerResult(
        outcome=EARLY_STOPPED, step=120, total_steps=400, loss=1.5, tokens_seen=9, early_stopping=es
    )
    words = f"{EARLY_STOPPED} step=120 best_step=80 metric=eval_loss value=1.23456789 patience=3"
    from_json = p.early_stopped([finished_pod("demo-a1-0", result.model_dump_json())])
    assert from_json is not None
    assert from_json == p.early_stopped([finished_pod("demo-a1-0", words)])
    assert (from_json.step, from_json.best_step, from_json.value) == (120, 80, 1.234568)


def running(step: int, loss: float) -> FineTuneJobStatus:
    """A planned job of 40 steps whose metrics were last read at `step`."""
    job, _ = run(make_job())
    status = job.status
    assert status is not None and status.plan is not None
    status.plan = status.plan.model_copy(update={"total_steps": 40})
    status.progress = ProgressStatus(step=step, total_steps=40, loss=loss, percent=55)
    return status


def test_the_final_status_takes_the_trainers_numbers_not_the_last_scrape() -> None:
    """Metrics were last read at step 22 (loss 6.2106); the trainer's own last step says
    6.1787: the status ends with that."""
    status = running(22, 6.2106)
    progress.record_result(status, FINISHED)
    progress.complete(status, T0 + timedelta(minutes=5))
    done = status.progress
    assert done is not None and (done.step, done.total_steps, done.percent) == (40, 40, 100)
    assert done.loss == 6.1787 and done.eval_loss == 6.3
    assert done.summary == "40/40 (100%)"
    assert status.checkpoint is not None and status.checkpoint.latest_step == 40
    # Without a result (a version 1 trainer), the last scrape stays as before.
    old = running(22, 6.2106)
    progress.complete(old, T0 + timedelta(minutes=5))
    assert old.progress is not None and (old.progress.step, old.progress.loss) == (40, 6.2106)


def test_a_run_too_short_to_scrape_still_gets_its_numbers() -> None:
    status = running(0, 0.0)
    status.progress = None
    progress.record_result(status, FINISHED)
    progress.complete(status, T0)
    assert status.progress is not None and status.progress.loss == 6.1787
    assert (status.progress.step, status.progress.percent) == (40, 100)
