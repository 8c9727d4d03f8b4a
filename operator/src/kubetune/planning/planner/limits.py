"""Why a pool cannot run a job: the constraint that ruled it out, the closest miss, and the
"To fix:" advice of a job that no pool can run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kubetune.api.errors import InfeasibleError
from kubetune.api.units import about
from kubetune.api.v1alpha1 import FineTuneJobSpec, GPUPool
from kubetune.planning.planner.configs import methods_to_try
from kubetune.planning.planner.context import JobContext
from kubetune.planning.planner.plans import GIB, Candidate, Limit, PlannerSettings, Rejection


@dataclass
class PoolReport:
    """Why a pool produced no acceptable candidate: the closest miss per constraint."""

    smallest_fit_gib: float | None = None
    memory_gib: float = 0.0
    fastest_s: float | None = None
    cheapest: float | None = None
    capacity: str | None = None
    batch: str | None = None
    forbidden: int = 0
    single_node: int = 0
    """Layouts not tried because they span nodes (`single_node_reason`)."""
    reasons: list[str] = field(default_factory=list)


def eligible_pools(
    spec: FineTuneJobSpec,
    pools: Sequence[GPUPool],
    rejected: list[Rejection],
    settings: PlannerSettings,
) -> list[GPUPool]:
    allowed = set(spec.resources.pools)
    tenant, reach = settings.tenant, settings.volume_pools
    out = []
    for pool in pools:
        selector = pool.spec.namespace_selector
        if reach is not None and pool.name not in reach:
            rejected.append(
                Rejection(
                    pool.name,
                    Limit.VOLUME,
                    f"none of its nodes can mount the job's checkpoint volume "
                    f"({settings.volume_where})",
                )
            )
        elif tenant is not None and not tenant.may_use(selector):
            rejected.append(
                Rejection(
                    pool.name,
                    Limit.NAMESPACE,
                    f"namespace {tenant.name} may not use it (its spec.namespaceSelector "
                    f"selects {selector.describe() if selector else 'every namespace'})",
                )
            )
        elif allowed and pool.name not in allowed:
            rejected.append(
                Rejection(pool.name, Limit.NOT_LISTED, "not listed in spec.resources.pools")
            )
        elif pool.spec.spot and spec.resources.spot == "never":
            rejected.append(
                Rejection(pool.name, Limit.SPOT, "spot pool, and spec.resources.spot is 'never'")
            )
        else:
            out.append(pool)
    return out


def consider(ctx: JobContext, c: Candidate, report: PoolReport) -> bool:
    """Record why `c` is unacceptable in `report`; True when it is acceptable."""
    if c.layout in ctx.settings.forbid:
        report.forbidden += 1
        return False
    if not ctx.fits(c):
        need = c.estimate.per_gpu_bytes * ctx.settings.safety_factor / GIB
        if report.smallest_fit_gib is None or need < report.smallest_fit_gib:
            report.smallest_fit_gib = need
        report.memory_gib = c.gpu_memory_gib
        return False
    if ctx.deadline_s is not None and c.duration_s > ctx.deadline_s:
        if report.fastest_s is None or c.duration_s < report.fastest_s:
            report.fastest_s = c.duration_s
        return False
    if ctx.budget is not None and c.cost > ctx.budget:
        if report.cheapest is None or c.cost < report.cheapest:
            report.cheapest = c.cost
        return False
    return True


def explain(pool: str, report: PoolReport, ctx: JobContext) -> Rejection:
    """The closest miss on `pool`, and whether layouts over several nodes, which might
    have been acceptable, were left out (they are then named, with the reason)."""
    why = _closest_miss(pool, report, ctx)
    if not report.single_node:
        return why
    if why.limit is Limit.NODES:
        return replace(why, spans_nodes=True)
    reason = ctx.settings.single_node_reason
    message = f"{why.message}; it may not span nodes, as {reason}"
    return replace(why, message=message, spans_nodes=True)


def _closest_miss(pool: str, report: PoolReport, ctx: JobContext) -> Rejection:
    """The closest miss on `pool`, most actionable limit first."""
    if report.fastest_s is not None:
        return Rejection(
            pool,
            Limit.DEADLINE,
            f"fastest fitting configuration takes {about(report.fastest_s)}, "
            f"over the deadline {ctx.spec.resources.deadline}",
        )
    if report.cheapest is not None:
        return Rejection(
            pool,
            Limit.BUDGET,
            f"cheapest fitting configuration costs ${report.cheapest:,.2f}, "
            f"over maxCostUSD ${ctx.budget or 0:,.2f}",
        )
    if report.smallest_fit_gib is not None:
        return Rejection(
            pool,
            Limit.MEMORY,
            f"needs at least {report.smallest_fit_gib:.1f} GiB per GPU (estimate × safety "
            f"{ctx.settings.safety_factor:g}) in its smallest configuration; "
            f"GPUs have {report.memory_gib:g} GiB",
        )
    if report.forbidden:
        return Rejection(
            pool,
            Limit.OUT_OF_MEMORY_BEFORE,
            "every configuration that fits ran out of memory before",
        )
    if report.batch:
        return Rejection(pool, Limit.BATCH_SPLIT, report.batch)
    if report.capacity:
        return Rejection(pool, Limit.NODES, report.capacity)
    return Rejection(pool, Limit.NOTHING_TO_TRY, "no configuration to try")


def infeasible(ctx: JobContext, rejected: list[Rejection]) -> InfeasibleError:
    if not rejected:
        return InfeasibleError(
            "No GPUPool exists, so the job has nowhere to run.",
            "create GPUPool objects (see examples/gpupools.yaml or the chart's gpuPools value).",
        )
    lines = "; ".join(f"{r.pool}: {r.message}" for r in rejected)
    limits = {r.limit for r in rejected}
    hints: list[str] = []
    if any(r.spans_nodes for r in rejected):
        hints.append(ctx.settings.single_node_fix or "let the job span nodes")
    if Limit.MEMORY in limits:
        if ctx.spec.method in ("full", "lora"):
            hints.append("use method qlora or auto")
        if ctx.spec.resources.gpus != "auto":
            hints.append("set resources.gpus to auto or more GPUs")
        if ctx.spec.training.gradient_checkpointing is False:
            hints.append("enable training.gradientCheckpointing")
        if ctx.spec.training.chunked_cross_entropy is False:
            hints.append("enable training.chunkedCrossEntropy")
        if ctx.spec.training.fused_cross_entropy is False and any(
            ctx.fused_applies(m) for m in methods_to_try(ctx.spec)
        ):
            hints.append("enable training.fusedCrossEntropy")
        if ctx.spec.training.activation_offloading is False:
            hints.append("enable training.activationOffloading")
        full = ctx.spec.method in ("full", "auto")
        if full and ctx.spec.training.optimizer_in_backward is False:
            hints.append("enable training.optimizerInBackward")
        micro = ctx.spec.training.micro_batch_size
        if micro is not None and ctx.spec.training.global_batch_size > micro:
            # a fixed micro-batch below the global batch means accumulation, whose gradients
            # exist throughout the step (unsharded in fp32 under FSDP)
            hints.append(
                f"raise or unset training.microBatchSize (now {micro}), or lower "
                "training.globalBatchSize: gradients accumulated over micro-batches stay in "
                "memory for the whole step"
            )
        hints.append(f"shorten training.sequenceLength (now {ctx.spec.training.sequence_length})")
        hints.append("add a pool with larger GPUs")
    if Limit.DEADLINE in limits:
        hints.append("relax resources.deadline or allow faster pools")
    if Limit.BUDGET in limits:
        hints.append("raise resources.maxCostUSD or allow cheaper pools (spot)")
    if limits & {Limit.NOT_LISTED, Limit.SPOT}:
        hints.append("widen resources.pools / resources.spot")
    if Limit.VOLUME in limits:
        hints.append(
            "the checkpoints stay where their volume is: add nodes there to a pool the job may "
            "use, or list such a pool in resources.pools"
        )
    if Limit.NAMESPACE in limits:
        hints.append(
            "ask the cluster admin for a pool this namespace may use (GPUPool "
            "spec.namespaceSelector), or to label the namespace so that one selects it"
        )
    if Limit.BATCH_SPLIT in limits:
        hints.append(
            "make training.globalBatchSize a multiple of the GPU count (a power of two works best)"
        )
    return InfeasibleError(
        f"No pool can run this job. {lines}.", "; ".join(hints) or "relax the job's limits."
    )
