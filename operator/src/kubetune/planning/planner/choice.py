"""The choice among acceptable candidates: the job's objective (cost or time) first, then
stable tie-breakers; the best of each other pool are the alternatives."""

from __future__ import annotations

from kubetune.api.v1alpha1 import FineTuneJobSpec, Objective
from kubetune.planning.planner.context import JobContext
from kubetune.planning.planner.limits import infeasible
from kubetune.planning.planner.plans import (
    METHOD_ORDER,
    Candidate,
    Plan,
    PlannerSettings,
    Rejection,
)


def objective_of(spec: FineTuneJobSpec, settings: PlannerSettings) -> Objective:
    """The job's own objective, or the operator's default when the job sets none."""
    return spec.resources.objective or settings.default_objective


def rank_key(c: Candidate, objective: str, spot_policy: str) -> tuple[float | int | str, ...]:
    """Total order on candidates: the objective first, then stable tie-breakers."""
    primary, secondary = (c.cost, c.duration_s) if objective == "cost" else (c.duration_s, c.cost)
    spot_rank = (0 if c.spot else 1) if spot_policy == "preferred" else 0
    return (
        int(c.queued),
        round(primary, 6),
        spot_rank,
        round(secondary, 6),
        c.total_gpus,
        METHOD_ORDER[c.method],
        c.pool,
        -c.micro_batch,
        int(c.grad_ckpt),
        c.sharding,
    )


def finish(
    ctx: JobContext, accepted: list[Candidate], rejected: list[Rejection], alternatives: int
) -> Plan:
    """The best candidate and, for "why not that pool?", the best of each other pool; with
    none acceptable, the error that explains every pool's rejection."""
    objective = objective_of(ctx.spec, ctx.settings)
    spot = ctx.spec.resources.spot
    if not accepted:
        raise infeasible(ctx, rejected)
    ranked = sorted(accepted, key=lambda c: rank_key(c, objective, spot))
    best = ranked[0]
    # The runners-up answer "why not that pool?": the best of each other pool, in rank order.
    seen = {best.pool}
    alts: list[Candidate] = []
    for c in ranked[1:]:
        if c.pool not in seen and len(alts) < alternatives:
            seen.add(c.pool)
            alts.append(c)
    return Plan(
        chosen=best,
        alternatives=alts,
        rejected=rejected,
        total_steps=ctx.steps,
        total_tokens=ctx.total_tokens,
        dataset=ctx.dataset,
        objective=objective,
    )
