"""The trainer's Indexed batch Job: one pod per node that runs `torchrun` (one Job per
attempt), with its resources, security contexts, tolerations and the failure policy that
tells the operator's exit codes apart. docs/trainer-pods.md explains every choice."""

from __future__ import annotations

import math
from typing import Any

from kubetune.api.units import quantity_value
from kubetune.api.v1alpha1 import FineTuneJob, GPUPool, PlanStatus
from kubetune.api.vocabulary import (
    ANNOTATION_PLAN_REVISION,
    GPU_RESOURCE,
    LABEL_JOB_UID,
    PROMETHEUS_PATH_ANNOTATION,
    PROMETHEUS_PORT_ANNOTATION,
    PROMETHEUS_SCRAPE_ANNOTATION,
)
from kubetune.control.build.env import trainer_env
from kubetune.control.build.names import ChildNames, child_names, labels, metadata, object_meta
from kubetune.control.build.paths import CACHE_DIR, CHECKPOINT_DIR, CONFIG_DIR, CONFIG_PATH
from kubetune.control.build.settings import BuildSettings
from kubetune.control.build.storage import cache_volume, claim_volumes, staged_in
from kubetune.control.pods import TRAINER_CONTAINER
from kubetune_trainer.contract import (
    EXIT_CHECKPOINT_FAILED,
    EXIT_CONFIG_ERROR,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    EXIT_SUPERSEDED,
)

CONTAINER_NAME = TRAINER_CONTAINER  # the one pods.py reads statuses of
RUN_AS_ID = 1000


# --------------------------------------------------------------------------- resources


def host_memory_gib(plan: PlanStatus, settings: BuildSettings) -> float:
    """Host memory of one trainer pod: the per-GPU amount for each of its GPUs, plus what the
    plan keeps in host memory (offloaded activations), times the plan's host-memory scale
    (raised each time the kernel killed a trainer for memory)."""
    base = float(quantity_value(settings.memory_per_gpu)) * plan.gpus_per_node / 2**30
    return round((base + (plan.host_offload_gib or 0.0)) * plan.host_memory_scale, 2)


def memory_quantity(gib: float) -> str:
    """`gib` as a memory quantity: whole GiB as `128Gi`, else MiB rounded up."""
    if gib == int(gib):
        return f"{int(gib)}Gi"
    return f"{math.ceil(gib * 1024)}Mi"


def _cpu_request(cpu_per_gpu: str, gpus: int) -> str:
    """`cpu_per_gpu` for each of the pod's GPUs, in millicores where it is given in them
    (`1500m` × 8 → `12000m`), else in cores (`4` × 8 → `32`, `1.5` × 3 → `4.5`)."""
    cores = quantity_value(cpu_per_gpu) * gpus
    if cpu_per_gpu.endswith("m"):
        return f"{format((cores * 1000).normalize(), 'f')}m"
    return format(cores.normalize(), "f")


def _trainer_resources(plan: PlanStatus, settings: BuildSettings) -> dict[str, Any]:
    gpus = plan.gpus_per_node
    # Plans made before they carried their host memory get it from the settings.
    gib = plan.host_memory_gib
    memory = memory_quantity(host_memory_gib(plan, settings) if gib is None else gib)
    limits: dict[str, str] = {GPU_RESOURCE: str(gpus)}
    if settings.memory_limit:
        # Within a limit of its own, a trainer that grows is killed by the kernel (OOMKilled,
        # which the operator reads and answers with more memory) instead of pressing its
        # node until the kubelet evicts it or its neighbours.
        limits["memory"] = memory
    return {
        "requests": {"cpu": _cpu_request(settings.cpu_per_gpu, gpus), "memory": memory},
        "limits": limits,
    }


# --------------------------------------------------------------------------- pod


