"""The planner's values: the settings it plans with, the candidates it weighs, the plan it
returns, and the layouts an out-of-memory exit condemns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Literal, NamedTuple

from kubetune.api.tenancy import Tenant
from kubetune.api.v1alpha1 import (
    GPUPool,
    Objective,
    PlanAlternative,
    PlanRejection,
    PlanStatus,
)
from kubetune.api.vocabulary import PlanReason
from kubetune.planning.estimator import VramEstimate
from kubetune.planning.throughput import DatasetSize
from kubetune_trainer.contract import Method, Sharding

GIB = 1024**3

Loss = Literal["plain", "chunked", "fused"]
"""How a configuration computes its loss: over full-vocabulary logits, chunked, or fused with
the output projection (kubetune_trainer.loss)."""

DEFAULT_SAFETY_FACTOR = 1.10
MAX_MICRO_BATCH = 64
METHOD_ORDER: dict[Method, int] = {"lora": 0, "qlora": 1, "full": 2}


class Layout(NamedTuple):
    """What an out-of-memory exit condemns: this pool, method, GPU count, micro-batch and
    recomputation setting. `status.failedLayouts` keeps them as `key()` strings."""

    pool: str
    method: Method
    total_gpus: int
    micro_batch: int
    grad_ckpt: bool

    def key(self) -> str:
        """`pool/method/GPUs/micro-batch/ckpt|nockpt`, e.g. `h100/lora/1/8/nockpt`."""
        ckpt = "ckpt" if self.grad_ckpt else "nockpt"
        return f"{self.pool}/{self.method}/{self.total_gpus}/{self.micro_batch}/{ckpt}"

    @classmethod
    def parse(cls, key: str) -> Layout:
        pool, method, gpus, micro, ckpt = key.split("/")
        if method not in METHOD_ORDER:
            raise ValueError(f"{key!r}: unknown method {method!r}")
        return cls(pool, method, int(gpus), int(micro), ckpt == "ckpt")

    @classmethod
    def of(cls, plan: PlanStatus) -> Layout:
        return cls(
            plan.pool,
            plan.method,
            plan.total_gpus,
            plan.micro_batch_size,
            plan.gradient_checkpointing,
        )


class Limit(Enum):
    """The constraint that ruled a pool out; it picks the "To fix:" advice."""

    NOT_LISTED = "not in spec.resources.pools"
    SPOT = "spot not allowed"
    MEMORY = "memory"
    DEADLINE = "deadline"
    BUDGET = "budget"
    OUT_OF_MEMORY_BEFORE = "ran out of memory before"
    BATCH_SPLIT = "global batch does not split"
    NODES = "too many nodes"
    NOTHING_TO_TRY = "nothing to try"
    NAMESPACE = "namespace not allowed"
    VOLUME = "checkpoint volume out of reach"


@dataclass(frozen=True)
class Rejection:
    """Why no configuration on `pool` was acceptable: the limit and its explanation."""

    pool: str
    limit: Limit
    message: str
    spans_nodes: bool = False
    """Layouts over several nodes were not tried (`PlannerSettings.single_node_reason`)."""


@dataclass(frozen=True)
class PlannerSettings:
    """Operator-wide knobs (Helm values / CLI flags)."""

    safety_factor: float = DEFAULT_SAFETY_FACTOR
    """An estimate times this must fit in GPU memory."""
    default_objective: Objective = "cost"
    """The objective of jobs that leave `spec.resources.objective` unset."""
    memory_scale: float = 1.0
    """Multiplies every estimate; raised after an OOM proved the estimate too low."""
    use_live_capacity: bool = True
    """Respect GPUPool status (free GPUs); off for offline `kubetune plan`."""
    min_total_gpus: int = 1
    """Re-plans after OOM may require more GPUs than before."""
    tenant: Tenant | None = None
    """The job's namespace: only pools whose spec.namespaceSelector takes it are eligible
    (None: not known, e.g. offline `kubetune plan`; every pool is)."""
    forbid: frozenset[Layout] = frozenset()
    """Layouts known to run out of memory."""
    single_node_reason: str | None = None
    """Why no layout may span nodes (the job's checkpoint volume cannot follow it there),
    e.g. "the checkpoint volume is ReadWriteOnce"; None: layouts may span nodes."""
    single_node_fix: str = ""
    """The "To fix:" advice for a job that one node cannot hold, when that reason is set."""
    volume_pools: frozenset[str] | None = None
    """The pools with a node that can mount the job's bound checkpoint volume (a zonal disk
    mounts in its zone only); None: any pool can."""
    volume_where: str = ""
    """Where that volume can be mounted, in words (its PersistentVolume and node affinity)."""


@dataclass(frozen=True)
class Candidate:
    pool: str
    method: Method
    nodes: int
    gpus_per_node: int
    sharding: Sharding
    micro_batch: int
    grad_accum: int
    grad_ckpt: bool
    estimate: VramEstimate
    gpu_memory_gib: float
    spot: bool
    price_per_hour: float
    tokens_per_second: float
    duration_s: float
    cost: float
    queued: bool = False
    """True when the pool has the capacity in principle but not free right now."""
    host_bytes_per_gpu: int = 0
    """Host memory each GPU's trainer process fills because of the layout (activations
    offloaded); the trainer pod's own needs come on top."""

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def layout(self) -> Layout:
        return Layout(self.pool, self.method, self.total_gpus, self.micro_batch, self.grad_ckpt)


