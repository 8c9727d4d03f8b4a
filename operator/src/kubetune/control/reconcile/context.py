"""What every part of one reconcile shares: what the handlers observed, the Decision the
parts write, the operator's settings, and `Context`, the one reconcile they all work on.

Nothing here decides by phase; the parts (preflight, upstream, stages, launch, recovery,
follow, suspension) do, and the package's `__init__` picks the part by phase.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Protocol

from kubetune.api.tenancy import Tenant
from kubetune.api.v1alpha1 import (
    FineTuneJob,
    FineTuneJobSpec,
    FineTuneJobStatus,
    GPUPool,
    PlanStatus,
    StageInStatus,
)
from kubetune.api.vocabulary import ConditionType, EventType, Reason
from kubetune.control import pods as p
from kubetune.control import progress
from kubetune.control.build.names import child_names
from kubetune.control.build.settings import BuildSettings
from kubetune.control.build.storage import InputRef, single_node
from kubetune.control.lifecycle import Transitions
from kubetune.control.reach import VolumeReach
from kubetune.planning.arch import ModelArch, arch_from_hf_config
from kubetune.planning.planner import Plan, PlannerSettings

Manifest = dict[str, Any]
ArchLoader = Callable[[str], ModelArch]
PlanFn = Callable[[FineTuneJobSpec, Sequence[GPUPool], ModelArch, PlannerSettings], Plan]
"""`planner.plan_job`, or a stand-in with its signature (the operator passes a cached one)."""


class AdmitFn(Protocol):
    """Asked before a new plan launches, with the plan and whether the planner found it must
    wait for capacity: None launches it, a message queues the job with that message. With
    `join=False` (a running job that would move to another pool) a message only means "not
    now": the job joins no queue. The operator passes its queue (controller/admission.py);
    `wait_when_busy` is the default."""

    def __call__(self, plan: PlanStatus, queued: bool, join: bool = True) -> str | None: ...


def wait_when_busy(plan: PlanStatus, queued: bool, join: bool = True) -> str | None:
    """Launch whenever the planner found room; no queue order."""
    if not queued:
        return None
    return (
        f"waiting for {plan.total_gpus} free GPU(s) in pool {plan.pool}; re-planning periodically"
    )


@dataclass(frozen=True)
class ControllerSettings:
    build: BuildSettings = field(default_factory=BuildSettings)
    planner: PlannerSettings = field(default_factory=PlannerSettings)
    allow_network: bool = False
    """Fetch config.json of unknown hub models at plan time."""
    queue_retry_seconds: float = 15.0
    poll_seconds: float = 30.0
    reschedule_seconds: float = 120.0
    """A trainer pod unschedulable this long makes the job re-plan onto another pool."""
    resync_seconds: float = 600.0
    """Every unfinished job is looked at at least this often, even without any event."""
    progress_write_seconds: float = 60.0
    """Status changes of progress and cost alone are written at most this often."""
    training_stall_seconds: float = 1800.0
    """A running attempt whose step count has not moved this long (or 20 planned steps, if
    longer) is relaunched from its checkpoint; a job's spec.recovery.stallTimeoutSeconds
    overrides it."""
    allowed_trainer_images: tuple[str, ...] = ()
    """Patterns (`fnmatch`: `registry.example.com/ml/*`) a job's spec.trainerImage must
    match; the operator's own trainer image is always allowed."""
    cache_volume_shared_trust: bool = False
    """The namespaces sharing `build.cache_volume` trust each other: required for it while
    a GPUPool is scoped to namespaces (control.reconcile.policy)."""
    stall_seconds: float = 300.0
    """Liveness fails when jobs are overdue this long and no reconcile succeeded."""
    planner_workers: int = 2
    """Worker threads that run reconciles (planning) off the operator's event loop."""
    scrape_concurrency: int = 16
    """Trainer metrics endpoints scraped at once."""
    startup_timeout_seconds: float = 900.0
    """A trainer pod that has a node (or a job whose claim or Secret is missing) and whose
    trainer has not started this long fails the attempt: the job fails when the cause is its
    image or its config, else the attempt is relaunched as a restart."""


@dataclass(frozen=True)
class MissingInput:
    """An object the job reads that the launch preflight did not find."""

    ref: InputRef
    problem: str
    """`does not exist`, `has no key 'token'`."""

    def describe(self, namespace: str) -> str:
        ref = self.ref
        return f"{ref.kind} {ref.name!r} ({ref.field}) {self.problem} in namespace {namespace}"


