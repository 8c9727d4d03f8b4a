"""Operator settings from environment variables (the Helm chart sets them).

KUBETUNE_TRAINER_IMAGE              trainer image for jobs without an override
KUBETUNE_IMAGE_PULL_POLICY          pull policy of trainer pods (IfNotPresent)
KUBETUNE_CHECKPOINT_STORAGE_CLASS   StorageClass of checkpoint volumes (cluster default)
KUBETUNE_SAFETY_FACTOR              estimate × this must fit in GPU memory (1.10)
KUBETUNE_DEFAULT_OBJECTIVE          objective of jobs without spec.resources.objective (cost)
KUBETUNE_TERMINATION_GRACE_SECONDS  time the trainer gets to checkpoint on stop (120)
KUBETUNE_TRAINER_CPU_PER_GPU        CPU request of trainer pods per GPU (4)
KUBETUNE_TRAINER_MEMORY_PER_GPU     memory request of trainer pods per GPU (16Gi)
KUBETUNE_POLL_SECONDS               how often running jobs are re-read (10)
KUBETUNE_QUEUE_RETRY_SECONDS        how often queued jobs are re-planned (15)
KUBETUNE_RESCHEDULE_SECONDS         unschedulable trainer pods this long: move pools (120)
KUBETUNE_ALLOW_NETWORK              fetch config.json of unknown hub models (false)
KUBETUNE_METRICS_PORT               operator /metrics port (8000; read by controller.metrics)

docs/configuration.md lists the same with the Helm values that set them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from decimal import Decimal
from typing import get_args

from kubetune.api.v1alpha1 import Objective
from kubetune.control.builders import QUANTITY, BuildSettings
from kubetune.control.reconcile import ControllerSettings
from kubetune.planning.planner import PlannerSettings

_TRUE = {"1", "true", "yes", "on"}


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


def _quantity(env: Mapping[str, str], name: str, default: str) -> str:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    match = QUANTITY.match(raw)
    if match is None or Decimal(match.group(1)) <= 0:
        raise ValueError(
            f"{name}={raw!r} is not a positive Kubernetes quantity; to fix: set it to a "
            f"number with an optional unit, e.g. {default!r}, or unset it for {default}"
        )
    return raw


def _objective(env: Mapping[str, str], name: str, default: Objective) -> Objective:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    allowed: tuple[Objective, ...] = get_args(Objective)
    for objective in allowed:
        if raw == objective:
            return objective
    raise ValueError(
        f"{name}={raw!r}: the default objective must be one of {', '.join(allowed)}; "
        f"to fix: set {name} to one of them, or unset it for {default}"
    )


def settings_from_env(env: Mapping[str, str] | None = None) -> ControllerSettings:
    env = os.environ if env is None else env
    build = BuildSettings(
        trainer_image=env.get("KUBETUNE_TRAINER_IMAGE") or BuildSettings.trainer_image,
        image_pull_policy=env.get("KUBETUNE_IMAGE_PULL_POLICY") or BuildSettings.image_pull_policy,
        checkpoint_storage_class=env.get("KUBETUNE_CHECKPOINT_STORAGE_CLASS") or None,
        termination_grace_seconds=int(
            _float(
                env, "KUBETUNE_TERMINATION_GRACE_SECONDS", BuildSettings.termination_grace_seconds
            )
        ),
        cpu_per_gpu=_quantity(env, "KUBETUNE_TRAINER_CPU_PER_GPU", BuildSettings.cpu_per_gpu),
        memory_per_gpu=_quantity(
            env, "KUBETUNE_TRAINER_MEMORY_PER_GPU", BuildSettings.memory_per_gpu
        ),
    )
    planner = PlannerSettings(
        safety_factor=_float(env, "KUBETUNE_SAFETY_FACTOR", PlannerSettings.safety_factor),
        default_objective=_objective(
            env, "KUBETUNE_DEFAULT_OBJECTIVE", PlannerSettings.default_objective
        ),
    )
    return ControllerSettings(
        build=build,
        planner=planner,
        allow_network=(env.get("KUBETUNE_ALLOW_NETWORK", "").lower() in _TRUE),
        poll_seconds=_float(env, "KUBETUNE_POLL_SECONDS", 10.0),
        queue_retry_seconds=_float(env, "KUBETUNE_QUEUE_RETRY_SECONDS", 15.0),
        reschedule_seconds=_float(env, "KUBETUNE_RESCHEDULE_SECONDS", 120.0),
    )
