"""Every word the operator writes into status, conditions, Events and metric labels, and
every label and annotation key it writes on objects or reads from them.

Each set is closed and defined once, here: the CRD's enums are rendered from these classes,
the reconcile logic names its transitions and reasons with them, and the operator's metrics
pre-create their label values from them (tests/unit/test_vocabulary.py compares all three).
What varies from job to job — pod names, seconds, layouts, sizes — goes into messages and
status fields, never into one of these words, so that a label built from one stays bounded.
The label and annotation keys close the module: kubetune's own (`kubetune.io/...`) and the
Kubernetes, Prometheus and NVIDIA ones the operator relies on (the same test fails where a
key is spelled a second time).

The words the operator shares with the trainer (methods, precisions, optimizers, sharding,
exit codes, checkpoint names) are the trainer contract's: `kubetune_trainer.contract`.
"""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    """Where a FineTuneJob is in its life (`status.phase`); control/lifecycle.py has the
    transitions between them."""

    PENDING = "Pending"
    """Created; nothing decided yet."""
    PLANNING = "Planning"
    """Being planned, or waiting for a GPUPool to exist."""
    QUEUED = "Queued"
    """Planned onto a pool whose GPUs are busy; re-planned until capacity frees."""
    RUNNING = "Running"
    """A trainer attempt exists (its pods may still be starting)."""
    SUSPENDED = "Suspended"
    """Stopped by `spec.suspend`, resumable from its checkpoint."""
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


TERMINAL_PHASES: frozenset[Phase] = frozenset({Phase.SUCCEEDED, Phase.FAILED})


class ConditionType(StrEnum):
    """The conditions of a FineTuneJob (`status.conditions[].type`)."""

    PLANNED = "Planned"
    QUEUED = "Queued"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    STAGED_IN = "StagedIn"
    """The stage-in step fetched, checked and measured the model and data (False while it
    runs); set only on jobs that read from a remote store."""
    EXPORTED = "Exported"
    """The export step wrote the GGUF file spec.output.gguf asks for (False while it runs);
    set only on jobs with spec.output.gguf. It runs after training and before the stage-out,
    so an `s3://` output uploads the file too; the job succeeds after both."""
    UPLOADED = "Uploaded"
    """The stage-out step uploaded the output to the `s3://` URI spec.output.uri names
    (False while it runs); set only on jobs with such an output. The job succeeds after it."""
    UPSTREAM_READY = "UpstreamReady"
    """False while the FineTuneJob an `ftj://` model comes from has not Succeeded; set only on
    such jobs."""
    INPUTS_READY = "InputsReady"
    """False while an object the job reads (a `pvc://` claim, the token Secret) is missing;
    set only once one was found missing."""


