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
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import lru_cache
from typing import Literal, NamedTuple

from kubetune.api.errors import InfeasibleError
from kubetune.api.tenancy import Tenant
from kubetune.api.units import about
from kubetune.api.v1alpha1 import (
    FineTuneJobSpec,
    GPUPool,
    Objective,
    PlanAlternative,
    PlanRejection,
    PlanStatus,
    parse_duration,
)
from kubetune.api.vocabulary import PlanReason
from kubetune.planning.arch import ModelArch
from kubetune.planning.estimator import (
    TRAINER_QLORA_MATMUL_KEEPS_INPUT,
    Attention,
    EstimatorError,
    TrainingSetup,
    VramEstimate,
    estimate_vram,
    fused_ce_blocker,
    offloaded_bytes,
    trainer_attention,
)
from kubetune.planning.throughput import (
    ROWS_PER_PAIR,
    DatasetSize,
    StepTime,
    cost_usd,
    dataset_size,
    flops_per_token,
    micro_batch_efficiency,
    reference_passes,
    startup_seconds,
    step_time,
    total_steps,
)
from kubetune_trainer.contract import Method, Sharding

GIB = 1024**3

Loss = Literal["plain", "chunked", "fused"]
"""How a configuration computes its loss: over full-vocabulary logits, chunked, or fused with
the output projection (kubetune_trainer.loss)."""
DEFAULT_SAFETY_FACTOR = 1.10
MAX_MICRO_BATCH = 64
METHOD_ORDER: dict[Method, int] = {"lora": 0, "qlora": 1, "full": 2}

ESTIMATES_KEPT = 16384
"""Memory estimates kept across plans (about 1.2 KB each, at most about 20 MB): a job that
waits is planned again whenever capacity changes and asks the same questions, and so do jobs
alike (an estimate depends on the model and the layout, never on a pool or a dataset)."""


@lru_cache(maxsize=ESTIMATES_KEPT)
def _estimate(arch: ModelArch, setup: TrainingSetup) -> VramEstimate:
    return estimate_vram(arch, setup)


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


@dataclass
class _PoolReport:
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


def _methods(spec: FineTuneJobSpec) -> list[Method]:
    if spec.method == "auto":
        # Full fine-tuning changes the result, not just the cost: never chosen implicitly.
        return ["lora", "qlora"]
    return [spec.method]


def _layouts(
    pool: GPUPool, spec: FineTuneJobSpec, settings: PlannerSettings
) -> Iterator[tuple[int, int]]:
    """(nodes, GPUs per node) shapes this pool can offer the job."""
    per_node = pool.spec.gpus_per_node
    wanted = spec.resources.gpus
    if wanted != "auto":
        gpn = min(int(wanted), per_node)
        if int(wanted) % gpn == 0:
            yield int(wanted) // gpn, gpn
        return
    gpn = 1
    while gpn < per_node:
        yield 1, gpn
        gpn *= 2
    for nodes in range(1, pool.spec.max_nodes + 1):
        yield nodes, per_node


def _capacity(pool: GPUPool, nodes: int, gpn: int, settings: PlannerSettings) -> str | bool | None:
    """None when the layout fits now, True when it fits once GPUs free up, or a reason."""
    if nodes > pool.spec.max_nodes:
        return f"needs {nodes} nodes, pool allows {pool.spec.max_nodes}"
    status = pool.status
    if not settings.use_live_capacity or status is None or status.updated_at is None:
        return None
    if status.nodes and nodes > status.nodes:
        return True
    per_node_free = status.free_gpus_per_node or []
    if per_node_free:
        if sum(1 for free in per_node_free if free >= gpn) >= nodes:
            return None
        return True
    return None if status.free_gpus >= nodes * gpn else True


def _micro_batches(global_batch: int, data_parallel: int, fixed: int | None) -> list[int]:
    if global_batch % data_parallel:
        return []
    per_gpu = global_batch // data_parallel
    if fixed is not None:
        return [fixed] if per_gpu % fixed == 0 else []
    return sorted(
        (m for m in range(1, min(per_gpu, MAX_MICRO_BATCH) + 1) if per_gpu % m == 0), reverse=True
    )


