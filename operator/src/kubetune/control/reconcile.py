"""What the operator should do next for one FineTuneJob (pure).

`reconcile(job, observed, settings, now=..., load_arch=...)` looks at the job's spec and
status plus what exists in the cluster (its batch Job and pods, the GPU pools) and returns
a `Decision`: the new status, the manifests to create, the objects to delete and the
Events to post. The kopf handlers only gather `Observed` and carry out the `Decision`, so
every rule below is unit-tested without a cluster, and running it twice is harmless:
creates are create-if-absent and the status is recomputed from what is seen.

One reconcile takes one of these paths, by the job's phase (control/lifecycle.py has the
phases and the legal moves between them):

    finished (Succeeded, Failed)  → stop what still runs, delete old attempts, TTL
    spec.suspend                  → Suspended: stop the trainer (it checkpoints first)
    Suspended, resumed            → relaunch from the checkpoint (plan first if never planned)
    Pending, Planning, Queued     → preflight (the claims and Secret it reads exist); the
                                    stage-in step for S3 sources (fetch, check, measure);
                                    plan with what was measured; launch, or queue for capacity
    Running                       → follow: success, failure (OOM re-plan, config error,
                                    relaunch), ended pods, a move to another pool, budget and
                                    deadline, progress, pods that do not start (and why)

The helpers in control/pods.py read the batch Job and pods; control/progress.py keeps
progress, checkpoint and cost; `lifecycle.Transitions` makes every phase change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from fnmatch import fnmatchcase
from typing import Any, Protocol

from kubetune.api.errors import InfeasibleError, SpecError
from kubetune.api.tenancy import Tenant
from kubetune.api.units import about, quantity_value, size
from kubetune.api.v1alpha1 import (
    CHAIN_SCHEME,
    INT64_MAX,
    EarlyStoppedStatus,
    ExportStatus,
    FineTuneJob,
    FineTuneJobSpec,
    FineTuneJobStatus,
    GPUPool,
    PlanStatus,
    ProgressStatus,
    Recovery,
    StageInStatus,
    StageOutStatus,
    UpstreamStatus,
    parse_duration,
)
from kubetune.api.vocabulary import (
    ANNOTATION_TEST_FAULTS,
    ConditionType,
    EventType,
    Phase,
    PlanReason,
    Reason,
    RecoveryReason,
    StepKind,
)
from kubetune.control import pods as p
from kubetune.control import progress
from kubetune.control.build.children import build_children
from kubetune.control.build.names import child_names
from kubetune.control.build.settings import BuildSettings
from kubetune.control.build.stages import (
    build_export,
    build_stage_in,
    build_stage_out,
    fetched_sources,
    gguf_uri,
    needs_export,
    needs_stage_in,
    needs_stage_out,
)
from kubetune.control.build.storage import (
    CACHE_CLAIM,
    InputRef,
    checkpoint_size,
    input_refs,
    single_node,
)
from kubetune.control.build.trainer import host_memory_gib, memory_quantity
from kubetune.control.conditions import get_condition, is_true, now_rfc3339
from kubetune.control.lifecycle import Transitions, is_finished
from kubetune.planning.arch import ArchitectureError, ModelArch, arch_from_hf_config
from kubetune.planning.estimator import EstimatorError
from kubetune.planning.planner import (
    Layout,
    Plan,
    PlannerSettings,
    plan_job,
    replan_settings_after_oom,
)
from kubetune_trainer.contract import (
    EXIT_CHECKPOINT_FAILED,
    EXIT_CONFIG_ERROR,
    EXIT_OOM,
    EXIT_STOPPED,
    ExportResult,
    StageInResult,
    StageOutResult,
)

Manifest = dict[str, Any]
ArchLoader = Callable[[str], ModelArch]
PlanFn = Callable[[FineTuneJobSpec, Sequence[GPUPool], ModelArch, PlannerSettings], Plan]
"""`planner.plan_job`, or a stand-in with its signature (the operator passes a cached one)."""


class AdmitFn(Protocol):
    """Asked before a new plan launches, with the plan and whether the planner found it must
    wait for capacity: None launches it, a message queues the job with that message. With
    `join=False` (a running job that would move to another pool) a message only means "not
    now": the job joins no queue. The operator passes its queue (controller/runtime.py);
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
    """What the launch preflight found missing of `builders.input_refs(job)` (read only
    before a launch; empty when all exist or they could not be read)."""
    lost_nodes: Mapping[str, str] = field(default_factory=dict)
    """Nodes of `pods` that are not Ready: node → since when ("" when not known)."""
    checkpoint_claim: Mapping[str, Any] | None = None
    """The job's checkpoint PersistentVolumeClaim (`spec` and `status`), if it exists."""
    checkpoint_class_expands: bool | None = None
    """Whether that claim's StorageClass allows volume expansion (None: not known)."""


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


def claim_access_modes(claim: Mapping[str, Any]) -> list[str]:
    """The access modes a PersistentVolumeClaim asked for."""
    return [str(mode) for mode in (claim.get("spec") or {}).get("accessModes") or []]


def may_create_stage_in(job: FineTuneJob, observed: Observed, settings: ControllerSettings) -> bool:
    """Whether a reconcile of `job` may create its stage-in step: only then does it need
    `Observed.cache_in_use` (what the step's cache eviction must keep)."""
    if observed.stage_in_job is not None or not needs_stage_in(job, settings.build):
        return False
    return job.status is None or not staged_in(job.status)


def needs_preflight(job: FineTuneJob) -> bool:
    """Whether a reconcile of `job` may launch a new attempt from where it is (not yet
    running, or suspended): only then are the claims and Secret it reads looked up."""
    phase = job.status.phase if job.status is not None else Phase.PENDING
    if job.spec.suspend:
        return False
    return phase in (Phase.PENDING, Phase.PLANNING, Phase.QUEUED, Phase.SUSPENDED)


def reconcile(
    job: FineTuneJob,
    observed: Observed,
    settings: ControllerSettings,
    *,
    now: datetime,
    load_arch: ArchLoader,
    plan: PlanFn = plan_job,
    admit: AdmitFn = wait_when_busy,
) -> Decision:
    status = (job.status or FineTuneJobStatus()).model_copy(deep=True)
    generation = job.metadata.get("generation")
    status.observed_generation = generation
    decision = Decision(status=status)
    _Reconciler(job, observed, settings, now, load_arch, decision, generation, plan, admit).run()
    return decision


