"""The volumes of a job: the checkpoint claim (its size and access mode), the namespace's
cache, the claims `pvc://` URIs name, and which of them the launch preflight checks.

The checkpoint claim is one per FineTuneJob and outlives attempts; the cache claim is one per
namespace and belongs to no job. `docs/trainer-pods.md` explains the choices for the people
who run the cluster.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kubetune.api.v1alpha1 import FineTuneJob, PlanStatus, StageInStatus
from kubetune.api.vocabulary import (
    ANNOTATION_JOB_UID,
    ANNOTATION_RETENTION,
    LABEL_MANAGED_BY,
    LABEL_NAME,
)
from kubetune.control.build.names import child_names, dns_label, metadata, object_meta
from kubetune.control.build.paths import PVC_ROOT
from kubetune.control.build.settings import BuildSettings
from kubetune_trainer.contract import GGUF_QUANTIZER_TYPES
from kubetune_trainer.uris import Form, parse_uri

_GIB = 1024**3
CACHE_CLAIM = "kubetune-cache"
"""The namespace's model and data cache: one claim shared by every job of the namespace,
written by stage-in pods, mounted read-only by trainer pods; no job owns it."""


# --------------------------------------------------------------------------- URIs


@dataclass(frozen=True)
class Location:
    kind: Literal["path", "hub", "s3", "https"]
    source: str
    claim: str | None = None
    revision: str | None = None


def locate(uri: str, *, split_revision: bool = False) -> Location:
    """Where a model/dataset/output URI is inside the trainer pod. `split_revision`: a hub
    id's `@<revision>` is the revision (models), not part of the id."""
    parsed = parse_uri(uri)
    if parsed.form is Form.PVC:
        claim, sub = parsed.claim, parsed.path
        path = f"{PVC_ROOT}/{claim}/{sub}" if sub else f"{PVC_ROOT}/{claim}"
        return Location("path", path, claim=claim)
    if parsed.form is Form.S3:
        return Location("s3", uri)
    if parsed.form in (Form.HTTPS, Form.HTTP):
        return Location("https", uri)
    if parsed.form is Form.PATH:
        return Location("path", uri)
    if parsed.is_hub and split_revision:
        assert parsed.hub_id is not None
        return Location("hub", parsed.hub_id, revision=parsed.revision)
    if parsed.is_hub:
        return Location("hub", parsed.path)
    # An `ftj://` model before the upstream's result replaces it (`reconcile.upstream.chained`)
    # counts as a hub model, as it always has: the stage-in decisions taken on the job before
    # it is chained (`reconcile.stages.may_create_stage_in`) see it so.
    return Location("hub", uri)


def output_location(job: FineTuneJob) -> Location | None:
    """Where a `pvc://` output is in the pods; None: the output goes to the checkpoint
    volume's `output/` (and from there to an `s3://` output)."""
    uri = job.spec.output.uri
    return locate(uri) if uri and parse_uri(uri).form is Form.PVC else None


@dataclass(frozen=True)
class InputRef:
    """An object in the job's namespace that its trainer pods need and the operator does not
    create: a claim a `pvc://` URI names, or the Secret holding the hub token. Checked before
    a launch (the launch preflight), so that a job whose inputs are missing never holds GPUs."""

    kind: Literal["PersistentVolumeClaim", "Secret"]
    name: str
    field: str
    """The spec field that names it (`spec.dataset.uri`)."""
    key: str | None = None
    """The Secret's key the trainer reads."""


def input_refs(job: FineTuneJob) -> list[InputRef]:
    """What the job's trainer pods mount or read from its namespace, in spec order."""
    spec = job.spec
    refs: list[InputRef] = []
    seen: set[str] = set()
    for field, uri in (
        ("spec.model.uri", spec.model.uri),
        ("spec.dataset.uri", spec.dataset.uri),
        ("spec.output.uri", spec.output.uri),
    ):
        claim = locate(uri).claim if uri else None
        if claim is not None and claim not in seen:
            seen.add(claim)
            refs.append(InputRef("PersistentVolumeClaim", claim, field))
    token = spec.model.token_secret_ref
    if token is not None:
        refs.append(InputRef("Secret", token.name, "spec.model.tokenSecretRef", token.key))
    if spec.s3 is not None and spec.s3.credentials_secret is not None:
        secret = spec.s3.credentials_secret
        refs.append(InputRef("Secret", secret, "spec.s3.credentialsSecret", "AWS_ACCESS_KEY_ID"))
    return refs


