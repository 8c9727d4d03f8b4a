"""Condition semantics and operator settings."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from kubetune.api.vocabulary import ConditionType, Reason
from kubetune.control import conditions as c
from kubetune.controller.settings import settings_from_env

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_transition_time_moves_only_on_flip() -> None:
    conds = c.set_condition([], ConditionType.RUNNING, False, Reason.PODS_STARTING, now=T0)
    later = c.set_condition(
        conds,
        ConditionType.RUNNING,
        False,
        Reason.PODS_STARTING,
        "still",
        now=T0 + timedelta(hours=1),
    )
    assert later[0].last_transition_time == "2026-01-01T00:00:00Z"
    assert later[0].message == "still"
    flipped = c.set_condition(
        later, ConditionType.RUNNING, True, Reason.TRAINING, now=T0 + timedelta(hours=2)
    )
    assert flipped[0].last_transition_time == "2026-01-01T02:00:00Z"
    assert flipped[0].reason == Reason.TRAINING


def test_other_conditions_are_kept() -> None:
    conds = c.set_condition([], ConditionType.PLANNED, True, Reason.PLAN_READY, now=T0)
    conds = c.set_condition(
        conds, ConditionType.RUNNING, True, Reason.TRAINING, now=T0, generation=3
    )
    assert [x.type for x in conds] == [ConditionType.PLANNED, ConditionType.RUNNING]
    assert (
        c.is_true(conds, ConditionType.PLANNED)
        and c.get_condition(conds, ConditionType.RUNNING).observed_generation == 3
    )  # type: ignore[union-attr]
    assert not c.is_true(conds, ConditionType.FAILED)


def test_settings_from_env() -> None:
    s = settings_from_env(
        {
            "KUBETUNE_TRAINER_IMAGE": "registry.local/trainer:1",
            "KUBETUNE_SAFETY_FACTOR": "1.25",
            "KUBETUNE_ALLOW_NETWORK": "true",
            "KUBETUNE_POLL_SECONDS": "3",
        }
    )
    assert s.build.trainer_image == "registry.local/trainer:1"
    assert s.planner.safety_factor == 1.25
    assert s.allow_network and s.poll_seconds == 3
    defaults = settings_from_env({})
    assert defaults.planner.safety_factor == 1.10 and not defaults.allow_network
    with pytest.raises(ValueError, match="KUBETUNE_SAFETY_FACTOR"):
        settings_from_env({"KUBETUNE_SAFETY_FACTOR": "lots"})


def test_default_objective_setting() -> None:
    assert settings_from_env({}).planner.default_objective == "cost"
    assert settings_from_env({"KUBETUNE_DEFAULT_OBJECTIVE": ""}).planner.default_objective == (
        "cost"
    )
    for value in ("cost", "time"):
        s = settings_from_env({"KUBETUNE_DEFAULT_OBJECTIVE": value})
        assert s.planner.default_objective == value
    # Other planner settings are unaffected.
    s = settings_from_env({"KUBETUNE_DEFAULT_OBJECTIVE": "time", "KUBETUNE_SAFETY_FACTOR": "1.3"})
    assert s.planner.safety_factor == 1.3 and s.planner.default_objective == "time"


@pytest.mark.parametrize("value", ["fast", "Time", " cost", "cheapest"])
def test_bad_default_objective_names_the_variable_and_the_allowed_values(value: str) -> None:
    with pytest.raises(ValueError) as err:
        settings_from_env({"KUBETUNE_DEFAULT_OBJECTIVE": value})
    message = str(err.value)
    assert message.startswith(f"KUBETUNE_DEFAULT_OBJECTIVE={value!r}")
    assert "cost, time" in message and "to fix" in message


def test_trainer_pod_requests_per_gpu() -> None:
    defaults = settings_from_env({})
    assert (defaults.build.cpu_per_gpu, defaults.build.memory_per_gpu) == ("4", "16Gi")
    s = settings_from_env(
        {"KUBETUNE_TRAINER_CPU_PER_GPU": "500m", "KUBETUNE_TRAINER_MEMORY_PER_GPU": "1.5Gi"}
    )
    assert (s.build.cpu_per_gpu, s.build.memory_per_gpu) == ("500m", "1.5Gi")


def test_trainer_memory_limit_is_on_unless_turned_off() -> None:
    assert settings_from_env({}).build.memory_limit is True
    assert settings_from_env({"KUBETUNE_TRAINER_MEMORY_LIMIT": "false"}).build.memory_limit is False
    with pytest.raises(ValueError, match=r"KUBETUNE_TRAINER_MEMORY_LIMIT='maybe' .* to fix"):
        settings_from_env({"KUBETUNE_TRAINER_MEMORY_LIMIT": "maybe"})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KUBETUNE_TRAINER_CPU_PER_GPU", "four"),
        ("KUBETUNE_TRAINER_CPU_PER_GPU", "0"),
        ("KUBETUNE_TRAINER_CPU_PER_GPU", "-1"),
        ("KUBETUNE_TRAINER_MEMORY_PER_GPU", "16GB"),
        ("KUBETUNE_TRAINER_MEMORY_PER_GPU", "0Gi"),
    ],
)
def test_bad_trainer_pod_request_names_the_variable_and_the_fix(name: str, value: str) -> None:
    with pytest.raises(ValueError) as err:
        settings_from_env({name: value})
    assert str(err.value).startswith(f"{name}={value!r} is not a positive Kubernetes quantity")
    assert "to fix" in str(err.value)


def test_checkpoint_read_write_many_setting() -> None:
    assert settings_from_env({}).build.checkpoint_read_write_many is False
    on = settings_from_env({"KUBETUNE_CHECKPOINT_READ_WRITE_MANY": "true"})
    assert on.build.checkpoint_read_write_many is True
    off = settings_from_env({"KUBETUNE_CHECKPOINT_READ_WRITE_MANY": "false"})
    assert off.build.checkpoint_read_write_many is False
    with pytest.raises(ValueError, match=r"KUBETUNE_CHECKPOINT_READ_WRITE_MANY.*to fix"):
        settings_from_env({"KUBETUNE_CHECKPOINT_READ_WRITE_MANY": "rwx"})
