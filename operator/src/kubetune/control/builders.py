"""Manifests for one training attempt, as plain dicts (pure: no cluster, no kopf).

A FineTuneJob owns five children, applied in this order:

1. the checkpoint PersistentVolumeClaim (one per FineTuneJob, it outlives attempts),
2. a ConfigMap with the trainer's `config.json` (one per attempt: a re-plan changes it),
3. a headless Service that gives the trainer pods stable DNS names for rendezvous
   (one per FineTuneJob),
4. a NetworkPolicy that admits to the trainer pods only their own job's pods, and on the
   metrics port the operator and the metrics scrapers (one per FineTuneJob; left out when
   the `network_policy` setting is off),
5. an Indexed `batch/v1` Job with one pod per node that runs `torchrun` (one per attempt).

Names are deterministic so that re-running a handler finds what an earlier run created.
An *attempt* is one launch of the batch Job: it starts at 1 and increases on every
relaunch (after a failure, after an out-of-memory re-plan, on resume after suspend), so a
new attempt never collides with a Job that is still terminating.

`docs/trainer-pods.md` explains every choice made here for the people who run the cluster.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from kubetune.api.errors import SpecError
from kubetune.api.units import quantity_value
from kubetune.api.v1alpha1 import API_VERSION, FineTuneJob, GPUPool, PlanStatus, StageInStatus
from kubetune.api.vocabulary import StepKind
from kubetune.control.pods import TRAINER_CONTAINER
from kubetune_trainer.contract import (
    EXIT_CHECKPOINT_FAILED,
    EXIT_CONFIG_ERROR,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    GGUF_QUANTIZER_TYPES,
    CheckpointConfig,
    DatasetRef,
    DpoConfig,
    EarlyStoppingConfig,
    ExportConfig,
    FaultInjection,
    InjectableOomPhase,
    JobRef,
    LoraConfig,
    MetricsConfig,
    ModelRef,
    OutputConfig,
    ParallelConfig,
    StageInConfig,
    StageOutConfig,
    TrainerConfig,
    TrainingConfig,
)

GIB = 1024**3

CONTAINER_NAME = TRAINER_CONTAINER  # the one pods.py reads statuses of
CONFIG_DIR = "/etc/kubetune"
CONFIG_KEY = "config.json"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
CHECKPOINT_DIR = "/checkpoints"
OUTPUT_DIR = f"{CHECKPOINT_DIR}/output"
TRAIN_LOG = f"{CHECKPOINT_DIR}/train-log.jsonl"
"""The trainer's JSON-lines record of every step, checkpoint and restart, on the volume so
that it survives pods and attempts (docs/trainer.md describes the records)."""
HF_HOME = f"{CHECKPOINT_DIR}/.hf-cache"
PVC_ROOT = "/mnt/pvc"
CACHE_CLAIM = "kubetune-cache"
"""The namespace's model and data cache: one claim shared by every job of the namespace,
written by stage-in pods, mounted read-only by trainer pods; no job owns it."""
CACHE_DIR = "/cache"
LABEL_STEP = "kubetune.io/step"
"""A `StepKind` on a CPU step's Job and pod (trainer pods carry `kubetune.io/attempt`)."""
TOKEN_ENV = "HF_TOKEN"
GPU_RESOURCE = "nvidia.com/gpu"
RUN_AS_ID = 1000

LABEL_NAME = "app.kubernetes.io/name"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_JOB = "kubetune.io/job"
LABEL_ATTEMPT = "kubetune.io/attempt"
ANNOTATION_RETENTION = "kubetune.io/retention"
ANNOTATION_JOB_UID = "kubetune.io/job-uid"
ANNOTATION_PLAN_REVISION = "kubetune.io/plan-revision"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
ANNOTATION_TEST_FAULTS = "kubetune.io/test-faults"
"""Test-only fault injection, e.g. `{"oomAtStep": 6, "attempts": [1]}`: the trainer of the
listed attempts (all when omitted) fails as if out of GPU memory before that step. The e2e
tests use it to exercise OOM recovery without a GPU; never set it on real work."""