class _Reconciler:
    """One reconcile of one job: reads `job` and `observed`, writes only `decision`."""

    def __init__(
        self,
        job: FineTuneJob,
        observed: Observed,
        settings: ControllerSettings,
        now: datetime,
        load_arch: ArchLoader,
        decision: Decision,
        generation: int | None,
        plan: PlanFn = plan_job,
        admit: AdmitFn = wait_when_busy,
    ) -> None:
        self.raw_model_uri = job.spec.model.uri
        job = chained(job, decision.status.upstream)
        self.job = job
        self.spec = measured_spec(job.spec, decision.status.stage_in)
        self.observed = observed
        self.settings = settings
        self.now = now
        self.load_arch = load_arch
        self.plan_job = plan
        self.admit = admit
        self.d = decision
        self.s = decision.status
        self.go = Transitions(decision.status, now, generation)

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

    # ------------------------------------------------------------------ entry

    def run(self) -> None:
        if is_finished(self.s):
            self.finished()
            return
        if self.spec.suspend:
            self.suspend()
            return
        if self.waiting_for_upstream():
            return
        if self.s.phase == Phase.RUNNING:
            self.adopt_lost_launch()
        self.delete_stale_attempts()
        if self.s.phase == Phase.SUSPENDED:
            if not self.inputs_missing():
                self.resume()
            return
        if self.s.plan is None or self.s.phase in (Phase.PENDING, Phase.PLANNING, Phase.QUEUED):
            if self.refused() or self.inputs_missing() or self.staging_in():
                return
            self.plan_and_launch()
            return
        self.follow()

    # ------------------------------------------------------------------ the end

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

    def finished(self) -> None:
        job = self.observed.batch_job
        if job is not None and (job.get("status") or {}).get("active"):
            self.stop_trainer()
        self.delete_stale_attempts(newer_too=True)
        ttl = self.spec.ttl_seconds_after_finished
        done = p.parse_time(self.s.completion_time)
        if ttl is None or done is None:
            return
        left = (done + timedelta(seconds=ttl) - self.now).total_seconds()
        if left <= 0:
            self.d.delete_self = True
        else:
            self.d.requeue_after = left

    # ------------------------------------------------------------------ suspend / resume

    def suspend(self) -> None:
        if self.s.phase != Phase.SUSPENDED:
            self.go.suspend()
            self.d.event(Reason.SUSPEND_REQUESTED, "Stopping the trainer; it checkpoints first")
            progress.accrue(self.s.cost, self.now, self.training_share())
        self.stop_trainer()
        self.delete_stale_attempts(newer_too=True)

    def resume(self) -> None:
        stopping = [p.pod_name(pod) for pod in self.observed.pods if self.still_stopping(pod)]
        if stopping:
            # The suspended attempt's trainer is still checkpointing: a new one now would
            # run two trainers on one checkpoint folder.
            self.s.message = f"resuming once the trainer stops: pod {', '.join(stopping)}"
            self.d.requeue_after = self.settings.poll_seconds
            return
        self.go.resume()
        self.d.event(Reason.RESUMED, "Resuming from the latest checkpoint")
        if self.s.plan is None:
            # Suspended before it was ever planned (or staged in): do that now.
            self.go.replan()
            if not self.staging_in():
                self.plan_and_launch()
            return
        self.launch()

    def still_stopping(self, pod: Mapping[str, Any]) -> bool:
        """A trainer pod that still runs, unless its deletion is long overdue (its node is
        gone: nothing runs there any more, and the pod object lingers)."""
        if p.pod_phase(pod) not in (p.PodPhase.PENDING, p.PodPhase.RUNNING):
            return False
        due = p.parse_time((pod.get("metadata") or {}).get("deletionTimestamp"))
        return due is None or (self.now - due).total_seconds() < OVERDUE_DELETION_SECONDS

    # ------------------------------------------------------------------ lost writes

    def adopt_lost_launch(self) -> None:
        """Follow a newer attempt whose launch the status never recorded.

        The operator creates the batch Job even when the apiserver rejected the status
        write that recorded its launch (and an older operator created children before it
        wrote the status): it then finds a batch Job one attempt ahead of `status.attempt`.
        Creating the old attempt's children again would run two trainers on one checkpoint
        folder.
        """
        newest = self.observed.attempt
        if newest > self.s.attempt:
            self.d.event(
                Reason.ADOPTED,
                f"following attempt {newest}, launched before the operator could record it",
            )
            self.s.attempt = newest
            self.s.trainer_pods = []

    def delete_stale_attempts(self, newer_too: bool = False) -> None:
        """Delete batch Jobs of earlier attempts (and, when finished, of any other)."""
        for attempt in self.observed.other_attempts:
            if attempt < self.s.attempt or (newer_too and attempt != self.s.attempt):
                self._delete_attempt(attempt)

    # ------------------------------------------------------------------ admins' rules

    def refused(self) -> bool:
        """Fail a job that asks for what the cluster's admins do not allow (before any GPU
        is spent): a trainer image off the allow-list, a Secret its namespace did not
        allow. True when it failed."""
        image = self.spec.trainer_image
        if image is not None and not self.image_allowed(image):
            allowed = [self.settings.build.trainer_image, *self.settings.allowed_trainer_images]
            self.fail(
                Reason.IMAGE_NOT_ALLOWED,
                f"spec.trainerImage {image!r} is not allowed on this cluster (allowed: "
                f"{', '.join(allowed)}). To fix: remove spec.trainerImage to use the "
                "operator's trainer image, or ask the cluster admin to add the image to the "
                "chart value operator.allowedTrainerImages",
            )
            return True
        tenant = self.observed.tenant
        if tenant is None:
            return False
        for ref in input_refs(self.job):
            refusal = ref.kind == "Secret" and tenant.secret_refusal(ref.name, ref.field)
            if refusal:
                self.fail(Reason.SECRET_NOT_ALLOWED, refusal)
                return True
        return False

    def image_allowed(self, image: str) -> bool:
        if image == self.settings.build.trainer_image:
            return True
        return any(fnmatchcase(image, pattern) for pattern in self.settings.allowed_trainer_images)

    # ------------------------------------------------------------------ launch preflight

    def inputs_missing(self) -> bool:
        """Hold a job whose claims or token Secret do not exist (before any GPU is asked
        for): condition InputsReady=False naming each, until they exist; after the startup
        timeout the job fails. True while it holds the job."""
        missing = self.observed.missing_inputs
        before = get_condition(self.s.conditions, ConditionType.INPUTS_READY)
        if not missing:
            if before is not None and before.status != "True":
                self.go.condition(
                    ConditionType.INPUTS_READY, True, Reason.INPUTS_FOUND, "every input exists"
                )
                self.d.event(Reason.INPUTS_FOUND, "Every claim and Secret the job reads exists")
            return False
        namespace = str(self.job.metadata.get("namespace") or "default")
        volume = any(m.ref.kind == "PersistentVolumeClaim" for m in missing)
        reason = Reason.MISSING_VOLUME if volume else Reason.MISSING_SECRET
        timeout = self.settings.startup_timeout_seconds
        what = "; ".join(m.describe(namespace) for m in missing)
        message = f"{what}. To fix: {_fix_missing(missing)}"
        since = p.parse_time(before.last_transition_time) if before is not None else None
        if before is None or before.status == "True" or since is None:
            since = self.now
        waited = (self.now - since).total_seconds()
        if waited >= timeout:
            self.go.condition(ConditionType.INPUTS_READY, False, reason, message)
            self.fail(reason, f"still missing after {waited:.0f}s: {message}")
            return True
        held = f"{message}; the job starts once it exists (it fails after {timeout:.0f}s)"
        if before is None or before.status == "True" or before.message != held:
            self.d.event(reason, held, warning=True)
        self.go.condition(ConditionType.INPUTS_READY, False, reason, held)
        self.s.message = held
        self.d.requeue_after = self.settings.queue_retry_seconds
        return True

    # ------------------------------------------------------------------ chained jobs

    def waiting_for_upstream(self) -> bool:
        """A job whose model is another FineTuneJob's result (`ftj://<name>`) waits in Pending
        until that one Succeeded, then takes where its whole model is (status.upstream); it
        fails when the upstream failed, does not exist, or writes no whole model. True while
        it holds the job."""
        uri = self.raw_model_uri
        if not uri.startswith(CHAIN_SCHEME) or self.s.upstream is not None:
            return False
        name = uri[len(CHAIN_SCHEME) :]
        up = self.observed.upstream
        self.d.requeue_after = self.settings.queue_retry_seconds
        if up is None:
            created = p.parse_time(self.job.metadata.get("creationTimestamp"))
            young = created is None or (self.now - created).total_seconds() < UPSTREAM_GRACE_SECONDS
            if not self.observed.upstream_read:
                # No answer, or a refusal (the operator's RBAC, the API server's trouble):
                # the operator's log has the status code.
                self.hold_for_upstream(name, "not read yet: the read got no answer")
                return True
            if young:
                self.hold_for_upstream(name, "not found yet")
                return True
            self.fail(
                Reason.UPSTREAM_FAILED,
                f"FineTuneJob {name} (spec.model.uri {uri}) does not exist in namespace "
                f"{self.job.metadata.get('namespace')}. To fix: create it, or point "
                "spec.model.uri at an existing job, then create this job again",
            )
            return True
        upstream_status = up.status or FineTuneJobStatus()
        if upstream_status.phase == Phase.FAILED:
            why = get_condition(upstream_status.conditions, ConditionType.FAILED)
            said = f"{why.reason}: {why.message[:300]}" if why else upstream_status.message
            self.fail(
                Reason.UPSTREAM_FAILED,
                f"the upstream FineTuneJob {name} failed ({said}). To fix: run {name} again "
                "until it succeeds, then create this job again",
            )
            return True
        if upstream_status.phase != Phase.SUCCEEDED:
            self.hold_for_upstream(name, f"phase {upstream_status.phase}")
            return True
        taken = upstream_result(up)
        if isinstance(taken, str):
            self.fail(Reason.UPSTREAM_FAILED, taken)
            return True
        self.s.upstream = taken
        self.job = chained(self.job, taken)
        self.spec = measured_spec(self.job.spec, self.s.stage_in)
        said = f"FineTuneJob {name} succeeded: training on its model at {taken.model_uri}"
        self.go.condition(ConditionType.UPSTREAM_READY, True, Reason.UPSTREAM_SUCCEEDED, said)
        self.d.event(Reason.UPSTREAM_SUCCEEDED, said)
        self.s.message = said
        self.d.requeue_after = None
        return False

    def hold_for_upstream(self, name: str, state: str) -> None:
        said = f"waiting for FineTuneJob {name} ({state}) to succeed: its model is this job's"
        if get_condition(self.s.conditions, ConditionType.UPSTREAM_READY) is None:
            self.d.event(Reason.WAITING_FOR_UPSTREAM, said)
        self.go.condition(ConditionType.UPSTREAM_READY, False, Reason.WAITING_FOR_UPSTREAM, said)
        self.s.message = said

    # ------------------------------------------------------------------ stage-in

    def staging_in(self) -> bool:
        """Run the stage-in step of a job with S3 sources before planning its launch: create
        it, follow it, fail the job with its reason, or take its measurements. True while it
        holds the job."""
        build = self.settings.build
        if not needs_stage_in(self.job, build) or staged_in(self.s):
            return False
        batch = self.observed.stage_in_job
        if batch is None and self.unplannable_before_staging():
            return True
        self.d.requeue_after = self.settings.poll_seconds
        if batch is None:
            try:
                keep = self.observed.cache_in_use
                self.d.create.extend(build_stage_in(self.job, build, keep_paths=keep))
            except SpecError as exc:
                self.fail(Reason.INVALID_SPEC, str(exc))
                return True
            self.go.plan()
            fetched = fetched_sources(self.job, build)
            what = (
                f"fetching {' and '.join(fetched)} into the namespace's cache (claim "
                f"{CACHE_CLAIM}), then checking and measuring the model and data"
                if fetched
                else f"reading the config.json of {self.job.spec.model.uri} and measuring "
                f"{self.job.spec.dataset.uri} (spec.model.architecture is unset)"
            )
            if get_condition(self.s.conditions, ConditionType.STAGED_IN) is None:
                self.d.event(Reason.STAGING_IN, what)
            self.go.condition(ConditionType.STAGED_IN, False, Reason.STAGING_IN, what)
            self.s.message = f"staging in: {what}"
            return True
        end = self.step_ended(StepKind.STAGE_IN, batch, self.observed.stage_in_pods)
        if end is None:
            self.show_stage_in_progress()
            return True
        if end.code == 0:
            staged = parse_stage_in(end.message)
            if staged is None:
                self.fail(Reason.STAGE_IN_FAILED, _no_result(StepKind.STAGE_IN, batch, end))
                return True
            staged.assumed_tokens = assumed_tokens(self.job.spec)
            self.s.stage_in = staged
            self.spec = measured_spec(self.job.spec, staged)
            # The trainer's children read where the files are from the job's status.
            self.job = self.job.model_copy(update={"status": self.s})
            summary = (
                f"staged in: {staged.examples} examples, {staged.tokens} tokens per epoch "
                f"(the plan assumed {staged.assumed_tokens}); {staged.downloaded_bytes} bytes "
                f"fetched, {staged.reused_bytes} reused from the cache"
            )
            self.go.condition(ConditionType.STAGED_IN, True, Reason.STAGED_IN, summary)
            self.d.event(Reason.STAGED_IN, summary)
            return False
        why = "a permanent failure" if end.code == EXIT_CONFIG_ERROR else "failed repeatedly"
        self.fail(Reason.STAGE_IN_FAILED, f"the stage-in step {why}: {end.message[-600:]}")
        return True

    def unplannable_before_staging(self) -> bool:
        """Fail a job no pool could ever run before its model is fetched (a 405B model on
        one GPU), when its architecture is known without the files. An architecture only
        the files tell is read by the stage-in step; one spec.model.architecture names
        wrongly fails now."""
        if not self.observed.pools:
            return False
        try:
            arch = self.model_arch()
            self.plan_job(self.spec, self.observed.pools, arch, self.for_job(self.settings.planner))
        except ArchitectureError as exc:
            if self.spec.model.architecture is None:
                return False
            self._unplannable(Reason.UNKNOWN_ARCHITECTURE, str(exc))
            return True
        except InfeasibleError as exc:
            self._unplannable(Reason.INFEASIBLE, str(exc))
            return True
        except EstimatorError:
            return False  # said by the plan after the stage-in, with the model's own config
        return False

    def show_stage_in_progress(self) -> None:
        """status.stageIn's bytes and files so far, from the stage-in pod's gauges."""
        scraped = self.observed.stage_in_metrics
        if not scraped:
            return
        done, total = (int(scraped.get(f"bytes_{k}", 0)) for k in ("done", "total"))
        files_done, files_total = (int(scraped.get(f"files_{k}", 0)) for k in ("done", "total"))
        self.s.stage_in = StageInStatus(
            bytes_done=done, bytes_total=total, files_done=files_done, files_total=files_total
        )
        if total:
            self.s.message = (
                f"staging in: {size(done)} of {size(total)}, {files_done} of {files_total} files"
            )
            # The Progress column of `kubectl get` until the launch counts steps instead.
            self.s.progress = ProgressStatus(summary=f"stage-in {size(done)}/{size(total)}")

    def step_ended(
        self, kind: StepKind, batch: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]
    ) -> p.StepEnd | None:
        """How a CPU step's Job ended: its last pod's exit, with code 0 when the Job
        succeeded and the pod's code (never 0) when it failed. None while it runs: then
        status.message says what its pod does, and a pod that does not start within the
        startup timeout fails the job."""
        status = batch.get("status") or {}
        end = p.step_end(pods, kind)
        if p.job_succeeded(status):
            return p.StepEnd(0, end.message)
        if p.job_failed(status):
            return p.StepEnd(end.code or 1, end.message)
        verb, doing = STEP_VERBS[kind]
        running = [p.pod_name(pod) for pod in pods if p.trainer_running(pod, kind.value)]
        waiting = p.most_telling([s for pod in pods if (s := p.startup(pod, kind.value))])
        if running:
            self.s.message = f"{verb}: pod {running[0]} {doing}"
        elif waiting is not None:
            self.s.message = f"{verb}: {waiting.message}"
            timeout = self.settings.startup_timeout_seconds
            if waiting.overdue(self.now, timeout):
                self.fail(
                    STEP_FAILURES[kind],
                    f"the {kind.value} pod did not start within {timeout:.0f}s: "
                    f"{waiting.message}. To fix: what the message names (the image, a Secret, "
                    "a claim), then create the job again",
                )
        return None

    # ------------------------------------------------------------------ after training

    def after_training(self, step: _AfterTraining) -> bool:
        """Run one CPU step after training succeeded (the export, the stage-out): create it,
        follow it, fail the job with its reason, or record what it did. True while it holds
        the job (the next step and the success wait for it)."""
        self.d.requeue_after = self.settings.poll_seconds
        condition, running, done = STEP_CONDITIONS[step.kind]
        failed = STEP_FAILURES[step.kind]
        if step.batch is None:
            try:
                self.d.create.extend(step.build())
                what = step.doing()
            except SpecError as exc:
                self.fail(Reason.INVALID_SPEC, str(exc))
                return True
            if get_condition(self.s.conditions, condition) is None:
                self.d.event(running, what)
            self.go.condition(condition, False, running, what)
            self.s.message = what
            return True
        end = self.step_ended(step.kind, step.batch, step.pods)
        if end is None:
            return True
        if end.code == 0:
            summary = step.record(end.message)
            if summary is None:
                self.fail(failed, f"{_no_result(step.kind, step.batch, end)}. {step.kept}")
                return True
            self.go.condition(condition, True, done, summary)
            self.d.event(done, summary)
            return False
        why = "a permanent failure" if end.code == EXIT_CONFIG_ERROR else "failed repeatedly"
        name = (step.batch.get("metadata") or {}).get("name")
        detail = end.message[-600:]
        then = (
            "Then"
            if "To fix" in detail
            else (f"To fix: read its log (`kubectl logs job/{name}`); then")
        )
        self.fail(
            failed,
            f"the {step.kind.value} step {why}: {detail}. {step.kept}. {then}, to "
            f"{step.again} without training again, delete this job and create it again under "
            f"the same name with {step.fixed}spec.checkpoint.resumeFromUID: "
            f"{self.job.metadata.get('uid')} (it resumes at the last step and {step.again}s)",
        )
        return True

    def exporting(self) -> bool:
        """The GGUF file spec.output.gguf asks for, written by the export step."""
        if not needs_export(self.job) or self.s.export is not None:
            return False

        def record(message: str) -> str | None:
            exported = parse_export(message, gguf_uri(self.job))
            if exported is None:
                return None
            self.s.export = exported
            return (
                f"wrote {exported.uri} ({exported.quantization}, {exported.bytes} bytes) in "
                f"{exported.seconds}s"
            )

        return self.after_training(
            _AfterTraining(
                kind=StepKind.EXPORT,
                batch=self.observed.export_job,
                pods=self.observed.export_pods,
                build=lambda: build_export(self.job, self.settings.build),
                doing=lambda: f"exporting the trained model to GGUF: {gguf_uri(self.job)}",
                record=record,
                kept="The trained output stays on its volume",
                again="export",
                fixed="the fixed spec.output.gguf and ",
            )
        )

    def staging_out(self) -> bool:
        """An `s3://` output, uploaded by the stage-out step (the job succeeds only after)."""
        if not needs_stage_out(self.job) or self.s.stage_out is not None:
            return False

        def record(message: str) -> str | None:
            uploaded = parse_stage_out(message)
            if uploaded is None:
                return None
            self.s.stage_out = uploaded
            return (
                f"uploaded {uploaded.files} files ({uploaded.bytes} bytes) to "
                f"{uploaded.destination}: {uploaded.uploaded_bytes} bytes sent, "
                f"{uploaded.skipped_bytes} already there"
            )

        pvc = child_names(self.job_name, 1).pvc
        return self.after_training(
            _AfterTraining(
                kind=StepKind.STAGE_OUT,
                batch=self.observed.stage_out_job,
                pods=self.observed.stage_out_pods,
                build=lambda: build_stage_out(self.job, self.settings.build),
                doing=lambda: f"uploading the output to {self.spec.output.uri}",
                record=record,
                kept=f"The output stays on the checkpoint volume ({pvc}, output/)",
                again="upload",
                fixed="",
            )
        )

    def for_job(self, planner: PlannerSettings) -> PlannerSettings:
        """Planner settings that keep the job off pools its namespace may not use, and on
        one node where its checkpoint volume cannot follow it to several."""
        claim = self.observed.checkpoint_claim
        held = single_node(
            self.job, self.settings.build, None if claim is None else claim_access_modes(claim)
        )
        return replace(
            planner,
            tenant=self.observed.tenant,
            single_node_reason=None if held is None else held.reason,
            single_node_fix="" if held is None else held.fix,
        )

    # ------------------------------------------------------------------ planning

    def plan_and_launch(self) -> None:
        self.go.plan()
        new = self.make_plan(1, PlanReason.INITIAL, None, self.settings.planner)
        if new is None:
            return
        self.s.plan = new.status
        message = self.admit(new.status, new.queued)
        if message is not None:
            if not is_true(self.s.conditions, ConditionType.QUEUED):
                self.d.event(Reason.INSUFFICIENT_CAPACITY, message)
            self.go.queue(message)
            self.d.requeue_after = self.settings.queue_retry_seconds
            return
        if get_condition(self.s.conditions, ConditionType.QUEUED) is not None:
            self.go.condition(
                ConditionType.QUEUED, False, Reason.CAPACITY_AVAILABLE, "capacity is free"
            )
        self.launch()

    def make_plan(
        self, revision: int, reason: PlanReason, message: str | None, planner: PlannerSettings
    ) -> NewPlan | None:
        """Plan the job; when it cannot be planned, record why and return None."""
        if not self.observed.pools:
            msg = "no GPUPool exists yet; create pools (see examples/gpupools.yaml)"
            self.go.condition(ConditionType.PLANNED, False, Reason.NO_POOLS, msg)
            self.s.message = msg
            self.d.requeue_after = self.settings.queue_retry_seconds
            return None
        try:
            arch = self.model_arch()
            plan = self.plan_job(self.spec, self.observed.pools, arch, self.for_job(planner))
        except ArchitectureError as exc:
            self._unplannable(Reason.UNKNOWN_ARCHITECTURE, str(exc))
            return None
        except InfeasibleError as exc:
            self._unplannable(Reason.INFEASIBLE, str(exc))
            return None
        except EstimatorError as exc:  # e.g. LoRA target modules the model does not have
            self._unplannable(Reason.INVALID_SPEC, str(exc))
            return None
        status = plan.to_status(
            self.observed.pools, revision=revision, reason=reason, message=message
        )
        too_big = _first_int_over(status.to_wire(), INT64_MAX)
        if too_big is not None:
            self._unplannable(
                Reason.INFEASIBLE,
                f"the plan's {too_big} does not fit in a 64-bit integer: the job is far larger "
                "than any run. To fix: lower training.maxSteps, training.epochs or "
                "dataset.numExamples",
            )
            return None
        status.memory_scale = round(planner.memory_scale, 4)
        self.set_host_memory(status, self.s.plan)
        # A plan that waits for capacity is a plan all the same. A queued job is planned
        # again on every look; it tells of a plan only when the plan changed.
        summary = (
            f"{status.method} on {status.nodes}×{status.gpus_per_node} {status.gpu_product} "
            f"(pool {status.pool}), ~{status.per_gpu_memory_gib:.1f} GiB/GPU, "
            f"~{about(status.estimated_duration_seconds)}, "
            f"~${status.estimated_cost_usd:,.2f}"
        )
        before = get_condition(self.s.conditions, ConditionType.PLANNED)
        new = before is None or before.status != "True" or before.message != summary
        self.go.condition(ConditionType.PLANNED, True, Reason.PLAN_READY, summary)
        if new:
            self.d.event(Reason.PLAN_READY, f"Plan r{revision}: {summary}")
        return NewPlan(status, plan.queued)

    def set_host_memory(self, status: PlanStatus, previous: PlanStatus | None) -> None:
        """The trainer pods' host memory of a new plan, with what host out-of-memory kills
        of the job taught (`previous` plan's scale)."""
        status.host_memory_scale = previous.host_memory_scale if previous is not None else 1.0
        status.host_memory_gib = host_memory_gib(status, self.settings.build)

    def _unplannable(self, reason: Reason, message: str) -> None:
        self.go.condition(ConditionType.PLANNED, False, reason, message)
        self.fail(reason, message)

    def learned_planner(self, plan: PlanStatus) -> PlannerSettings:
        """Planner settings with what out-of-memory failures taught: the memory scale of
        `plan` and every layout that ran out of memory, forbidden."""
        return replace(
            self.settings.planner,
            memory_scale=plan.memory_scale,
            forbid=frozenset(Layout.parse(key) for key in self.s.failed_layouts),
        )

    # ------------------------------------------------------------------ launch

    def launch(self) -> None:
        """Start the next attempt of the current plan (it resumes from the checkpoint)."""
        plan = self.s.plan
        assert plan is not None
        pool = self.pool(plan.pool)
        if pool is None:
            # The pool disappeared since the plan was made: plan again next time.
            self.go.replan()
            self.d.requeue_after = self.settings.queue_retry_seconds
            return
        attempt = self.s.attempt + 1
        try:
            children = build_children(self.job, plan, pool, self.settings.build, attempt)
        except SpecError as exc:
            self.fail(Reason.INVALID_SPEC, str(exc))
            return
        self.d.create.extend(children)
        self.fit_checkpoint_volume(plan)
        self.go.launch(attempt)
        progress.start_attempt(self.s, plan, self.now)
        self.d.event(Reason.LAUNCHED, f"Attempt {attempt} on pool {plan.pool}")
        faults = (self.job.metadata.get("annotations") or {}).get(ANNOTATION_TEST_FAULTS)
        if faults and not self.settings.build.allow_test_faults and attempt == 1:
            self.d.event(
                Reason.TEST_FAULTS_IGNORED,
                f"annotation {ANNOTATION_TEST_FAULTS} is ignored: this operator runs without "
                "KUBETUNE_ALLOW_TEST_FAULTS (Helm value operator.allowTestFaults), as a "
                "production operator should",
                warning=True,
            )
        self.d.requeue_after = self.settings.poll_seconds

    def fit_checkpoint_volume(self, plan: PlanStatus) -> None:
        """A plan that needs a larger checkpoint volume than the claim made with an earlier
        attempt asks for (a re-plan to full fine-tuning, more copies): raise the claim's
        request where its StorageClass allows expansion, else warn that it may run out."""
        claim = self.observed.checkpoint_claim
        if claim is None:
            return
        requests = ((claim.get("spec") or {}).get("resources") or {}).get("requests") or {}
        have = str(requests.get("storage") or "")
        want = checkpoint_size(self.job, plan)
        if not have or quantity_value(want) <= quantity_value(have):
            return
        name = str((claim.get("metadata") or {}).get("name"))
        storage_class = (claim.get("spec") or {}).get("storageClassName") or "(none)"
        needs = f"plan r{plan.revision} needs about {want} of checkpoints; {name} asks for {have}"
        if self.observed.checkpoint_class_expands:
            self.d.resize_claims.append((name, want))
            self.d.event(
                Reason.CHECKPOINT_VOLUME_EXPANDED,
                f"{needs}: its request was raised to {want} (StorageClass {storage_class} "
                "allows volume expansion)",
            )
            return
        self.d.event(
            Reason.CHECKPOINT_VOLUME_SMALL,
            f"{needs}, and its StorageClass {storage_class} does not allow volume expansion: "
            "the trainer may run out of room when it saves. To fix: expand the claim by hand "
            "if the storage allows it, lower spec.checkpoint.keep, or run the job again with "
            "a larger spec.checkpoint.storage.size",
            warning=True,
        )

    # ------------------------------------------------------------------ follow

    def follow(self) -> None:
        plan = self.s.plan
        assert plan is not None
        self.d.requeue_after = self.settings.poll_seconds
        job = self.observed.batch_job
        if job is None:
            self.recreate_children(plan)
            return
        progress.accrue(self.s.cost, self.now, self.training_share())
        job_status = job.get("status") or {}
        if p.job_succeeded(job_status):
            # Read while the trainer's pods are certain to be there (export and upload
            # steps may run long).
            self.s.early_stopped = self.s.early_stopped or p.early_stopped(self.observed.pods)
            if not self.exporting() and not self.staging_out():
                self.succeed()
            return
        if p.job_failed(job_status):
            self.handle_failure()
            return
        if self.record_ended_pods(job_status):
            return
        if self.move_if_stuck() or self.check_limits():
            return
        if self.relaunch_after_preemption(job_status):
            return
        if self.observed.trainer_metrics:
            step = progress.read_metrics(self.s, self.spec, self.observed.trainer_metrics, self.now)
            if step is not None:
                self.d.event(Reason.CHECKPOINT, f"checkpoint at step {step} is complete")
        if self.relaunch_if_stalled(plan):
            return
        if self.report_lost_nodes():
            return
        if self.running_trainers() >= plan.nodes:
            if not is_true(self.s.conditions, ConditionType.RUNNING):
                self.d.event(Reason.TRAINING, f"{plan.nodes} trainer pod(s) running")
                self.s.message = f"attempt {self.s.attempt} training"
            self.go.condition(
                ConditionType.RUNNING, True, Reason.TRAINING, f"attempt {self.s.attempt} training"
            )
            return
        self.follow_startup()

    def report_lost_nodes(self) -> bool:
        """A trainer pod whose node stopped being Ready: it shows as running, but nothing
        runs it, and no kubelet will confirm its end, so the batch Job cannot replace it
        until the node is deleted or taken out of service. Say so (condition Running=False,
        status.message, a Warning Event when it starts). Stall detection still relaunches
        the attempt after its timeout. True when one was found."""
        lost = sorted(
            (str(node), p.pod_name(pod))
            for pod in self.observed.pods
            if (node := (pod.get("spec") or {}).get("nodeName")) in self.observed.lost_nodes
            and p.pod_phase(pod) not in p.POD_DONE
        )
        if not lost:
            return False
        node, pod = lost[0]
        since = self.observed.lost_nodes[node]
        message = (
            f"pod {pod} is on node {node}, not Ready{f' since {since}' if since else ''}: its "
            "kubelet no longer reports, so the pod cannot be replaced until the node is gone. "
            "To fix: if the machine is lost, delete the Node object (or taint it "
            "node.kubernetes.io/out-of-service=nodeshutdown:NoExecute); the trainer then "
            "resumes from the latest checkpoint on another node"
        )
        before = get_condition(self.s.conditions, ConditionType.RUNNING)
        if before is None or before.reason != Reason.NODE_NOT_READY:
            self.d.event(Reason.NODE_NOT_READY, message, warning=True)
        self.go.condition(ConditionType.RUNNING, False, Reason.NODE_NOT_READY, message)
        self.s.message = f"attempt {self.s.attempt}: {message}"
        return True

    def running_trainers(self) -> int:
        return sum(1 for pod in self.observed.pods if p.trainer_running(pod))

    def training_share(self) -> float:
        """The fraction of the attempt's trainer pods that train now (what the job costs)."""
        plan = self.s.plan
        return self.running_trainers() / plan.nodes if plan is not None else 0.0

    def follow_startup(self) -> None:
        """Some trainers do not run: say why (condition Running=False with the reason,
        status.message, an Event when the reason changes), and fail the attempt when a pod
        with a node has not started within the startup timeout."""
        startups = [s for s in map(p.startup, self.observed.pods) if s is not None]
        shown = p.most_telling(startups)
        if shown is None:
            return  # pods not created yet (or not in the cache yet)
        before = get_condition(self.s.conditions, ConditionType.RUNNING)
        changed = before is None or before.reason != shown.reason
        if changed and shown.reason != Reason.PODS_STARTING:
            self.d.event(shown.reason, shown.message, warning=True)
        self.go.condition(ConditionType.RUNNING, False, shown.reason, shown.message)
        self.s.message = f"attempt {self.s.attempt}: {shown.message}"
        timeout = self.settings.startup_timeout_seconds
        stuck = p.most_telling([s for s in startups if s.overdue(self.now, timeout)])
        if stuck is None:
            return
        why = f"{stuck.message} (not started after {timeout:.0f}s)"
        if stuck.user_error:
            self.fail(Reason.STARTUP_TIMEOUT, f"{why}. To fix: {_fix_startup(stuck.reason)}")
            return
        if self.out_of_restarts(f"trainer did not start: {why}"):
            return
        self.s.restarts += 1
        self.add_recovery(RecoveryReason.POD_FAILURE, why, pod=stuck.pod)
        self.d.event(Reason.STARTUP_TIMEOUT, f"{why}; relaunching", warning=True)
        self.stop_trainer()
        self.launch()

    def recreate_children(self, plan: PlanStatus) -> None:
        """The batch Job was deleted behind our back, or is not in the cache yet:
        create-if-absent again."""
        pool = self.pool(plan.pool)
        if pool is None or not self.s.attempt:
            return
        try:
            children = build_children(self.job, plan, pool, self.settings.build, self.s.attempt)
        except SpecError as exc:
            self.fail(Reason.INVALID_SPEC, str(exc))
            return
        self.d.create.extend(children)

    def check_limits(self) -> bool:
        budget = self.spec.resources.max_cost_usd
        if budget is not None and self.s.cost is not None and self.s.cost.accrued_usd >= budget:
            self.fail(
                Reason.BUDGET_EXCEEDED,
                f"accrued ${self.s.cost.accrued_usd:,.2f} reached maxCostUSD ${budget:,.2f}; "
                "the trainer checkpoints on stop. To fix: delete this job and create it again "
                "under the same name with a higher spec.resources.maxCostUSD and "
                f"spec.checkpoint.resumeFromUID: {self.job.metadata.get('uid')} to resume from "
                "its checkpoint",
            )
            return True
        deadline = self.spec.resources.deadline
        started = p.parse_time(self.s.start_time)
        if deadline and started and self.now - started >= parse_duration(deadline):
            self.fail(
                Reason.DEADLINE_EXCEEDED,
                f"training ran past the deadline {deadline}; the trainer checkpoints on stop",
            )
            return True
        return False

    def succeed(self) -> None:
        """Succeeded: Completed, or EarlyStopped when the trainer said so (`follow` read its
        termination message into status.earlyStopped before the steps after training)."""
        stopped = self.s.early_stopped
        if stopped is None:
            self.go.succeed()
            self.d.event(Reason.COMPLETED, "Training finished")
        else:
            said = early_stop_message(stopped, self.s.progress)
            self.go.succeed(Reason.EARLY_STOPPED, said)
            self.d.event(Reason.EARLY_STOPPED, said)
        progress.complete(self.s, self.now)
        self.finished()

    # ------------------------------------------------------------------ recovery

    def add_recovery(self, reason: RecoveryReason, message: str, pod: str | None = None) -> None:
        """Record a handled failure of the current attempt; the run resumes from the newest
        checkpoint. Every reason is counted in `recoveryCounts`; the list itself keeps the
        current attempt's entries (control/pods.py tells its pods apart by them) and the
        latest of earlier attempts, up to KEEP_RECOVERIES in all."""
        self.s.recoveries.append(
            Recovery(
                reason=reason,
                time=now_rfc3339(self.now),
                step=self.s.checkpoint.latest_step if self.s.checkpoint else None,
                attempt=self.s.attempt,
                pod=pod,
                message=message,
            )
        )
        counts = self.s.recovery_counts
        if not counts and len(self.s.recoveries) > 1:  # a status from before the counters
            for earlier in self.s.recoveries[:-1]:
                counts[earlier.reason] = counts.get(earlier.reason, 0) + 1
        counts[reason] = counts.get(reason, 0) + 1
        self.s.recoveries = trim_recoveries(self.s.recoveries, self.s.attempt)

    def record_ended_pods(self, job_status: Mapping[str, Any]) -> bool:
        """Count each trainer pod of this attempt that ended early; the batch Job replaces
        it (control/pods.py `ended_pods` tells preemptions from failures). True when the job
        failed: preempted too often without progress."""
        look = p.ended_pods(
            self.observed.pods,
            self.s.trainer_pods,
            self.s.recoveries,
            self.s.attempt,
            int(job_status.get("failed") or 0),
        )
        killed = next((end for end in look.ended if end.host_oom), None)
        if killed is not None:
            # Its peers' ends are the same failure: the next attempt replaces them all.
            self.recover_host_oom(f"pod {killed.pod} ran out of host memory", pod=killed.pod)
            return True
        for end in look.ended:
            self.s.restarts += 1
            self.add_recovery(end.reason, end.message, pod=end.pod)
            tail = f"{end.message}; it resumes from the latest checkpoint"
            if end.reason == RecoveryReason.PREEMPTION:
                self.d.event(Reason.PREEMPTED, tail)
            else:
                self.d.event(Reason.TRAINER_FAILED, tail, warning=True)
        self.s.trainer_pods = look.alive
        in_a_row = preemptions_without_progress(self.s.recoveries)
        limit = self.spec.recovery.max_preemptions_without_progress
        if in_a_row > limit:
            self.fail(
                Reason.PREEMPTION_LIMIT,
                f"preempted {in_a_row} times in a row without a new checkpoint in between "
                f"(spec.recovery.maxPreemptionsWithoutProgress={limit}). To fix: run on "
                "on-demand pools (spec.resources.spot: never), checkpoint more often "
                "(spec.checkpoint.intervalSteps), or raise the limit",
            )
            return True
        return False

    def relaunch_after_preemption(self, job_status: Mapping[str, Any]) -> bool:
        """Start the next attempt at once when trainers of this one were preempted and none
        runs any more, rather than wait for the batch Job to replace them.

        The Job controller replaces a pod only after its back-off, and the back-off counts
        every failed pod, those its podFailurePolicy ignores (preemptions) included, until a
        pod succeeds or the Job is deleted: 10 s after the first preemption, 20 s after the
        second, doubling up to 10 minutes. A new batch Job starts with none. Where the Job
        controller already replaced a pod (it shows as alive here, or as active in the Job's
        status), that pod is followed instead, as is every pod still saving its checkpoint
        (the other nodes' pods of a multi-node attempt). True when it relaunched."""
        if self.s.trainer_pods or int(job_status.get("active") or 0):
            return False
        mine = [r for r in self.s.recoveries if r.attempt == self.s.attempt]
        if not mine or mine[-1].reason != RecoveryReason.PREEMPTION:
            return False  # a crash is left to the batch Job and its back-off
        self.stop_trainer()
        self.launch()
        return True

    def move_if_stuck(self) -> bool:
        """Re-plan when a trainer pod cannot be scheduled (its pool has no room any more).

        After a preemption the next attempt's pod (or the Job controller's replacement) waits
        for room in the same pool. When it has waited `reschedule_seconds` and another allowed
        pool has free GPUs now, the job moves there: the batch Job is deleted and the new plan
        launches as a new attempt that resumes from the checkpoint. Otherwise it keeps waiting.
        """
        plan = self.s.plan
        assert plan is not None
        stuck = []
        for pod in self.observed.pods:
            since = p.unschedulable_since(pod)
            if since and (self.now - since).total_seconds() >= self.settings.reschedule_seconds:
                stuck.append((p.pod_name(pod), since))
        if not stuck:
            return False
        elsewhere = [pool for pool in self.observed.pools if pool.name != plan.pool]
        if not elsewhere:
            return False
        try:
            arch = self.model_arch()
            # What earlier out-of-memory re-plans learned still holds on the new pool.
            moved = self.plan_job(
                self.spec, elsewhere, arch, self.for_job(self.learned_planner(plan))
            )
        except (ArchitectureError, InfeasibleError):
            return False
        if moved.queued:
            return False
        name, since = stuck[0]
        waited = (self.now - since).total_seconds()
        why = f"pod {name} found no room in pool {plan.pool} for {waited:.0f}s"
        new = moved.to_status(
            self.observed.pools,
            revision=plan.revision + 1,
            reason=PlanReason.UNSCHEDULABLE,
            message=why,
        )
        # The new pool's free GPUs go to the jobs queued for them first, and are reserved
        # for this one as for any launch: a move that skipped the queue would take the GPUs
        # the queue's front is launching into, and one of the two would be stuck in turn.
        if self.admit(new, False, join=False) is not None:
            return False
        if self.out_of_restarts("trainer pods found no room"):
            return True
        new.memory_scale = plan.memory_scale
        self.set_host_memory(new, plan)
        self.s.restarts += 1
        message = (
            f"{PlanReason.UNSCHEDULABLE}: {why}; moved to pool {new.pool} ({new.total_gpus} GPU(s))"
        )
        self.add_recovery(RecoveryReason.RESCHEDULED, message, pod=name)
        self.d.event(Reason.RESCHEDULED, message, warning=True)
        self.stop_trainer()
        self.s.plan = new
        self.launch()
        return True

    def handle_failure(self) -> None:
        """The batch Job failed: re-plan after an OOM, stop on a config error, a failed
        checkpoint or a requested stop, relaunch otherwise."""
        end = p.trainer_exit(self.observed.pods)
        if end.code == EXIT_OOM:
            self.recover_oom(end.detail)
        elif end.code == EXIT_CONFIG_ERROR:
            self.fail(
                Reason.TRAINER_CONFIG_ERROR,
                f"the trainer rejected its config or data: {end.detail}",
            )
        elif end.code == EXIT_CHECKPOINT_FAILED:
            self.fail(
                Reason.CHECKPOINT_FAILED,
                f"the trainer could not write or load a checkpoint: {end.detail}",
            )
        elif end.code == EXIT_STOPPED:
            self.fail(Reason.TRAINER_FAILED, f"the trainer stopped on request: {end.detail}")
        elif end.host_oom:
            self.recover_host_oom("a trainer ran out of host memory")
        else:
            self.relaunch(end)

    def out_of_restarts(self, what: str) -> bool:
        """Fail the job when it has used up spec.recovery.maxRestarts; `what` happened."""
        limit = self.spec.recovery.max_restarts
        if self.s.restarts < limit:
            return False
        self.fail(
            Reason.RESTART_LIMIT,
            f"{what} after {self.s.restarts} restarts (spec.recovery.maxRestarts={limit})",
        )
        return True

    def stall_timeout(self, plan: PlanStatus) -> float:
        """Seconds without step progress after which an attempt counts as stalled (0: never)."""
        own = self.spec.recovery.stall_timeout_seconds
        if own is not None:
            return float(own)
        step = plan.estimated_duration_seconds / max(1, plan.total_steps)
        return max(self.settings.training_stall_seconds, STALL_STEPS * step)

    def relaunch_if_stalled(self, plan: PlanStatus) -> bool:
        """Relaunch an attempt whose step count stopped moving (a hung rank, a stalled
        volume) from its checkpoint, as a restart; True when it did something."""
        timeout = self.stall_timeout(plan)
        stalled = progress.stalled_for(self.s, self.now)
        if timeout <= 0 or stalled is None or stalled < timeout:
            return False
        step = self.s.progress.step if self.s.progress else 0
        why = f"no step progress for {stalled:.0f}s (stall timeout {timeout:.0f}s) at step {step}"
        if self.out_of_restarts(f"trainer stalled ({why})"):
            return True
        self.s.restarts += 1
        self.add_recovery(RecoveryReason.STALLED, why)
        self.d.event(Reason.STALLED, f"Trainer stalled: {why}; relaunching from the checkpoint",
                     warning=True)  # fmt: skip
        self.stop_trainer()
        self.launch()
        return True

    def relaunch(self, end: p.TrainerExit) -> None:
        why = end.describe()
        if self.out_of_restarts(f"trainer failed ({why}: {end.detail})"):
            return
        self.s.restarts += 1
        self.add_recovery(RecoveryReason.POD_FAILURE, f"{why}: {end.detail}")
        self.d.event(Reason.TRAINER_FAILED, f"Trainer failed ({why}); relaunching", warning=True)
        self.stop_trainer()
        self.launch()

    def memory_replans(self) -> int:
        """Re-plans after running out of memory so far, GPU and host together (what
        spec.recovery.maxOOMReplans limits)."""
        kinds = (RecoveryReason.OOM, RecoveryReason.HOST_OOM)
        return max(
            sum(self.s.recovery_counts.get(kind, 0) for kind in kinds),
            sum(1 for r in self.s.recoveries if r.reason in kinds),
        )

    def recover_host_oom(self, what: str, pod: str | None = None) -> None:
        """The kernel killed a trainer for host memory (OOMKilled; `what` says which): relaunch
        the same layout with `pods.HOST_MEMORY_GROWTH` times the host memory, from the checkpoint.
        Fail when the out-of-memory budget is spent, or when the pool's nodes could not hold
        that much (its pods would never be scheduled)."""
        plan = self.s.plan
        assert plan is not None
        what = f"{what} ({p.HOST_OOM_REASON})"
        build = self.settings.build
        old = memory_quantity(plan.host_memory_gib or host_memory_gib(plan, build))
        replans, limit = self.memory_replans(), self.spec.recovery.max_oom_replans
        if replans >= limit:
            self.fail(
                Reason.OOM_LIMIT,
                f"{what} with {old} per trainer pod: out of memory {replans + 1} times, GPU and "
                f"host together (spec.recovery.maxOOMReplans={limit}). To fix: "
                f"{p.HOST_MEMORY_FIX}, or raise spec.recovery.maxOOMReplans",
            )
            return
        new = plan.model_copy(
            update={
                "revision": plan.revision + 1,
                "reason": PlanReason.HOST_OUT_OF_MEMORY,
                "host_memory_scale": round(plan.host_memory_scale * p.HOST_MEMORY_GROWTH, 4),
            }
        )
        new.host_memory_gib = host_memory_gib(new, build)
        more = f"{old} → {memory_quantity(new.host_memory_gib)} of host memory per trainer pod"
        pool = self.pool(plan.pool)
        room = pool.status.node_memory_gib if pool is not None and pool.status else None
        if room is not None and room < new.host_memory_gib:
            self.fail(
                Reason.HOST_MEMORY_UNAVAILABLE,
                f"{what}; the next attempt would need {more}, and the largest node of pool "
                f"{plan.pool} has {room:g} GiB allocatable: its pods could never be scheduled. "
                f"To fix: {p.HOST_MEMORY_FIX}",
            )
            return
        new.message = f"{what}; {more}"
        message = (
            f"{what}; relaunched from the latest checkpoint with {more}. To fix for good: "
            f"{p.HOST_MEMORY_FIX}"
        )
        self.s.plan = new
        self.add_recovery(RecoveryReason.HOST_OOM, message, pod=pod)
        self.d.event(Reason.HOST_OUT_OF_MEMORY, message, warning=True)
        self.stop_trainer()
        attempt = self.s.attempt
        self.launch()
        if self.s.attempt > attempt:
            self.s.message = f"launched attempt {self.s.attempt}: {message}"

    def recover_oom(self, detail: str) -> None:
        plan = self.s.plan
        assert plan is not None
        ooms = self.memory_replans()
        limit = self.spec.recovery.max_oom_replans
        if ooms >= limit:
            self.fail(
                Reason.OOM_LIMIT,
                f"out of GPU memory {ooms + 1} times (spec.recovery.maxOOMReplans={limit}). "
                "To fix: allow method qlora or more GPUs, or shorten training.sequenceLength",
            )
            return
        layout = Layout.of(plan).key()
        if layout not in self.s.failed_layouts:
            self.s.failed_layouts.append(layout)
        safer = replan_settings_after_oom(plan, self.learned_planner(plan), p.peak_gib(detail))
        old = f"{plan.method} {plan.total_gpus}×{plan.pool} micro-batch {plan.micro_batch_size}"
        phase = p.oom_phase(detail)
        ran_out = f"{old} ran out of memory" + (f" while {phase}" if phase else "")
        new = self.make_plan(plan.revision + 1, PlanReason.OUT_OF_MEMORY, ran_out, safer)
        if new is None:
            return
        self.s.plan = new.status
        message = (
            f"{ran_out}; re-planned to {new.status.method} "
            f"{new.status.total_gpus}×{new.status.pool} micro-batch "
            f"{new.status.micro_batch_size} checkpointing {new.status.gradient_checkpointing}"
        )
        self.add_recovery(RecoveryReason.OOM, message)
        self.d.event(Reason.OUT_OF_MEMORY, message, warning=True)
        self.stop_trainer()
        if new.queued:
            self.go.queue("waiting for capacity after re-plan")
            self.d.requeue_after = self.settings.queue_retry_seconds
            return
        self.launch()


