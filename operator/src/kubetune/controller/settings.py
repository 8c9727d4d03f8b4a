"""Operator settings from environment variables (the Helm chart sets them).

KUBETUNE_TRAINER_IMAGE              trainer image for jobs without an override
KUBETUNE_IMAGE_PULL_POLICY          pull policy of trainer pods (IfNotPresent)
KUBETUNE_CHECKPOINT_STORAGE_CLASS   StorageClass of checkpoint volumes (cluster default)
KUBETUNE_CHECKPOINT_READ_WRITE_MANY that class offers ReadWriteMany: accessMode auto volumes are
                                    ReadWriteMany and plans may span nodes (false)
KUBETUNE_SAFETY_FACTOR              estimate × this must fit in GPU memory (1.10)
KUBETUNE_DEFAULT_OBJECTIVE          objective of jobs without spec.resources.objective (cost)
KUBETUNE_TERMINATION_GRACE_SECONDS  time the trainer gets to checkpoint on stop (120)
KUBETUNE_TRAINER_CPU_PER_GPU        CPU request of trainer pods per GPU (4)
KUBETUNE_TRAINER_MEMORY_PER_GPU     host memory of trainer pods per GPU, before what the plan
                                    adds (16Gi)
KUBETUNE_TRAINER_MEMORY_LIMIT       trainer pods get a memory limit equal to their request (true)
KUBETUNE_CACHE_SIZE                 size of a namespace's model and data cache claim (200Gi)
KUBETUNE_CACHE_STORAGE_CLASS        its StorageClass, ReadWriteMany (the checkpoints' class)
KUBETUNE_STAGE_IN_NODE_SELECTOR     JSON object: node labels stage-in pods need ({})
KUBETUNE_STAGE_IN_TOLERATIONS       JSON list: tolerations of stage-in pods ([])
KUBETUNE_STAGE_IN_CPU               CPU request of stage-in and stage-out pods (2)
KUBETUNE_STAGE_IN_MEMORY            memory request of stage-in and stage-out pods (8Gi)
KUBETUNE_EXPORT_CPU                 CPU request of GGUF export pods (4)
KUBETUNE_EXPORT_MEMORY              memory request of GGUF export pods (16Gi)
KUBETUNE_CACHE_EVICT_ABOVE          evict least-recently-used cache entries above this size
                                    (90% of KUBETUNE_CACHE_SIZE)
KUBETUNE_CACHE_VOLUME               JSON object: a pod volume source shared by every namespace as
                                    the cache, instead of a claim per namespace ({})
KUBETUNE_STAGE_IN_HUB               fetch hub models and datasets in the stage-in step (true)
KUBETUNE_HF_ENDPOINT                HF_ENDPOINT of stage-in and trainer pods (huggingface.co)
KUBETUNE_POLL_SECONDS               how often a running job's trainer metrics are read (30)
KUBETUNE_QUEUE_RETRY_SECONDS        how often queued jobs are re-planned without events (15)
KUBETUNE_RESCHEDULE_SECONDS         unschedulable trainer pods this long: move pools (120)
KUBETUNE_RESYNC_SECONDS             every unfinished job is looked at at least this often (600)
KUBETUNE_PROGRESS_WRITE_SECONDS     progress/cost-only status writes at most this often (60)
KUBETUNE_STALL_SECONDS              liveness fails when reconciles stalled this long (300)
KUBETUNE_TRAINING_STALL_SECONDS     relaunch an attempt whose step stopped moving this long (1800)
KUBETUNE_STARTUP_TIMEOUT_SECONDS    fail an attempt whose trainer has a node and has not started
                                    this long, or a job whose inputs are missing this long (900)
KUBETUNE_PLANNER_WORKERS            threads that run reconciles off the event loop (2)
KUBETUNE_SCRAPE_CONCURRENCY         trainer metrics endpoints read at once (16)
KUBETUNE_ALLOW_NETWORK              fetch config.json of unknown hub models (false)
KUBETUNE_ALLOW_TEST_FAULTS          obey the kubetune.io/test-faults annotation (false)
KUBETUNE_ALLOWED_TRAINER_IMAGES     other images jobs may name, comma-separated patterns ()
KUBETUNE_METRICS_PORT               operator /metrics port (8000; read by controller.metrics)
KUBETUNE_NETWORK_POLICIES           create a NetworkPolicy for each job's trainer pods (true)
KUBETUNE_OPERATOR_NAMESPACE         the operator's namespace, admitted to the trainers' metrics
                                    port (POD_NAMESPACE; unset: none)
KUBETUNE_OPERATOR_POD_LABELS        JSON object: labels of the operator's pods ({})
KUBETUNE_METRICS_FROM               JSON list of NetworkPolicyPeers that may scrape trainers
                                    (namespaces labelled kubetune.io/metrics-scraper=true)

docs/configuration.md lists the same with the Helm values that set them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any, get_args

from kubetune.api.units import quantity_value
from kubetune.api.v1alpha1 import Objective
from kubetune.control.build.settings import BuildSettings
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


def _positive(env: Mapping[str, str], name: str, default: float) -> float:
    value = _float(env, name, default)
    if value <= 0:
        raise ValueError(
            f"{name}={env.get(name)!r} must be greater than zero; to fix: set a positive "
            f"number, or unset it for {default:g}"
        )
    return value


def _quantity(env: Mapping[str, str], name: str, default: str) -> str:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = quantity_value(raw)
    except ValueError:
        value = Decimal(0)
    if value <= 0:
        raise ValueError(
            f"{name}={raw!r} is not a positive Kubernetes quantity; to fix: set it to a "
            f"number with an optional unit, e.g. {default!r}, or unset it for {default}"
        )
    return raw


def _cache_max_bytes(env: Mapping[str, str]) -> int:
    """KUBETUNE_CACHE_EVICT_ABOVE in bytes; unset: 90% of the cache claim's size."""
    size = _quantity(env, "KUBETUNE_CACHE_SIZE", BuildSettings.cache_size)
    default = quantity_value(size) * Decimal("0.9")
    raw = env.get("KUBETUNE_CACHE_EVICT_ABOVE")
    if raw is None or raw == "":
        return int(default)
    return int(quantity_value(_quantity(env, "KUBETUNE_CACHE_EVICT_ABOVE", size)))