# Budget for the shared part of every child name. The longest name derived from it is the
# pod hostname of an Indexed Job, `<base>-a<attempt>-<index>`, which must be a DNS label
# (≤ 63): this leaves room for five attempt digits and four index digits.
_MAX_BASE = 63 - len("-a99999") - len("-9999")
_HASH_LEN = 6
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class BuildSettings:
    """Operator-wide knobs for the children (Helm values / CLI flags)."""

    trainer_image: str = "kubetune/trainer:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    checkpoint_storage_class: str | None = None
    """StorageClass for checkpoint volumes when the job names none (cluster default if unset)."""
    checkpoint_read_write_many: bool = False
    """The checkpoint StorageClass offers ReadWriteMany: jobs with access mode `auto` get a
    ReadWriteMany volume from the start and may span nodes; off, theirs is ReadWriteOnce and
    their plans stay on one node."""
    termination_grace_seconds: int = 120
    """Time the trainer gets after SIGTERM to finish its emergency checkpoint."""
    metrics_port: int = 9400
    rendezvous_port: int = 29400
    backoff_limit: int = 3
    network_policy: bool = True
    """Create a NetworkPolicy with each job's children (`build_network_policy`)."""
    operator_namespace: str | None = None
    """Namespace of the operator's pods, which scrape the trainers' metrics port; None (the
    operator runs outside the cluster): the NetworkPolicy names no operator peer."""
    operator_pod_labels: tuple[tuple[str, str], ...] = ()
    """Labels that select the operator's pods in `operator_namespace`."""
    metrics_from: tuple[dict[str, Any], ...] = (
        {"namespaceSelector": {"matchLabels": {"kubetune.io/metrics-scraper": "true"}}},
    )
    """NetworkPolicyPeers (podSelector / namespaceSelector / ipBlock) besides the operator
    that may reach the trainers' metrics port, e.g. Prometheus; empty: none."""
    shm_size: str = "8Gi"
    """Size of the memory-backed /dev/shm (NCCL and data loader workers use it)."""
    tmp_size: str = "10Gi"
    """Size limit of the /tmp emptyDir (the root filesystem is read-only)."""
    cpu_per_gpu: str = "4"
    """CPU request per GPU of the pod."""
    memory_per_gpu: str = "16Gi"
    """Host memory per GPU of the pod, before what the plan adds (`host_memory_gib`)."""
    memory_limit: bool = True
    """Give the trainer container a memory limit equal to its request; off: a request only."""
    launcher: tuple[str, ...] = ("python", "-m", "kubetune_trainer.launch")
    """Container command; it receives torchrun's arguments. The trainer's launcher runs
    torchrun in-process and exits with the workers' contract code (torchrun alone exits 1
    for every worker failure, which would hide OOM and preemption from podFailurePolicy); one
    worker on one node runs in the launcher's own process, without torchrun."""
    rendezvous_join_timeout_seconds: int = 1800
    """How long the first pod waits for its peers to be scheduled before giving up."""
    allow_test_faults: bool = False
    """Obey the `kubetune.io/test-faults` annotation (test clusters only): off, it is ignored."""
    cache_size: str = "200Gi"
    """Size of a namespace's model and data cache claim (`kubetune-cache`) when created."""
    cache_storage_class: str | None = None
    """StorageClass of the cache claim (it must offer ReadWriteMany where trainer pods of
    several nodes read it); unset: the checkpoint StorageClass, else the cluster default."""
    stage_in_cpu: str = "2"
    stage_in_memory: str = "8Gi"
    """CPU and memory requests of a stage-in or stage-out pod (it downloads and tokenizes the
    data, or hashes and uploads the output)."""
    export_cpu: str = "4"
    export_memory: str = "16Gi"
    """CPU and memory requests of an export pod. llama.cpp's converter reads the model
    lazily, one tensor at a time through the page cache, so it needs a few GiB beyond the
    largest tensor, not the whole model; the quantizer uses every CPU it gets."""
    stage_in_node_selector: tuple[tuple[str, str], ...] = ()
    stage_in_tolerations: tuple[dict[str, Any], ...] = ()
    """Where stage-in pods may run: by default any node, preferring ones without a GPU; a
    cluster whose only nodes are tainted GPU nodes gives the tolerations."""
    stage_in_hub: bool = True
    """Fetch hub models and datasets in the stage-in step (into the shared cache) rather
    than in the trainer pods; off: rank 0 of the trainer downloads them, as GPUs wait."""
    hub_endpoint: str | None = None
    """HF_ENDPOINT of stage-in and trainer pods (a hub mirror); unset: huggingface.co."""
    cache_max_bytes: int | None = None
    """Evict least-recently-used cache entries above this many bytes (stage-in step)."""
    cache_volume: Mapping[str, Any] | None = None
    """A pod volume source (`{"csi": {...}}`, `{"nfs": {...}}`) every namespace's stage-in and
    trainer pods mount as the cache instead of a claim of their own: one cache for the
    cluster. None: a claim `kubetune-cache` per namespace."""


@dataclass(frozen=True)
class ChildNames:
    pvc: str
    config_map: str
    service: str
    network_policy: str
    job: str


# --------------------------------------------------------------------------- names & metadata


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:_HASH_LEN]