@dataclass
class Plan:
    chosen: Candidate
    alternatives: list[Candidate]
    rejected: list[Rejection]
    """One per pool that could not run the job, by pool name."""
    total_steps: int
    total_tokens: int
    dataset: DatasetSize
    objective: str

    @property
    def queued(self) -> bool:
        return self.chosen.queued

    def to_status(
        self,
        pools: Sequence[GPUPool],
        revision: int = 1,
        reason: PlanReason = PlanReason.INITIAL,
        message: str | None = None,
    ) -> PlanStatus:
        c = self.chosen
        pool = next(p for p in pools if p.name == c.pool)
        return PlanStatus(
            revision=revision,
            reason=reason,
            message=message,
            method=c.method,
            pool=c.pool,
            gpu_product=pool.spec.gpu.product,
            gpu_memory_gib=c.gpu_memory_gib,
            nodes=c.nodes,
            gpus_per_node=c.gpus_per_node,
            total_gpus=c.total_gpus,
            spot=c.spot,
            sharding=c.estimate.setup.sharding,
            precision=c.estimate.setup.precision,
            optimizer=c.estimate.setup.optimizer,
            micro_batch_size=c.micro_batch,
            gradient_accumulation=c.grad_accum,
            gradient_checkpointing=c.grad_ckpt,
            chunked_cross_entropy=True if c.estimate.setup.chunked_ce else None,
            fused_cross_entropy=True if c.estimate.setup.fused_ce else None,
            activation_offloading=True if c.estimate.setup.activation_offload else None,
            optimizer_in_backward=True if c.estimate.setup.optimizer_in_backward else None,
            per_gpu_memory_gib=round(c.estimate.per_gpu_bytes / GIB, 2),
            memory_breakdown_gib={
                k: round(v / GIB, 3) for k, v in c.estimate.breakdown.items() if v
            },
            host_offload_gib=(
                round(c.host_bytes_per_gpu * c.gpus_per_node / GIB, 2)
                if c.host_bytes_per_gpu
                else None
            ),
            trainable_params=c.estimate.trainable_params,
            model_params=c.estimate.total_params,
            total_steps=self.total_steps,
            total_tokens=self.total_tokens,
            estimated_tokens_per_second=round(c.tokens_per_second, 1),
            estimated_duration_seconds=round(c.duration_s, 1),
            estimated_cost_usd=round(c.cost, 2),
            price_per_hour_usd=round(c.price_per_hour, 4),
            alternatives=[
                PlanAlternative(
                    pool=a.pool,
                    method=a.method,
                    total_gpus=a.total_gpus,
                    nodes=a.nodes,
                    per_gpu_memory_gib=round(a.estimate.per_gpu_bytes / GIB, 2),
                    estimated_duration_seconds=round(a.duration_s, 1),
                    estimated_cost_usd=round(a.cost, 2),
                )
                for a in self.alternatives
            ],
            rejected=[PlanRejection(pool=r.pool, reason=r.message) for r in self.rejected],
        )


def replan_settings_after_oom(
    previous: PlanStatus, settings: PlannerSettings, measured_peak_gib: float | None = None
) -> PlannerSettings:
    """Planner settings for a re-plan after the trainer ran out of memory.

    The estimate proved too low for that layout: scale every estimate so the failed layout
    no longer fits (by the measured peak when the trainer reported one), and forbid it.
    """
    seen = max(previous.gpu_memory_gib, measured_peak_gib or 0.0)
    scale = max(settings.memory_scale * 1.15, seen * 1.05 / max(previous.per_gpu_memory_gib, 1e-3))
    return replace(settings, memory_scale=scale, forbid=settings.forbid | {Layout.of(previous)})