def _cache_volume(env: Mapping[str, str]) -> dict[str, Any] | None:
    """KUBETUNE_CACHE_VOLUME: one volume source (`{"csi": {...}}`); `{}` or unset: none."""
    raw = env.get("KUBETUNE_CACHE_VOLUME") or "{}"
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"KUBETUNE_CACHE_VOLUME is not JSON ({exc})") from None
    if value == {}:
        return None
    if not isinstance(value, dict) or len(value) != 1 or "name" in value:
        raise ValueError(
            f"KUBETUNE_CACHE_VOLUME={raw!r} is not one pod volume source; to fix: give one, "
            'e.g. {"csi": {"driver": "nfs.csi.k8s.io", "volumeAttributes": {"server": '
            '"nfs.storage", "share": "/kubetune-cache"}}}, or {} for a claim per namespace'
        )
    return value


def _url(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", raw):
        raise ValueError(
            f"{name}={raw!r} is not an http(s) URL; to fix: set it like "
            "'https://hub.example.internal', or unset it for huggingface.co"
        )
    return raw.rstrip("/")


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


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in {"0", "false", "no", "off"}:
        return False
    raise ValueError(
        f"{name}={raw!r} is not true or false; to fix: set true or false, or unset it for "
        f"{str(default).lower()}"
    )


def _json(env: Mapping[str, str], name: str, expected: type, example: str) -> Any:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ValueError(
            f"{name}={raw!r} is not JSON ({exc}); to fix: set it to JSON such as {example}"
        ) from None
    if not isinstance(value, expected):
        raise ValueError(
            f"{name}={raw!r} is not a JSON {expected.__name__}; to fix: set it to JSON such "
            f"as {example}"
        )
    return value


_PEER_KEYS = {"podSelector", "namespaceSelector", "ipBlock"}


def _string_map(env: Mapping[str, str], name: str) -> tuple[tuple[str, str], ...]:
    value = _json(env, name, dict, '{"app.kubernetes.io/name": "kubetune"}') or {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(
            f"{name}={env.get(name)!r}: label keys and values must be strings; to fix: quote "
            "every value"
        )
    return tuple(sorted(value.items()))


def _operator_pod_labels(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return _string_map(env, "KUBETUNE_OPERATOR_POD_LABELS")


_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}


def _tolerations(env: Mapping[str, str], name: str) -> tuple[dict[str, Any], ...]:
    example = '[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]'
    value = _json(env, name, list, example) or []
    for item in value:
        if not isinstance(item, dict) or not item or set(item) - _TOLERATION_KEYS:
            raise ValueError(
                f"{name}: {item!r} is not a toleration; to fix: give each item some of "
                f"{', '.join(sorted(_TOLERATION_KEYS))}, e.g. {example}"
            )
    return tuple(value)


def _metrics_from(env: Mapping[str, str]) -> tuple[dict[str, Any], ...]:
    name = "KUBETUNE_METRICS_FROM"
    value = _json(env, name, list, '[{"namespaceSelector": {"matchLabels": {"team": "obs"}}}]')
    if value is None:
        return BuildSettings.metrics_from
    for peer in value:
        if not isinstance(peer, dict) or not peer or set(peer) - _PEER_KEYS:
            raise ValueError(
                f"{name}: {peer!r} is not a NetworkPolicyPeer; to fix: give each item one or "
                "more of podSelector, namespaceSelector (label selectors) or ipBlock"
            )
    return tuple(value)


def settings_from_env(env: Mapping[str, str] | None = None) -> ControllerSettings:
    env = os.environ if env is None else env
    build = BuildSettings(
        trainer_image=env.get("KUBETUNE_TRAINER_IMAGE") or BuildSettings.trainer_image,
        image_pull_policy=env.get("KUBETUNE_IMAGE_PULL_POLICY") or BuildSettings.image_pull_policy,
        checkpoint_storage_class=env.get("KUBETUNE_CHECKPOINT_STORAGE_CLASS") or None,
        checkpoint_read_write_many=_bool(
            env, "KUBETUNE_CHECKPOINT_READ_WRITE_MANY", BuildSettings.checkpoint_read_write_many
        ),
        termination_grace_seconds=int(
            _float(
                env, "KUBETUNE_TERMINATION_GRACE_SECONDS", BuildSettings.termination_grace_seconds
            )
        ),
        cpu_per_gpu=_quantity(env, "KUBETUNE_TRAINER_CPU_PER_GPU", BuildSettings.cpu_per_gpu),
        memory_per_gpu=_quantity(
            env, "KUBETUNE_TRAINER_MEMORY_PER_GPU", BuildSettings.memory_per_gpu
        ),
        memory_limit=_bool(env, "KUBETUNE_TRAINER_MEMORY_LIMIT", BuildSettings.memory_limit),
        network_policy=_bool(env, "KUBETUNE_NETWORK_POLICIES", BuildSettings.network_policy),
        cache_size=_quantity(env, "KUBETUNE_CACHE_SIZE", BuildSettings.cache_size),
        cache_storage_class=env.get("KUBETUNE_CACHE_STORAGE_CLASS") or None,
        stage_in_node_selector=_string_map(env, "KUBETUNE_STAGE_IN_NODE_SELECTOR"),
        stage_in_tolerations=_tolerations(env, "KUBETUNE_STAGE_IN_TOLERATIONS"),
        stage_in_cpu=_quantity(env, "KUBETUNE_STAGE_IN_CPU", BuildSettings.stage_in_cpu),
        stage_in_memory=_quantity(env, "KUBETUNE_STAGE_IN_MEMORY", BuildSettings.stage_in_memory),
        export_cpu=_quantity(env, "KUBETUNE_EXPORT_CPU", BuildSettings.export_cpu),
        export_memory=_quantity(env, "KUBETUNE_EXPORT_MEMORY", BuildSettings.export_memory),
        cache_max_bytes=_cache_max_bytes(env),
        cache_volume=_cache_volume(env),
        stage_in_hub=_bool(env, "KUBETUNE_STAGE_IN_HUB", BuildSettings.stage_in_hub),
        hub_endpoint=_url(env, "KUBETUNE_HF_ENDPOINT"),
        operator_namespace=(
            env.get("KUBETUNE_OPERATOR_NAMESPACE") or env.get("POD_NAMESPACE") or None
        ),
        operator_pod_labels=_operator_pod_labels(env),
        metrics_from=_metrics_from(env),
        allow_test_faults=(env.get("KUBETUNE_ALLOW_TEST_FAULTS", "").lower() in _TRUE),
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
        allowed_trainer_images=tuple(
            filter(
                None, (p.strip() for p in env.get("KUBETUNE_ALLOWED_TRAINER_IMAGES", "").split(","))
            )
        ),
        poll_seconds=_float(env, "KUBETUNE_POLL_SECONDS", ControllerSettings.poll_seconds),
        queue_retry_seconds=_float(
            env, "KUBETUNE_QUEUE_RETRY_SECONDS", ControllerSettings.queue_retry_seconds
        ),
        reschedule_seconds=_float(
            env, "KUBETUNE_RESCHEDULE_SECONDS", ControllerSettings.reschedule_seconds
        ),
        resync_seconds=_positive(env, "KUBETUNE_RESYNC_SECONDS", ControllerSettings.resync_seconds),
        progress_write_seconds=_float(
            env, "KUBETUNE_PROGRESS_WRITE_SECONDS", ControllerSettings.progress_write_seconds
        ),
        stall_seconds=_positive(env, "KUBETUNE_STALL_SECONDS", ControllerSettings.stall_seconds),
        training_stall_seconds=_positive(
            env, "KUBETUNE_TRAINING_STALL_SECONDS", ControllerSettings.training_stall_seconds
        ),
        startup_timeout_seconds=_positive(
            env, "KUBETUNE_STARTUP_TIMEOUT_SECONDS", ControllerSettings.startup_timeout_seconds
        ),
        planner_workers=int(
            _positive(env, "KUBETUNE_PLANNER_WORKERS", ControllerSettings.planner_workers)
        ),
        scrape_concurrency=int(
            _positive(env, "KUBETUNE_SCRAPE_CONCURRENCY", ControllerSettings.scrape_concurrency)
        ),
    )