def pod_security() -> dict[str, Any]:
    """The pod security context of trainer and CPU-step pods (Pod Security `restricted`)."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_ID,
        "runAsGroup": RUN_AS_ID,
        "fsGroup": RUN_AS_ID,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
    }


def _tolerations(pool: GPUPool) -> list[dict[str, Any]]:
    tolerations = [t.to_wire() for t in pool.spec.tolerations]
    gpu = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
    if gpu not in tolerations:
        tolerations.append(gpu)
    return tolerations


def _pod_failure_policy() -> dict[str, Any]:
    def on_exit(codes: list[int], action: str) -> dict[str, Any]:
        return {
            "action": action,
            "onExitCodes": {
                "containerName": CONTAINER_NAME,
                "operator": "In",
                "values": sorted(codes),  # the API server wants them in order
            },
        }

    return {
        "rules": [
            # Preempted after writing a checkpoint: not counted against backoffLimit (the
            # operator starts the next attempt; reconcile.relaunch_after_preemption).
            on_exit([EXIT_PREEMPTED], "Ignore"),
            # Evicted, preempted by the scheduler, node drained: same.
            {
                "action": "Ignore",
                "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
            },
            # Out of GPU memory: retrying the same layout is pointless; the operator re-plans.
            on_exit([EXIT_OOM], "FailJob"),
            # Bad config is permanent, so is a checkpoint that cannot be written or loaded;
            # a requested stop must not be retried, nor an attempt a later one superseded.
            on_exit(
                [EXIT_CONFIG_ERROR, EXIT_STOPPED, EXIT_CHECKPOINT_FAILED, EXIT_SUPERSEDED],
                "FailJob",
            ),
        ]
    }


def _torchrun_args(
    job: FineTuneJob, plan: PlanStatus, settings: BuildSettings, attempt: int
) -> list[str]:
    name, _, uid = metadata(job)
    names = child_names(name, attempt)
    args = [f"--nnodes={plan.nodes}", f"--nproc-per-node={plan.gpus_per_node}"]
    if plan.nodes == 1:
        args.insert(0, "--standalone")
    else:
        args += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={names.job}-0.{names.service}:{settings.rendezvous_port}",
            f"--rdzv-id={uid or name}-a{attempt}",
            f"--rdzv-conf=join_timeout={settings.rendezvous_join_timeout_seconds}",
        ]
    args += ["--max-restarts=0", "-m", "kubetune_trainer", "--config", CONFIG_PATH]
    return args


def _trainer_volumes(
    job: FineTuneJob, names: ChildNames, settings: BuildSettings
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) of a trainer pod: its config, the checkpoint claim, /dev/shm and
    /tmp, the claims `pvc://` URIs name, and the cache where the stage-in step put the model
    or the data."""
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": names.config_map}},
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": names.pvc}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size}},
        {"name": "tmp", "emptyDir": {"sizeLimit": settings.tmp_size}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "checkpoints", "mountPath": CHECKPOINT_DIR},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    claims, claim_mounts = claim_volumes(job)
    volumes += claims
    mounts += claim_mounts
    staged = staged_in(job)
    in_cache = [staged.model_path, staged.dataset_path] if staged is not None else []
    if any(str(path).startswith(f"{CACHE_DIR}/") for path in in_cache):
        volumes.append(cache_volume(settings, read_only=True))
        mounts.append({"name": "cache", "mountPath": CACHE_DIR, "readOnly": True})
    return volumes, mounts


def _trainer_pod_spec(
    job: FineTuneJob, plan: PlanStatus, pool: GPUPool, settings: BuildSettings, attempt: int
) -> dict[str, Any]:
    names = child_names(metadata(job)[0], attempt)
    volumes, mounts = _trainer_volumes(job, names, settings)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": job.spec.trainer_image or settings.trainer_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": list(settings.launcher),
        "args": _torchrun_args(job, plan, settings, attempt),
        "env": trainer_env(job, attempt, settings),
        "ports": [
            {"name": "metrics", "containerPort": settings.metrics_port, "protocol": "TCP"},
            {"name": "rendezvous", "containerPort": settings.rendezvous_port, "protocol": "TCP"},
        ],
        "resources": _trainer_resources(plan, settings),
        "volumeMounts": mounts,
        # The trainer writes why it ended to /dev/termination-log; when it could not (killed,
        # or the launcher itself failed), the kubelet uses the tail of the log instead.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security(),
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        # The pod's sandbox process is PID 1 and reaps orphans; the launcher is an ordinary
        # process, so signals reach it as they do everywhere else (a PID 1 ignores any it
        # has no handler for, SIGKILL from within included). The pod has one container.
        "shareProcessNamespace": True,
        "subdomain": names.service,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": settings.termination_grace_seconds,
        "securityContext": pod_security(),
        "tolerations": _tolerations(pool),
        "containers": [container],
        "volumes": volumes,
    }
    if pool.spec.node_selector:
        pod_spec["nodeSelector"] = dict(pool.spec.node_selector)
    return pod_spec


# --------------------------------------------------------------------------- batch Job


def build_indexed_job(
    job: FineTuneJob,
    plan: PlanStatus,
    pool: GPUPool,
    settings: BuildSettings,
    attempt: int,
) -> dict[str, Any]:
    """The Indexed batch Job: one pod per node, `torchrun` inside."""
    name, _, uid = metadata(job)
    plan_revision = str(plan.revision)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": object_meta(
            job,
            child_names(name, attempt).job,
            attempt=attempt,
            annotations={ANNOTATION_PLAN_REVISION: plan_revision},
        ),
        "spec": {
            "completionMode": "Indexed",
            "completions": plan.nodes,
            "parallelism": plan.nodes,
            "backoffLimit": settings.backoff_limit,
            "suspend": False,
            # A replacement pod starts only once the old one has terminated, so two pods
            # never write the same checkpoint folder at once.
            "podReplacementPolicy": "Failed",
            "podFailurePolicy": _pod_failure_policy(),
            "template": {
                "metadata": {
                    "labels": {**labels(job, attempt), LABEL_JOB_UID: uid},
                    "annotations": {
                        PROMETHEUS_SCRAPE_ANNOTATION: "true",
                        PROMETHEUS_PORT_ANNOTATION: str(settings.metrics_port),
                        PROMETHEUS_PATH_ANNOTATION: "/metrics",
                        ANNOTATION_PLAN_REVISION: plan_revision,
                    },
                },
                "spec": _trainer_pod_spec(job, plan, pool, settings, attempt),
            },
        },
    }
