"""The planner: which pool, how many GPUs, which method and batch layout (pure).

Shaped like SkyPilot's optimizer: enumerate candidates, keep what fits (memory, capacity,
deadline, budget), rank the rest by the objective, and explain every rejected pool.

    pools × nodes × GPUs per node × method × sharding × micro-batch × checkpointing
        → estimate_vram (fits?) → step_time → duration → cost → choose

Within one (pool, method, GPU layout, sharding) group, configurations are tried from the
fastest to the slowest and the first that fits wins: a larger micro-batch and no
recomputation are never slower, so nothing better is skipped. `brute_force_plan`
evaluates every candidate and exists to prove that claim in the property tests.

Four memory savers join the walk when the job leaves them unset: each configuration is sized
with the plain loss, then with the chunked one, then with the fused one (where the trainer runs
it), then with the optimizer step in backward (full fine-tuning with one micro-batch per step,
with each loss again), until one fits (they cost no time); and a group in which nothing fits is
walked again with activation offloading, on its checkpointed configurations only, where the
host-link time it adds is the same for every micro-batch, so fastest-first still holds.

`plan_job` walks the same groups in the same order, but the memory estimate depends on the
method and layout only, never on the pool, so it is computed once per layout and shared by
every pool (the gradient accumulation it counts follows from the job's global batch, the
micro-batch and the GPU count, all part of the layout); a configuration is priced (step time,
duration, cost) only once it fits, and step times are shared by pools with the same GPU and
network. `brute_force_plan(..., exhaustive=False)` is that walk without any of this, and the
property tests hold `plan_job` to it plan for plan (alternatives and rejections included).

The package, in the order its modules import each other: `plans` (settings, candidates, the
plan, the layouts an OOM condemns) < `configs` (what a job may try, as the trainer runs it)
< `context` (what one job's candidates share) < `limits` (why a pool is rejected, and the
"To fix:" advice) < `choice` (the ranking by objective) < `search` (the walks).
"""

from kubetune.planning.planner.choice import objective_of, rank_key
from kubetune.planning.planner.configs import grad_accumulation, rows_per_sample
from kubetune.planning.planner.plans import (
    DEFAULT_SAFETY_FACTOR,
    GIB,
    MAX_MICRO_BATCH,
    METHOD_ORDER,
    Candidate,
    Layout,
    Limit,
    Loss,
    Plan,
    PlannerSettings,
    Rejection,
    replan_settings_after_oom,
)
from kubetune.planning.planner.search import brute_force_plan, plan_job

__all__ = [
    "DEFAULT_SAFETY_FACTOR",
    "GIB",
    "MAX_MICRO_BATCH",
    "METHOD_ORDER",
    "Candidate",
    "Layout",
    "Limit",
    "Loss",
    "Plan",
    "PlannerSettings",
    "Rejection",
    "brute_force_plan",
    "grad_accumulation",
    "objective_of",
    "plan_job",
    "rank_key",
    "replan_settings_after_oom",
    "rows_per_sample",
]