def _dns_label(text: str, max_len: int) -> str:
    """`text` when it is a DNS-1035 label (letter first) of at most `max_len` characters.

    Anything else (too long, dots, a leading digit) is cleaned, cut, and gets a hash of the
    original appended, which keeps the result stable and keeps `a.b` and `a-b` apart.
    """
    cleaned = re.sub(r"[^a-z0-9-]", "-", text.lower()).strip("-")
    if not cleaned[:1].isalpha():
        cleaned = f"ftj-{cleaned}".rstrip("-")
    if cleaned == text and len(cleaned) <= max_len:
        return cleaned
    head = cleaned[: max_len - _HASH_LEN - 1].rstrip("-")
    return f"{head}-{_short_hash(text)}"


def _base_name(job_name: str) -> str:
    # FineTuneJob names are DNS subdomains (up to 253 characters, dots, a digit may come
    # first); Service names and pod hostnames must be DNS labels.
    if not job_name:
        raise ValueError("the FineTuneJob has no metadata.name")
    return _dns_label(job_name, _MAX_BASE)


def label_value(name: str) -> str:
    # Object names are valid label values up to 63 characters; longer ones are shortened
    # the same way as child names.
    return name if len(name) <= 63 else _base_name(name)


def child_names(job_name: str, attempt: int) -> ChildNames:
    """Names of the children of one FineTuneJob for one attempt (deterministic)."""
    if attempt < 1:
        raise ValueError(f"attempt must be 1 or more, got {attempt}")
    base = _base_name(job_name)
    names = ChildNames(
        pvc=f"{base}-ckpt",
        config_map=f"{base}-a{attempt}",
        service=base,
        network_policy=base,
        job=f"{base}-a{attempt}",
    )
    for name in (names.pvc, names.config_map, names.service, names.network_policy, names.job):
        if len(name) > 63 or not _DNS_LABEL.match(name):
            raise ValueError(f"child name {name!r} of {job_name!r} is not a DNS label")
    return names


def _metadata(job: FineTuneJob) -> tuple[str, str, str]:
    name = str(job.metadata.get("name") or "")
    if not name:
        raise ValueError("the FineTuneJob has no metadata.name")
    namespace = str(job.metadata.get("namespace") or "default")
    uid = str(job.metadata.get("uid") or "")
    return name, namespace, uid