def _pvc_claims(job: FineTuneJob) -> dict[str, bool]:
    """Claims named by `pvc://` URIs → read-only (only model/dataset read from them)."""
    claims: dict[str, bool] = {}
    for uri in (job.spec.model.uri, job.spec.dataset.uri):
        loc = locate(uri)
        if loc.claim is not None:
            claims.setdefault(loc.claim, True)
    out = output_location(job)
    if out is not None and out.claim is not None:
        claims[out.claim] = False
    return claims


# --------------------------------------------------------------------------- checkpoint volume


def checkpoint_size(job: FineTuneJob, plan: PlanStatus) -> str:
    """Requested size of the checkpoint volume.

    Estimate (bytes), rounded up to whole GiB, at least 1Gi:

    - checkpoints: `keep + 1` of them exist while the newest is written and before the
      oldest is pruned (`keep + 2` with early stopping: the best step's is never pruned).
      Full fine-tuning stores weights plus two Adam moments, taken as
      12 B/param (fp32 weights and moments, the `amp-bf16`/`fp32` layout; `bf16` and 8-bit
      optimizers need less). LoRA/QLoRA store only adapters: 16 B per trainable param
      (fp32 adapter, two fp32 moments, gradient-scaler/RNG slack).
    - final model: 2 B/param (bf16) when the result is a whole model (full fine-tuning,
      or `mergeAdapter`) and it is written to this volume (output is not `pvc://`).
    - hub cache: `HF_HOME` lives on this volume so relaunches do not download again, so
      a hub model adds its bf16 weights, 2 B/param.
    - GGUF (`output.gguf`, output not `pvc://`): the file, 4/2/1 B/param for f32, f16 or
      bf16, and q8_0 or smaller; a quantized type adds its f16 intermediate, 2 B/param, which
      exists beside it while the export runs.
    - 1 GiB headroom: adapters, tokenizer, metrics log, small hub datasets.
    """
    storage = job.spec.checkpoint.storage
    if storage.size:
        return storage.size
    copies = job.spec.checkpoint.keep + 1
    if job.spec.training.early_stopping is not None:
        copies += 1
    if plan.method == "full":
        total = copies * 12 * plan.model_params
    else:
        total = copies * 16 * plan.trainable_params
    whole_model_output = plan.method == "full" or job.spec.output.merge_adapter
    if whole_model_output and output_location(job) is None:
        total += 2 * plan.model_params
    if locate(job.spec.model.uri).kind == "hub" and staged_in(job) is None:
        total += 2 * plan.model_params
    gguf = job.spec.output.gguf
    if gguf is not None and output_location(job) is None:
        per_param = {"f32": 4, "f16": 2, "bf16": 2}.get(gguf.quantization, 1)
        if gguf.quantization in GGUF_QUANTIZER_TYPES:
            per_param += 2
        total += per_param * plan.model_params
    total += _GIB
    return f"{max(1, math.ceil(total / _GIB))}Gi"


READ_WRITE_MANY = "ReadWriteMany"


def access_mode(job: FineTuneJob, plan: PlanStatus, settings: BuildSettings) -> str:
    """The checkpoint volume's access mode: the job's, or with `auto` ReadWriteMany where the
    operator's class offers it (so that a later re-plan may span nodes), else ReadWriteOnce.
    A plan over several nodes gets ReadWriteMany whatever the setting (a plan made before
    plans were held to one node)."""
    mode = job.spec.checkpoint.storage.access_mode
    if mode != "auto":
        return mode
    if settings.checkpoint_read_write_many or plan.nodes > 1:
        return READ_WRITE_MANY
    return "ReadWriteOnce"


@dataclass(frozen=True)
class SingleNode:
    """Why a job's layouts may not span nodes, and what to change (`PlannerSettings`)."""

    reason: str
    fix: str


