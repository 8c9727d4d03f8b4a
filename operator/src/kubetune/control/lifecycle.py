"""The phases of a FineTuneJob and the only ways to move between them (pure).

    Pending → Planning → (Queued →) Running → Succeeded
    every unfinished phase → Failed, and → Suspended (spec.suspend) → back to work

`TRANSITIONS` is the whole table (docs/architecture.md draws it, and a test keeps the drawing
equal to it); `move` refuses anything else, so a change to the reconcile
logic that would, say, revive a finished job fails its unit tests instead of reaching a
cluster. Every phase change in the operator goes through one of the functions below, and
each sets the phase together with the conditions, message and times that belong to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from kubetune.api.v1alpha1 import FineTuneJobStatus
from kubetune.api.vocabulary import TERMINAL_PHASES, ConditionType, Phase, Reason
from kubetune.control.conditions import now_rfc3339, set_condition

TRANSITIONS: Mapping[Phase, frozenset[Phase]] = {
    # A new job is planned; suspended before anything happens; or unreadable.
    Phase.PENDING: frozenset({Phase.PLANNING, Phase.SUSPENDED, Phase.FAILED}),
    # Planned: launched at once, or queued for capacity; or it fits nowhere.
    Phase.PLANNING: frozenset({Phase.QUEUED, Phase.RUNNING, Phase.SUSPENDED, Phase.FAILED}),
    # Capacity freed up (launch), or a re-plan found no pool any more.
    Phase.QUEUED: frozenset({Phase.RUNNING, Phase.SUSPENDED, Phase.FAILED}),
    # Done; stopped for good; re-planned after an OOM onto busy GPUs (Queued); relaunched into
    # a pool that no longer exists (Planning again).
    Phase.RUNNING: frozenset(
        {Phase.SUCCEEDED, Phase.FAILED, Phase.QUEUED, Phase.PLANNING, Phase.SUSPENDED}
    ),
    # Resumed: relaunched from the checkpoint, or planned first when it never had a plan.
    Phase.SUSPENDED: frozenset({Phase.RUNNING, Phase.PLANNING, Phase.FAILED}),
    Phase.SUCCEEDED: frozenset(),
    Phase.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A phase change the table does not allow: a bug in the reconcile logic."""


def move(status: FineTuneJobStatus, to: Phase) -> None:
    """Set `status.phase` to `to`; staying in the same phase is always allowed."""
    here = Phase(status.phase)
    if to != here and to not in TRANSITIONS[here]:
        raise IllegalTransition(f"a FineTuneJob cannot go from {here} to {to}")
    status.phase = to


def is_finished(status: FineTuneJobStatus) -> bool:
    return status.phase in TERMINAL_PHASES


class Transitions:
    """The phase changes of one reconcile: each sets the phase and what belongs with it."""

    def __init__(self, status: FineTuneJobStatus, now: datetime, generation: int | None) -> None:
        self.status = status
        self.now = now
        self.generation = generation

    def condition(
        self, type_: ConditionType, status: bool, reason: Reason, message: str = ""
    ) -> None:
        self.status.conditions = set_condition(
            self.status.conditions,
            type_,
            status,
            reason,
            message,
            now=self.now,
            generation=self.generation,
        )

    def plan(self) -> None:
        """A new job starts planning (other unfinished phases plan where they are)."""
        if self.status.phase == Phase.PENDING:
            move(self.status, Phase.PLANNING)

    def replan(self) -> None:
        """The planned pool is gone: plan again from scratch."""
        move(self.status, Phase.PLANNING)
        self.status.plan = None

    def queue(self, message: str) -> None:
        move(self.status, Phase.QUEUED)
        self.status.message = message
        self.condition(ConditionType.QUEUED, True, Reason.INSUFFICIENT_CAPACITY, message)

    def launch(self, attempt: int) -> None:
        move(self.status, Phase.RUNNING)
        self.status.attempt = attempt
        self.status.trainer_pods = []
        self.status.message = f"launched attempt {attempt}"
        self.status.start_time = self.status.start_time or now_rfc3339(self.now)
        self.condition(
            ConditionType.RUNNING, False, Reason.PODS_STARTING, f"attempt {attempt}: pods starting"
        )

    def suspend(self) -> None:
        move(self.status, Phase.SUSPENDED)
        self.status.message = "suspended; the trainer checkpoints on SIGTERM"
        self.condition(
            ConditionType.SUSPENDED, True, Reason.SUSPEND_REQUESTED, "spec.suspend is true"
        )
        self.condition(ConditionType.RUNNING, False, Reason.SUSPEND_REQUESTED, "suspended")

    def resume(self) -> None:
        """Leaves Suspended through `launch` or `plan`; only the condition changes here."""
        self.condition(
            ConditionType.SUSPENDED, False, Reason.RESUMED, "resumed by spec.suspend=false"
        )

    def succeed(self, reason: Reason = Reason.COMPLETED, message: str | None = None) -> None:
        """Done: COMPLETED, or EARLY_STOPPED with `message` saying where and why."""
        move(self.status, Phase.SUCCEEDED)
        self.status.completion_time = now_rfc3339(self.now)
        self.status.message = message or "training finished"
        self.condition(ConditionType.RUNNING, False, reason, message or "trainer finished")
        self.condition(ConditionType.SUCCEEDED, True, reason, message or "trainer finished")

    def fail(self, reason: Reason, message: str) -> None:
        """The one way a job fails, whoever finds the reason (reconcile or the handlers)."""
        move(self.status, Phase.FAILED)
        self.status.message = message
        self.status.completion_time = self.status.completion_time or now_rfc3339(self.now)
        self.condition(ConditionType.FAILED, True, reason, message)
        self.condition(ConditionType.RUNNING, False, reason, message)


def failed(
    status: FineTuneJobStatus,
    reason: Reason,
    message: str,
    now: datetime,
    generation: int | None = None,
) -> FineTuneJobStatus:
    """A copy of `status`, Failed for `reason`: for failures found outside `reconcile`."""
    copy = status.model_copy(deep=True)
    Transitions(copy, now, generation).fail(reason, message)
    return copy