def owner_reference(job: FineTuneJob) -> dict[str, Any]:
    """The controller reference that lets garbage collection delete a child with its job."""
    name, _, uid = _metadata(job)
    return {
        "apiVersion": API_VERSION,
        "kind": job.kind,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def labels(job: FineTuneJob, attempt: int | None = None) -> dict[str, str]:
    name, _, _ = _metadata(job)
    value = label_value(name)
    result = {
        LABEL_NAME: "kubetune-trainer",
        LABEL_MANAGED_BY: "kubetune",
        LABEL_INSTANCE: value,
        LABEL_JOB: value,
    }
    if attempt is not None:
        result[LABEL_ATTEMPT] = str(attempt)
    return result


def _object_meta(
    job: FineTuneJob,
    name: str,
    *,
    attempt: int | None = None,
    owned: bool = True,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    _, namespace, _ = _metadata(job)
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": labels(job, attempt),
    }
    if annotations:
        meta["annotations"] = annotations
    if owned:
        meta["ownerReferences"] = [owner_reference(job)]
    return meta


# --------------------------------------------------------------------------- URIs


@dataclass(frozen=True)
class _Location:
    kind: Literal["path", "hub", "s3", "https"]
    source: str
    claim: str | None = None
    revision: str | None = None


def _locate(uri: str, *, split_revision: bool = False) -> _Location:
    """Where a model/dataset/output URI is inside the trainer pod."""
    if uri.startswith("pvc://"):
        claim, _, sub = uri[len("pvc://") :].partition("/")
        sub = sub.strip("/")
        path = f"{PVC_ROOT}/{claim}/{sub}" if sub else f"{PVC_ROOT}/{claim}"
        return _Location("path", path, claim=claim)
    if uri.startswith("s3://"):
        return _Location("s3", uri)
    if uri.startswith(("https://", "http://")):
        return _Location("https", uri)
    if uri.startswith("/"):
        return _Location("path", uri)
    hub_id = uri[len("hf://") :] if uri.startswith("hf://") else uri
    hub_id = hub_id.strip("/")
    revision = None
    if split_revision and "@" in hub_id:
        hub_id, _, rev = hub_id.partition("@")
        revision = rev or None
    return _Location("hub", hub_id, revision=revision)


def _output_location(job: FineTuneJob) -> _Location | None:
    uri = job.spec.output.uri
    return _locate(uri) if uri and uri.startswith("pvc://") else None


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
        claim = _locate(uri).claim if uri and uri.startswith("pvc://") else None
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
        loc = _locate(uri)
        if loc.claim is not None:
            claims.setdefault(loc.claim, True)
    out = _output_location(job)
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
    if whole_model_output and _output_location(job) is None:
        total += 2 * plan.model_params
    if _locate(job.spec.model.uri).kind == "hub" and _staged(job) is None:
        total += 2 * plan.model_params
    gguf = job.spec.output.gguf
    if gguf is not None and _output_location(job) is None:
        per_param = {"f32": 4, "f16": 2, "bf16": 2}.get(gguf.quantization, 1)
        if gguf.quantization in GGUF_QUANTIZER_TYPES:
            per_param += 2
        total += per_param * plan.model_params
    total += GIB
    return f"{max(1, math.ceil(total / GIB))}Gi"


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
        pvc = child_names(_metadata(job)[0], 1).pvc
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
    name, _, uid = _metadata(job)
    storage = job.spec.checkpoint.storage
    meta = _object_meta(
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


# --------------------------------------------------------------------------- trainer config


def build_trainer_config(
    job: FineTuneJob, plan: PlanStatus, settings: BuildSettings, attempt: int
) -> TrainerConfig:
    """The contract the trainer reads: the job's spec with the plan's choices filled in."""
    name, namespace, uid = _metadata(job)
    spec = job.spec
    model_loc = _locate(spec.model.uri, split_revision=True)
    dataset_loc = _locate(spec.dataset.uri)
    staged = _staged(job)
    if staged is not None:  # the stage-in step put them in the cache (or read them in place)
        model_loc = _Location("path", str(staged.model_path))
        dataset_loc = _Location("path", str(staged.dataset_path or dataset_loc.source))
    output_loc = _output_location(job)
    lora = None
    if plan.method != "full":
        settings_lora = spec.lora_or_default
        lora = LoraConfig(
            rank=settings_lora.rank,
            alpha=settings_lora.alpha,
            dropout=settings_lora.dropout,
            target_modules=list(settings_lora.target_modules),
            double_quant=settings_lora.double_quant,
        )
    training = spec.training
    model, dataset = _source_refs(job, model_loc, dataset_loc)
    return TrainerConfig(
        job=JobRef(name=name, namespace=namespace, uid=uid),
        method=plan.method,
        model=model,
        dataset=dataset,
        lora=lora,
        training=TrainingConfig(
            epochs=training.epochs,
            max_steps=training.max_steps,
            total_steps=plan.total_steps,
            learning_rate=training.learning_rate,
            warmup_ratio=training.warmup_ratio,
            weight_decay=training.weight_decay,
            sequence_length=training.sequence_length,
            global_batch_size=training.global_batch_size,
            micro_batch_size=plan.micro_batch_size,
            gradient_accumulation=plan.gradient_accumulation,
            packing=training.packing,
            gradient_checkpointing=plan.gradient_checkpointing,
            precision=plan.precision,
            optimizer=plan.optimizer,
            chunked_cross_entropy=bool(plan.chunked_cross_entropy),
            fused_cross_entropy=bool(plan.fused_cross_entropy),
            activation_offloading=bool(plan.activation_offloading),
            optimizer_in_backward=bool(plan.optimizer_in_backward),
            seed=training.seed,
            objective=training.objective,
            dpo=DpoConfig(
                beta=dpo.beta if (dpo := training.dpo) else DpoConfig().beta,
                label_smoothing=dpo.label_smoothing if dpo else DpoConfig().label_smoothing,
            ),
            early_stopping=(
                EarlyStoppingConfig(**es.effective())
                if (es := training.early_stopping) is not None
                else None
            ),
        ),
        parallel=ParallelConfig(
            nodes=plan.nodes, gpus_per_node=plan.gpus_per_node, sharding=plan.sharding
        ),
        checkpoint=CheckpointConfig(
            dir=CHECKPOINT_DIR,
            interval_steps=spec.checkpoint.interval_steps,
            interval_minutes=spec.checkpoint.interval_minutes,
            keep=spec.checkpoint.keep,
            resume_from_uid=spec.checkpoint.resume_from_uid,
        ),
        output=OutputConfig(
            dir=output_loc.source if output_loc is not None else OUTPUT_DIR,
            merge_adapter=spec.output.merge_adapter,
        ),
        metrics=MetricsConfig(port=settings.metrics_port, log_path=TRAIN_LOG),
        faults=fault_injection(job, attempt) if settings.allow_test_faults else FaultInjection(),
    )


_STEP_FAULTS = {
    "oomAtStep": "oom_at_step",
    "hangAtStep": "hang_at_step",
    "killAtStep": "kill_at_step",
    "diskFullAtStep": "disk_full_at_step",
    "hostMemoryAtStep": "host_memory_at_step",
}
_OOM_PHASES: tuple[str, ...] = get_args(InjectableOomPhase)


def fault_injection(job: FineTuneJob, attempt: int) -> FaultInjection:
    """The fault injection the `kubetune.io/test-faults` annotation asks of this attempt."""
    annotations = job.metadata.get("annotations") or {}
    raw = annotations.get(ANNOTATION_TEST_FAULTS)
    if not raw:
        return FaultInjection()
    how = (
        'expected a JSON object such as {"oomAtStep": 6, "attempts": [1]} or '
        '{"stepSeconds": 0.3}: oomAtStep, hangAtStep, killAtStep (with killRank, default 0), '
        "diskFullAtStep or hostMemoryAtStep a step >= 1, oomInPhase one of "
        f"{', '.join(_OOM_PHASES)}, attempts a list of attempt numbers (default: every "
        "attempt), stepSeconds a least time per step in (0, 60]"
    )
    try:
        spec = json.loads(raw)
    except ValueError as exc:
        raise SpecError(f"annotation {ANNOTATION_TEST_FAULTS} is not JSON ({exc})", how) from None
    known = {*_STEP_FAULTS, "oomInPhase", "killRank", "attempts", "stepSeconds"}
    if not isinstance(spec, dict) or set(spec) - known:
        raise SpecError(f"annotation {ANNOTATION_TEST_FAULTS}={raw!r} is not understood", how)
    steps = {field: spec.get(key) for key, field in _STEP_FAULTS.items()}
    attempts, seconds = spec.get("attempts"), spec.get("stepSeconds")
    phase, rank = spec.get("oomInPhase"), spec.get("killRank", 0)
    # JSON numbers arrive as int or float; true/false are bools, which isinstance calls ints.
    step_ok = all(s is None or (type(s) is int and s >= 1) for s in steps.values())
    seconds_ok = seconds is None or (type(seconds) in (int, float) and 0 < seconds <= 60)
    attempts_ok = attempts is None or (
        isinstance(attempts, list) and all(isinstance(a, int) for a in attempts)
    )
    other_ok = (phase is None or phase in _OOM_PHASES) and type(rank) is int and rank >= 0
    asks = [*steps.values(), seconds, phase]
    if not (step_ok and seconds_ok and attempts_ok and other_ok) or all(a is None for a in asks):
        raise SpecError(f"annotation {ANNOTATION_TEST_FAULTS}={raw!r} is not understood", how)
    if attempts is not None and attempt not in attempts:
        return FaultInjection()
    return FaultInjection(
        **steps,
        oom_in_phase=phase,
        kill_rank=rank,
        min_step_seconds=None if seconds is None else float(seconds),
    )


def build_config_map(
    job: FineTuneJob, plan: PlanStatus, settings: BuildSettings, attempt: int
) -> dict[str, Any]:
    name, _, _ = _metadata(job)
    config = build_trainer_config(job, plan, settings, attempt)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _object_meta(
            job,
            child_names(name, attempt).config_map,
            attempt=attempt,
            annotations={ANNOTATION_PLAN_REVISION: str(plan.revision)},
        ),
        "data": {CONFIG_KEY: config.to_json()},
    }


# --------------------------------------------------------------------------- service


def build_headless_service(job: FineTuneJob, settings: BuildSettings) -> dict[str, Any]:
    """DNS for `<job>-<index>.<service>`, published before pods are ready (rendezvous)."""
    name, _, _ = _metadata(job)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _object_meta(job, child_names(name, 1).service),
        "spec": {
            "clusterIP": "None",
            "selector": {LABEL_JOB: label_value(name)},
            "publishNotReadyAddresses": True,
            "ports": [
                {
                    "name": "rendezvous",
                    "port": settings.rendezvous_port,
                    "targetPort": settings.rendezvous_port,
                    "protocol": "TCP",
                },
                {
                    "name": "metrics",
                    "port": settings.metrics_port,
                    "targetPort": settings.metrics_port,
                    "protocol": "TCP",
                },
            ],
        },
    }