class Reason(StrEnum):
    """Reasons of conditions and Kubernetes Events (`reason`), in CamelCase as Kubernetes has
    them. A message beside the reason carries the details."""

    # planning
    PLAN_READY = "PlanReady"
    NO_POOLS = "NoPools"
    INFEASIBLE = "Infeasible"
    INVALID_SPEC = "InvalidSpec"
    UNKNOWN_ARCHITECTURE = "UnknownArchitecture"
    INSUFFICIENT_CAPACITY = "InsufficientCapacity"
    CAPACITY_AVAILABLE = "CapacityAvailable"
    # the launch preflight
    MISSING_VOLUME = "MissingVolume"
    """A PersistentVolumeClaim a `pvc://` URI names does not exist in the job's namespace."""
    MISSING_SECRET = "MissingSecret"
    """The Secret (or its key) spec.model.tokenSecretRef names does not exist."""
    INPUTS_FOUND = "InputsFound"
    # a model from another FineTuneJob (`ftj://`)
    WAITING_FOR_UPSTREAM = "WaitingForUpstream"
    """The upstream FineTuneJob has not Succeeded yet; the job waits in Pending."""
    UPSTREAM_SUCCEEDED = "UpstreamSucceeded"
    UPSTREAM_FAILED = "UpstreamFailed"
    """The upstream FineTuneJob failed, was deleted, does not exist or produces no whole model."""
    # the stage-in step
    STAGING_IN = "StagingIn"
    STAGED_IN = "StagedIn"
    STAGE_IN_FAILED = "StageInFailed"
    """The stage-in step could not fetch, check or measure the model or data: a permanent
    failure (no access, no such object, bad data) or too many transient ones."""
    # the export step
    EXPORTING = "Exporting"
    EXPORTED = "Exported"
    EXPORT_FAILED = "ExportFailed"
    """The export step could not write the GGUF file: a permanent failure (an architecture,
    tokenizer or type llama.cpp cannot write, no quantizer in the image) or too many transient
    ones. The trained output stays on its volume."""
    # the stage-out step
    UPLOADING = "Uploading"
    UPLOADED = "Uploaded"
    UPLOAD_FAILED = "UploadFailed"
    """The stage-out step could not upload the output to S3: a permanent failure (no access,
    no such bucket) or too many transient ones. The output stays on the checkpoint volume."""
    # running
    LAUNCHED = "Launched"
    PODS_STARTING = "PodsStarting"
    TRAINING = "Training"
    CHECKPOINT = "Checkpoint"
    ADOPTED = "Adopted"
    IMAGE_PULL_FAILED = "ImagePullFailed"
    """A trainer pod's image cannot be pulled (ErrImagePull, ImagePullBackOff)."""
    CONTAINER_CONFIG_ERROR = "ContainerConfigError"
    """The kubelet cannot create the trainer container (a Secret, key or ConfigMap missing)."""
    UNSCHEDULABLE = "Unschedulable"
    """A trainer pod waits for room: the scheduler's message says why."""
    STARTUP_TIMEOUT = "StartupTimeout"
    """A trainer pod bound to a node did not start within the startup timeout."""
    NODE_NOT_READY = "NodeNotReady"
    """A trainer pod's node stopped being Ready (its kubelet no longer reports): the pod
    cannot be replaced until the node is deleted or taken out of service."""
    SUSPEND_REQUESTED = "SuspendRequested"
    RESUMED = "Resumed"
    # recovery
    PREEMPTED = "Preempted"
    TRAINER_FAILED = "TrainerFailed"
    OUT_OF_MEMORY = "OutOfMemory"
    HOST_OUT_OF_MEMORY = "HostOutOfMemory"
    """The kernel killed a trainer for host memory (OOMKilled): the next attempt gets more."""
    RESCHEDULED = "Rescheduled"
    CHECKPOINT_VOLUME_EXPANDED = "CheckpointVolumeExpanded"
    """A re-plan needs a larger checkpoint volume than the claim asks for, and its
    StorageClass allows expansion: the claim's request was raised."""
    CHECKPOINT_VOLUME_SMALL = "CheckpointVolumeMayBeTooSmall"
    """A re-plan needs a larger checkpoint volume than the claim asks for, and its
    StorageClass does not allow expansion (or is not known)."""
    # the end
    COMPLETED = "Completed"
    EARLY_STOPPED = "EarlyStopped"
    """Succeeded: the validation metric stopped improving (spec.training.earlyStopping), so
    training ended before its last step; the output is the best evaluation's weights."""
    TRAINER_CONFIG_ERROR = "TrainerConfigError"
    CHECKPOINT_FAILED = "CheckpointFailed"
    """The trainer could not write a checkpoint (no room on the volume, a write error), or
    none on the volume can be loaded (exit 45): a relaunch would fail the same way."""
    OOM_LIMIT = "OutOfMemoryLimitReached"
    HOST_MEMORY_UNAVAILABLE = "HostMemoryUnavailable"
    """A trainer ran out of host memory and the pool's nodes have no room for more."""
    RESTART_LIMIT = "RestartLimitReached"
    PREEMPTION_LIMIT = "PreemptionLimitReached"
    """Preempted again and again without a new checkpoint in between."""
    STALLED = "Stalled"
    """The step count stopped moving; the attempt was relaunched from the checkpoint."""
    BUDGET_EXCEEDED = "BudgetExceeded"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    CHILD_CONFLICT = "ChildConflict"
    """An object the job needs (its batch Job, Service, ConfigMap) exists and is not its."""
    # what the cluster's admins allow
    IMAGE_NOT_ALLOWED = "ImageNotAllowed"
    """spec.trainerImage is not on the operator's allow-list (docs/security.md)."""
    SECRET_NOT_ALLOWED = "SecretNotAllowed"
    """The job names a Secret its namespace has not allowed FineTuneJobs to use."""
    SHARED_CACHE_REFUSED = "SharedCacheRefused"
    """The job would fetch into the cluster-wide cache volume, which namespaces that are
    kept apart (a GPUPool scoped to namespaces) would share without the admins' consent."""
    TEST_FAULTS_IGNORED = "TestFaultsIgnored"
    """The test-fault annotation is set, and this operator does not obey it."""
    # the operator itself
    STATUS_REJECTED = "StatusRejected"
    """The API server refused a status update as invalid; the job is still reconciled."""
    OPERATOR_OUTDATED = "OperatorOutdated"
    """The job has fields this operator does not know (a newer CRD): it is left alone."""
    # GPUPools
    POOL_ACCEPTED = "Accepted"
    POOLS_OVERLAP = "PoolsOverlap"
    POOLS_DISJOINT = "PoolsDisjoint"


class PoolConditionType(StrEnum):
    """The conditions of a GPUPool (`status.conditions[].type`)."""

    VALID = "Valid"
    """False when the operator cannot read the pool; such a pool takes part in no plan."""
    OVERLAPPING = "Overlapping"
    """True when another pool's nodeSelector selects some of this pool's ready nodes: their
    GPUs count in both pools, and plans on the two may count them twice."""


