"""The CPU-only steps around training, each a ConfigMap and a batch Job of one pod of the
trainer image: the stage-in (fetch, check and measure the model and data into the
namespace's cache before any GPU is asked for), the export (a GGUF file after training) and
the stage-out (upload the output to S3)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kubetune.api.errors import SpecError
from kubetune.api.v1alpha1 import FineTuneJob
from kubetune.api.vocabulary import GPU_PRESENT_LABEL, LABEL_STEP, StepKind
from kubetune.control.build.config import source_refs
from kubetune.control.build.env import hub_env, s3_env, token_env
from kubetune.control.build.names import (
    child_names,
    dns_label,
    labels,
    metadata,
    object_meta,
    step_name,
)
from kubetune.control.build.paths import CACHE_DIR, CHECKPOINT_DIR, CONFIG_DIR, OUTPUT_DIR, PVC_ROOT
from kubetune.control.build.settings import BuildSettings
from kubetune.control.build.storage import (
    build_cache_pvc,
    cache_volume,
    claim_volumes,
    locate,
    output_location,
)
from kubetune.control.build.trainer import container_security, pod_security
from kubetune_trainer.contract import (
    EXIT_CONFIG_ERROR,
    ExportConfig,
    JobRef,
    StageInConfig,
    StageOutConfig,
)
from kubetune_trainer.uris import Form, parse_uri, pvc_uri

# --------------------------------------------------------------------------- stage-in


def fetched_sources(job: FineTuneJob, settings: BuildSettings) -> list[str]:
    """The job's model and dataset URIs that come from a store (S3, https, and the hub
    unless `stage_in_hub` is off): the stage-in step fetches them into the namespace's
    cache, so that no GPU waits for a download."""
    remote = {"s3", "https", "hub"} if settings.stage_in_hub else {"s3", "https"}
    uris = (job.spec.model.uri, job.spec.dataset.uri)
    return [uri for uri in uris if locate(uri).kind in remote]


def needs_stage_in(job: FineTuneJob, settings: BuildSettings) -> bool:
    """Whether a CPU-only stage-in step runs before the plan: something must be fetched, or
    planning needs what only the files say (a model on a volume with no
    `spec.model.architecture`: its config.json)."""
    if fetched_sources(job, settings):
        return True
    return job.spec.model.architecture is None and locate(job.spec.model.uri).kind == "path"


def build_stage_in_config(
    job: FineTuneJob, settings: BuildSettings, keep_paths: Sequence[str] = ()
) -> StageInConfig:
    name, namespace, uid = metadata(job)
    spec = job.spec
    model, dataset = source_refs(
        job, locate(spec.model.uri, split_revision=True), locate(spec.dataset.uri)
    )
    return StageInConfig(
        job=JobRef(name=name, namespace=namespace, uid=uid),
        model=model,
        dataset=dataset,
        cache_dir=CACHE_DIR,
        result_path=f"{CACHE_DIR}/jobs/{uid or name}/stage-in.json",
        # The data measure the same whatever the adapter; `auto` is measured as LoRA.
        method="lora" if spec.method == "auto" else spec.method,
        sequence_length=spec.training.sequence_length,
        packing=spec.training.packing,
        objective=spec.training.objective,
        metrics_port=settings.metrics_port,
        cache_max_bytes=settings.cache_max_bytes,
        keep_paths=list(keep_paths),
    )


def build_stage_in(
    job: FineTuneJob, settings: BuildSettings, keep_paths: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """The cache claim, the stage-in config and the stage-in Job: one CPU-only pod that
    fetches, checks and measures the model and data (`kubetune_trainer.stagein`).
    `keep_paths`: cache entries other jobs of the namespace read, which eviction keeps."""
    config = build_stage_in_config(job, settings, keep_paths)
    fetches = bool(fetched_sources(job, settings))
    # Only what is fetched needs the shared cache; a model read in place is checked and
    # measured with nothing kept.
    volumes: list[dict[str, Any]] = [
        cache_volume(settings, read_only=False)
        if fetches
        else {"name": "cache", "emptyDir": {"sizeLimit": settings.tmp_size}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "cache", "mountPath": CACHE_DIR}]
    claims, claim_mounts = claim_volumes(job, read_only_only=True)
    step = _step_job(
        job,
        settings,
        StepKind.STAGE_IN,
        config.model_dump(mode="json"),
        volumes + claims,
        mounts + claim_mounts,
        env=[
            {"name": "HF_HOME", "value": f"{CACHE_DIR}/.hf-home"},
            *token_env(job),
            *hub_env(settings),
            *s3_env(job),
        ],
    )
    if fetches and settings.cache_volume is None:
        return [build_cache_pvc(job, settings), *step]
    return step


# --------------------------------------------------------------------------- stage-out


def needs_stage_out(job: FineTuneJob) -> bool:
    """Whether the output goes to S3: a CPU-only stage-out step uploads it after training."""
    uri = job.spec.output.uri
    return uri is not None and parse_uri(uri).form is Form.S3


def build_stage_out_config(job: FineTuneJob) -> StageOutConfig:
    name, namespace, uid = metadata(job)
    assert job.spec.output.uri is not None
    return StageOutConfig(
        job=JobRef(name=name, namespace=namespace, uid=uid),
        source_dir=OUTPUT_DIR,
        destination=job.spec.output.uri,
    )


def build_stage_out(job: FineTuneJob, settings: BuildSettings) -> list[dict[str, Any]]:
    """The stage-out config and Job: one CPU-only pod that uploads the output the trainer
    wrote under `output/` on the checkpoint volume (mounted read-only) to the `s3://` URI
    (`kubetune_trainer.stageout`). The files stay on the volume."""
    name, _, _ = metadata(job)
    claim = child_names(name, 1).pvc
    volumes = [
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    ]
    mounts = [{"name": "checkpoints", "mountPath": CHECKPOINT_DIR, "readOnly": True}]
    config = build_stage_out_config(job).model_dump(mode="json")
    return _step_job(job, settings, StepKind.STAGE_OUT, config, volumes, mounts, env=s3_env(job))


# --------------------------------------------------------------------------- export

GGUF_DIR = "gguf"
"""The export writes `<output>/gguf/<job>-<quantization>.gguf`."""


def needs_export(job: FineTuneJob) -> bool:
    """Whether a CPU-only export step writes a GGUF file after training."""
    return job.spec.output.gguf is not None


def _output_dir(job: FineTuneJob) -> str:
    """Where the trainer writes the output inside its pods (and the export pod)."""
    out = output_location(job)
    return out.source if out is not None else OUTPUT_DIR


def gguf_file_name(job: FineTuneJob) -> str:
    gguf = job.spec.output.gguf
    assert gguf is not None
    return f"{metadata(job)[0]}-{gguf.quantization}.gguf"


def gguf_uri(job: FineTuneJob) -> str:
    """Where the GGUF file is, as a `pvc://` URI: under the claim spec.output.uri names, or
    under `output/` of the checkpoint claim."""
    tail = f"{GGUF_DIR}/{gguf_file_name(job)}"
    uri = job.spec.output.uri
    if uri is not None and output_location(job) is not None:
        return f"{uri.rstrip('/')}/{tail}"
    return pvc_uri(child_names(metadata(job)[0], 1).pvc, f"output/{tail}")


def build_export_config(job: FineTuneJob) -> ExportConfig:
    """The export of the whole model: `model/` of a full fine-tune, `merged/` of a LoRA or
    QLoRA run (the API requires mergeAdapter for those)."""
    name, namespace, uid = metadata(job)
    gguf = job.spec.output.gguf
    assert gguf is not None
    plan = job.status.plan if job.status is not None else None
    method = plan.method if plan is not None else job.spec.method
    if method != "full" and not job.spec.output.merge_adapter:
        raise SpecError(
            f"spec.output.gguf needs a whole model, and the plan's method {method} writes "
            "only an adapter. To fix: set spec.output.mergeAdapter: true"
        )
    out = _output_dir(job)
    return ExportConfig(
        job=JobRef(name=name, namespace=namespace, uid=uid),
        model_dir=f"{out}/{'model' if method == 'full' else 'merged'}",
        out_file=f"{out}/{GGUF_DIR}/{gguf_file_name(job)}",
        quantization=gguf.quantization,
        pre_tokenizer=gguf.pre_tokenizer,
    )


def build_export(job: FineTuneJob, settings: BuildSettings) -> list[dict[str, Any]]:
    """The export config and Job: one CPU-only pod that writes the GGUF file next to the
    output (`kubetune_trainer.export`), with the claim that holds the output mounted
    read-write: the checkpoint claim, or the one a `pvc://` output names."""
    name, _, _ = metadata(job)
    config = build_export_config(job).model_dump(mode="json")
    out = output_location(job)
    if out is not None and out.claim is not None:
        volume = dns_label(f"pvc-{out.claim}", 63)
        claim, mount_path = out.claim, f"{PVC_ROOT}/{out.claim}"
    else:
        volume, claim, mount_path = "checkpoints", child_names(name, 1).pvc, CHECKPOINT_DIR
    volumes = [{"name": volume, "persistentVolumeClaim": {"claimName": claim}}]
    mounts = [{"name": volume, "mountPath": mount_path}]
    resources = {"cpu": settings.export_cpu, "memory": settings.export_memory}
    # The converter reads only local files: no hub, and a cache in the pod's /tmp (the image's
    # HF_HOME is on the checkpoint claim, which a `pvc://` output's export does not mount).
    env = [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "HF_HOME", "value": "/tmp/hf"}]
    return _step_job(
        job, settings, StepKind.EXPORT, config, volumes, mounts, env=env, requests=resources
    )


# --------------------------------------------------------------------------- CPU steps


STEP_MODULES: dict[StepKind, str] = {
    StepKind.STAGE_IN: "kubetune_trainer.stagein",
    StepKind.EXPORT: "kubetune_trainer.export",
    StepKind.STAGE_OUT: "kubetune_trainer.stageout",
}
STEP_BACKOFF_LIMITS: dict[StepKind, int] = {
    StepKind.STAGE_IN: 2,
    StepKind.EXPORT: 2,
    StepKind.STAGE_OUT: 5,
}
"""Pods a step may fail transiently before it fails: Kubernetes waits 10 s, 20 s, 40 s, …
between them, so an upload rides out a store that is down for about ten minutes."""
STEP_CONFIG_KEY = "step.json"


def _step_container(
    job: FineTuneJob,
    settings: BuildSettings,
    kind: StepKind,
    mounts: list[dict[str, Any]],
    env: list[dict[str, Any]],
    requests: Mapping[str, str] | None,
) -> dict[str, Any]:
    return {
        "name": kind.value,
        "image": job.spec.trainer_image or settings.trainer_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["python", "-m", STEP_MODULES[kind]],
        "args": ["--config", f"{CONFIG_DIR}/{STEP_CONFIG_KEY}"],
        "env": [
            {"name": "HOME", "value": "/tmp"},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            *env,
        ],
        "resources": {
            "requests": dict(requests)
            if requests is not None
            else {"cpu": settings.stage_in_cpu, "memory": settings.stage_in_memory}
        },
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            *mounts,
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security(),
    }


def _step_pod_spec(
    settings: BuildSettings,
    step: str,
    container: dict[str, Any],
    volumes: list[dict[str, Any]],
) -> dict[str, Any]:
    """One pod, preferring nodes without a GPU (or where `stage_in_node_selector` and
    `stage_in_tolerations` say)."""
    no_gpu = {
        "weight": 100,
        "preference": {
            "matchExpressions": [
                {"key": GPU_PRESENT_LABEL, "operator": "NotIn", "values": ["true"]}
            ]
        },
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": pod_security(),
        "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [no_gpu]}},
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": step}},
            {"name": "tmp", "emptyDir": {"sizeLimit": settings.tmp_size}},
            *volumes,
        ],
    }
    if settings.stage_in_node_selector:
        pod_spec["nodeSelector"] = dict(settings.stage_in_node_selector)
    if settings.stage_in_tolerations:
        pod_spec["tolerations"] = [dict(t) for t in settings.stage_in_tolerations]
    return pod_spec


def _step_job(
    job: FineTuneJob,
    settings: BuildSettings,
    kind: StepKind,
    config: Mapping[str, Any],
    volumes: list[dict[str, Any]],
    mounts: list[dict[str, Any]],
    env: list[dict[str, Any]],
    requests: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """A step's ConfigMap and batch Job: one pod of the trainer image, no GPU asked for. A
    permanent failure (exit EXIT_CONFIG_ERROR) fails the Job at once; a transient one is
    retried up to STEP_BACKOFF_LIMITS."""
    name, _, _ = metadata(job)
    step = step_name(name, kind)
    step_labels = {**labels(job), LABEL_STEP: kind.value}
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {**object_meta(job, step), "labels": step_labels},
        "data": {STEP_CONFIG_KEY: json.dumps(dict(config), indent=2)},
    }
    container = _step_container(job, settings, kind, mounts, env, requests)
    fail_on_config_error = {
        "action": "FailJob",
        "onExitCodes": {
            "containerName": kind.value,
            "operator": "In",
            "values": [EXIT_CONFIG_ERROR],
        },
    }
    batch = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {**object_meta(job, step), "labels": step_labels},
        "spec": {
            "backoffLimit": STEP_BACKOFF_LIMITS[kind],
            "podReplacementPolicy": "Failed",
            "podFailurePolicy": {"rules": [fail_on_config_error]},
            "template": {
                "metadata": {"labels": step_labels},
                "spec": _step_pod_spec(settings, step, container, volumes),
            },
        },
    }
    return [config_map, batch]
