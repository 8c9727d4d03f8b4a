"""The layout search: pools x methods x GPU layouts x sharding, each group walked fastest
first up to its first acceptable configuration (`plan_job`), and the unoptimised walks the
property tests hold it to (`brute_force_plan`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

from kubetune.api.v1alpha1 import FineTuneJobSpec, GPUPool
from kubetune.planning.arch import ModelArch
from kubetune.planning.planner.choice import finish
from kubetune.planning.planner.configs import (
    fastest_first,
    gpu_layouts,
    methods_to_try,
    micro_batches,
    pool_capacity,
    with_offload,
)
from kubetune.planning.planner.context import JobContext
from kubetune.planning.planner.limits import PoolReport, consider, eligible_pools, explain
from kubetune.planning.planner.plans import GIB, Candidate, Layout, Plan, PlannerSettings, Rejection
from kubetune_trainer.contract import Method, Sharding


def _groups(
    ctx: JobContext, pool: GPUPool, report: PoolReport
) -> Iterator[tuple[Method, int, int, Sharding, list[tuple[int, bool]], str | bool | None]]:
    """Every (method, layout, sharding) group with its configurations, fastest first."""
    spec = ctx.spec
    ckpts = (
        [False, True]
        if spec.training.gradient_checkpointing is None
        else [spec.training.gradient_checkpointing]
    )
    for method in methods_to_try(spec):
        for nodes, gpn in gpu_layouts(pool, spec, ctx.settings):
            total = nodes * gpn
            if total < ctx.settings.min_total_gpus:
                continue
            capacity = pool_capacity(pool, nodes, gpn, ctx.settings)
            if isinstance(capacity, str):
                report.capacity = capacity
                continue
            single_node = ctx.settings.single_node_reason
            if nodes > 1 and single_node:
                report.single_node += 1
                if report.single_node == 1:  # the fewest nodes say it
                    report.capacity = f"spans {nodes} nodes, but {single_node}"
                continue
            micros = micro_batches(
                spec.training.global_batch_size, total, spec.training.micro_batch_size
            )
            if not micros:
                report.batch = (
                    f"global batch {spec.training.global_batch_size} does not split evenly "
                    f"over {total} GPUs"
                    + (
                        f" with micro-batch {spec.training.micro_batch_size}"
                        if spec.training.micro_batch_size
                        else ""
                    )
                )
                continue
            shardings: list[Sharding] = ["none"] if total == 1 else ["full", "grad-op"]
            configs = [(m, ck) for m in micros for ck in ckpts]
            for sharding in shardings:
                yield method, nodes, gpn, sharding, configs, capacity


def _search(ctx: JobContext, pools: Sequence[GPUPool]) -> tuple[list[Candidate], list[Rejection]]:
    """`_reference_search(exhaustive=False)`, with shared estimates and lazy pricing.

    Per configuration, in the reference's order: forbidden? fits? Only a configuration that
    passes both is priced, and the group's walk ends there (accepted, or past the deadline or
    the budget, which slower configurations of the group would miss too). The report records
    exactly what the reference's `consider` records, from the same numbers.
    """
    rejected: list[Rejection] = []
    accepted: list[Candidate] = []
    forbid = ctx.settings.forbid
    safety = ctx.settings.safety_factor
    deadline, budget = ctx.deadline_s, ctx.budget
    for pool in eligible_pools(ctx.spec, pools, rejected, ctx.settings):
        report = PoolReport()
        before = len(accepted)
        memory_gib = pool.spec.gpu.memory_gib
        memory_bytes = memory_gib * GIB
        for method, nodes, gpn, sharding, configs, capacity in _groups(ctx, pool, report):
            total = nodes * gpn
            for offload in ctx.offloads:
                priced = False
                for micro, ckpt in ctx.ordered(with_offload(configs, offload), method):
                    if forbid and Layout(pool.name, method, total, micro, ckpt) in forbid:
                        report.forbidden += 1
                        continue
                    for loss, in_backward in ctx.savers(method, total, sharding, micro):
                        estimate = ctx.estimate(
                            method, total, sharding, micro, ckpt, loss, offload, in_backward
                        )
                        if estimate.per_gpu_bytes * safety <= memory_bytes:
                            break
                    else:
                        need = estimate.per_gpu_bytes * safety / GIB
                        if report.smallest_fit_gib is None or need < report.smallest_fit_gib:
                            report.smallest_fit_gib = need
                        report.memory_gib = memory_gib
                        continue
                    c = ctx.candidate(
                        pool, method, nodes, gpn, sharding, micro, ckpt, estimate, capacity is True
                    )
                    if deadline is not None and c.duration_s > deadline:
                        if report.fastest_s is None or c.duration_s < report.fastest_s:
                            report.fastest_s = c.duration_s
                    elif budget is not None and c.cost > budget:
                        if report.cheapest is None or c.cost < report.cheapest:
                            report.cheapest = c.cost
                    else:
                        accepted.append(c)
                    priced = True
                    break
                if priced:
                    break
        if len(accepted) == before:
            rejected.append(explain(pool.name, report, ctx))
    return accepted, sorted(rejected, key=lambda r: r.pool)


def _reference_search(
    ctx: JobContext, pools: Sequence[GPUPool], exhaustive: bool
) -> tuple[list[Candidate], list[Rejection]]:
    """The plain walk: every configuration evaluated from scratch (`exhaustive`: all of
    them; otherwise each group up to its first acceptable configuration)."""
    rejected: list[Rejection] = []
    accepted: list[Candidate] = []
    for pool in eligible_pools(ctx.spec, pools, rejected, ctx.settings):
        report = PoolReport()
        before = len(accepted)
        for method, nodes, gpn, sharding, configs, capacity in _groups(ctx, pool, report):
            seq = ctx.spec.training.sequence_length
            for offload in ctx.offloads:
                fitted = False
                for micro, ckpt in fastest_first(with_offload(configs, offload), method, seq):
                    c = ctx.evaluate(pool, method, nodes, gpn, sharding, micro, ckpt, offload)
                    if capacity is True:
                        c = replace(c, queued=True)
                    fits = ctx.fits(c) and c.layout not in ctx.settings.forbid
                    fitted = fitted or fits
                    if consider(ctx, c, report):
                        accepted.append(c)
                        if not exhaustive:
                            break
                    elif not exhaustive and fits:
                        # It fits but misses the deadline/budget; slower configurations of
                        # the same group would miss it too.
                        break
                if fitted:  # offloading only where nothing fitted without it
                    break
        if len(accepted) == before:
            rejected.append(explain(pool.name, report, ctx))
    return accepted, sorted(rejected, key=lambda r: r.pool)


def plan_job(
    spec: FineTuneJobSpec,
    pools: Sequence[GPUPool],
    arch: ModelArch,
    settings: PlannerSettings | None = None,
    alternatives: int = 3,
) -> Plan:
    """Choose the best configuration for `spec` or raise InfeasibleError with advice."""
    ctx = JobContext(spec, arch, settings or PlannerSettings())
    accepted, rejected = _search(ctx, pools)
    return finish(ctx, accepted, rejected, alternatives)


def brute_force_plan(
    spec: FineTuneJobSpec,
    pools: Sequence[GPUPool],
    arch: ModelArch,
    settings: PlannerSettings | None = None,
    alternatives: int = 3,
    *,
    exhaustive: bool = True,
) -> Plan:
    """The references the property tests compare `plan_job` against, both unoptimised:
    every candidate evaluated (`exhaustive`), or `plan_job`'s walk with every candidate it
    visits evaluated from scratch (no shared estimates, no lazy pricing)."""
    ctx = JobContext(spec, arch, settings or PlannerSettings())
    accepted, rejected = _reference_search(ctx, pools, exhaustive=exhaustive)
    return finish(ctx, accepted, rejected, alternatives)
