"""A Running job: follow its attempt to success (through the steps after training), to a
failure (recovery.py), to its limits (budget, deadline), and say why trainers do not run
(pods that do not start, lost nodes). A finished job stops what still runs and waits for
its TTL."""

from __future__ import annotations

from datetime import timedelta

from kubetune.api.v1alpha1 import EarlyStoppedStatus, ProgressStatus, parse_duration
from kubetune.api.vocabulary import ConditionType, Reason, RecoveryReason
from kubetune.control import pods as p
from kubetune.control import progress
from kubetune.control.conditions import get_condition, is_true
from kubetune.control.reconcile.context import Context
from kubetune.control.reconcile.launch import launch_attempt, recreate_children
from kubetune.control.reconcile.recovery import (
    add_recovery,
    handle_failure,
    move_if_stuck,
    out_of_restarts,
    record_ended_pods,
    relaunch_after_preemption,
    relaunch_if_stalled,
)
from kubetune.control.reconcile.stages import exporting, keep_output, output_at_risk, staging_out


def finished(ctx: Context) -> None:
    job = ctx.observed.batch_job
    if job is not None and (job.get("status") or {}).get("active"):
        ctx.stop_trainer()
    ctx.delete_stale_attempts(newer_too=True)
    if output_at_risk(ctx):
        keep_output(ctx)
    ttl = ctx.spec.ttl_seconds_after_finished
    done = p.parse_time(ctx.s.completion_time)
    if ttl is None or done is None:
        return
    left = (done + timedelta(seconds=ttl) - ctx.now).total_seconds()
    if left <= 0:
        ctx.d.delete_self = True
    else:
        ctx.d.requeue_after = left


def adopt_lost_launch(ctx: Context) -> None:
    """Follow a newer attempt whose launch the status never recorded.

    The operator creates the batch Job even when the apiserver rejected the status
    write that recorded its launch (and an older operator created children before it
    wrote the status): it then finds a batch Job one attempt ahead of `status.attempt`.
    Creating the old attempt's children again would run two trainers on one checkpoint
    folder.
    """
    newest = ctx.observed.attempt
    if newest > ctx.s.attempt:
        ctx.d.event(
            Reason.ADOPTED,
            f"following attempt {newest}, launched before the operator could record it",
        )
        ctx.s.attempt = newest
        ctx.s.trainer_pods = []


def follow_attempt(ctx: Context) -> None:
    plan = ctx.s.plan
    assert plan is not None
    ctx.d.requeue_after = ctx.settings.poll_seconds
    job = ctx.observed.batch_job
    if job is None:
        recreate_children(ctx, plan)
        return
    ctx.accrue_cost()
    job_status = job.get("status") or {}
    if p.job_succeeded(job_status):
        # Read while the trainer's pods are certain to be there (export and upload
        # steps may run long): its own final numbers, over the last ones scraped.
        result = p.trainer_result(ctx.observed.pods)
        if result is not None:
            progress.record_result(ctx.s, result)
        ctx.s.early_stopped = ctx.s.early_stopped or p.early_stopped(ctx.observed.pods)
        if not exporting(ctx) and not staging_out(ctx):
            _succeed(ctx)
        return
    if p.job_failed(job_status):
        handle_failure(ctx)
        return
    if record_ended_pods(ctx, job_status):
        return
    if move_if_stuck(ctx) or _check_limits(ctx):
        return
    if relaunch_after_preemption(ctx, job_status):
        return
    if ctx.observed.trainer_metrics:
        step = progress.read_metrics(ctx.s, ctx.spec, ctx.observed.trainer_metrics, ctx.now)
        if step is not None:
            ctx.d.event(Reason.CHECKPOINT, f"checkpoint at step {step} is complete")
    if relaunch_if_stalled(ctx, plan):
        return
    if _report_lost_nodes(ctx):
        return
    if ctx.running_trainers() >= plan.nodes:
        if not is_true(ctx.s.conditions, ConditionType.RUNNING):
            ctx.d.event(Reason.TRAINING, f"{plan.nodes} trainer pod(s) running")
            ctx.s.message = f"attempt {ctx.s.attempt} training"
        ctx.go.condition(
            ConditionType.RUNNING, True, Reason.TRAINING, f"attempt {ctx.s.attempt} training"
        )
        return
    _follow_startup(ctx)


