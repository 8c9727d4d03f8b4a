"""What every candidate of one job needs, computed once per job: the job's totals, its
memory estimates (shared by every pool, and kept across plans), its step times (shared by
pools with the same GPU and network) and its priced candidates."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from kubetune.api.v1alpha1 import FineTuneJobSpec, GPUPool, parse_duration
from kubetune.planning.arch import ModelArch
from kubetune.planning.estimator import (
    EstimatorError,
    TrainingSetup,
    VramEstimate,
    estimate_vram,
    fused_ce_blocker,
    offloaded_bytes,
    trainer_attention,
)
from kubetune.planning.planner.configs import (
    fastest_first,
    free_savers,
    grad_accumulation,
    off_then_on,
    rows_per_sample,
    steps_in_backward,
    training_setup,
)
from kubetune.planning.planner.plans import GIB, Candidate, Loss, PlannerSettings
from kubetune.planning.throughput import (
    StepTime,
    cost_usd,
    dataset_size,
    flops_per_token,
    reference_passes,
    startup_seconds,
    step_time,
    total_steps,
)
from kubetune_trainer.contract import Method, Sharding

ESTIMATES_KEPT = 16384
"""Memory estimates kept across plans (about 1.2 KB each, at most about 20 MB): a job that
waits is planned again whenever capacity changes and asks the same questions, and so do jobs
alike (an estimate depends on the model and the layout, never on a pool or a dataset)."""


@lru_cache(maxsize=ESTIMATES_KEPT)
def _estimate(arch: ModelArch, setup: TrainingSetup) -> VramEstimate:
    return estimate_vram(arch, setup)


_StepKey = tuple[float, float, float, int, int, Method, Sharding, int, bool, bool]
"""bf16 TFLOPS, interconnect GB/s, network Gb/s, nodes, GPUs per node, method, sharding,
micro-batch, checkpointing, offloading: everything a step time depends on besides the job."""


class JobContext:
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
        self.free = free_savers(spec)
        self.offloads = off_then_on(spec.training.activation_offloading)
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
        applies = steps_in_backward(
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
        setup = training_setup(
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
            order = self._orders[key] = fastest_first(
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
