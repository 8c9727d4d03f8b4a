"""Every environment variable the operator reads, in one table.

Each row names the variable, the settings field it sets, how its value is read
(settings/parse.py), what it means and which Helm values set it. The settings objects are
built from this table (settings/__init__.py), docs/configuration.md's table is rendered from
it (`make docs`, hack/settings_table.py), and tests hold the chart's Deployment to it. A
field's default is its settings class's own, so the documented default cannot drift from
the one in force.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kubetune.control.build.settings import BuildSettings
from kubetune.control.reconcile import ControllerSettings
from kubetune.controller.leader import LeaderSettings
from kubetune.controller.settings import parse as p
from kubetune.planning.planner import PlannerSettings


@dataclass(frozen=True)
class MetricsSettings:
    port: int = 8000
    """The operator's /metrics port; 0: any free port, below zero: none."""


GROUPS: dict[str, type] = {
    "build": BuildSettings,
    "planner": PlannerSettings,
    "controller": ControllerSettings,
    "leader": LeaderSettings,
    "metrics": MetricsSettings,
}
"""The settings classes the table's fields belong to, by the prefix of `Setting.field`."""


@dataclass(frozen=True)
class Setting:
    """One environment variable of the operator."""

    env: str
    field: str
    """`group.name`: the field of a settings class of `GROUPS` that the variable sets."""
    parse: p.Parser
    help: str
    """What it does (Markdown, one line of docs/configuration.md's table)."""
    values: tuple[str, ...] = ()
    """The chart values its Deployment sets the variable from."""
    chart: str = ""
    """How the chart sets it, where naming `values` says too little (Markdown, naming each of
    them); `values` and `chart` both empty: the chart does not set it."""
    default: str = ""
    """The default as docs/configuration.md says it, where the field's own says too little
    (Markdown); empty: the field's default, shown as it is."""
    default_from: str = ""
    """Another variable (an earlier row of the same group) whose value is this one's default."""

    @property
    def group(self) -> str:
        return self.field.split(".", 1)[0]

    @property
    def name(self) -> str:
        return self.field.split(".", 1)[1]

    def field_default(self) -> Any:
        """The default of the field this variable sets, as its settings class has it."""
        for f in dataclasses.fields(GROUPS[self.group]):
            if f.name == self.name:
                if f.default is not dataclasses.MISSING:
                    return f.default
                if f.default_factory is not dataclasses.MISSING:
                    return f.default_factory()
                break
        raise LookupError(f"{self.env}: {GROUPS[self.group].__name__} has no default {self.name}")


