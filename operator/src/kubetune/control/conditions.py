"""Conditions with Kubernetes semantics (pure); their types and reasons are the closed sets
in `kubetune.api.vocabulary`.

`lastTransitionTime` moves only when a condition's status flips; a changed reason or
message alone updates those fields and keeps the time, as metav1.Condition prescribes.
"""

from __future__ import annotations

from datetime import UTC, datetime

from kubetune.api.v1alpha1 import Condition
from kubetune.api.vocabulary import ConditionType, Reason


def now_rfc3339(now: datetime | None = None) -> str:
    return (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    conditions: list[Condition],
    type_: ConditionType,
    status: bool | str,
    reason: Reason,
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


def get_condition(conditions: list[Condition], type_: ConditionType) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def is_true(conditions: list[Condition], type_: ConditionType) -> bool:
    cond = get_condition(conditions, type_)
    return cond is not None and cond.status == "True"
