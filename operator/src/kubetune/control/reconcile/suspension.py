"""spec.suspend: a job is Suspended by stopping its trainer (which checkpoints first), and
resumed from that checkpoint once the trainer has stopped."""

from __future__ import annotations

from kubetune.api.vocabulary import Phase, Reason
from kubetune.control import pods as p
from kubetune.control.reconcile.context import Context
from kubetune.control.reconcile.launch import launch_attempt, plan_and_launch
from kubetune.control.reconcile.stages import staging_in


def suspend(ctx: Context) -> None:
    if ctx.s.phase != Phase.SUSPENDED:
        ctx.go.suspend()
        ctx.d.event(Reason.SUSPEND_REQUESTED, "Stopping the trainer; it checkpoints first")
        ctx.accrue_cost()
    ctx.stop_trainer()
    ctx.delete_stale_attempts(newer_too=True)


def resume(ctx: Context) -> None:
    stopping = [p.pod_name(pod) for pod in ctx.observed.pods if p.still_running(pod, ctx.now)]
    if stopping:
        # The suspended attempt's trainer is still checkpointing: a new one now would
        # run two trainers on one checkpoint folder.
        ctx.s.message = f"resuming once the trainer stops: pod {', '.join(stopping)}"
        ctx.d.requeue_after = ctx.settings.poll_seconds
        return
    ctx.go.resume()
    ctx.d.event(Reason.RESUMED, "Resuming from the latest checkpoint")
    if ctx.s.plan is None:
        # Suspended before it was ever planned (or staged in): do that now.
        ctx.go.replan()
        if not staging_in(ctx):
            plan_and_launch(ctx)
        return
    launch_attempt(ctx)
