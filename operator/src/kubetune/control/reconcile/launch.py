"""Planning and launching: plan the job (or say why it cannot be planned), admit or queue the
plan, and create the children of the next attempt, which resumes from the checkpoint."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from kubetune.api.errors import InfeasibleError, SpecError
from kubetune.api.units import about, quantity_value
from kubetune.api.v1alpha1 import INT64_MAX, PlanStatus
from kubetune.api.vocabulary import ANNOTATION_TEST_FAULTS, ConditionType, PlanReason, Reason
from kubetune.control import pods as p
from kubetune.control import progress
from kubetune.control.build.children import build_children
from kubetune.control.build.storage import checkpoint_size
from kubetune.control.build.trainer import host_memory_gib
from kubetune.control.conditions import get_condition, is_true
from kubetune.control.reconcile.context import Context, NewPlan
from kubetune.control.reconcile.policy import may_use_pool, refused
from kubetune.planning.arch import ArchitectureError
from kubetune.planning.estimator import EstimatorError
from kubetune.planning.planner import Layout, PlannerSettings


def plan_and_launch(ctx: Context) -> None:
    ctx.go.plan()
    new = make_plan(ctx, 1, PlanReason.INITIAL, None, ctx.settings.planner)
    if new is None:
        return
    ctx.s.plan = new.status
    message = ctx.admit(new.status, new.queued)
    if message is not None:
        if not is_true(ctx.s.conditions, ConditionType.QUEUED):
            ctx.d.event(Reason.INSUFFICIENT_CAPACITY, message)
        ctx.go.queue(message)
        ctx.d.requeue_after = ctx.settings.queue_retry_seconds
        return
    if get_condition(ctx.s.conditions, ConditionType.QUEUED) is not None:
        ctx.go.condition(ConditionType.QUEUED, False, Reason.CAPACITY_AVAILABLE, "capacity is free")
    launch_attempt(ctx)


def make_plan(
    ctx: Context, revision: int, reason: PlanReason, message: str | None, planner: PlannerSettings
) -> NewPlan | None:
    """Plan the job; when it cannot be planned, record why and return None."""
    if not ctx.observed.pools:
        msg = "no GPUPool exists yet; create pools (see examples/gpupools.yaml)"
        ctx.go.condition(ConditionType.PLANNED, False, Reason.NO_POOLS, msg)
        ctx.s.message = msg
        ctx.d.requeue_after = ctx.settings.queue_retry_seconds
        return None
    try:
        arch = ctx.model_arch()
        plan = ctx.plan_job(ctx.spec, ctx.observed.pools, arch, ctx.for_job(planner))
    except ArchitectureError as exc:
        ctx.unplannable(Reason.UNKNOWN_ARCHITECTURE, str(exc))
        return None
    except InfeasibleError as exc:
        ctx.unplannable(Reason.INFEASIBLE, str(exc))
        return None
    except EstimatorError as exc:  # e.g. LoRA target modules the model does not have
        ctx.unplannable(Reason.INVALID_SPEC, str(exc))
        return None
    status = plan.to_status(ctx.observed.pools, revision=revision, reason=reason, message=message)
    too_big = _first_int_over(status.to_wire(), INT64_MAX)
    if too_big is not None:
        ctx.unplannable(
            Reason.INFEASIBLE,
            f"the plan's {too_big} does not fit in a 64-bit integer: the job is far larger "
            "than any run. To fix: lower training.maxSteps, training.epochs or "
            "dataset.numExamples",
        )
        return None
    status.memory_scale = round(planner.memory_scale, 4)
    set_host_memory(ctx, status, ctx.s.plan)
    # A plan that waits for capacity is a plan all the same. A queued job is planned
    # again on every look; it tells of a plan only when the plan changed.
    summary = (
        f"{status.method} on {status.nodes}×{status.gpus_per_node} {status.gpu_product} "
        f"(pool {status.pool}), ~{status.per_gpu_memory_gib:.1f} GiB/GPU, "
        f"~{about(status.estimated_duration_seconds)}, "
        f"~${status.estimated_cost_usd:,.2f}"
    )
    before = get_condition(ctx.s.conditions, ConditionType.PLANNED)
    new = before is None or before.status != "True" or before.message != summary
    ctx.go.condition(ConditionType.PLANNED, True, Reason.PLAN_READY, summary)
    if new:
        ctx.d.event(Reason.PLAN_READY, f"Plan r{revision}: {summary}")
    return NewPlan(status, plan.queued)


def set_host_memory(ctx: Context, status: PlanStatus, previous: PlanStatus | None) -> None:
    """The trainer pods' host memory of a new plan, with what host out-of-memory kills
    of the job taught (`previous` plan's scale)."""
    status.host_memory_scale = previous.host_memory_scale if previous is not None else 1.0
    status.host_memory_gib = host_memory_gib(status, ctx.settings.build)


def learned_planner(ctx: Context, plan: PlanStatus) -> PlannerSettings:
    """Planner settings with what out-of-memory failures taught: the memory scale of
    `plan` and every layout that ran out of memory, forbidden."""
    return replace(
        ctx.settings.planner,
        memory_scale=plan.memory_scale,
        forbid=frozenset(Layout.parse(key) for key in ctx.s.failed_layouts),
    )


def launch_attempt(ctx: Context) -> None:
    """Start the next attempt of the current plan (it resumes from the checkpoint)."""
    plan = ctx.s.plan
    assert plan is not None
    if refused(ctx):  # a spec patched since the last launch
        return
    pool = ctx.pool(plan.pool)
    if pool is None or not may_use_pool(ctx, pool):
        # The pool disappeared, or no longer takes this namespace, since the plan was
        # made: plan again next time.
        ctx.go.replan()
        ctx.d.requeue_after = ctx.settings.queue_retry_seconds
        return
    attempt = ctx.s.attempt + 1
    try:
        children = build_children(ctx.job, plan, pool, ctx.settings.build, attempt)
    except SpecError as exc:
        ctx.fail(Reason.INVALID_SPEC, str(exc))
        return
    _fit_checkpoint_volume(ctx, plan)
    ctx.go.launch(attempt)
    progress.start_attempt(ctx.s, plan, ctx.now)
    # The attempt ending now is an earlier one from here on: its pods fence the new one's.
    _create_fenced(ctx, children, [*ctx.observed.earlier_pods, *ctx.observed.pods])
    ctx.d.event(Reason.LAUNCHED, f"Attempt {attempt} on pool {plan.pool}")
    faults = (ctx.job.metadata.get("annotations") or {}).get(ANNOTATION_TEST_FAULTS)
    if faults and not ctx.settings.build.allow_test_faults and attempt == 1:
        ctx.d.event(
            Reason.TEST_FAULTS_IGNORED,
            f"annotation {ANNOTATION_TEST_FAULTS} is ignored: this operator runs without "
            "KUBETUNE_ALLOW_TEST_FAULTS (Helm value operator.allowTestFaults), as a "
            "production operator should",
            warning=True,
        )
    ctx.d.requeue_after = ctx.settings.poll_seconds


def _fit_checkpoint_volume(ctx: Context, plan: PlanStatus) -> None:
    """A plan that needs a larger checkpoint volume than the claim made with an earlier
    attempt asks for (a re-plan to full fine-tuning, more copies): raise the claim's
    request where its StorageClass allows expansion, else warn that it may run out."""
    claim = ctx.observed.checkpoint_claim
    if claim is None:
        return
    requests = ((claim.get("spec") or {}).get("resources") or {}).get("requests") or {}
    have = str(requests.get("storage") or "")
    want = checkpoint_size(ctx.job, plan)
    if not have or quantity_value(want) <= quantity_value(have):
        return
    name = str((claim.get("metadata") or {}).get("name"))
    storage_class = (claim.get("spec") or {}).get("storageClassName") or "(none)"
    needs = f"plan r{plan.revision} needs about {want} of checkpoints; {name} asks for {have}"
    if ctx.observed.checkpoint_class_expands:
        ctx.d.resize_claims.append((name, want))
        ctx.d.event(
            Reason.CHECKPOINT_VOLUME_EXPANDED,
            f"{needs}: its request was raised to {want} (StorageClass {storage_class} "
            "allows volume expansion)",
        )
        return
    ctx.d.event(
        Reason.CHECKPOINT_VOLUME_SMALL,
        f"{needs}, and its StorageClass {storage_class} does not allow volume expansion: "
        "the trainer may run out of room when it saves. To fix: expand the claim by hand "
        "if the storage allows it, lower spec.checkpoint.keep, or run the job again with "
        "a larger spec.checkpoint.storage.size",
        warning=True,
    )


def recreate_children(ctx: Context, plan: PlanStatus) -> None:
    """The batch Job was deleted behind our back, or is not in the cache yet:
    create-if-absent again."""
    pool = ctx.pool(plan.pool)
    if pool is None or not ctx.s.attempt:
        return
    try:
        children = build_children(ctx.job, plan, pool, ctx.settings.build, ctx.s.attempt)
    except SpecError as exc:
        ctx.fail(Reason.INVALID_SPEC, str(exc))
        return
    _create_fenced(ctx, children, ctx.observed.earlier_pods)


def _create_fenced(
    ctx: Context, children: list[dict[str, Any]], earlier: Sequence[Mapping[str, Any]]
) -> None:
    """Create an attempt's children, its batch Job only once no trainer pod of an earlier
    attempt may still write: two trainers on one checkpoint folder would remove each
    other's temporary checkpoints and prune what the other loads. (A stall relaunch stops
    a trainer that still runs; a pod on a lost node stops counting once its deletion is
    overdue.) Until then a later look creates it (`recreate_children`)."""
    running = [p.pod_name(pod) for pod in earlier if p.still_running(pod, ctx.now)]
    if not running:
        ctx.d.create.extend(children)
        return
    ctx.d.create.extend(m for m in children if m["kind"] != "Job")
    ctx.d.requeue_after = ctx.settings.poll_seconds
    ctx.s.message = (
        f"attempt {ctx.s.attempt} starts once the earlier attempt's trainer has stopped: "
        f"pod {', '.join(running)}"
    )


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