@dataclass(frozen=True)
class Observed:
    """What the handlers read from the cluster for one reconcile."""

    pools: list[GPUPool]
    batch_job: Mapping[str, Any] | None = None
    """The batch Job of the current attempt, if it exists."""
    pods: Sequence[Mapping[str, Any]] = field(default_factory=list)
    """Pods of the current attempt."""
    trainer_metrics: Mapping[str, float] | None = None
    """The rank-0 trainer's metrics (`kubetune_trainer_` prefix removed), when reachable."""
    attempt: int = 0
    """The attempt `batch_job` and `pods` belong to: the status's, or a newer one whose
    batch Job exists although the status never recorded its launch (the operator stopped
    between creating it and writing the status)."""
    other_attempts: Sequence[int] = ()
    """Attempts, other than `attempt`, whose batch Job exists and is not being deleted."""
    earlier_pods: Sequence[Mapping[str, Any]] = ()
    """Trainer pods of this job's attempts before `attempt` that still exist (stopping, or
    ended): the next attempt's pods start only once none of them may still write."""
    tenant: Tenant | None = None
    """The job's namespace: the pools it may use, the Secrets it may reference (None: not
    known; every pool is eligible and no Secret is checked)."""
    stage_in_job: Mapping[str, Any] | None = None
    """The stage-in step's batch Job, if it exists (jobs with S3 sources)."""
    stage_in_pods: Sequence[Mapping[str, Any]] = field(default_factory=list)
    """Its pods: the ended one's termination message carries the result."""
    stage_in_metrics: Mapping[str, float] | None = None
    """The running stage-in pod's progress gauges (`kubetune_trainer_stagein_` removed)."""
    cache_in_use: Sequence[str] = ()
    """Cache entries (status.stageIn paths) that other unfinished jobs sharing the cache read;
    looked up only when this look may create the stage-in step (`may_create_stage_in`)."""
    export_job: Mapping[str, Any] | None = None
    """The export step's batch Job, if it exists (jobs with spec.output.gguf)."""
    export_pods: Sequence[Mapping[str, Any]] = field(default_factory=list)
    stage_out_job: Mapping[str, Any] | None = None
    """The stage-out step's batch Job, if it exists (jobs with an `s3://` output)."""
    stage_out_pods: Sequence[Mapping[str, Any]] = field(default_factory=list)
    upstream: FineTuneJob | None = None
    """The FineTuneJob an `ftj://` model names, read before the job takes its result."""
    upstream_read: bool = False
    """Whether that read got an answer (the job, or that it does not exist)."""
    missing_inputs: Sequence[MissingInput] = ()
    """What the launch preflight found missing of `build.storage.input_refs(job)` (read only
    before a launch; empty when all exist or they could not be read)."""
    lost_nodes: Mapping[str, str] = field(default_factory=dict)
    """Nodes of `pods` that are not Ready: node → since when ("" when not known)."""
    checkpoint_claim: Mapping[str, Any] | None = None
    """The job's checkpoint PersistentVolumeClaim (`spec` and `status`), if it exists."""
    checkpoint_class_expands: bool | None = None
    """Whether that claim's StorageClass allows volume expansion (None: not known)."""
    checkpoint_reach: VolumeReach | None = None
    """The pools that can mount that claim's bound volume, when its PersistentVolume has a
    node affinity (a zonal disk); None: any pool can."""


@dataclass(frozen=True)
class Event:
    type: EventType
    reason: Reason
    message: str


@dataclass
class Decision:
    status: FineTuneJobStatus
    create: list[Manifest] = field(default_factory=list)
    delete_jobs: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    resize_claims: list[tuple[str, str]] = field(default_factory=list)
    """(claim, new storage request): claims to expand."""
    release_claims: list[str] = field(default_factory=list)
    """Claims whose owner reference to the job goes (before `delete_self`): deleting the job
    then leaves them."""
    delete_self: bool = False
    requeue_after: float | None = None

    def event(self, reason: Reason, message: str, warning: bool = False) -> None:
        kind = EventType.WARNING if warning else EventType.NORMAL
        self.events.append(Event(kind, reason, message))


@dataclass(frozen=True)
class NewPlan:
    """A plan made by `reconcile`, and whether its pool has to free GPUs first."""

    status: PlanStatus
    queued: bool


def _claim_access_modes(claim: Mapping[str, Any]) -> list[str]:
    """The access modes a PersistentVolumeClaim asked for."""
    return [str(mode) for mode in (claim.get("spec") or {}).get("accessModes") or []]


