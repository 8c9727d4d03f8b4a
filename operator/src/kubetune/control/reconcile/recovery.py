"""After a failure: an OOM re-plans with a safer layout, a host OOM relaunches with more host
memory, a preempted, failed, stalled or unschedulable attempt is counted and relaunched from
its checkpoint, and a job out of restarts, re-plans or patience fails. Every handled failure
is recorded in status.recoveries."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kubetune.api.errors import InfeasibleError
from kubetune.api.v1alpha1 import PlanStatus, Recovery
from kubetune.api.vocabulary import PlanReason, Reason, RecoveryReason
from kubetune.control import pods as p
from kubetune.control import progress
from kubetune.control.build.trainer import host_memory_gib, memory_quantity
from kubetune.control.conditions import now_rfc3339
from kubetune.control.reconcile.context import Context
from kubetune.control.reconcile.launch import (
    launch_attempt,
    learned_planner,
    make_plan,
    set_host_memory,
)
from kubetune.planning.arch import ArchitectureError
from kubetune.planning.planner import Layout, replan_settings_after_oom
from kubetune_trainer.contract import (
    EXIT_CHECKPOINT_FAILED,
    EXIT_CONFIG_ERROR,
    EXIT_OOM,
    EXIT_STOPPED,
    EXIT_SUPERSEDED,
)

STALL_STEPS = 20
"""An attempt is stalled after at least this many planned step times without progress."""


KEEP_RECOVERIES = 20
"""Entries of earlier attempts kept in status.recoveries (the current attempt's and a run of
preemptions without progress all stay: `trim_recoveries`)."""


def add_recovery(
    ctx: Context, reason: RecoveryReason, message: str, pod: str | None = None
) -> None:
    """Record a handled failure of the current attempt; the run resumes from the newest
    checkpoint. Every reason is counted in `recoveryCounts`; the list itself keeps the
    current attempt's entries (control/pods.py tells its pods apart by them) and the
    latest of earlier attempts, up to KEEP_RECOVERIES in all."""
    ctx.s.recoveries.append(
        Recovery(
            reason=reason,
            time=now_rfc3339(ctx.now),
            step=ctx.s.checkpoint.latest_step if ctx.s.checkpoint else None,
            attempt=ctx.s.attempt,
            pod=pod,
            message=message,
        )
    )
    counts = ctx.s.recovery_counts
    if not counts and len(ctx.s.recoveries) > 1:  # a status from before the counters
        for earlier in ctx.s.recoveries[:-1]:
            counts[earlier.reason] = counts.get(earlier.reason, 0) + 1
    counts[reason] = counts.get(reason, 0) + 1
    ctx.s.recoveries = trim_recoveries(ctx.s.recoveries, ctx.s.attempt)


def record_ended_pods(ctx: Context, job_status: Mapping[str, Any]) -> bool:
    """Count each trainer pod of this attempt that ended early; the batch Job replaces
    it (control/pods.py `ended_pods` tells preemptions from failures). True when the job
    failed: preempted too often without progress."""
    look = p.ended_pods(
        ctx.observed.pods,
        ctx.s.trainer_pods,
        ctx.s.recoveries,
        ctx.s.attempt,
        int(job_status.get("failed") or 0),
    )
    killed = next((end for end in look.ended if end.host_oom), None)
    if killed is not None:
        # Its peers' ends are the same failure: the next attempt replaces them all.
        _recover_host_oom(ctx, f"pod {killed.pod} ran out of host memory", pod=killed.pod)
        return True
    for end in look.ended:
        ctx.s.restarts += 1
        add_recovery(ctx, end.reason, end.message, pod=end.pod)
        tail = f"{end.message}; it resumes from the latest checkpoint"
        if end.reason == RecoveryReason.PREEMPTION:
            ctx.d.event(Reason.PREEMPTED, tail)
        else:
            ctx.d.event(Reason.TRAINER_FAILED, tail, warning=True)
    ctx.s.trainer_pods = look.alive
    in_a_row = preemptions_without_progress(ctx.s.recoveries)
    limit = ctx.spec.recovery.max_preemptions_without_progress
    if in_a_row > limit:
        ctx.fail(
            Reason.PREEMPTION_LIMIT,
            f"preempted {in_a_row} times in a row without a new checkpoint in between "
            f"(spec.recovery.maxPreemptionsWithoutProgress={limit}). To fix: run on "
            "on-demand pools (spec.resources.spot: never), checkpoint more often "
            "(spec.checkpoint.intervalSteps), or raise the limit",
        )
        return True
    return False


def relaunch_after_preemption(ctx: Context, job_status: Mapping[str, Any]) -> bool:
    """Start the next attempt at once when trainers of this one were preempted and none
    runs any more, rather than wait for the batch Job to replace them.

    The Job controller replaces a pod only after its back-off, and the back-off counts
    every failed pod, those its podFailurePolicy ignores (preemptions) included, until a
    pod succeeds or the Job is deleted: 10 s after the first preemption, 20 s after the
    second, doubling up to 10 minutes. A new batch Job starts with none. Where the Job
    controller already replaced a pod (it shows as alive here, or as active in the Job's
    status), that pod is followed instead, as is every pod still saving its checkpoint
    (the other nodes' pods of a multi-node attempt). True when it relaunched."""
    if ctx.s.trainer_pods or int(job_status.get("active") or 0):
        return False
    mine = [r for r in ctx.s.recoveries if r.attempt == ctx.s.attempt]
    if not mine or mine[-1].reason != RecoveryReason.PREEMPTION:
        return False  # a crash is left to the batch Job and its back-off
    ctx.stop_trainer()
    launch_attempt(ctx)
    return True


def move_if_stuck(ctx: Context) -> bool:
    """Re-plan when a trainer pod cannot be scheduled (its pool has no room any more).

    After a preemption the next attempt's pod (or the Job controller's replacement) waits
    for room in the same pool. When it has waited `reschedule_seconds` and another allowed
    pool has free GPUs now, the job moves there: the batch Job is deleted and the new plan
    launches as a new attempt that resumes from the checkpoint. Otherwise it keeps waiting.
    """
    plan = ctx.s.plan
    assert plan is not None
    stuck = []
    for pod in ctx.observed.pods:
        since = p.unschedulable_since(pod)
        if since and (ctx.now - since).total_seconds() >= ctx.settings.reschedule_seconds:
            stuck.append((p.pod_name(pod), since))
    if not stuck:
        return False
    elsewhere = [pool for pool in ctx.observed.pools if pool.name != plan.pool]
    if not elsewhere:
        return False
    try:
        arch = ctx.model_arch()
        # What earlier out-of-memory re-plans learned still holds on the new pool.
        moved = ctx.plan_job(ctx.spec, elsewhere, arch, ctx.for_job(learned_planner(ctx, plan)))
    except (ArchitectureError, InfeasibleError):
        return False
    if moved.queued:
        return False
    name, since = stuck[0]
    waited = (ctx.now - since).total_seconds()
    why = f"pod {name} found no room in pool {plan.pool} for {waited:.0f}s"
    new = moved.to_status(
        ctx.observed.pools,
        revision=plan.revision + 1,
        reason=PlanReason.UNSCHEDULABLE,
        message=why,
    )
    # The new pool's free GPUs go to the jobs queued for them first, and are reserved
    # for this one as for any launch: a move that skipped the queue would take the GPUs
    # the queue's front is launching into, and one of the two would be stuck in turn.
    if ctx.admit(new, False, join=False) is not None:
        return False
    if out_of_restarts(ctx, "trainer pods found no room"):
        return True
    new.memory_scale = plan.memory_scale
    set_host_memory(ctx, new, plan)
    ctx.s.restarts += 1
    message = (
        f"{PlanReason.UNSCHEDULABLE}: {why}; moved to pool {new.pool} ({new.total_gpus} GPU(s))"
    )
    add_recovery(ctx, RecoveryReason.RESCHEDULED, message, pod=name)
    ctx.d.event(Reason.RESCHEDULED, message, warning=True)
    ctx.stop_trainer()
    ctx.s.plan = new
    launch_attempt(ctx)
    return True


def handle_failure(ctx: Context) -> None:
    """The batch Job failed: re-plan after an OOM, stop on a config error, a failed
    checkpoint or a requested stop, relaunch otherwise."""
    end = p.trainer_exit(ctx.observed.pods)
    if end.code == EXIT_OOM:
        _recover_oom(ctx, end.detail)
    elif end.code == EXIT_CONFIG_ERROR:
        ctx.fail(
            Reason.TRAINER_CONFIG_ERROR,
            f"the trainer rejected its config or data: {end.detail}",
        )
    elif end.code == EXIT_CHECKPOINT_FAILED:
        ctx.fail(
            Reason.CHECKPOINT_FAILED,
            f"the trainer could not write or load a checkpoint: {end.detail}",
        )
    elif end.code == EXIT_SUPERSEDED:  # the folder names a later attempt than the current
        ctx.fail(
            Reason.CHECKPOINT_FAILED,
            f"the checkpoint folder is claimed by a later attempt of this job: {end.detail}",
        )
    elif end.code == EXIT_STOPPED:
        ctx.fail(Reason.TRAINER_FAILED, f"the trainer stopped on request: {end.detail}")
    elif end.host_oom:
        _recover_host_oom(ctx, "a trainer ran out of host memory")
    else:
        _relaunch(ctx, end)


def out_of_restarts(ctx: Context, what: str) -> bool:
    """Fail the job when it has used up spec.recovery.maxRestarts; `what` happened."""
    limit = ctx.spec.recovery.max_restarts
    if ctx.s.restarts < limit:
        return False
    ctx.fail(
        Reason.RESTART_LIMIT,
        f"{what} after {ctx.s.restarts} restarts (spec.recovery.maxRestarts={limit})",
    )
    return True


def _stall_timeout(ctx: Context, plan: PlanStatus) -> float:
    """Seconds without step progress after which an attempt counts as stalled (0: never)."""
    own = ctx.spec.recovery.stall_timeout_seconds
    if own is not None:
        return float(own)
    step = plan.estimated_duration_seconds / max(1, plan.total_steps)
    return max(ctx.settings.training_stall_seconds, STALL_STEPS * step)


def relaunch_if_stalled(ctx: Context, plan: PlanStatus) -> bool:
    """Relaunch an attempt whose step count stopped moving (a hung rank, a stalled
    volume) from its checkpoint, as a restart; True when it did something."""
    timeout = _stall_timeout(ctx, plan)
    stalled = progress.stalled_for(ctx.s, ctx.now)
    if timeout <= 0 or stalled is None or stalled < timeout:
        return False
    step = ctx.s.progress.step if ctx.s.progress else 0
    why = f"no step progress for {stalled:.0f}s (stall timeout {timeout:.0f}s) at step {step}"
    if out_of_restarts(ctx, f"trainer stalled ({why})"):
        return True
    ctx.s.restarts += 1
    add_recovery(ctx, RecoveryReason.STALLED, why)
    ctx.d.event(Reason.STALLED, f"Trainer stalled: {why}; relaunching from the checkpoint",
                 warning=True)  # fmt: skip
    ctx.stop_trainer()
    launch_attempt(ctx)
    return True


def _relaunch(ctx: Context, end: p.TrainerExit) -> None:
    why = end.describe()
    if out_of_restarts(ctx, f"trainer failed ({why}: {end.detail})"):
        return
    ctx.s.restarts += 1
    add_recovery(ctx, RecoveryReason.POD_FAILURE, f"{why}: {end.detail}")
    ctx.d.event(Reason.TRAINER_FAILED, f"Trainer failed ({why}); relaunching", warning=True)
    ctx.stop_trainer()
    launch_attempt(ctx)


def _memory_replans(ctx: Context) -> int:
    """Re-plans after running out of memory so far, GPU and host together (what
    spec.recovery.maxOOMReplans limits)."""
    kinds = (RecoveryReason.OOM, RecoveryReason.HOST_OOM)
    return max(
        sum(ctx.s.recovery_counts.get(kind, 0) for kind in kinds),
        sum(1 for r in ctx.s.recoveries if r.reason in kinds),
    )


def _recover_host_oom(ctx: Context, what: str, pod: str | None = None) -> None:
    """The kernel killed a trainer for host memory (OOMKilled; `what` says which): relaunch
    the same layout with `pods.HOST_MEMORY_GROWTH` times the host memory, from the checkpoint.
    Fail when the out-of-memory budget is spent, or when the pool's nodes could not hold
    that much (its pods would never be scheduled)."""
    plan = ctx.s.plan
    assert plan is not None
    what = f"{what} ({p.HOST_OOM_REASON})"
    build = ctx.settings.build
    old = memory_quantity(plan.host_memory_gib or host_memory_gib(plan, build))
    replans, limit = _memory_replans(ctx), ctx.spec.recovery.max_oom_replans
    if replans >= limit:
        ctx.fail(
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
    pool = ctx.pool(plan.pool)
    room = pool.status.node_memory_gib if pool is not None and pool.status else None
    if room is not None and room < new.host_memory_gib:
        ctx.fail(
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
    ctx.s.plan = new
    add_recovery(ctx, RecoveryReason.HOST_OOM, message, pod=pod)
    ctx.d.event(Reason.HOST_OUT_OF_MEMORY, message, warning=True)
    ctx.stop_trainer()
    attempt = ctx.s.attempt
    launch_attempt(ctx)
    if ctx.s.attempt > attempt:
        ctx.s.message = f"launched attempt {ctx.s.attempt}: {message}"


def _recover_oom(ctx: Context, detail: str) -> None:
    plan = ctx.s.plan
    assert plan is not None
    ooms = _memory_replans(ctx)
    limit = ctx.spec.recovery.max_oom_replans
    if ooms >= limit:
        ctx.fail(
            Reason.OOM_LIMIT,
            f"out of GPU memory {ooms + 1} times (spec.recovery.maxOOMReplans={limit}). "
            "To fix: allow method qlora or more GPUs, or shorten training.sequenceLength",
        )
        return
    layout = Layout.of(plan).key()
    if layout not in ctx.s.failed_layouts:
        ctx.s.failed_layouts.append(layout)
    safer = replan_settings_after_oom(plan, learned_planner(ctx, plan), p.peak_gib(detail))
    old = f"{plan.method} {plan.total_gpus}×{plan.pool} micro-batch {plan.micro_batch_size}"
    phase = p.oom_phase(detail)
    ran_out = f"{old} ran out of memory" + (f" while {phase}" if phase else "")
    new = make_plan(ctx, plan.revision + 1, PlanReason.OUT_OF_MEMORY, ran_out, safer)
    if new is None:
        return
    ctx.s.plan = new.status
    message = (
        f"{ran_out}; re-planned to {new.status.method} "
        f"{new.status.total_gpus}×{new.status.pool} micro-batch "
        f"{new.status.micro_batch_size} checkpointing {new.status.gradient_checkpointing}"
    )
    add_recovery(ctx, RecoveryReason.OOM, message)
    ctx.d.event(Reason.OUT_OF_MEMORY, message, warning=True)
    ctx.stop_trainer()
    if new.queued:
        ctx.go.queue("waiting for capacity after re-plan")
        ctx.d.requeue_after = ctx.settings.queue_retry_seconds
        return
    launch_attempt(ctx)


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
