"""The environment of the trainer and CPU-step containers: where the config is, how long to
shut down, which rank a pod is, and the credentials (hub token, S3 keys) as Secret
references, never as values."""

from __future__ import annotations

from typing import Any

from kubetune.api.v1alpha1 import FineTuneJob
from kubetune.api.vocabulary import COMPLETION_INDEX_ANNOTATION
from kubetune.control.build.paths import CONFIG_PATH, HF_HOME
from kubetune.control.build.settings import BuildSettings

TOKEN_ENV = "HF_TOKEN"
SHUTDOWN_MARGIN_SECONDS = 10
"""How much sooner than the kubelet the trainer's launcher gives up on its workers."""
MIN_SHUTDOWN_SECONDS = 5


def launcher_shutdown_seconds(termination_grace_seconds: int) -> int:
    """How long the launcher (torchrun) waits after SIGTERM for its workers to checkpoint
    before it kills them: the pod's grace period less a margin of 10 s, at least 5 s. The
    launcher then still has time to collect the workers' exit codes and exit with them
    before the kubelet's SIGKILL ends the pod (which would leave exit code 137)."""
    return max(MIN_SHUTDOWN_SECONDS, termination_grace_seconds - SHUTDOWN_MARGIN_SECONDS)


def trainer_env(job: FineTuneJob, attempt: int, settings: BuildSettings) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "KUBETUNE_CONFIG", "value": CONFIG_PATH},
        {"name": "KUBETUNE_ATTEMPT", "value": str(attempt)},
        {
            "name": "KUBETUNE_SHUTDOWN_TIMEOUT",
            "value": str(launcher_shutdown_seconds(settings.termination_grace_seconds)),
        },
        {
            "name": "NODE_RANK",
            "valueFrom": {
                "fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}
            },
        },
        {"name": "HF_HOME", "value": HF_HOME},
        # The root filesystem is read-only: caches that default to $HOME (triton, torch
        # extensions, matplotlib) go to the /tmp emptyDir.
        {"name": "HOME", "value": "/tmp"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "OMP_NUM_THREADS", "value": "4"},
    ]
    return env + token_env(job) + hub_env(settings)


def token_env(job: FineTuneJob) -> list[dict[str, Any]]:
    """`HF_TOKEN` from the Secret spec.model.tokenSecretRef names, if any."""
    token = job.spec.model.token_secret_ref
    if token is None:
        return []
    ref = {"name": token.name, "key": token.key}
    return [{"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": ref}}]


def hub_env(settings: BuildSettings) -> list[dict[str, Any]]:
    """HF_ENDPOINT for a hub mirror or a private hub (`hub_endpoint`); none: huggingface.co."""
    if settings.hub_endpoint is None:
        return []
    return [{"name": "HF_ENDPOINT", "value": settings.hub_endpoint}]


def s3_env(job: FineTuneJob) -> list[dict[str, Any]]:
    s3 = job.spec.s3
    if s3 is None:
        return []
    env: list[dict[str, Any]] = []
    if s3.credentials_secret is not None:
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            ref = {"name": s3.credentials_secret, "key": key}
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    if s3.region is not None:
        env.append({"name": "AWS_REGION", "value": s3.region})
    if s3.endpoint is not None:
        env.append({"name": "AWS_ENDPOINT_URL", "value": s3.endpoint})
    return env