# --------------------------------------------------------------------------- network policy

METRICS_SCRAPER_LABEL = "kubetune.io/metrics-scraper"
"""The namespace label the default `metrics_from` admits (value `"true"`)."""
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
"""The label Kubernetes puts on every namespace, its name: selects one namespace by name."""


def build_network_policy(job: FineTuneJob, settings: BuildSettings) -> dict[str, Any]:
    """Ingress of the job's trainer pods (every attempt's): from pods of the same job on any
    port (the rendezvous port and the ephemeral ports of NCCL/gloo collectives), and on the
    metrics port from the operator's pods and the `metrics_from` peers. Everything else is
    refused where the CNI enforces NetworkPolicies. Egress is left open: trainers download
    models and data (hub, S3) and resolve names; see docs/trainer-pods.md."""
    name, _, _ = _metadata(job)
    same_job = {"podSelector": {"matchLabels": {LABEL_JOB: label_value(name)}}}
    scrapers: list[dict[str, Any]] = []
    if settings.operator_namespace:
        scrapers.append(
            {
                "namespaceSelector": {
                    "matchLabels": {NAMESPACE_NAME_LABEL: settings.operator_namespace}
                },
                "podSelector": {"matchLabels": dict(settings.operator_pod_labels)},
            }
        )
    scrapers.extend(json.loads(json.dumps(peer)) for peer in settings.metrics_from)
    ingress: list[dict[str, Any]] = [{"from": [same_job]}]
    if scrapers:
        ingress.append(
            {
                "from": scrapers,
                "ports": [{"protocol": "TCP", "port": settings.metrics_port}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _object_meta(job, child_names(name, 1).network_policy),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_JOB: label_value(name)}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


# --------------------------------------------------------------------------- batch Job


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


def _torchrun_args(
    job: FineTuneJob, plan: PlanStatus, settings: BuildSettings, attempt: int
) -> list[str]:
    name, _, uid = _metadata(job)
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


SHUTDOWN_MARGIN_SECONDS = 10
"""How much sooner than the kubelet the trainer's launcher gives up on its workers."""
MIN_SHUTDOWN_SECONDS = 5


def launcher_shutdown_seconds(termination_grace_seconds: int) -> int:
    """How long the launcher (torchrun) waits after SIGTERM for its workers to checkpoint
    before it kills them: the pod's grace period less a margin of 10 s, at least 5 s. The
    launcher then still has time to collect the workers' exit codes and exit with them
    before the kubelet's SIGKILL ends the pod (which would leave exit code 137)."""
    return max(MIN_SHUTDOWN_SECONDS, termination_grace_seconds - SHUTDOWN_MARGIN_SECONDS)


def _env(job: FineTuneJob, attempt: int, settings: BuildSettings) -> list[dict[str, Any]]:
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
    return env + _token_env(job) + _hub_env(settings)


def _token_env(job: FineTuneJob) -> list[dict[str, Any]]:
    """`HF_TOKEN` from the Secret spec.model.tokenSecretRef names, if any."""
    token = job.spec.model.token_secret_ref
    if token is None:
        return []
    ref = {"name": token.name, "key": token.key}
    return [{"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": ref}}]


def _claim_volumes(
    job: FineTuneJob, *, read_only_only: bool = False
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) for the claims `pvc://` URIs name, at `/mnt/pvc/<claim>`; read-only
    where only read. `read_only_only`: leave out the claim the output is written to."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for claim, read_only in sorted(_pvc_claims(job).items()):
        if read_only_only and not read_only:
            continue
        volume_name = _dns_label(f"pvc-{claim}", 63)
        source: dict[str, Any] = {"claimName": claim}
        mount: dict[str, Any] = {"name": volume_name, "mountPath": f"{PVC_ROOT}/{claim}"}
        if read_only:
            source["readOnly"] = True
            mount["readOnly"] = True
        volumes.append({"name": volume_name, "persistentVolumeClaim": source})
        mounts.append(mount)
    return volumes, mounts


def _pod_security() -> dict[str, Any]:
    """The pod security context of trainer and stage-in pods (Pod Security `restricted`)."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_ID,
        "runAsGroup": RUN_AS_ID,
        "fsGroup": RUN_AS_ID,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security() -> dict[str, Any]:
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
            # a requested stop must not be retried.
            on_exit([EXIT_CONFIG_ERROR, EXIT_STOPPED, EXIT_CHECKPOINT_FAILED], "FailJob"),
        ]
    }


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


def build_indexed_job(
    job: FineTuneJob,
    plan: PlanStatus,
    pool: GPUPool,
    settings: BuildSettings,
    attempt: int,
) -> dict[str, Any]:
    """The Indexed batch Job: one pod per node, `torchrun` inside."""
    name, _, _ = _metadata(job)
    names = child_names(name, attempt)

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
    claim_volumes, claim_mounts = _claim_volumes(job)
    volumes += claim_volumes
    mounts += claim_mounts
    staged = _staged(job)
    in_cache = [staged.model_path, staged.dataset_path] if staged is not None else []
    if any(str(path).startswith(f"{CACHE_DIR}/") for path in in_cache):
        volumes.append(_cache_volume(settings, read_only=True))
        mounts.append({"name": "cache", "mountPath": CACHE_DIR, "readOnly": True})

    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": job.spec.trainer_image or settings.trainer_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": list(settings.launcher),
        "args": _torchrun_args(job, plan, settings, attempt),
        "env": _env(job, attempt, settings),
        "ports": [
            {"name": "metrics", "containerPort": settings.metrics_port, "protocol": "TCP"},
            {"name": "rendezvous", "containerPort": settings.rendezvous_port, "protocol": "TCP"},
        ],
        "resources": _trainer_resources(plan, settings),
        "volumeMounts": mounts,
        # The trainer writes why it ended to /dev/termination-log; when it could not (killed,
        # or the launcher itself failed), the kubelet uses the tail of the log instead.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
    }

    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "subdomain": names.service,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": settings.termination_grace_seconds,
        "securityContext": _pod_security(),
        "tolerations": _tolerations(pool),
        "containers": [container],
        "volumes": volumes,
    }
    if pool.spec.node_selector:
        pod_spec["nodeSelector"] = dict(pool.spec.node_selector)

    plan_revision = str(plan.revision)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _object_meta(
            job,
            names.job,
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
                    "labels": labels(job, attempt),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(settings.metrics_port),
                        "prometheus.io/path": "/metrics",
                        ANNOTATION_PLAN_REVISION: plan_revision,
                    },
                },
                "spec": pod_spec,
            },
        },
    }


# --------------------------------------------------------------------------- stage-in


def fetched_sources(job: FineTuneJob, settings: BuildSettings) -> list[str]:
    """The job's model and dataset URIs that come from a store (S3, https, and the hub
    unless `stage_in_hub` is off): the stage-in step fetches them into the namespace's
    cache, so that no GPU waits for a download."""
    remote = {"s3", "https", "hub"} if settings.stage_in_hub else {"s3", "https"}
    uris = (job.spec.model.uri, job.spec.dataset.uri)
    return [uri for uri in uris if _locate(uri).kind in remote]


def needs_stage_in(job: FineTuneJob, settings: BuildSettings) -> bool:
    """Whether a CPU-only stage-in step runs before the plan: something must be fetched, or
    planning needs what only the files say (a model on a volume with no
    `spec.model.architecture`: its config.json)."""
    if fetched_sources(job, settings):
        return True
    return job.spec.model.architecture is None and _locate(job.spec.model.uri).kind == "path"


def _source_refs(
    job: FineTuneJob, model: _Location, dataset: _Location
) -> tuple[ModelRef, DatasetRef]:
    """The contract's model and dataset references for where they are read from."""
    spec = job.spec
    return (
        ModelRef(
            source=model.source,
            kind=model.kind,
            revision=spec.model.revision or model.revision,
            token_env=TOKEN_ENV if spec.model.token_secret_ref is not None else None,
        ),
        DatasetRef(
            source=dataset.source,
            kind=dataset.kind,
            revision=spec.dataset.revision if dataset.kind == "hub" else None,
            format=spec.dataset.format,
            validation_split=spec.dataset.validation_split,
        ),
    )


