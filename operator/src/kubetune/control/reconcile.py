"""What the operator should do next for one FineTuneJob (pure).

`reconcile(job, observed, settings, now=..., load_arch=...)` looks at the job's spec and
status plus what exists in the cluster (its batch Job and pods, the GPU pools) and returns
a `Decision`: the new status, the manifests to create, the objects to delete and the
Events to post. The kopf handlers only gather `Observed` and carry out the `Decision`, so
every rule below is unit-tested without a cluster, and running it twice is harmless:
creates are create-if-absent and the status is recomputed from what is seen.

Life of a job (phases):

    Pending → (plan) → Queued ⇄ (capacity) → Running → Succeeded
                    ↘ Failed (infeasible)      ↓ ↑ suspend/resume, relaunch, OOM re-plan
                                               Failed (limits, budget, deadline, bad config)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from kubetune.api.errors import InfeasibleError, SpecError
from kubetune.api.v1alpha1 import (
    INT64_MAX,
    CheckpointStatus,
    CostStatus,
    FineTuneJob,
    FineTuneJobStatus,
    GPUPool,
    PlanStatus,
    ProgressStatus,
    Recovery,
    RecoveryReason,
    parse_duration,
)
from kubetune.control import conditions as c
from kubetune.control.builders import BuildSettings, build_children, child_names
from kubetune.planning.arch import ArchitectureError, ModelArch
from kubetune.planning.estimator import EstimatorError
from kubetune.planning.planner import PlannerSettings, plan_job, replan_settings_after_oom
from kubetune_trainer.contract import EXIT_CONFIG_ERROR, EXIT_OOM, EXIT_PREEMPTED, EXIT_STOPPED

Manifest = dict[str, Any]


@dataclass(frozen=True)
class ControllerSettings:
    build: BuildSettings = field(default_factory=BuildSettings)
    planner: PlannerSettings = field(default_factory=PlannerSettings)
    allow_network: bool = False
    """Fetch config.json of unknown hub models at plan time."""
    queue_retry_seconds: float = 15.0
    poll_seconds: float = 10.0
    reschedule_seconds: float = 120.0
    """A trainer pod unschedulable this long makes the job re-plan onto another pool."""


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


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Decision:
    status: FineTuneJobStatus
    create: list[Manifest] = field(default_factory=list)
    delete_jobs: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    delete_self: bool = False
    requeue_after: float | None = None

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.events.append(Event("Warning" if warning else "Normal", reason, message))


ArchLoader = Callable[[str], ModelArch]

FINISHED = ("Succeeded", "Failed")
JOB_ENDING_EXITS = (EXIT_OOM, EXIT_CONFIG_ERROR, EXIT_STOPPED)
"""Trainer exits on which the batch Job's podFailurePolicy fails the whole Job."""


def _ts(now: datetime) -> str:
    return c.now_rfc3339(now)