def parse_stage_in(message: str) -> StageInStatus | None:
    """status.stageIn from the stage-in pod's termination message (a StageInResult as
    JSON); None when it is not one."""
    try:
        result = StageInResult.model_validate_json(message)
    except ValueError:  # pydantic's ValidationError, for bad JSON too
        return None
    return StageInStatus(
        model_path=result.model_path,
        dataset_path=result.dataset_path,
        examples=result.examples,
        tokens=result.tokens,
        downloaded_bytes=result.downloaded_bytes,
        reused_bytes=result.reused_bytes,
        seconds=round(result.seconds, 1),
        model_config_json=dict(result.model_config_json) or None,
    )


UPSTREAM_GRACE_SECONDS = 60.0
"""How long a job waits for an `ftj://` upstream that does not exist (both applied at once
may arrive in either order) before it fails."""


def upstream_result(up: FineTuneJob) -> UpstreamStatus | str:
    """Where a Succeeded FineTuneJob's whole model is, and what it is, for a job chained
    after it; a message with "To fix:" when it left none."""
    name = str(up.metadata.get("name"))
    spec, status = up.spec, up.status or FineTuneJobStatus()
    method = status.plan.method if status.plan is not None else spec.method
    if method in ("lora", "qlora") and not spec.output.merge_adapter:
        return (
            f"the upstream FineTuneJob {name} wrote a LoRA adapter only, not a whole model. "
            f"To fix: set spec.output.mergeAdapter: true on {name} and run it again, then "
            "create this job again"
        )
    folder = "model" if method == "full" else "merged"
    out = spec.output.uri
    if out is not None:
        model_uri = f"{out.rstrip('/')}/{folder}"
    elif spec.checkpoint.storage.retention == "delete":
        return (
            f"the upstream FineTuneJob {name} keeps its output on its checkpoint volume, "
            "which it deletes when it finishes (checkpoint.storage.retention: delete). To fix: "
            f"run {name} again with retention retain or an output.uri, then create this job "
            "again"
        )
    else:
        model_uri = f"pvc://{child_names(name, 1).pvc}/output/{folder}"
    base = spec.model.uri
    inherited = status.upstream.architecture if status.upstream is not None else None
    hub_id = not base.startswith(("pvc://", "s3://", "/", CHAIN_SCHEME))
    return UpstreamStatus(
        name=name,
        uid=str(up.metadata.get("uid") or ""),
        model_uri=model_uri,
        architecture=spec.model.architecture or inherited or (base if hub_id else None),
    )