def build_stage_in_config(
    job: FineTuneJob, settings: BuildSettings, keep_paths: Sequence[str] = ()
) -> StageInConfig:
    name, namespace, uid = _metadata(job)
    spec = job.spec
    model, dataset = _source_refs(
        job, _locate(spec.model.uri, split_revision=True), _locate(spec.dataset.uri)
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


def _hub_env(settings: BuildSettings) -> list[dict[str, Any]]:
    """HF_ENDPOINT for a hub mirror or a private hub (`hub_endpoint`); none: huggingface.co."""
    if settings.hub_endpoint is None:
        return []
    return [{"name": "HF_ENDPOINT", "value": settings.hub_endpoint}]


def _s3_env(job: FineTuneJob) -> list[dict[str, Any]]:
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


def build_cache_pvc(job: FineTuneJob, settings: BuildSettings) -> dict[str, Any]:
    """The namespace's cache claim, created by the first job that needs it and owned by
    none (deleting a job never deletes the cache)."""
    _, namespace, _ = _metadata(job)
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
        _cache_volume(settings, read_only=False)
        if fetches
        else {"name": "cache", "emptyDir": {"sizeLimit": settings.tmp_size}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "cache", "mountPath": CACHE_DIR}]
    claim_volumes, claim_mounts = _claim_volumes(job, read_only_only=True)
    step = _step_job(
        job,
        settings,
        StepKind.STAGE_IN,
        config.model_dump(mode="json"),
        volumes + claim_volumes,
        mounts + claim_mounts,
        env=[
            {"name": "HF_HOME", "value": f"{CACHE_DIR}/.hf-home"},
            *_token_env(job),
            *_hub_env(settings),
            *_s3_env(job),
        ],
    )
    if fetches and settings.cache_volume is None:
        return [build_cache_pvc(job, settings), *step]
    return step