def _off_then_on(chosen: bool | None) -> list[bool]:
    """A memory saver the job leaves to the planner is tried off, then on; a set one as set.
    The chunked and fused losses and the optimizer in backward are tried per configuration
    (they cost no time); activation offloading per group of configurations, only when none
    fitted without it (host-link time every step)."""
    return [False, True] if chosen is None else [chosen]


def _losses(spec: FineTuneJobSpec) -> list[Loss]:
    """The losses a configuration tries, in order: the plain one, the chunked one, the fused
    one (the least memory, but a kernel only for CUDA); one the job sets is the only one."""
    if spec.training.fused_cross_entropy:
        return ["fused"]
    if spec.training.chunked_cross_entropy:
        return ["chunked"]
    losses: list[Loss] = ["plain"]
    if spec.training.chunked_cross_entropy is None:
        losses.append("chunked")
    if spec.training.fused_cross_entropy is None:
        losses.append("fused")
    return losses


def _free_savers(spec: FineTuneJobSpec) -> list[tuple[Loss, bool]]:
    """(loss, optimizer in backward) in the order a configuration tries them: the plain
    step, the chunked loss, the fused loss, then the optimizer in backward (which gives up
    gradient clipping) with each loss again."""
    return [
        (loss, in_backward)
        for in_backward in _off_then_on(spec.training.optimizer_in_backward)
        for loss in _losses(spec)
    ]


def rows_per_sample(spec: FineTuneJobSpec) -> int:
    """Sequences the model runs per sample of the batch: 2 for a DPO pair, else 1."""
    return ROWS_PER_PAIR if spec.training.objective == "dpo" else 1