def chained(job: FineTuneJob, upstream: UpstreamStatus | None) -> FineTuneJob:
    """The job as the rest of the reconcile sees it: an `ftj://` model replaced by where the
    upstream's model is (and its architecture, unless the spec names one)."""
    if upstream is None or not job.spec.model.uri.startswith(CHAIN_SCHEME):
        return job
    model = job.spec.model.model_copy(
        update={
            "uri": upstream.model_uri,
            "architecture": job.spec.model.architecture or upstream.architecture,
        }
    )
    return job.model_copy(update={"spec": job.spec.model_copy(update={"model": model})})


def staged_in(status: FineTuneJobStatus) -> bool:
    """Whether the stage-in step finished for the job (status.stageIn has its result, not
    only progress)."""
    return status.stage_in is not None and status.stage_in.model_path is not None


def parse_stage_out(message: str) -> StageOutStatus | None:
    """status.stageOut from the stage-out pod's termination message (a StageOutResult as
    JSON); None when it is not one."""
    try:
        result = StageOutResult.model_validate_json(message)
    except ValueError:
        return None
    return StageOutStatus(
        destination=result.destination,
        files=result.files,
        bytes=result.bytes,
        uploaded_bytes=result.uploaded_bytes,
        skipped_bytes=result.skipped_bytes,
        seconds=round(result.seconds, 1),
    )