def _report_lost_nodes(ctx: Context) -> bool:
    """A trainer pod whose node stopped being Ready: it shows as running, but nothing
    runs it, and no kubelet will confirm its end, so the batch Job cannot replace it
    until the node is deleted or taken out of service. Say so (condition Running=False,
    status.message, a Warning Event when it starts). Stall detection still relaunches
    the attempt after its timeout. True when one was found."""
    lost = sorted(
        (str(node), p.pod_name(pod))
        for pod in ctx.observed.pods
        if (node := (pod.get("spec") or {}).get("nodeName")) in ctx.observed.lost_nodes
        and p.pod_phase(pod) not in p.POD_DONE
    )
    if not lost:
        return False
    node, pod = lost[0]
    since = ctx.observed.lost_nodes[node]
    message = (
        f"pod {pod} is on node {node}, not Ready{f' since {since}' if since else ''}: its "
        "kubelet no longer reports, so the pod cannot be replaced until the node is gone. "
        "To fix: if the machine is lost, delete the Node object (or taint it "
        "node.kubernetes.io/out-of-service=nodeshutdown:NoExecute); the trainer then "
        "resumes from the latest checkpoint on another node"
    )
    before = get_condition(ctx.s.conditions, ConditionType.RUNNING)
    if before is None or before.reason != Reason.NODE_NOT_READY:
        ctx.d.event(Reason.NODE_NOT_READY, message, warning=True)
    ctx.go.condition(ConditionType.RUNNING, False, Reason.NODE_NOT_READY, message)
    ctx.s.message = f"attempt {ctx.s.attempt}: {message}"
    return True


def _follow_startup(ctx: Context) -> None:
    """Some trainers do not run: say why (condition Running=False with the reason,
    status.message, an Event when the reason changes), and fail the attempt when a pod
    with a node has not started within the startup timeout."""
    startups = [s for s in map(p.startup, ctx.observed.pods) if s is not None]
    shown = p.most_telling(startups)
    if shown is None:
        return  # pods not created yet (or not in the cache yet)
    before = get_condition(ctx.s.conditions, ConditionType.RUNNING)
    changed = before is None or before.reason != shown.reason
    if changed and shown.reason != Reason.PODS_STARTING:
        ctx.d.event(shown.reason, shown.message, warning=True)
    ctx.go.condition(ConditionType.RUNNING, False, shown.reason, shown.message)
    ctx.s.message = f"attempt {ctx.s.attempt}: {shown.message}"
    timeout = ctx.settings.startup_timeout_seconds
    stuck = p.most_telling([s for s in startups if s.overdue(ctx.now, timeout)])
    if stuck is None:
        return
    why = f"{stuck.message} (not started after {timeout:.0f}s)"
    if stuck.user_error:
        ctx.fail(Reason.STARTUP_TIMEOUT, f"{why}. To fix: {_fix_startup(stuck.reason)}")
        return
    if out_of_restarts(ctx, f"trainer did not start: {why}"):
        return
    ctx.s.restarts += 1
    add_recovery(ctx, RecoveryReason.POD_FAILURE, why, pod=stuck.pod)
    ctx.d.event(Reason.STARTUP_TIMEOUT, f"{why}; relaunching", warning=True)
    ctx.stop_trainer()
    launch_attempt(ctx)


def _check_limits(ctx: Context) -> bool:
    budget = ctx.spec.resources.max_cost_usd
    if budget is not None and ctx.s.cost is not None and ctx.s.cost.accrued_usd >= budget:
        ctx.fail(
            Reason.BUDGET_EXCEEDED,
            f"accrued ${ctx.s.cost.accrued_usd:,.2f} reached maxCostUSD ${budget:,.2f}; "
            "the trainer checkpoints on stop. To fix: delete this job and create it again "
            "under the same name with a higher spec.resources.maxCostUSD and "
            f"spec.checkpoint.resumeFromUID: {ctx.job.metadata.get('uid')} to resume from "
            "its checkpoint",
        )
        return True
    deadline = ctx.spec.resources.deadline
    started = p.parse_time(ctx.s.start_time)
    if deadline and started and ctx.now - started >= parse_duration(deadline):
        ctx.fail(
            Reason.DEADLINE_EXCEEDED,
            f"training ran past the deadline {deadline}; the trainer checkpoints on stop",
        )
        return True
    return False


def _succeed(ctx: Context) -> None:
    """Succeeded: Completed, or EarlyStopped when the trainer said so (`follow_attempt` read
    its termination message into status.earlyStopped before the steps after training)."""
    stopped = ctx.s.early_stopped
    if stopped is None:
        ctx.go.succeed()
        ctx.d.event(Reason.COMPLETED, "Training finished")
    else:
        said = _early_stop_message(stopped, ctx.s.progress)
        ctx.go.succeed(Reason.EARLY_STOPPED, said)
        ctx.d.event(Reason.EARLY_STOPPED, said)
    progress.complete(ctx.s, ctx.now)
    finished(ctx)


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


def _early_stop_message(stopped: EarlyStoppedStatus, progress: ProgressStatus | None) -> str:
    """What status.message and the Succeeded condition say of a run that stopped early."""
    total = f" of {progress.total_steps}" if progress is not None and progress.total_steps else ""
    value = f" {stopped.value:.4g}" if stopped.value is not None else ""
    evaluations = f" for {stopped.patience} evaluations" if stopped.patience else ""
    return (
        f"training stopped early at step {stopped.step}{total}: {stopped.metric} did not "
        f"improve{evaluations}; the output holds step {stopped.best_step}'s weights "
        f"({stopped.metric}{value})"
    )