def grad_accumulation(spec: FineTuneJobSpec, micro: int, gpus: int) -> int:
    """Micro-batches per optimizer step on each GPU: global batch / (micro-batch × GPUs)."""
    return max(1, spec.training.global_batch_size // (micro * gpus))


def _setup(
    spec: FineTuneJobSpec,
    method: Method,
    gpus: int,
    sharding: Sharding,
    micro: int,
    ckpt: bool,
    loss: Loss = "plain",
    offload: bool = False,
    attention: Attention = "sdpa",
    in_backward: bool = False,
) -> TrainingSetup:
    lora = spec.lora_or_default
    return TrainingSetup(
        method=method,
        # DPO's micro-batch of pairs holds a chosen and a rejected row each.
        micro_batch=micro * rows_per_sample(spec),
        seq_len=spec.training.sequence_length,
        gpus=gpus,
        sharding=sharding,
        # Micro-batches per optimizer step: the global batch and the micro-batch both count
        # samples (pairs for DPO), so the rows per sample cancel out.
        grad_accumulation=grad_accumulation(spec, micro, gpus),
        precision=spec.training.precision,
        optimizer=spec.training.optimizer,
        grad_ckpt=ckpt,
        lora_rank=lora.rank,
        lora_targets=tuple(lora.target_modules),
        lora_dropout=lora.dropout,
        qlora_double_quant=lora.double_quant,
        qlora_matmul_keeps_input=TRAINER_QLORA_MATMUL_KEEPS_INPUT,
        chunked_ce=loss == "chunked",
        fused_ce=loss == "fused",
        activation_offload=offload,
        attention=attention,
        optimizer_in_backward=in_backward,
    )


def _steps_in_backward(method: Method, gpus: int, sharding: Sharding, accumulation: int) -> bool:
    """Whether the optimizer in backward applies: full fine-tuning (adapters' gradients are
    small), one micro-batch per step, and not DDP, whose hooks see unaveraged gradients."""
    return method == "full" and accumulation == 1 and not (gpus > 1 and sharding == "none")


_StepKey = tuple[float, float, float, int, int, Method, Sharding, int, bool, bool]
"""bf16 TFLOPS, interconnect GB/s, network Gb/s, nodes, GPUs per node, method, sharding,
micro-batch, checkpointing, offloading: everything a step time depends on besides the job."""


class _Context:
    """Per-job values every candidate needs, computed once."""

    def __init__(self, spec: FineTuneJobSpec, arch: ModelArch, settings: PlannerSettings):
        self.spec = spec
        self.arch = arch
        self.settings = settings
        self.dataset = dataset_size(spec.dataset, spec.training)
        self.steps = total_steps(self.dataset, spec.training)
        self.tokens_per_step = (
            spec.training.global_batch_size * spec.training.sequence_length * rows_per_sample(spec)
        )
        self.total_tokens = self.steps * self.tokens_per_step
        self.deadline_s = (
            parse_duration(spec.resources.deadline).total_seconds()
            if spec.resources.deadline
            else None
        )
        self.budget = spec.resources.max_cost_usd
        self.free = _free_savers(spec)
        self.offloads = _off_then_on(spec.training.activation_offloading)
        self.attention = trainer_attention(arch)
        # What the fast walk computes once for this job.
        self._estimates: dict[
            tuple[Method, int, Sharding, int, bool, Loss, bool, bool], VramEstimate
        ] = {}
        self._fused_applies: dict[Method, bool] = {}
        self._orders: dict[tuple[Method, tuple[tuple[int, bool], ...]], list[tuple[int, bool]]] = {}
        self._step_times: dict[_StepKey, StepTime] = {}
        self._startup_s = startup_seconds(2.0 * arch.total_params)

    def evaluate(
        self,
        pool: GPUPool,
        method: Method,
        nodes: int,
        gpn: int,
        sharding: Sharding,
        micro: int,
        ckpt: bool,
        offload: bool = False,
    ) -> Candidate:
        """One configuration from scratch (the reference the fast walk is tested against),
        with the first of its `savers` that fits (or the last)."""
        total = nodes * gpn
        for loss, in_backward in self.savers(method, total, sharding, micro):
            estimate = self.fresh_estimate(
                method, total, sharding, micro, ckpt, loss, offload, in_backward
            )
            if self.fits_gib(estimate, pool.spec.gpu.memory_gib):
                break
        st = self.step_time_of(pool, method, nodes, gpn, sharding, micro, ckpt, estimate)
        startup_s = startup_seconds(2.0 * self.arch.total_params)
        return self.build(pool, method, nodes, gpn, sharding, micro, ckpt, estimate, st, startup_s)

    def step_time_of(
        self,
        pool: GPUPool,
        method: Method,
        nodes: int,
        gpn: int,
        sharding: Sharding,
        micro: int,
        ckpt: bool,
        estimate: VramEstimate,
    ) -> StepTime:
        weight_bytes = (
            2.0 * self.arch.total_params if method != "qlora" else 0.56 * self.arch.total_params
        )
        grad_bytes = 2.0 * (
            self.arch.total_params if method == "full" else estimate.trainable_params
        )
        seq = self.spec.training.sequence_length
        micro_batches = self.spec.training.global_batch_size // (micro * nodes * gpn)
        return step_time(
            gpu=pool.spec.gpu,
            network_gbps=pool.spec.network_gbps,
            nodes=nodes,
            gpus_per_node=gpn,
            method=method,
            sharding=sharding,
            flops_token=flops_per_token(
                self.arch.active_params,
                self.arch.num_layers,
                self.arch.hidden_size,
                seq,
                method,
                ckpt,
                extra_passes=reference_passes(self.spec.training, method),
            ),
            tokens_per_step=self.tokens_per_step,
            micro_batch_tokens=micro * seq * rows_per_sample(self.spec),
            weight_bytes=weight_bytes,
            grad_bytes=grad_bytes,
            offload_bytes=offloaded_bytes(self.arch, estimate.setup) * micro_batches,
        )

    def build(
        self,
        pool: GPUPool,
        method: Method,
        nodes: int,
        gpn: int,
        sharding: Sharding,
        micro: int,
        ckpt: bool,
        estimate: VramEstimate,
        st: StepTime,
        startup_s: float,
        queued: bool = False,
    ) -> Candidate:
        total = nodes * gpn
        duration = self.steps * st.step_s + startup_s
        return Candidate(
            pool=pool.name,
            method=method,
            nodes=nodes,
            gpus_per_node=gpn,
            sharding=sharding,
            micro_batch=micro,
            grad_accum=grad_accumulation(self.spec, micro, total),
            grad_ckpt=ckpt,
            estimate=estimate,
            gpu_memory_gib=pool.spec.gpu.memory_gib,
            spot=pool.spec.spot,
            price_per_hour=total * pool.spec.price_per_gpu_hour,
            tokens_per_second=st.tokens_per_s,
            duration_s=duration,
            cost=cost_usd(duration, total, pool.spec.price_per_gpu_hour),
            queued=queued,
            host_bytes_per_gpu=offloaded_bytes(self.arch, estimate.setup),
        )

    def fits(self, c: Candidate) -> bool:
        return self.fits_gib(c.estimate, c.gpu_memory_gib)

    def fits_gib(self, estimate: VramEstimate, memory_gib: float) -> bool:
        return estimate.per_gpu_bytes * self.settings.safety_factor <= memory_gib * GIB

    def savers(
        self, method: Method, total: int, sharding: Sharding, micro: int
    ) -> list[tuple[Loss, bool]]:
        """`free` for one configuration: the optimizer in backward only where it applies
        (`optimizerInBackward: true` means wherever it does), the fused loss only where the
        trainer runs it, each combination once."""
        applies = _steps_in_backward(
            method, total, sharding, grad_accumulation(self.spec, micro, total)
        )
        fused = self.fused_applies(method)
        out: list[tuple[Loss, bool]] = []
        for loss, in_backward in self.free:
            pair = (loss, in_backward and applies)
            if (fused or loss != "fused") and pair not in out:
                out.append(pair)
        return out

    def fused_applies(self, method: Method) -> bool:
        """Whether the trainer runs the fused loss for this job's model with `method`;
        `fusedCrossEntropy: true` where it cannot is an invalid spec (EstimatorError)."""
        applies = self._fused_applies.get(method)
        if applies is None:
            lora = self.spec.lora_or_default
            blocker = fused_ce_blocker(self.arch, method, tuple(lora.target_modules))
            if blocker is not None and self.spec.training.fused_cross_entropy:
                raise EstimatorError(
                    f"training.fusedCrossEntropy is true, but the trainer cannot fuse the "
                    f"loss of {self.arch.name} with method {method}: {blocker}. To fix: use "
                    "training.chunkedCrossEntropy instead, or unset it"
                )
            applies = self._fused_applies[method] = blocker is None
        return applies

    # ---- the fast walk: the same numbers as `evaluate`, each computed once per job

    def estimate(
        self,
        method: Method,
        total: int,
        sharding: Sharding,
        micro: int,
        ckpt: bool,
        loss: Loss,
        offload: bool,
        in_backward: bool = False,
    ) -> VramEstimate:
        """`evaluate`'s memory estimate; it depends on no pool, so every pool shares it."""
        key = (method, total, sharding, micro, ckpt, loss, offload, in_backward)
        estimate = self._estimates.get(key)
        if estimate is None:
            estimate = self._estimates[key] = self.fresh_estimate(*key)
        return estimate

    def fresh_estimate(
        self,
        method: Method,
        total: int,
        sharding: Sharding,
        micro: int,
        ckpt: bool,
        loss: Loss,
        offload: bool,
        in_backward: bool,
    ) -> VramEstimate:
        """The memory estimate of one layout, computed now (scaled by `memory_scale`)."""
        setup = _setup(
            self.spec,
            method,
            total,
            sharding,
            micro,
            ckpt,
            loss,
            offload,
            self.attention,
            in_backward,
        )
        estimate = _estimate(self.arch, setup)
        if self.settings.memory_scale != 1.0:
            estimate = _scaled(estimate, self.settings.memory_scale)
        return estimate

    def ordered(self, configs: list[tuple[int, bool]], method: Method) -> list[tuple[int, bool]]:
        key = (method, tuple(configs))
        order = self._orders.get(key)
        if order is None:
            order = self._orders[key] = _ordered(
                configs, method, self.spec.training.sequence_length
            )
        return order

    def candidate(
        self,
        pool: GPUPool,
        method: Method,
        nodes: int,
        gpn: int,
        sharding: Sharding,
        micro: int,
        ckpt: bool,
        estimate: VramEstimate,
        queued: bool,
    ) -> Candidate:
        """What `evaluate` returns for this configuration, given its (shared) estimate."""
        gpu = pool.spec.gpu
        step_key = (
            gpu.bf16_tflops,
            gpu.interconnect_gbps,
            pool.spec.network_gbps,
            nodes,
            gpn,
            method,
            sharding,
            micro,
            ckpt,
            estimate.setup.activation_offload,
        )
        st = self._step_times.get(step_key)
        if st is None:
            st = self._step_times[step_key] = self.step_time_of(
                pool, method, nodes, gpn, sharding, micro, ckpt, estimate
            )
        return self.build(
            pool, method, nodes, gpn, sharding, micro, ckpt, estimate, st, self._startup_s, queued
        )


def _scaled(estimate: VramEstimate, scale: float) -> VramEstimate:
    breakdown = {k: int(v * scale) for k, v in estimate.breakdown.items()}
    return replace(estimate, per_gpu_bytes=sum(breakdown.values()), breakdown=breakdown)


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


def _eligible_pools(
    spec: FineTuneJobSpec,
    pools: Sequence[GPUPool],
    rejected: list[Rejection],
    tenant: Tenant | None = None,
) -> list[GPUPool]:
    allowed = set(spec.resources.pools)
    out = []
    for pool in pools:
        selector = pool.spec.namespace_selector
        if tenant is not None and not tenant.may_use(selector):
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


def _groups(
    ctx: _Context, pool: GPUPool, report: _PoolReport
) -> Iterator[tuple[Method, int, int, Sharding, list[tuple[int, bool]], str | bool | None]]:
    """Every (method, layout, sharding) group with its configurations, fastest first."""
    spec = ctx.spec
    ckpts = (
        [False, True]
        if spec.training.gradient_checkpointing is None
        else [spec.training.gradient_checkpointing]
    )
    for method in _methods(spec):
        for nodes, gpn in _layouts(pool, spec, ctx.settings):
            total = nodes * gpn
            if total < ctx.settings.min_total_gpus:
                continue
            capacity = _capacity(pool, nodes, gpn, ctx.settings)
            if isinstance(capacity, str):
                report.capacity = capacity
                continue
            single_node = ctx.settings.single_node_reason
            if nodes > 1 and single_node:
                report.single_node += 1
                if report.single_node == 1:  # the fewest nodes say it
                    report.capacity = f"spans {nodes} nodes, but {single_node}"
                continue
            micros = _micro_batches(
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


def _consider(ctx: _Context, c: Candidate, report: _PoolReport) -> bool:
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


def _explain(pool: str, report: _PoolReport, ctx: _Context) -> Rejection:
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


def _closest_miss(pool: str, report: _PoolReport, ctx: _Context) -> Rejection:
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


def _search(ctx: _Context, pools: Sequence[GPUPool]) -> tuple[list[Candidate], list[Rejection]]:
    """`_reference_search(exhaustive=False)`, with shared estimates and lazy pricing.

    Per configuration, in the reference's order: forbidden? fits? Only a configuration that
    passes both is priced, and the group's walk ends there (accepted, or past the deadline or
    the budget, which slower configurations of the group would miss too). The report records
    exactly what the reference's `_consider` records, from the same numbers.
    """
    rejected: list[Rejection] = []
    accepted: list[Candidate] = []
    forbid = ctx.settings.forbid
    safety = ctx.settings.safety_factor
    deadline, budget = ctx.deadline_s, ctx.budget
    for pool in _eligible_pools(ctx.spec, pools, rejected, ctx.settings.tenant):
        report = _PoolReport()
        before = len(accepted)
        memory_gib = pool.spec.gpu.memory_gib
        memory_bytes = memory_gib * GIB
        for method, nodes, gpn, sharding, configs, capacity in _groups(ctx, pool, report):
            total = nodes * gpn
            for offload in ctx.offloads:
                priced = False
                for micro, ckpt in ctx.ordered(_with_offload(configs, offload), method):
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
            rejected.append(_explain(pool.name, report, ctx))
    return accepted, sorted(rejected, key=lambda r: r.pool)


def _reference_search(
    ctx: _Context, pools: Sequence[GPUPool], exhaustive: bool
) -> tuple[list[Candidate], list[Rejection]]:
    """The plain walk: every configuration evaluated from scratch (`exhaustive`: all of
    them; otherwise each group up to its first acceptable configuration)."""
    rejected: list[Rejection] = []
    accepted: list[Candidate] = []
    for pool in _eligible_pools(ctx.spec, pools, rejected, ctx.settings.tenant):
        report = _PoolReport()
        before = len(accepted)
        for method, nodes, gpn, sharding, configs, capacity in _groups(ctx, pool, report):
            seq = ctx.spec.training.sequence_length
            for offload in ctx.offloads:
                fitted = False
                for micro, ckpt in _ordered(_with_offload(configs, offload), method, seq):
                    c = ctx.evaluate(pool, method, nodes, gpn, sharding, micro, ckpt, offload)
                    if capacity is True:
                        c = replace(c, queued=True)
                    fits = ctx.fits(c) and c.layout not in ctx.settings.forbid
                    fitted = fitted or fits
                    if _consider(ctx, c, report):
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
            rejected.append(_explain(pool.name, report, ctx))
    return accepted, sorted(rejected, key=lambda r: r.pool)


def _with_offload(configs: list[tuple[int, bool]], offload: bool) -> list[tuple[int, bool]]:
    """The configurations walked with activation offloading: those with checkpointing, where
    it moves one input per layer (and then costs the same host-link time per step whatever
    the micro-batch, so the fastest-first order still holds)."""
    return [(m, ck) for m, ck in configs if ck] if offload else configs


def _ordered(
    configs: Iterable[tuple[int, bool]], method: Method, seq_len: int
) -> list[tuple[int, bool]]:
    """Fastest first.

    Inside one group only the micro-batch and recomputation vary; compute time is
    proportional to passes(checkpointing) / efficiency(micro-batch tokens), and the GPU count
    (so the price per hour) is fixed, so this order is also cheapest first.
    """

    def compute_factor(mc: tuple[int, bool]) -> tuple[float, int, bool]:
        micro, ckpt = mc
        passes = flops_per_token(1, 0, 0, seq_len, method, ckpt)
        return (round(passes / micro_batch_efficiency(micro * seq_len), 9), -micro, ckpt)

    return sorted(configs, key=compute_factor)


def _finish(
    ctx: _Context, accepted: list[Candidate], rejected: list[Rejection], alternatives: int
) -> Plan:
    objective = objective_of(ctx.spec, ctx.settings)
    spot = ctx.spec.resources.spot
    if not accepted:
        raise _infeasible(ctx, rejected)
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


def _infeasible(ctx: _Context, rejected: list[Rejection]) -> InfeasibleError:
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
            ctx.fused_applies(m) for m in _methods(ctx.spec)
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


def plan_job(
    spec: FineTuneJobSpec,
    pools: Sequence[GPUPool],
    arch: ModelArch,
    settings: PlannerSettings | None = None,
    alternatives: int = 3,
) -> Plan:
    """Choose the best configuration for `spec` or raise InfeasibleError with advice."""
    ctx = _Context(spec, arch, settings or PlannerSettings())
    accepted, rejected = _search(ctx, pools)
    return _finish(ctx, accepted, rejected, alternatives)


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
    ctx = _Context(spec, arch, settings or PlannerSettings())
    accepted, rejected = _reference_search(ctx, pools, exhaustive=exhaustive)
    return _finish(ctx, accepted, rejected, alternatives)


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


__all__ = [
    "Candidate",
    "Layout",
    "Limit",
    "Plan",
    "PlannerSettings",
    "Rejection",
    "brute_force_plan",
    "objective_of",
    "plan_job",
    "rank_key",
    "replan_settings_after_oom",
]