def parse_export(message: str, uri: str) -> ExportStatus | None:
    """status.export from the export pod's termination message (an ExportResult as JSON);
    None when it is not one. `uri` says where the file is for the user (the pod's path is
    its mount)."""
    try:
        result = ExportResult.model_validate_json(message)
    except ValueError:
        return None
    return ExportStatus(
        uri=uri,
        quantization=result.quantization,
        bytes=result.bytes,
        seconds=round(result.seconds, 1),
    )


@dataclass(frozen=True)
class _AfterTraining:
    """A CPU step that runs after training succeeded, for `_Reconciler.after_training`."""

    kind: StepKind
    batch: Mapping[str, Any] | None
    pods: Sequence[Mapping[str, Any]]
    build: Callable[[], list[dict[str, Any]]]
    """The step's objects; raises SpecError."""
    doing: Callable[[], str]
    """What the step does, for status.message, the condition and the Event."""
    record: Callable[[str], str | None]
    """Record the step's result (its termination message) in status and return the summary;
    None when the message holds no result."""
    kept: str
    """What is left where, when the step fails."""
    again: str
    """The verb for running the step again without training ("export", "upload")."""
    fixed: str
    """What to fix in the spec first, as "the fixed … and " (or nothing)."""


STEP_CONDITIONS: dict[StepKind, tuple[ConditionType, Reason, Reason]] = {
    StepKind.EXPORT: (ConditionType.EXPORTED, Reason.EXPORTING, Reason.EXPORTED),
    StepKind.STAGE_OUT: (ConditionType.UPLOADED, Reason.UPLOADING, Reason.UPLOADED),
}
"""The condition of a step after training and its reasons while it runs and once done (its
failure's is STEP_FAILURES')."""


