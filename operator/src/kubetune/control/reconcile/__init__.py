"""What the operator should do next for one FineTuneJob (pure).

`reconcile(job, observed, settings, now=..., load_arch=...)` looks at the job's spec and
status plus what exists in the cluster (its batch Job and pods, the GPU pools) and returns
a `Decision`: the new status, the manifests to create, the objects to delete and the
Events to post. The kopf handlers only gather `Observed` and carry out the `Decision`, so
every rule is unit-tested without a cluster, and running it twice is harmless: creates are
create-if-absent and the status is recomputed from what is seen.

One reconcile takes one of these paths (control/lifecycle.py has the phases and the legal
moves between them); `PHASE_HANDLERS` picks the path by phase, after the two checks that
come first for every unfinished job:

    spec.suspend                  → Suspended: stop the trainer (it checkpoints first)
                                    (suspension.py)
    an `ftj://` model             → wait until that FineTuneJob succeeded (upstream.py)
    Succeeded, Failed             → stop what still runs, delete old attempts, TTL (follow.py)
    Suspended, resumed            → relaunch from the checkpoint, plan first if never planned
                                    (suspension.py)
    Pending, Planning, Queued     → preflight: the admins' rules (policy.py, checked again
                                    before every launch and step), the claims and Secret it
                                    reads exist (preflight.py); the stage-in step for remote
                                    sources (stages.py); plan with what was measured; launch,
                                    or queue for capacity (launch.py)
    Running                       → follow: success and the steps after training, ended pods,
                                    budget and deadline, progress, lost nodes, pods that do
                                    not start (follow.py); failures, preemptions, stalls and
                                    moves to another pool (recovery.py)

Every part works on one `context.Context` (the job, what was observed, the Decision being
written). The helpers in control/pods.py read the batch Job and pods; control/progress.py
keeps progress, checkpoint and cost; `lifecycle.Transitions` makes every phase change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime

from kubetune.api.v1alpha1 import FineTuneJob, FineTuneJobStatus
from kubetune.api.vocabulary import Phase
from kubetune.control.lifecycle import Transitions, is_finished
from kubetune.control.reconcile.context import (
    AdmitFn,
    ArchLoader,
    Context,
    ControllerSettings,
    Decision,
    MissingInput,
    Observed,
    PlanFn,
    measured_spec,
    wait_when_busy,
)
from kubetune.control.reconcile.follow import adopt_lost_launch, finished, follow_attempt
from kubetune.control.reconcile.launch import plan_and_launch
from kubetune.control.reconcile.policy import refused
from kubetune.control.reconcile.preflight import inputs_missing, needs_preflight
from kubetune.control.reconcile.recovery import (
    KEEP_RECOVERIES,
    preemptions_without_progress,
    trim_recoveries,
)
from kubetune.control.reconcile.stages import may_create_stage_in, staging_in
from kubetune.control.reconcile.suspension import resume, suspend
from kubetune.control.reconcile.upstream import chained, upstream_result, waiting_for_upstream
from kubetune.planning.planner import plan_job

__all__ = [
    "KEEP_RECOVERIES",
    "PHASE_HANDLERS",
    "ControllerSettings",
    "Decision",
    "MissingInput",
    "Observed",
    "chained",
    "may_create_stage_in",
    "needs_preflight",
    "preemptions_without_progress",
    "reconcile",
    "trim_recoveries",
    "upstream_result",
]


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
    seen = chained(job, status.upstream)
    ctx = Context(
        job=seen,
        spec=measured_spec(seen.spec, status.stage_in),
        raw_model_uri=job.spec.model.uri,
        observed=observed,
        settings=settings,
        now=now,
        load_arch=load_arch,
        plan_job=plan,
        admit=admit,
        d=decision,
        go=Transitions(status, now, generation),
    )
    if not is_finished(ctx.s):
        if ctx.spec.suspend:
            suspend(ctx)
            return decision
        if waiting_for_upstream(ctx):
            return decision
    PHASE_HANDLERS[ctx.s.phase](ctx)
    return decision


def _start(ctx: Context) -> None:
    """Pending, Planning, Queued: launch once the preflight and the stage-in step let it."""
    ctx.delete_stale_attempts()
    _launch_when_ready(ctx)


def _launch_when_ready(ctx: Context) -> None:
    if refused(ctx) or inputs_missing(ctx) or staging_in(ctx):
        return
    plan_and_launch(ctx)


def _run(ctx: Context) -> None:
    """Running: follow the attempt (a status without a plan is planned first)."""
    adopt_lost_launch(ctx)
    ctx.delete_stale_attempts()
    if ctx.s.plan is None:
        _launch_when_ready(ctx)
        return
    follow_attempt(ctx)


def _resume(ctx: Context) -> None:
    """Suspended, and spec.suspend is off: resume once every input exists."""
    ctx.delete_stale_attempts()
    if not inputs_missing(ctx):
        resume(ctx)


PHASE_HANDLERS: Mapping[Phase, Callable[[Context], None]] = {
    Phase.PENDING: _start,
    Phase.PLANNING: _start,
    Phase.QUEUED: _start,
    Phase.RUNNING: _run,
    Phase.SUSPENDED: _resume,
    Phase.SUCCEEDED: finished,
    Phase.FAILED: finished,
}
"""What a reconcile does by the job's phase, once spec.suspend and an upstream still to
succeed have had their say (a finished job heeds neither)."""