# The order is docs/configuration.md's: what the children are built with, then the planner,
# the timings, the policies, and the operator's own process.
SETTINGS: tuple[Setting, ...] = (
    Setting(
        "KUBETUNE_TRAINER_IMAGE",
        "build.trainer_image",
        p.text,
        "trainer image for jobs without `spec.trainerImage`",
        values=("operator.trainerImage",),
    ),
    Setting(
        "KUBETUNE_IMAGE_PULL_POLICY",
        "build.image_pull_policy",
        p.text,
        "pull policy of trainer pods",
        values=("operator.trainerImagePullPolicy",),
    ),
    Setting(
        "KUBETUNE_CHECKPOINT_STORAGE_CLASS",
        "build.checkpoint_storage_class",
        p.text,
        "StorageClass of checkpoint volumes without `spec.checkpoint.storage.storageClassName`",
        values=("operator.checkpointStorageClass",),
        default="cluster default",
    ),
    Setting(
        "KUBETUNE_CHECKPOINT_READ_WRITE_MANY",
        "build.checkpoint_read_write_many",
        p.boolean,
        "the checkpoint StorageClass offers ReadWriteMany: a job with "
        "`spec.checkpoint.storage.accessMode: auto` gets a ReadWriteMany checkpoint volume from "
        "its first attempt and may be planned, and re-planned after running out of memory, over "
        "several nodes; `false`: its volume is ReadWriteOnce and its plans stay on one node "
        "(docs/trainer-pods.md)",
        values=("operator.checkpointReadWriteMany",),
    ),
    Setting(
        "KUBETUNE_CACHE_SIZE",
        "build.cache_size",
        p.quantity,
        "size of a namespace's model and data cache claim `kubetune-cache`, created by the "
        "first job with a source to fetch (hub, `s3://`, `https://`) (docs/data.md)",
        values=("operator.cacheSize",),
    ),
    Setting(
        "KUBETUNE_CACHE_VOLUME",
        "build.cache_volume",
        p.volume_source,
        'JSON object: one pod volume source (`{"csi": {…}}`, `{"nfs": {…}}`) that every '
        "namespace's stage-in and trainer pods mount as the cache, for one cache for the "
        "cluster; `{}`: a claim `kubetune-cache` per namespace (docs/data.md)",
        values=("operator.cacheVolume",),
        default="`{}`",
    ),
    Setting(
        "KUBETUNE_CACHE_VOLUME_SHARED_TRUST",
        "controller.cache_volume_shared_trust",
        p.boolean,
        "the namespaces sharing `KUBETUNE_CACHE_VOLUME` trust each other (any of them can change "
        "what the others read there); `false` while a GPUPool is scoped to namespaces: jobs that "
        "would fetch into the shared cache fail with reason `SharedCacheRefused` "
        "(docs/security.md)",
        values=("operator.cacheVolumeSharedTrust",),
    ),
    Setting(
        "KUBETUNE_CACHE_EVICT_ABOVE",
        "build.cache_max_bytes",
        p.cache_bytes,
        "the stage-in step evicts least-recently-used cache entries that no unfinished job of "
        "the namespace reads until the cache holds at most this much",
        values=("operator.cacheEvictAbove",),
        default="90% of the cache size",
        default_from="KUBETUNE_CACHE_SIZE",
    ),
    Setting(
        "KUBETUNE_STAGE_IN_HUB",
        "build.stage_in_hub",
        p.boolean,
        "fetch hub models and datasets in the stage-in step, into the cache, before any GPU is "
        "asked for; `false`: rank 0 of the trainer downloads them while its GPUs wait",
        values=("operator.stageInHub",),
    ),
    Setting(
        "KUBETUNE_HF_ENDPOINT",
        "build.hub_endpoint",
        p.url,
        "`HF_ENDPOINT` of stage-in and trainer pods: a hub mirror or private hub",
        values=("operator.hubEndpoint",),
        default="unset (huggingface.co)",
    ),
    Setting(
        "KUBETUNE_CACHE_STORAGE_CLASS",
        "build.cache_storage_class",
        p.text,
        "StorageClass of the cache claim; it must offer ReadWriteMany where trainer pods of "
        "several nodes read it",
        values=("operator.cacheStorageClass",),
        default="the checkpoints'",
    ),
    Setting(
        "KUBETUNE_STAGE_IN_NODE_SELECTOR",
        "build.stage_in_node_selector",
        p.string_map,
        "JSON object: node labels stage-in pods need; they ask for no GPU and prefer nodes "
        "without `nvidia.com/gpu.present=true`",
        values=("operator.stageInNodeSelector",),
        default="`{}`",
    ),
    Setting(
        "KUBETUNE_STAGE_IN_TOLERATIONS",
        "build.stage_in_tolerations",
        p.tolerations,
        "JSON list: tolerations of stage-in pods, where every node is a tainted GPU node",
        values=("operator.stageInTolerations",),
        default="`[]`",
    ),
    Setting(
        "KUBETUNE_STAGE_IN_CPU",
        "build.stage_in_cpu",
        p.quantity,
        "CPU request of stage-in and stage-out pods",
        values=("operator.stageInCPU",),
    ),
    Setting(
        "KUBETUNE_STAGE_IN_MEMORY",
        "build.stage_in_memory",
        p.quantity,
        "memory request of stage-in and stage-out pods",
        values=("operator.stageInMemory",),
    ),
    Setting(
        "KUBETUNE_EXPORT_CPU",
        "build.export_cpu",
        p.quantity,
        "CPU request of GGUF export pods",
        values=("operator.exportCPU",),
    ),
    Setting(
        "KUBETUNE_EXPORT_MEMORY",
        "build.export_memory",
        p.quantity,
        "memory request of GGUF export pods: llama.cpp's converter reads one tensor at a time, "
        "so a few GiB beyond the largest tensor suffice (docs/serving.md)",
        values=("operator.exportMemory",),
    ),
    Setting(
        "KUBETUNE_SAFETY_FACTOR",
        "planner.safety_factor",
        p.number,
        "an estimate times this must fit in GPU memory",
        values=("operator.safetyFactor",),
    ),
    Setting(
        "KUBETUNE_DEFAULT_OBJECTIVE",
        "planner.default_objective",
        p.objective,
        "what the planner minimizes (`cost` or `time`) for jobs that leave "
        "`spec.resources.objective` unset; any other value stops the operator at start",
        values=("operator.defaultObjective",),
    ),
    Setting(
        "KUBETUNE_TERMINATION_GRACE_SECONDS",
        "build.termination_grace_seconds",
        p.whole,
        "how long the trainer gets to checkpoint when stopped",
        values=("operator.terminationGraceSeconds",),
    ),
    Setting(
        "KUBETUNE_TRAINER_CPU_PER_GPU",
        "build.cpu_per_gpu",
        p.quantity,
        "CPU request of a trainer pod per GPU it runs (a Kubernetes quantity: `8`, `500m`); "
        "keep it within a GPU node's CPUs per GPU, or pods stay unschedulable; a bad value "
        "stops the operator at start",
        values=("operator.trainerCPUPerGPU",),
    ),
    Setting(
        "KUBETUNE_TRAINER_MEMORY_PER_GPU",
        "build.memory_per_gpu",
        p.quantity,
        "host memory of a trainer pod per GPU (a quantity: `64Gi`), before what its plan adds "
        "(offloaded activations) and 1.5× after each time the kernel killed one of the job's "
        "trainers for memory (`status.plan.hostMemoryGiB`, docs/trainer-pods.md#scheduling)",
        values=("operator.trainerMemoryPerGPU",),
    ),
    Setting(
        "KUBETUNE_TRAINER_MEMORY_LIMIT",
        "build.memory_limit",
        p.boolean,
        "trainer pods get a memory limit equal to their memory request, so a trainer that "
        "outgrows it is killed inside its pod (`OOMKilled`) and relaunched with more, rather "
        "than the node's pods being evicted; `false`: a request only",
        values=("operator.trainerMemoryLimit",),
    ),
    Setting(
        "KUBETUNE_POLL_SECONDS",
        "controller.poll_seconds",
        p.number,
        "how often a running job's trainer metrics (progress, checkpoints) are read; a budget "
        "or deadline stops a job up to this long after it is reached, and a checkpoint's Event "
        "comes up to this late (a pod or batch Job changing wakes the job at once whatever "
        "this is). Lower it for a few jobs followed closely; at 10 s the operator takes about "
        "twice the CPU per running job (docs/operations.md)",
        values=("operator.pollSeconds",),
    ),
    Setting(
        "KUBETUNE_QUEUE_RETRY_SECONDS",
        "controller.queue_retry_seconds",
        p.number,
        "how often a job among the first eight of a pool's queue is re-planned when no change "
        "of capacity woke it first, give or take a tenth so that queued jobs do not all look "
        "at once (jobs further back wait for events: docs/operations.md); also how often a "
        "job waiting for its pools, inputs or upstream job looks again",
        values=("operator.queueRetrySeconds",),
    ),
    Setting(
        "KUBETUNE_RESYNC_SECONDS",
        "controller.resync_seconds",
        p.positive,
        "every unfinished job is looked at at least this often, even when no event concerns "
        "it (finished jobs are looked at only for their TTL)",
        values=("operator.resyncSeconds",),
    ),
    Setting(
        "KUBETUNE_PROGRESS_WRITE_SECONDS",
        "controller.progress_write_seconds",
        p.number,
        "status writes that change only `status.progress` and `status.cost`, or only a queued "
        "job's position in its queue, happen at most this often (the operator's metrics stay "
        "current); a position that moved by less than a tenth of the one shown (outside the "
        "first ten places) at most every ten times this, and a job deep in a queue looks "
        "again at least that often (or at the resync, if sooner) so that such a move is "
        "shown; any other change is written at once",
        values=("operator.progressWriteSeconds",),
    ),
    Setting(
        "KUBETUNE_STALL_SECONDS",
        "controller.stall_seconds",
        p.positive,
        "liveness (`/healthz`) fails when jobs are overdue by this long and no reconcile "
        "succeeded in that time",
        values=("operator.stallSeconds",),
    ),
    Setting(
        "KUBETUNE_PLANNER_WORKERS",
        "controller.planner_workers",
        p.whole_positive,
        "threads that run reconciles (planning is the costly part) off the operator's event loop",
        values=("operator.plannerWorkers",),
    ),
    Setting(
        "KUBETUNE_SCRAPE_CONCURRENCY",
        "controller.scrape_concurrency",
        p.whole_positive,
        "trainer metrics endpoints read at once",
        values=("operator.scrapeConcurrency",),
    ),
    Setting(
        "KUBETUNE_RESCHEDULE_SECONDS",
        "controller.reschedule_seconds",
        p.number,
        "a trainer pod that stays unschedulable this long (its pool has no room left, e.g. "
        "after a preemption) makes the operator re-plan; when another pool has room the job "
        "moves there and resumes from its checkpoint. It is also how long an admitted job "
        "keeps its GPU reservation once the scheduler turns its pods away "
        "([the queue](operations.md#the-queue-for-gpus))",
        values=("operator.rescheduleSeconds",),
    ),
    Setting(
        "KUBETUNE_STARTUP_TIMEOUT_SECONDS",
        "controller.startup_timeout_seconds",
        p.positive,
        "a trainer pod that has a node and whose trainer has not started this long fails its "
        "attempt: the job fails (`StartupTimeout`) when the pod cannot pull its image or "
        "create its container, else the attempt is relaunched as a restart; a job whose "
        "`pvc://` claim or token Secret is still missing this long fails (`MissingVolume`, "
        "`MissingSecret`)",
        values=("operator.startupTimeoutSeconds",),
    ),
    Setting(
        "KUBETUNE_TRAINING_STALL_SECONDS",
        "controller.training_stall_seconds",
        p.positive,
        "relaunch a running attempt from its checkpoint when its step count has not moved this "
        "long (or 20 planned steps, if longer); `spec.recovery.stallTimeoutSeconds` overrides "
        "it per job",
        values=("operator.trainingStallSeconds",),
    ),
    Setting(
        "KUBETUNE_ALLOW_NETWORK",
        "controller.allow_network",
        p.loose_flag,
        "fetch `config.json` of hub models missing from the built-in table (`true`, `yes`, "
        "`on` or `1`; anything else is `false`)",
        values=("operator.allowNetwork",),
    ),
    Setting(
        "KUBETUNE_ALLOWED_TRAINER_IMAGES",
        "controller.allowed_trainer_images",
        p.comma_list,
        "other images a job may name in `spec.trainerImage`: comma-separated shell-style "
        "patterns (docs/security.md)",
        values=("operator.allowedTrainerImages",),
        chart="`operator.allowedTrainerImages`, joined with commas",
        default="empty",
    ),
    Setting(
        "KUBETUNE_ALLOW_TEST_FAULTS",
        "build.allow_test_faults",
        p.loose_flag,
        "obey the `kubetune.io/test-faults` annotation (test clusters only; `true`, `yes`, "
        "`on` or `1`; anything else is `false`)",
        values=("operator.allowTestFaults",),
    ),
    Setting(
        "KUBETUNE_METRICS_PORT",
        "metrics.port",
        p.port,
        "port of the operator's `/metrics` (0: any free port, -1: off); see docs/metrics.md",
        values=("metrics.port", "metrics.enabled"),
        chart="`metrics.port`; -1 unless `metrics.enabled`",
    ),
    Setting(
        "KUBETUNE_NETWORK_POLICIES",
        "build.network_policy",
        p.boolean,
        "create a NetworkPolicy with each job's trainer pods (docs/trainer-pods.md, "
        '"NetworkPolicy"); `false` creates none and leaves existing ones alone',
        values=("networkPolicy.enabled",),
    ),
    Setting(
        "KUBETUNE_OPERATOR_NAMESPACE",
        "build.operator_namespace",
        p.or_pod_namespace,
        "the operator's namespace: its pods (`KUBETUNE_OPERATOR_POD_LABELS`) may reach the "
        "trainers' metrics port; unset (the operator runs outside the cluster): the policy "
        "names no operator peer",
        chart="the release namespace",
        default="`POD_NAMESPACE`, else none",
    ),
    Setting(
        "KUBETUNE_OPERATOR_POD_LABELS",
        "build.operator_pod_labels",
        p.string_map,
        "JSON object, the labels of the operator's pods",
        chart="its selector labels",
        default="`{}` (every pod of that namespace)",
    ),
    Setting(
        "KUBETUNE_METRICS_FROM",
        "build.metrics_from",
        p.network_peers,
        "JSON list of NetworkPolicyPeers (`podSelector`, `namespaceSelector`, `ipBlock`) that "
        "may also reach the metrics port, e.g. Prometheus; `[]`: the operator only",
        values=("networkPolicy.metricsFrom",),
        default='namespaces labelled `kubetune.io/metrics-scraper: "true"`',
    ),
    Setting(
        "KUBETUNE_LEADER_ELECTION",
        "leader.enabled",
        p.leader_flag,
        "`true`: the replicas elect a leader through a Lease and only it works "
        "(docs/operations.md)",
        values=("leaderElection.enabled", "replicaCount"),
        chart="`true` when `leaderElection.enabled` is, or `replicaCount` > 1",
    ),
    Setting(
        "KUBETUNE_LEASE_NAME",
        "leader.lease_name",
        p.text,
        "name of the Lease",
        values=("leaderElection.leaseName",),
        chart="`leaderElection.leaseName`; empty: the release's full name",
    ),
    Setting(
        "KUBETUNE_LEASE_NAMESPACE",
        "leader.lease_namespace",
        p.text,
        "namespace of the Lease; needed outside a pod",
        default="`POD_NAMESPACE`, else the pod's own namespace",
    ),
    Setting(
        "KUBETUNE_LEASE_DURATION_SECONDS",
        "leader.lease_duration_s",
        p.whole_lease_seconds,
        "whole seconds without renewal after which a standby takes the Lease over",
        values=("leaderElection.leaseDurationSeconds",),
    ),
    Setting(
        "KUBETUNE_LEASE_RENEW_DEADLINE_SECONDS",
        "leader.renew_deadline_s",
        p.lease_seconds,
        "a leader that has not renewed for this long exits (status 3); less than the duration",
        values=("leaderElection.renewDeadlineSeconds",),
    ),
    Setting(
        "KUBETUNE_LEASE_RETRY_SECONDS",
        "leader.retry_period_s",
        p.lease_seconds,
        "how often the leader renews and a standby looks; less than the renew deadline",
        values=("leaderElection.retryPeriodSeconds",),
    ),
)