STEP_VERBS: dict[StepKind, tuple[str, str]] = {
    StepKind.STAGE_IN: ("staging in", "is fetching and measuring"),
    StepKind.EXPORT: ("exporting to GGUF", "is converting the model"),
    StepKind.STAGE_OUT: ("uploading the output", "is uploading"),
}
"""What status.message says while a step's pod waits or runs."""
STEP_FAILURES: dict[StepKind, Reason] = {
    StepKind.STAGE_IN: Reason.STAGE_IN_FAILED,
    StepKind.EXPORT: Reason.EXPORT_FAILED,
    StepKind.STAGE_OUT: Reason.UPLOAD_FAILED,
}


def _no_result(kind: StepKind, batch: Mapping[str, Any], end: p.StepEnd) -> str:
    name = (batch.get("metadata") or {}).get("name")
    return (
        f"the {kind.value} step ended without its result (termination message: "
        f"{end.message[:200]!r}). To fix: read its log (`kubectl logs job/{name}`) and create "
        "the job again"
    )


def assumed_tokens(spec: FineTuneJobSpec) -> int | None:
    """Tokens of one epoch the spec's hints give (None: the planner's default assumption)."""
    data = spec.dataset
    if data.total_tokens is not None:
        return data.total_tokens
    if data.num_examples is not None and data.avg_tokens_per_example is not None:
        return data.num_examples * data.avg_tokens_per_example
    return None


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