def measured_spec(spec: FineTuneJobSpec, staged: StageInStatus | None) -> FineTuneJobSpec:
    """The spec the planner reads: the dataset's size as the stage-in step measured it."""
    if staged is None or not staged.tokens or not staged.examples:
        return spec
    dataset = spec.dataset.model_copy(
        update={
            "num_examples": staged.examples,
            "avg_tokens_per_example": max(1, staged.tokens // staged.examples),
            "total_tokens": staged.tokens,
        }
    )
    return spec.model_copy(update={"dataset": dataset})


@dataclass
class Context:
    """One reconcile of one job: the parts read `job`, `observed` and `settings`, and write
    only `d`, the Decision (its status is `s`; every phase change goes through `go`)."""

    job: FineTuneJob
    """The job as the parts see it: an `ftj://` model replaced by where the upstream's model
    is (`upstream.chained`); once staged in, with the status that says where its files are."""
    spec: FineTuneJobSpec
    """`job.spec` with the dataset's size as the stage-in step measured it (`measured_spec`)."""
    raw_model_uri: str
    """spec.model.uri as the user wrote it (`ftj://<name>` for a chained job)."""
    observed: Observed
    settings: ControllerSettings
    now: datetime
    load_arch: ArchLoader
    plan_job: PlanFn
    admit: AdmitFn
    d: Decision
    go: Transitions

    @property
    def s(self) -> FineTuneJobStatus:
        return self.d.status

    @property
    def job_name(self) -> str:
        return str(self.job.metadata["name"])

    @property
    def model_id(self) -> str:
        """What planning reads the architecture from."""
        return self.spec.model.architecture or self.spec.model.uri

    def model_arch(self) -> ModelArch:
        """The architecture to plan with: spec.model.architecture when set, else the
        config.json the stage-in step read, else what the model's URI names."""
        staged = self.s.stage_in
        if self.spec.model.architecture is None and staged and staged.model_config_json:
            return arch_from_hf_config(
                staged.model_config_json,
                self.spec.model.uri,
                source=f"{self.spec.model.uri} (config.json as staged)",
            )
        return self.load_arch(self.model_id)

    def pool(self, name: str) -> GPUPool | None:
        return next((pool for pool in self.observed.pools if pool.name == name), None)

    def fail(self, reason: Reason, message: str) -> None:
        """Fail the job for good, tell the user why and stop whatever still trains."""
        self.go.fail(reason, message)
        self.d.event(reason, message, warning=True)
        self.stop_trainer()

    def stop_trainer(self) -> None:
        if self.s.attempt and self.observed.batch_job is not None:
            self._delete_attempt(self.s.attempt)

    def _delete_attempt(self, attempt: int) -> None:
        name = child_names(self.job_name, attempt).job
        if name not in self.d.delete_jobs:
            self.d.delete_jobs.append(name)

    def delete_stale_attempts(self, newer_too: bool = False) -> None:
        """Delete batch Jobs of earlier attempts (and, when finished, of any other)."""
        for attempt in self.observed.other_attempts:
            if attempt < self.s.attempt or (newer_too and attempt != self.s.attempt):
                self._delete_attempt(attempt)

    def for_job(self, planner: PlannerSettings) -> PlannerSettings:
        """Planner settings that keep the job off pools its namespace may not use and off
        pools its bound checkpoint volume cannot be mounted in (a zonal disk), and on one
        node where that volume cannot follow it to several."""
        claim = self.observed.checkpoint_claim
        held = single_node(
            self.job, self.settings.build, None if claim is None else _claim_access_modes(claim)
        )
        reach = self.observed.checkpoint_reach
        return replace(
            planner,
            tenant=self.observed.tenant,
            single_node_reason=None if held is None else held.reason,
            single_node_fix="" if held is None else held.fix,
            volume_pools=None if reach is None else reach.pools,
            volume_where="" if reach is None else f"volume {reach.volume}: {reach.where}",
        )

    def unplannable(self, reason: Reason, message: str) -> None:
        self.go.condition(ConditionType.PLANNED, False, reason, message)
        self.fail(reason, message)

    def running_trainers(self) -> int:
        return sum(1 for pod in self.observed.pods if p.trainer_running(pod))

    def accrue_cost(self) -> None:
        """Bill the time since the last update for what the attempt's trainers ran of it."""
        plan = self.s.plan
        if plan is None:
            return
        ran = [p.trainer_interval(pod) for pod in self.observed.pods]
        progress.accrue(self.s.cost, self.now, [r for r in ran if r is not None], plan.nodes)