def _cache_volume(settings: BuildSettings, *, read_only: bool) -> dict[str, Any]:
    """The cache as a pod volume named `cache`: the namespace's claim, or the cluster-wide
    volume source `cache_volume` names (the same storage in every namespace)."""
    if settings.cache_volume is not None:
        return {"name": "cache", **json.loads(json.dumps(dict(settings.cache_volume)))}
    claim: dict[str, Any] = {"claimName": CACHE_CLAIM}
    if read_only:
        claim["readOnly"] = True
    return {"name": "cache", "persistentVolumeClaim": claim}


# --------------------------------------------------------------------------- stage-out


def needs_stage_out(job: FineTuneJob) -> bool:
    """Whether the output goes to S3: a CPU-only stage-out step uploads it after training."""
    uri = job.spec.output.uri
    return uri is not None and uri.startswith("s3://")


def build_stage_out_config(job: FineTuneJob) -> StageOutConfig:
    name, namespace, uid = _metadata(job)
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
    name, _, _ = _metadata(job)
    claim = child_names(name, 1).pvc
    volumes = [
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    ]
    mounts = [{"name": "checkpoints", "mountPath": CHECKPOINT_DIR, "readOnly": True}]
    config = build_stage_out_config(job).model_dump(mode="json")
    return _step_job(job, settings, StepKind.STAGE_OUT, config, volumes, mounts, env=_s3_env(job))


