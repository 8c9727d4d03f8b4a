"""What the planner may try for a job, each as the trainer would run it: the methods, the GPU
layouts a pool offers, the micro-batches that split the global batch, the memory savers, and
the order that puts the fastest configuration of a group first."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kubetune.api.v1alpha1 import FineTuneJobSpec, GPUPool
from kubetune.planning.estimator import (
    TRAINER_QLORA_MATMUL_KEEPS_INPUT,
    Attention,
    TrainingSetup,
)
from kubetune.planning.planner.plans import MAX_MICRO_BATCH, Loss, PlannerSettings
from kubetune.planning.throughput import ROWS_PER_PAIR, flops_per_token, micro_batch_efficiency
from kubetune_trainer.contract import Method, Sharding


def methods_to_try(spec: FineTuneJobSpec) -> list[Method]:
    if spec.method == "auto":
        # Full fine-tuning changes the result, not just the cost: never chosen implicitly.
        return ["lora", "qlora"]
    return [spec.method]


def gpu_layouts(
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


def pool_capacity(
    pool: GPUPool, nodes: int, gpn: int, settings: PlannerSettings
) -> str | bool | None:
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


def micro_batches(global_batch: int, data_parallel: int, fixed: int | None) -> list[int]:
    if global_batch % data_parallel:
        return []
    per_gpu = global_batch // data_parallel
    if fixed is not None:
        return [fixed] if per_gpu % fixed == 0 else []
    return sorted(
        (m for m in range(1, min(per_gpu, MAX_MICRO_BATCH) + 1) if per_gpu % m == 0), reverse=True
    )


def off_then_on(chosen: bool | None) -> list[bool]:
    """A memory saver the job leaves to the planner is tried off, then on; a set one as set.
    The chunked and fused losses and the optimizer in backward are tried per configuration
    (they cost no time); activation offloading per group of configurations, only when none
    fitted without it (host-link time every step)."""
    return [False, True] if chosen is None else [chosen]


def losses_to_try(spec: FineTuneJobSpec) -> list[Loss]:
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


def free_savers(spec: FineTuneJobSpec) -> list[tuple[Loss, bool]]:
    """(loss, optimizer in backward) in the order a configuration tries them: the plain
    step, the chunked loss, the fused loss, then the optimizer in backward (which gives up
    gradient clipping) with each loss again."""
    return [
        (loss, in_backward)
        for in_backward in off_then_on(spec.training.optimizer_in_backward)
        for loss in losses_to_try(spec)
    ]


def rows_per_sample(spec: FineTuneJobSpec) -> int:
    """Sequences the model runs per sample of the batch: 2 for a DPO pair, else 1."""
    return ROWS_PER_PAIR if spec.training.objective == "dpo" else 1


def grad_accumulation(spec: FineTuneJobSpec, micro: int, gpus: int) -> int:
    """Micro-batches per optimizer step on each GPU: global batch / (micro-batch × GPUs)."""
    return max(1, spec.training.global_batch_size // (micro * gpus))


def training_setup(
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


def steps_in_backward(method: Method, gpus: int, sharding: Sharding, accumulation: int) -> bool:
    """Whether the optimizer in backward applies: full fine-tuning (adapters' gradients are
    small), one micro-batch per step, and not DDP, whose hooks see unaveraged gradients."""
    return method == "full" and accumulation == 1 and not (gpus > 1 and sharding == "none")


def with_offload(configs: list[tuple[int, bool]], offload: bool) -> list[tuple[int, bool]]:
    """The configurations walked with activation offloading: those with checkpointing, where
    it moves one input per layer (and then costs the same host-link time per step whatever
    the micro-batch, so the fastest-first order still holds)."""
    return [(m, ck) for m, ck in configs if ck] if offload else configs


def fastest_first(
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