def _fix_missing(missing: Sequence[MissingInput]) -> str:
    fixes = []
    for m in missing:
        if m.ref.kind == "Secret":
            key = m.ref.key or "token"
            fixes.append(
                f"create it (`kubectl create secret generic {m.ref.name} "
                f"--from-literal={key}=<token>`) or correct {m.ref.field}"
            )
        else:
            fixes.append(f"create the claim {m.ref.name!r} or correct {m.ref.field}")
    return "; ".join(dict.fromkeys(fixes))


def _fix_startup(reason: Reason) -> str:
    if reason == Reason.IMAGE_PULL_FAILED:
        return (
            "check the image name and that the nodes can pull it (an imagePullSecret on the "
            "namespace's default ServiceAccount for a private registry)"
        )
    return (
        "create the Secret or ConfigMap the kubelet names, or correct the job; "
        "`kubectl describe pod` shows the kubelet's message"
    )


OVERDUE_DELETION_SECONDS = 60
"""A pod still there this long after its deletion was due (deletionTimestamp, which includes
the grace period) sits on a lost node: it no longer counts as running."""
STALL_STEPS = 20
"""An attempt is stalled after at least this many planned step times without progress."""
KEEP_RECOVERIES = 20
"""Entries of earlier attempts kept in status.recoveries (the current attempt's and a run of
preemptions without progress all stay: `trim_recoveries`)."""