def _parse_ts(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def reconcile(
    job: FineTuneJob,
    observed: Observed,
    settings: ControllerSettings,
    *,
    now: datetime,
    load_arch: ArchLoader,
) -> Decision:
    status = (job.status or FineTuneJobStatus()).model_copy(deep=True)
    generation = job.metadata.get("generation")
    status.observed_generation = generation
    d = Decision(status=status)
    r = _Reconciler(job, observed, settings, now, load_arch, d, generation)
    r.run()
    return d


class _Reconciler:
    def __init__(
        self,
        job: FineTuneJob,
        observed: Observed,
        settings: ControllerSettings,
        now: datetime,
        load_arch: ArchLoader,
        decision: Decision,
        generation: int | None,
    ) -> None:
        self.job = job
        self.spec = job.spec
        self.observed = observed
        self.settings = settings
        self.now = now
        self.load_arch = load_arch
        self.d = decision
        self.s = decision.status
        self.generation = generation

    # ------------------------------------------------------------------ helpers

    def cond(self, type_: str, status: bool, reason: str, message: str = "") -> None:
        self.s.conditions = c.set_condition(
            self.s.conditions,
            type_,
            status,
            reason,
            message,
            now=self.now,
            generation=self.generation,
        )

    def fail(self, reason: str, message: str) -> None:
        self.s.phase = "Failed"
        self.s.message = message
        self.s.completion_time = self.s.completion_time or _ts(self.now)
        self.cond(c.FAILED, True, reason, message)
        self.cond(c.RUNNING, False, reason, message)
        self.d.event(reason, message, warning=True)
        self._stop_trainer()

    def _stop_trainer(self) -> None:
        if self.s.attempt and self.observed.batch_job is not None:
            name = child_names(self.job_name, self.s.attempt).job
            if name not in self.d.delete_jobs:
                self.d.delete_jobs.append(name)

    @property
    def model_id(self) -> str:
        """What planning reads the architecture from."""
        return self.spec.model.architecture or self.spec.model.uri

    @property
    def job_name(self) -> str:
        return str(self.job.metadata["name"])

    def pool(self, name: str) -> GPUPool | None:
        return next((p for p in self.observed.pools if p.name == name), None)

    # ------------------------------------------------------------------ entry

    def run(self) -> None:
        if self.s.phase in FINISHED:
            self.finished()
            return
        if self.spec.suspend:
            self.suspend()
            return
        if self.s.phase == "Running":
            self.adopt_lost_launch()
        self.delete_stale_attempts()
        if self.s.phase == "Suspended":
            self.cond(c.SUSPENDED, False, c.RESUMED, "resumed by spec.suspend=false")
            self.d.event(c.RESUMED, "Resuming from the latest checkpoint")
            self.launch()
            return
        if self.s.plan is None or self.s.phase in ("Pending", "Planning", "Queued"):
            self.plan_and_launch()
            return
        self.follow()

    # ------------------------------------------------------------------ finished / TTL

    def finished(self) -> None:
        self._stop_trainer_if_active()
        self.delete_stale_attempts(newer_too=True)
        ttl = self.spec.ttl_seconds_after_finished
        done = _parse_ts(self.s.completion_time)
        if ttl is None or done is None:
            return
        left = (done + timedelta(seconds=ttl) - self.now).total_seconds()
        if left <= 0:
            self.d.delete_self = True
        else:
            self.d.requeue_after = left

    def _stop_trainer_if_active(self) -> None:
        job = self.observed.batch_job
        if job is not None and (job.get("status") or {}).get("active"):
            self._stop_trainer()

    # ------------------------------------------------------------------ suspend

    def suspend(self) -> None:
        if self.s.phase != "Suspended":
            self.s.phase = "Suspended"
            self.s.message = "suspended; the trainer checkpoints on SIGTERM"
            self.cond(c.SUSPENDED, True, c.SUSPEND_REQUESTED, "spec.suspend is true")
            self.cond(c.RUNNING, False, c.SUSPEND_REQUESTED, "suspended")
            self.d.event(c.SUSPEND_REQUESTED, "Stopping the trainer; it checkpoints first")
            self.accrue()
        self._stop_trainer()
        self.delete_stale_attempts(newer_too=True)

    # ------------------------------------------------------------------ lost writes

    def adopt_lost_launch(self) -> None:
        """Follow a newer attempt whose launch the status never recorded.

        The operator creates children before it writes the status; stopped in between, it
        finds a batch Job one attempt ahead of `status.attempt`. Creating the old attempt's
        children again would run two trainers on one checkpoint folder.
        """
        newest = self.observed.attempt
        if newest > self.s.attempt:
            self.d.event(
                "Adopted",
                f"following attempt {newest}, launched before the operator could record it",
            )
            self.s.attempt = newest
            self.s.trainer_pods = []

    def delete_stale_attempts(self, newer_too: bool = False) -> None:
        """Delete batch Jobs of earlier attempts (and, when finished, of any other)."""
        for attempt in self.observed.other_attempts:
            if attempt < self.s.attempt or (newer_too and attempt != self.s.attempt):
                name = child_names(self.job_name, attempt).job
                if name not in self.d.delete_jobs:
                    self.d.delete_jobs.append(name)

    # ------------------------------------------------------------------ planning

    def plan_and_launch(self) -> None:
        if self.s.phase == "Pending":
            self.s.phase = "Planning"
        plan = self.make_plan(revision=1, reason="Initial", planner=self.settings.planner)
        if plan is None:
            return
        if plan[1]:
            self.s.phase = "Queued"
            self.s.plan = plan[0]
            msg = (
                f"waiting for {plan[0].total_gpus} free GPU(s) in pool {plan[0].pool}; "
                "re-planning periodically"
            )
            if not c.is_true(self.s.conditions, c.QUEUED):
                self.d.event(c.INSUFFICIENT_CAPACITY, msg)
            self.s.message = msg
            self.cond(c.QUEUED, True, c.INSUFFICIENT_CAPACITY, msg)
            self.d.requeue_after = self.settings.queue_retry_seconds
            return
        if c.get_condition(self.s.conditions, c.QUEUED) is not None:
            self.cond(c.QUEUED, False, c.CAPACITY_AVAILABLE, "capacity is free")
        self.s.plan = plan[0]
        self.launch()

    def make_plan(
        self, revision: int, reason: str, planner: PlannerSettings
    ) -> tuple[PlanStatus, bool] | None:
        """Plan the job; on failure record why and return None."""
        if not self.observed.pools:
            msg = "no GPUPool exists yet; create pools (see examples/gpupools.yaml)"
            self.cond(c.PLANNED, False, c.NO_POOLS, msg)
            self.s.message = msg
            self.d.requeue_after = self.settings.queue_retry_seconds
            return None
        try:
            arch = self.load_arch(self.model_id)
        except ArchitectureError as exc:
            self.cond(c.PLANNED, False, c.UNKNOWN_ARCHITECTURE, str(exc))
            self.fail(c.UNKNOWN_ARCHITECTURE, str(exc))
            return None
        try:
            plan = plan_job(self.spec, self.observed.pools, arch, planner)
        except InfeasibleError as exc:
            self.cond(c.PLANNED, False, c.INFEASIBLE, str(exc))
            self.fail(c.INFEASIBLE, str(exc))
            return None
        except EstimatorError as exc:  # e.g. LoRA target modules the model does not have
            self.cond(c.PLANNED, False, c.INVALID_SPEC, str(exc))
            self.fail(c.INVALID_SPEC, str(exc))
            return None
        status = plan.to_status(self.observed.pools, revision=revision, reason=reason)
        too_big = _first_int_over(status.to_wire(), INT64_MAX)
        if too_big is not None:
            msg = (
                f"the plan's {too_big} does not fit in a 64-bit integer: the job is far larger "
                "than any run. To fix: lower training.maxSteps, training.epochs or "
                "dataset.numExamples"
            )
            self.cond(c.PLANNED, False, c.INFEASIBLE, msg)
            self.fail(c.INFEASIBLE, msg)
            return None
        status.memory_scale = round(planner.memory_scale, 4)
        if not plan.queued:
            summary = (
                f"{status.method} on {status.nodes}×{status.gpus_per_node} {status.gpu_product} "
                f"(pool {status.pool}), ~{status.per_gpu_memory_gib:.1f} GiB/GPU, "
                f"~{status.estimated_duration_seconds / 3600:.1f} h, "
                f"~${status.estimated_cost_usd:,.2f}"
            )
            self.cond(c.PLANNED, True, c.PLAN_READY, summary)
            self.d.event(c.PLAN_READY, f"Plan r{revision}: {summary}")
        return status, plan.queued

    # ------------------------------------------------------------------ launch

    def launch(self) -> None:
        plan = self.s.plan
        assert plan is not None
        pool = self.pool(plan.pool)
        if pool is None:
            # The pool disappeared between plan and launch: plan again next time.
            self.s.plan = None
            self.s.phase = "Planning"
            self.d.requeue_after = self.settings.queue_retry_seconds
            return
        try:
            children = build_children(self.job, plan, pool, self.settings.build, self.s.attempt + 1)
        except SpecError as exc:
            self.fail(c.INVALID_SPEC, str(exc))
            return
        self.s.attempt += 1
        self.s.trainer_pods = []
        self.d.create.extend(children)
        self.s.phase = "Running"
        self.s.message = f"launched attempt {self.s.attempt}"
        self.s.start_time = self.s.start_time or _ts(self.now)
        self.s.progress = self._progress_with_total(plan)
        self.s.cost = self._cost_with_plan(plan)
        self.cond(c.RUNNING, False, c.PODS_STARTING, f"attempt {self.s.attempt}: pods starting")
        self.d.event("Launched", f"Attempt {self.s.attempt} on pool {plan.pool}")
        self.d.requeue_after = self.settings.poll_seconds

    def _progress_with_total(self, plan: PlanStatus) -> ProgressStatus:
        progress = self.s.progress or ProgressStatus()
        progress.total_steps = plan.total_steps
        progress.summary = f"{progress.step}/{plan.total_steps} ({progress.percent}%)"
        return progress

    def _cost_with_plan(self, plan: PlanStatus) -> CostStatus:
        cost = self.s.cost or CostStatus()
        cost.estimated_usd = plan.estimated_cost_usd
        cost.rate_usd_per_hour = plan.price_per_hour_usd
        cost.updated_at = _ts(self.now)
        return cost

    # ------------------------------------------------------------------ follow

    def accrue(self) -> None:
        """Add the plan's price for the time since the last update while the Job existed.

        GPUs are billed from the moment pods are bound, so Pending pods count too.
        Timestamps have one-second resolution: measure against the whole second that is
        recorded, or every update would add up to a second too much.
        """
        cost = self.s.cost
        if cost is None or cost.rate_usd_per_hour is None:
            return
        now = self.now.replace(microsecond=0)
        last = _parse_ts(cost.updated_at) or now
        seconds = max(0.0, (now - last).total_seconds())
        cost.accrued_usd = round(cost.accrued_usd + cost.rate_usd_per_hour * seconds / 3600, 6)
        cost.updated_at = _ts(now)

    def follow(self) -> None:
        plan = self.s.plan
        assert plan is not None
        self.d.requeue_after = self.settings.poll_seconds
        job = self.observed.batch_job
        if job is None:
            # Deleted behind our back, or not in the cache yet: create-if-absent again.
            pool = self.pool(plan.pool)
            if pool is not None and self.s.attempt:
                try:
                    children = build_children(
                        self.job, plan, pool, self.settings.build, self.s.attempt
                    )
                except SpecError as exc:
                    self.fail(c.INVALID_SPEC, str(exc))
                    return
                self.d.create.extend(children)
            return
        self.accrue()
        job_status = job.get("status") or {}
        if _job_condition(job_status, "Complete") or _job_condition(
            job_status, "SuccessCriteriaMet"
        ):
            self.succeed()
            return
        if _job_condition(job_status, "Failed") or _job_condition(job_status, "FailureTarget"):
            self.handle_failure(job_status)
            return
        self.record_pod_restarts(job_status)
        if self.move_if_stuck():
            return
        if self.check_limits():
            return
        if self.observed.trainer_metrics:
            self.read_progress(self.observed.trainer_metrics)
        if (job_status.get("ready") or 0) >= plan.nodes or (
            job_status.get("active") or 0
        ) >= plan.nodes:
            if not c.is_true(self.s.conditions, c.RUNNING):
                self.d.event(c.TRAINING, f"{plan.nodes} trainer pod(s) running")
            self.cond(c.RUNNING, True, c.TRAINING, f"attempt {self.s.attempt} training")

    def read_progress(self, m: Mapping[str, float]) -> None:
        """Progress, ETA and the newest checkpoint from the trainer's own metrics."""
        m = {k: v for k, v in m.items() if math.isfinite(v)}  # NaN is not valid JSON
        plan = self.s.plan
        assert plan is not None
        progress = self.s.progress or ProgressStatus()
        progress.step = int(m.get("step", progress.step))
        progress.total_steps = int(m.get("total_steps") or plan.total_steps)
        progress.epoch = round(float(m.get("epoch", progress.epoch)), 3)
        progress.percent = min(100, int(100 * progress.step / max(1, progress.total_steps)))
        if "loss" in m:
            progress.loss = round(float(m["loss"]), 4)
        if "eval_loss" in m:
            progress.eval_loss = round(float(m["eval_loss"]), 4)
        tps = float(m.get("tokens_per_second", 0.0))
        if tps > 0:
            progress.tokens_per_second = round(tps, 1)
            tokens_per_step = (
                self.spec.training.global_batch_size * self.spec.training.sequence_length
            )
            left = (progress.total_steps - progress.step) * tokens_per_step / tps
            progress.eta_seconds = round(left, 1)
            progress.eta = human_duration(left)
        progress.summary = f"{progress.step}/{progress.total_steps} ({progress.percent}%)"
        progress.updated_at = _ts(self.now)
        self.s.progress = progress
        step = int(m.get("last_checkpoint_step", 0))
        if step > 0 and (self.s.checkpoint is None or self.s.checkpoint.latest_step != step):
            self.s.checkpoint = CheckpointStatus(
                latest_step=step, time=_ts(self.now), path=f"step-{step}"
            )
            self.d.event("Checkpoint", f"checkpoint at step {step} is complete")

    def check_limits(self) -> bool:
        budget = self.spec.resources.max_cost_usd
        if budget is not None and self.s.cost is not None and self.s.cost.accrued_usd >= budget:
            self.fail(
                c.BUDGET_EXCEEDED,
                f"accrued ${self.s.cost.accrued_usd:,.2f} reached maxCostUSD ${budget:,.2f}; "
                "the trainer checkpoints on stop. To fix: raise spec.resources.maxCostUSD "
                "and create a new job to resume from the checkpoint volume",
            )
            return True
        deadline = self.spec.resources.deadline
        started = _parse_ts(self.s.start_time)
        if deadline and started and self.now - started >= parse_duration(deadline):
            self.fail(
                c.DEADLINE_EXCEEDED,
                f"training ran past the deadline {deadline}; the trainer checkpoints on stop",
            )
            return True
        return False

    def succeed(self) -> None:
        self.s.phase = "Succeeded"
        self.s.completion_time = _ts(self.now)
        self.s.message = "training finished"
        total = (self.s.progress or self.s.plan or ProgressStatus()).total_steps
        if total and (self.s.checkpoint is None or self.s.checkpoint.latest_step != total):
            # The trainer exits 0 only after it checkpointed the last step (its contract);
            # the last metrics read may have come before that checkpoint.
            self.s.checkpoint = CheckpointStatus(
                latest_step=total, time=_ts(self.now), path=f"step-{total}"
            )
        if self.s.progress is not None:
            self.s.progress.step = self.s.progress.total_steps
            self.s.progress.percent = 100
            self.s.progress.eta_seconds = 0
            self.s.progress.eta = "0s"
            self.s.progress.summary = f"{self.s.progress.step}/{self.s.progress.total_steps} (100%)"
        self.cond(c.RUNNING, False, c.COMPLETED, "trainer finished")
        self.cond(c.SUCCEEDED, True, c.COMPLETED, "trainer finished")
        self.d.event(c.COMPLETED, "Training finished")
        self.finished()

    # ------------------------------------------------------------------ failures

    def record_pod_restarts(self, job_status: Mapping[str, Any]) -> None:
        """Record each trainer pod of this attempt that ended early; the Job replaces it.

        A pod is seen ending (phase Failed: preempted when it was disrupted or exited with
        the preemption code, else a pod failure), or it is simply gone at the next look
        (deleted soon after it ended). A gone pod counts as a failure when the batch Job's
        `failed` counter — which leaves out the failures its podFailurePolicy ignores,
        i.e. preemptions — is ahead of the failures recorded so far, else as a preemption.
        """
        recorded = {
            r.message.split(" ", 2)[1]
            for r in self.s.recoveries
            if r.message.startswith("pod ") and r.attempt == self.s.attempt
        }
        current: dict[str, Mapping[str, Any]] = {}
        for pod in self.observed.pods:
            name = str((pod.get("metadata") or {}).get("name", ""))
            current[name] = pod
            if name in recorded or (pod.get("status") or {}).get("phase") != "Failed":
                continue
            code, detail = _trainer_exit([pod])
            if code in JOB_ENDING_EXITS:
                continue  # the batch Job fails on it; handle_failure takes it from there
            if _was_preempted(pod):
                self._record_pod_recovery("Preemption", f"pod {name} preempted")
            else:
                why = f"exit code {code}" if code is not None else "failed"
                self._record_pod_recovery("PodFailure", f"pod {name} failed ({why}: {detail})")
        job_failed = int(job_status.get("failed") or 0)
        for name in self.s.trainer_pods:
            if name in current or name in recorded:
                continue
            counted = sum(
                1
                for r in self.s.recoveries
                if r.reason == "PodFailure" and r.attempt == self.s.attempt
            )
            if job_failed > counted:
                self._record_pod_recovery("PodFailure", f"pod {name} failed and is gone")
            else:
                self._record_pod_recovery("Preemption", f"pod {name} preempted and is gone")
        self.s.trainer_pods = sorted(
            name
            for name, pod in current.items()
            if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        )

    def move_if_stuck(self) -> bool:
        """Re-plan when a trainer pod cannot be scheduled (its pool has no room any more).

        After a preemption the Job controller's replacement pod waits for room in the same
        pool. When it has waited `reschedule_seconds` and another allowed pool has free GPUs
        now, the job moves there: the batch Job is deleted and the new plan launches as a new
        attempt that resumes from the checkpoint. Otherwise it keeps waiting.
        """
        plan = self.s.plan
        assert plan is not None
        stuck = []
        for pod in self.observed.pods:
            since = _unschedulable_since(pod)
            if since and (self.now - since).total_seconds() >= self.settings.reschedule_seconds:
                stuck.append((str((pod.get("metadata") or {}).get("name", "")), since))
        if not stuck:
            return False
        elsewhere = [p for p in self.observed.pools if p.name != plan.pool]
        if not elsewhere:
            return False
        try:
            arch = self.load_arch(self.model_id)
            # What earlier out-of-memory re-plans learned still holds on the new pool.
            moved = plan_job(self.spec, elsewhere, arch, self.learned_planner(plan))
        except (ArchitectureError, InfeasibleError):
            return False
        if moved.queued:
            return False
        limit = self.spec.recovery.max_restarts
        if self.s.restarts >= limit:
            self.fail(
                c.RESTART_LIMIT,
                f"trainer pods found no room after {self.s.restarts} restarts "
                f"(spec.recovery.maxRestarts={limit})",
            )
            return True
        name, since = stuck[0]
        waited = (self.now - since).total_seconds()
        reason = f"Unschedulable: pod {name} found no room in pool {plan.pool} for {waited:.0f}s"
        new = moved.to_status(self.observed.pools, revision=plan.revision + 1, reason=reason)
        new.memory_scale = plan.memory_scale
        self.s.restarts += 1
        message = f"{reason}; moved to pool {new.pool} ({new.total_gpus} GPU(s))"
        self.add_recovery("Rescheduled", message)
        self.d.event("Rescheduled", message, warning=True)
        self._stop_trainer()
        self.s.plan = new
        self.launch()
        return True

    def _record_pod_recovery(self, reason: Literal["Preemption", "PodFailure"], tag: str) -> None:
        self.s.restarts += 1
        self.add_recovery(reason, tag)
        if reason == "Preemption":
            self.d.event(c.PREEMPTED, f"{tag}; it resumes from the latest checkpoint")
        else:
            self.d.event(c.TRAINER_FAILED, f"{tag}; it resumes from the latest checkpoint", True)

    def handle_failure(self, job_status: Mapping[str, Any]) -> None:
        code, detail = _trainer_exit(self.observed.pods)
        if code == EXIT_OOM:
            self.recover_oom(detail)
        elif code == EXIT_CONFIG_ERROR:
            self.fail(c.CONFIG_ERROR, f"the trainer rejected its config or data: {detail}")
        elif code == EXIT_STOPPED:
            self.fail(c.TRAINER_FAILED, f"the trainer stopped on request: {detail}")
        else:
            self.relaunch(code, detail)

    def relaunch(self, code: int | None, detail: str) -> None:
        limit = self.spec.recovery.max_restarts
        why = f"exit code {code}" if code is not None else "pod failure"
        if self.s.restarts >= limit:
            self.fail(
                c.RESTART_LIMIT,
                f"trainer failed ({why}: {detail}) after {self.s.restarts} restarts "
                f"(spec.recovery.maxRestarts={limit})",
            )
            return
        self.s.restarts += 1
        self.add_recovery("PodFailure", f"{why}: {detail}")
        self.d.event(c.TRAINER_FAILED, f"Trainer failed ({why}); relaunching", warning=True)
        self._stop_trainer()
        self.launch()

    def recover_oom(self, detail: str) -> None:
        plan = self.s.plan
        assert plan is not None
        ooms = sum(1 for r in self.s.recoveries if r.reason == "OOM")
        limit = self.spec.recovery.max_oom_replans
        if ooms >= limit:
            self.fail(
                c.OOM_LIMIT,
                f"out of GPU memory {ooms + 1} times (spec.recovery.maxOOMReplans={limit}). "
                "To fix: allow method qlora or more GPUs, or shorten training.sequenceLength",
            )
            return
        layout = _layout_key(plan)
        if layout not in self.s.failed_layouts:
            self.s.failed_layouts.append(layout)
        safer = replan_settings_after_oom(plan, self.learned_planner(plan), _peak_gib(detail))
        old_desc = (
            f"{plan.method} {plan.total_gpus}×{plan.pool} micro-batch {plan.micro_batch_size}"
        )
        new = self.make_plan(plan.revision + 1, f"OutOfMemory: {old_desc} ran out of memory", safer)
        if new is None:
            return
        new_plan, queued = new
        self.s.plan = new_plan
        message = (
            f"{old_desc} ran out of memory; re-planned to {new_plan.method} "
            f"{new_plan.total_gpus}×{new_plan.pool} micro-batch "
            f"{new_plan.micro_batch_size} checkpointing {new_plan.gradient_checkpointing}"
        )
        self.add_recovery("OOM", message)
        self.d.event(c.OUT_OF_MEMORY, message, warning=True)
        self._stop_trainer()
        if queued:
            self.s.phase = "Queued"
            self.cond(c.QUEUED, True, c.INSUFFICIENT_CAPACITY, "waiting for capacity after re-plan")
            self.d.requeue_after = self.settings.queue_retry_seconds
            return
        self.launch()

    def _ckpt_step(self) -> int | None:
        return self.s.checkpoint.latest_step if self.s.checkpoint else None

    def add_recovery(self, reason: RecoveryReason, message: str) -> None:
        """Append a recovery of the current attempt, resumed from the newest checkpoint."""
        self.s.recoveries.append(
            Recovery(
                reason=reason,
                time=_ts(self.now),
                step=self._ckpt_step(),
                attempt=self.s.attempt,
                message=message,
            )
        )

    def learned_planner(self, plan: PlanStatus) -> PlannerSettings:
        """Planner settings with what out-of-memory failures taught: the memory scale of
        `plan` and every layout that ran out of memory, forbidden."""
        return replace(
            self.settings.planner,
            memory_scale=plan.memory_scale,
            forbid=frozenset(_parse_layout(x) for x in self.s.failed_layouts),
        )


# ---------------------------------------------------------------------- pod inspection


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


def mark_failed(
    status: FineTuneJobStatus, reason: str, message: str, now: datetime
) -> FineTuneJobStatus:
    """`status` turned Failed for a reason found outside `reconcile` (the handlers')."""
    failed = status.model_copy(deep=True)
    failed.phase = "Failed"
    failed.message = message
    failed.completion_time = failed.completion_time or _ts(now)
    failed.conditions = c.set_condition(failed.conditions, c.FAILED, True, reason, message, now=now)
    failed.conditions = c.set_condition(
        failed.conditions, c.RUNNING, False, reason, message, now=now
    )
    return failed


def human_duration(seconds: float) -> str:
    """1h20m, 4m10s, 35s."""
    total = int(max(0.0, seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def _job_condition(job_status: Mapping[str, Any], type_: str) -> bool:
    return any(
        cond.get("type") == type_ and cond.get("status") == "True"
        for cond in job_status.get("conditions") or []
    )


def _trainer_terminations(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    out = []
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") != "trainer":
            continue
        for key in ("state", "lastState"):
            term = (cs.get(key) or {}).get("terminated")
            if term:
                out.append(term)
    return out


def _unschedulable_since(pod: Mapping[str, Any]) -> datetime | None:
    """When a Pending pod was found unschedulable (PodScheduled=False, Unschedulable)."""
    status = pod.get("status") or {}
    if status.get("phase") not in (None, "Pending") or (pod.get("spec") or {}).get("nodeName"):
        return None
    for cond in status.get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == "Unschedulable"
            # Another pool cannot fix a volume problem (a missing or unbound claim).
            and "volume" not in str(cond.get("message", "")).lower()
            and "persistentvolumeclaim" not in str(cond.get("message", "")).lower()
        ):
            return (
                _parse_ts(cond.get("lastTransitionTime"))
                if cond.get("lastTransitionTime")
                else None
            )
    return None


def _was_preempted(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if any(
        cond.get("type") == "DisruptionTarget" and cond.get("status") == "True"
        for cond in status.get("conditions") or []
    ):
        return True
    return any(t.get("exitCode") == EXIT_PREEMPTED for t in _trainer_terminations(pod))


def _trainer_exit(pods: Sequence[Mapping[str, Any]]) -> tuple[int | None, str]:
    """The most telling trainer exit among failed pods: OOM, then config error, then any."""
    seen: list[tuple[int, str]] = []
    for pod in pods:
        for term in _trainer_terminations(pod):
            code = term.get("exitCode")
            if code is None or code == 0:
                continue
            detail = (term.get("message") or term.get("reason") or "").strip()
            seen.append((int(code), detail[-500:]))
    for wanted in (EXIT_OOM, EXIT_CONFIG_ERROR, EXIT_STOPPED):
        for code, detail in seen:
            if code == wanted:
                return code, detail
    if seen:
        return seen[0]
    return None, "no trainer exit code recorded"


def _peak_gib(detail: str) -> float | None:
    """The trainer writes `peak_gib=<float>` into its termination message on OOM."""
    for token in detail.replace(",", " ").split():
        if token.startswith("peak_gib="):
            try:
                return float(token.split("=", 1)[1])
            except ValueError:
                return None
    return None


def _layout_key(plan: PlanStatus) -> str:
    return "/".join(
        [
            plan.pool,
            plan.method,
            str(plan.total_gpus),
            str(plan.micro_batch_size),
            "ckpt" if plan.gradient_checkpointing else "nockpt",
        ]
    )


def _parse_layout(key: str) -> tuple[str, Any, int, int, bool]:
    pool, method, gpus, micro, ckpt = key.split("/")
    return pool, method, int(gpus), int(micro), ckpt == "ckpt"