def single_node(
    job: FineTuneJob, settings: BuildSettings, claim_modes: Sequence[str] | None
) -> SingleNode | None:
    """Whether the job's checkpoint volume can follow a layout over several nodes.

    Every pod of an attempt mounts the one checkpoint volume, created with the first
    attempt and never changed: once it exists its access modes (`claim_modes`) decide;
    before, the mode it will be created with (`access_mode` with a one-node plan). None:
    layouts may span nodes.
    """
    if claim_modes is not None:
        if READ_WRITE_MANY in claim_modes:
            return None
        pvc = child_names(metadata(job)[0], 1).pvc
        return SingleNode(
            f"its checkpoint volume {pvc} is {', '.join(claim_modes) or 'of no access mode'} "
            "(made with the first attempt; the mode of a claim cannot change)",
            "fit the job on one node (method qlora, a shorter training.sequenceLength), or run "
            "it again under a new name with spec.checkpoint.storage.accessMode ReadWriteMany "
            "on a StorageClass that offers it",
        )
    mode = job.spec.checkpoint.storage.access_mode
    if mode == READ_WRITE_MANY or (mode == "auto" and settings.checkpoint_read_write_many):
        return None
    if mode != "auto":
        return SingleNode(
            f"spec.checkpoint.storage.accessMode is {mode}",
            "set spec.checkpoint.storage.accessMode to ReadWriteMany (its StorageClass must "
            "offer it) so that the job may span nodes",
        )
    return SingleNode(
        "its checkpoint volume would be ReadWriteOnce (the operator is not told that the "
        "checkpoint StorageClass offers ReadWriteMany)",
        "if the checkpoint StorageClass offers ReadWriteMany, set the Helm value "
        "operator.checkpointReadWriteMany=true (KUBETUNE_CHECKPOINT_READ_WRITE_MANY; "
        "`kubetune plan --read-write-many`), or set spec.checkpoint.storage.accessMode "
        "ReadWriteMany on a class that offers it",
    )


def build_checkpoint_pvc(
    job: FineTuneJob, plan: PlanStatus, settings: BuildSettings
) -> dict[str, Any]:
    """The checkpoint volume.

    With retention `retain` it carries no owner reference, so deleting the FineTuneJob
    leaves it (and the checkpoints) behind; with `delete` garbage collection removes it
    with the job.
    """
    name, _, uid = metadata(job)
    storage = job.spec.checkpoint.storage
    meta = object_meta(
        job,
        child_names(name, 1).pvc,
        owned=storage.retention == "delete",
        annotations={ANNOTATION_RETENTION: storage.retention, ANNOTATION_JOB_UID: uid},
    )
    spec: dict[str, Any] = {
        "accessModes": [access_mode(job, plan, settings)],
        "resources": {"requests": {"storage": checkpoint_size(job, plan)}},
        "volumeMode": "Filesystem",
    }
    storage_class = storage.storage_class_name or settings.checkpoint_storage_class
    if storage_class:
        spec["storageClassName"] = storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}


# --------------------------------------------------------------------------- cache


def build_cache_pvc(job: FineTuneJob, settings: BuildSettings) -> dict[str, Any]:
    """The namespace's cache claim, created by the first job that needs it and owned by
    none (deleting a job never deletes the cache)."""
    _, namespace, _ = metadata(job)
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": settings.cache_size}},
    }
    storage_class = settings.cache_storage_class or settings.checkpoint_storage_class
    if storage_class:
        spec["storageClassName"] = storage_class
    meta = {
        "name": CACHE_CLAIM,
        "namespace": namespace,
        "labels": {LABEL_MANAGED_BY: "kubetune", LABEL_NAME: "kubetune-cache"},
    }
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}


def cache_volume(settings: BuildSettings, *, read_only: bool) -> dict[str, Any]:
    """The cache as a pod volume named `cache`: the namespace's claim, or the cluster-wide
    volume source `cache_volume` names (the same storage in every namespace)."""
    if settings.cache_volume is not None:
        return {"name": "cache", **json.loads(json.dumps(dict(settings.cache_volume)))}
    claim: dict[str, Any] = {"claimName": CACHE_CLAIM}
    if read_only:
        claim["readOnly"] = True
    return {"name": "cache", "persistentVolumeClaim": claim}


# --------------------------------------------------------------------------- pod volumes


def claim_volumes(
    job: FineTuneJob, *, read_only_only: bool = False
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) for the claims `pvc://` URIs name, at `/mnt/pvc/<claim>`; read-only
    where only read. `read_only_only`: leave out the claim the output is written to."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for claim, read_only in sorted(_pvc_claims(job).items()):
        if read_only_only and not read_only:
            continue
        volume_name = dns_label(f"pvc-{claim}", 63)
        source: dict[str, Any] = {"claimName": claim}
        mount: dict[str, Any] = {"name": volume_name, "mountPath": f"{PVC_ROOT}/{claim}"}
        if read_only:
            source["readOnly"] = True
            mount["readOnly"] = True
        volumes.append({"name": volume_name, "persistentVolumeClaim": source})
        mounts.append(mount)
    return volumes, mounts


def staged_in(job: FineTuneJob) -> StageInStatus | None:
    """What the stage-in step staged for this job, once it has."""
    staged = job.status.stage_in if job.status is not None else None
    return staged if staged is not None and staged.model_path is not None else None