def early_stop_message(stopped: EarlyStoppedStatus, progress: ProgressStatus | None) -> str:
    """What status.message and the Succeeded condition say of a run that stopped early."""
    total = f" of {progress.total_steps}" if progress is not None and progress.total_steps else ""
    value = f" {stopped.value:.4g}" if stopped.value is not None else ""
    evaluations = f" for {stopped.patience} evaluations" if stopped.patience else ""
    return (
        f"training stopped early at step {stopped.step}{total}: {stopped.metric} did not "
        f"improve{evaluations}; the output holds step {stopped.best_step}'s weights "
        f"({stopped.metric}{value})"
    )


def trim_recoveries(recoveries: list[Recovery], attempt: int) -> list[Recovery]:
    """At most KEEP_RECOVERIES entries, dropping the oldest of earlier attempts first. Two
    kinds stay: the current attempt's, since they tell its ended pods apart, and the
    preemptions in a row at the end, since spec.recovery.maxPreemptionsWithoutProgress
    counts them (each preemption starts an attempt of its own)."""
    excess = len(recoveries) - KEEP_RECOVERIES
    if excess <= 0:
        return recoveries
    run_start = _preemption_run(recoveries)[1]
    out = []
    for i, rec in enumerate(recoveries):
        if excess > 0 and rec.attempt != attempt and i < run_start:
            excess -= 1
            continue
        out.append(rec)
    return out


def preemptions_without_progress(recoveries: Sequence[Recovery]) -> int:
    """Preemptions at the end of `recoveries` with no newer checkpoint between them: a run
    preempted before it could save again.

    One preemption of a multi-node attempt ends every node's pod (all ranks checkpoint and
    exit with the preemption code), one recovery each: consecutive entries of the same
    attempt and step from pods of different completion indexes are one preemption; the same
    index again is the next one (its replacement pod was preempted too)."""
    return _preemption_run(recoveries)[0]


def _preemption_run(recoveries: Sequence[Recovery]) -> tuple[int, int]:
    """How many preemptions end `recoveries` without progress between them (as
    `preemptions_without_progress` counts), and the index of the run's first entry
    (len(recoveries) when there is none)."""
    run, step, attempt, indexes = 0, None, None, set[str]()
    first = len(recoveries)
    for i in range(len(recoveries) - 1, -1, -1):
        rec = recoveries[i]
        if rec.reason != RecoveryReason.PREEMPTION:
            break
        if step is not None and (rec.step or 0) < step:
            break  # progress was made between this preemption and the next
        first = i
        index = p.completion_index_of(rec.pod or "")
        same = run and rec.attempt == attempt and (rec.step or 0) == step
        if same and index is not None and index not in indexes:
            indexes.add(index)
            continue  # another node's pod of the same preemption
        step, attempt = rec.step or 0, rec.attempt
        indexes = {index} if index is not None else set()
        run += 1
    return run, first


def _first_int_over(value: Any, limit: int, path: str = "plan") -> str | None:
    """The path of the first integer in a wire dict larger than `limit` (Kubernetes int64)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return path if abs(value) > limit else None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _first_int_over(item, limit, f"{path}.{key}")
            if found:
                return found
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _first_int_over(item, limit, f"{path}[{i}]")
            if found:
                return found
    return None
