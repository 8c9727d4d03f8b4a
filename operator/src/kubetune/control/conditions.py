"""Conditions with Kubernetes semantics, and the reasons kubetune uses (pure).

`lastTransitionTime` moves only when a condition's status flips; a changed reason or
message alone updates those fields and keeps the time, as metav1.Condition prescribes.
"""

from __future__ import annotations

from datetime import UTC, datetime

from kubetune.api.v1alpha1 import Condition

# Condition types
PLANNED = "Planned"
QUEUED = "Queued"
RUNNING = "Running"
SUSPENDED = "Suspended"
SUCCEEDED = "Succeeded"
FAILED = "Failed"

# Reasons
PLAN_READY = "PlanReady"
INFEASIBLE = "Infeasible"
INVALID_SPEC = "InvalidSpec"
UNKNOWN_ARCHITECTURE = "UnknownArchitecture"
NO_POOLS = "NoPools"
INSUFFICIENT_CAPACITY = "InsufficientCapacity"
CAPACITY_AVAILABLE = "CapacityAvailable"
PODS_STARTING = "PodsStarting"
TRAINING = "Training"
TRAINER_EXITED = "TrainerExited"
SUSPEND_REQUESTED = "SuspendRequested"
RESUMED = "Resumed"
COMPLETED = "Completed"
OUT_OF_MEMORY = "OutOfMemory"
OOM_LIMIT = "OutOfMemoryLimitReached"
RESTART_LIMIT = "RestartLimitReached"
TRAINER_FAILED = "TrainerFailed"
CONFIG_ERROR = "TrainerConfigError"
PREEMPTED = "Preempted"
BUDGET_EXCEEDED = "BudgetExceeded"
DEADLINE_EXCEEDED = "DeadlineExceeded"


def now_rfc3339(now: datetime | None = None) -> str:
    return (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    conditions: list[Condition],
    type_: str,
    status: bool | str,
    reason: str,
    message: str = "",
    *,
    now: datetime | None = None,
    generation: int | None = None,
) -> list[Condition]:
    """Return a new list with `type_` set; other conditions are kept as they are."""
    text = status if isinstance(status, str) else ("True" if status else "False")
    old = get_condition(conditions, type_)
    since = now_rfc3339(now) if old is None or old.status != text else old.last_transition_time
    updated = Condition(
        type=type_,
        status=text,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )
    if old is None:
        return [*conditions, updated]
    return [updated if cond.type == type_ else cond for cond in conditions]


def get_condition(conditions: list[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def is_true(conditions: list[Condition], type_: str) -> bool:
    cond = get_condition(conditions, type_)
    return cond is not None and cond.status == "True"