class RecoveryReason(StrEnum):
    """What went wrong in a failure the operator handled (`status.recoveries[].reason`)."""

    OOM = "OOM"
    """The trainer ran out of GPU memory: re-planned with a safer layout."""
    HOST_OOM = "HostOutOfMemory"
    """The kernel killed a trainer for host memory (OOMKilled): relaunched with more."""
    PREEMPTION = "Preemption"
    """A trainer pod was preempted or evicted: replaced, resumed from the checkpoint."""
    POD_FAILURE = "PodFailure"
    """A trainer pod or the whole attempt failed otherwise: relaunched."""
    RESCHEDULED = "Rescheduled"
    """A trainer pod found no room in its pool: moved to another pool."""
    STALLED = "Stalled"
    """The step count stopped moving for the stall timeout: relaunched from the checkpoint."""


class PlanReason(StrEnum):
    """Why a plan was made (`status.plan.reason`, the `reason` label of `kubetune_plans_total`).
    `status.plan.message` says what exactly happened."""

    INITIAL = "Initial"
    OUT_OF_MEMORY = "OutOfMemory"
    """The previous layout ran out of GPU memory."""
    HOST_OUT_OF_MEMORY = "HostOutOfMemory"
    """A trainer pod ran out of host memory: the same layout with more."""
    UNSCHEDULABLE = "Unschedulable"
    """A trainer pod found no room in the previous pool."""


class QueueWait(StrEnum):
    """What a Queued job waits for in its pool's queue (`status.queue.waitingFor`)."""

    JOBS_AHEAD = "JobsAhead"
    """Jobs ahead of it in the queue (a higher priority, or created earlier) go first."""
    FREE_GPUS = "FreeGPUs"
    """Its pool has not enough free GPUs for its layout, after those reserved for jobs
    admitted before it."""


class StepKind(StrEnum):
    """The CPU-only steps around training: the `kubetune.io/step` label of their Job and pod,
    and the name of their container."""

    STAGE_IN = "stage-in"
    """Fetch, check and measure the model and data before any GPU is asked for."""
    EXPORT = "export"
    """Convert the trained model to GGUF after training, before the stage-out."""
    STAGE_OUT = "stage-out"
    """Upload the output to S3 after training."""


class EventType(StrEnum):
    """Kubernetes Event types."""

    NORMAL = "Normal"
    WARNING = "Warning"


# --------------------------------------------------------------------------- labels and annotations

LABEL_NAME = "app.kubernetes.io/name"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_JOB = "kubetune.io/job"
"""On every child of a FineTuneJob, and on its pods: the job's name (shortened past 63
characters); the operator's watches select its children by it."""
LABEL_JOB_UID = "kubetune.io/job-uid"
"""On a trainer attempt's pods: the uid of the FineTuneJob whose batch Job made them. A job
deleted and created again under its name has a new uid, so its reconciles never take the
old job's pods, still terminating, for its own."""
LABEL_ATTEMPT = "kubetune.io/attempt"
"""On a trainer attempt's ConfigMap, batch Job and pods: the attempt's number."""
LABEL_STEP = "kubetune.io/step"
"""A `StepKind` on a CPU step's Job and pod (trainer pods carry `kubetune.io/attempt`)."""
METRICS_SCRAPER_LABEL = "kubetune.io/metrics-scraper"
"""The namespace label the default `metrics_from` admits to the trainers' metrics port
(value `"true"`)."""
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
"""The label Kubernetes puts on every namespace, its name: selects one namespace by name."""
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
"""The label the Job controller puts on a batch Job's pods: the Job's name."""
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
"""The node label GPU feature discovery (alone, or in NVIDIA's GPU operator) sets to the
node's GPU product; a GPUPool without a nodeSelector selects the nodes labelled with its own."""
GPU_PRESENT_LABEL = "nvidia.com/gpu.present"
"""The node label NVIDIA's GPU operator sets on nodes with a GPU: CPU steps prefer nodes
without it."""
GPU_RESOURCE = "nvidia.com/gpu"
"""The extended resource NVIDIA's device plugin offers (and the key of the taint GPU nodes
commonly carry)."""

ANNOTATION_RETENTION = "kubetune.io/retention"
ANNOTATION_JOB_UID = LABEL_JOB_UID
"""On the checkpoint claim: the uid of the job that made it (a label key too, on pods)."""
ANNOTATION_PLAN_REVISION = "kubetune.io/plan-revision"
ANNOTATION_TEST_FAULTS = "kubetune.io/test-faults"
"""Test-only fault injection, e.g. `{"oomAtStep": 6, "attempts": [1]}`: the trainer of the
listed attempts (all when omitted) fails as if out of GPU memory before that step. The e2e
tests use it to exercise OOM recovery without a GPU; never set it on real work."""
ALLOWED_SECRETS_ANNOTATION = "kubetune.io/allowed-secrets"
"""On a Namespace: the Secrets its FineTuneJobs may reference, comma-separated
(`kubetune.api.tenancy`)."""
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
"""The index the Job controller gives each pod of an Indexed Job: the trainer's node rank."""
PROMETHEUS_SCRAPE_ANNOTATION = "prometheus.io/scrape"
PROMETHEUS_PORT_ANNOTATION = "prometheus.io/port"
PROMETHEUS_PATH_ANNOTATION = "prometheus.io/path"
"""The annotations a Prometheus configured for annotation-based discovery reads on a pod."""