# --------------------------------------------------------------------------- export

GGUF_DIR = "gguf"
"""The export writes `<output>/gguf/<job>-<quantization>.gguf`."""


def needs_export(job: FineTuneJob) -> bool:
    """Whether a CPU-only export step writes a GGUF file after training."""
    return job.spec.output.gguf is not None


def _output_dir(job: FineTuneJob) -> str:
    """Where the trainer writes the output inside its pods (and the export pod)."""
    out = _output_location(job)
    return out.source if out is not None else OUTPUT_DIR


def gguf_file_name(job: FineTuneJob) -> str:
    gguf = job.spec.output.gguf
    assert gguf is not None
    return f"{_metadata(job)[0]}-{gguf.quantization}.gguf"


def gguf_uri(job: FineTuneJob) -> str:
    """Where the GGUF file is, as a `pvc://` URI: under the claim spec.output.uri names, or
    under `output/` of the checkpoint claim."""
    tail = f"{GGUF_DIR}/{gguf_file_name(job)}"
    uri = job.spec.output.uri
    if uri is not None and uri.startswith("pvc://"):
        return f"{uri.rstrip('/')}/{tail}"
    return f"pvc://{child_names(_metadata(job)[0], 1).pvc}/output/{tail}"


def build_export_config(job: FineTuneJob) -> ExportConfig:
    """The export of the whole model: `model/` of a full fine-tune, `merged/` of a LoRA or
    QLoRA run (the API requires mergeAdapter for those)."""
    name, namespace, uid = _metadata(job)
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
    name, _, _ = _metadata(job)
    config = build_export_config(job).model_dump(mode="json")
    out = _output_location(job)
    if out is not None and out.claim is not None:
        volume = _dns_label(f"pvc-{out.claim}", 63)
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


def step_name(job_name: str, kind: StepKind) -> str:
    """Name of a step's Job and ConfigMap: `<job>-stagein`, `<job>-stageout`."""
    return f"{_base_name(job_name)}-{kind.value.replace('-', '')}"


def stage_in_name(job_name: str) -> str:
    return step_name(job_name, StepKind.STAGE_IN)


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
    """A step's ConfigMap and batch Job: one pod of the trainer image, no GPU asked for,
    preferring nodes without one (or where `stage_in_node_selector`/`_tolerations` say). A
    permanent failure (exit EXIT_CONFIG_ERROR) fails the Job at once; a transient one is
    retried up to STEP_BACKOFF_LIMITS."""
    name, _, _ = _metadata(job)
    step = step_name(name, kind)
    step_labels = {**labels(job), LABEL_STEP: kind.value}
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {**_object_meta(job, step), "labels": step_labels},
        "data": {STEP_CONFIG_KEY: json.dumps(dict(config), indent=2)},
    }
    container = {
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
        "securityContext": _container_security(),
    }
    no_gpu = {
        "weight": 100,
        "preference": {
            "matchExpressions": [
                {"key": "nvidia.com/gpu.present", "operator": "NotIn", "values": ["true"]}
            ]
        },
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": _pod_security(),
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
        "metadata": {**_object_meta(job, step), "labels": step_labels},
        "spec": {
            "backoffLimit": STEP_BACKOFF_LIMITS[kind],
            "podReplacementPolicy": "Failed",
            "podFailurePolicy": {"rules": [fail_on_config_error]},
            "template": {"metadata": {"labels": step_labels}, "spec": pod_spec},
        },
    }
    return [config_map, batch]


def _staged(job: FineTuneJob) -> StageInStatus | None:
    """What the stage-in step staged for this job, once it has."""
    staged = job.status.stage_in if job.status is not None else None
    return staged if staged is not None and staged.model_path is not None else None


def build_children(
    job: FineTuneJob,
    plan: PlanStatus,
    pool: GPUPool,
    settings: BuildSettings,
    attempt: int,
) -> list[dict[str, Any]]:
    """Every child in apply order: volume, config, DNS, network policy, then the pods that
    need them (the policy exists before any trainer pod does)."""
    children = [
        build_checkpoint_pvc(job, plan, settings),
        build_config_map(job, plan, settings, attempt),
        build_headless_service(job, settings),
    ]
    if settings.network_policy:
        children.append(build_network_policy(job, settings))
    children.append(build_indexed_job(job, plan, pool, settings, attempt))
    return children
