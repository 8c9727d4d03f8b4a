"""Throughput, duration and cost model (pure).

A deliberately simple, documented model (docs/planner.md):

* FLOPs per trained token: 6·P for full fine-tuning (forward 2·P, backward 4·P), 4·P for
  LoRA/QLoRA (the frozen base skips weight gradients), + 2·P when activations are
  recomputed, + the attention term 12·L·h·s (PaLM appendix B) scaled the same way.
  P is the *active* parameter count, so MoE models cost what their routed experts cost.
* Achieved FLOP/s = GPUs × peak bf16 TFLOPS × MFU. MFU per method from published runs
  (full ≈ 40 %, LoRA ≈ 35 %, QLoRA ≈ 25 % for the NF4 dequantization), discounted when a
  micro-batch holds few tokens (kernels do not saturate the GPU).
* Communication per optimizer step: FSDP all-gathers the bf16 weights twice (forward and
  backward) and reduce-scatters gradients once; without sharding, gradients are
  all-reduced. Bandwidth is the intra-node link, or the network when nodes > 1. 70 % of the
  communication overlaps with compute; the rest is exposed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kubetune.api.v1alpha1 import DatasetSource, GPUSpec, TrainingSettings
from kubetune_trainer.contract import Method

MFU: dict[Method, float] = {"full": 0.40, "lora": 0.35, "qlora": 0.25}
COMM_OVERLAP = 0.7
SATURATION_TOKENS = 1024
# Host <-> GPU copies of activation offloading: PCIe 4.0 x16 carries 31.5 GB/s per direction
# in theory, about 25 GB/s from pinned memory in practice (PCIe 5.0 GPUs get more; the
# planner counts the slower link). The trainer's copies are synchronous: not overlapped.
HOST_LINK_BYTES_PER_S = 25e9
STARTUP_SECONDS = 120.0
LOAD_BANDWIDTH_BYTES_PER_S = 1.0e9
DEFAULT_EXAMPLES = 10_000
DEFAULT_TOKENS_PER_EXAMPLE = 512


@dataclass(frozen=True)
class DatasetSize:
    tokens_per_epoch: int
    sequences_per_epoch: int
    assumed: bool
    """True when the spec gave no size hint and the defaults were used."""


def dataset_size(dataset: DatasetSource, training: TrainingSettings) -> DatasetSize:
    """Tokens and sequences processed per epoch, from the spec's size hints."""
    seq = training.sequence_length
    examples = dataset.num_examples
    per_example = dataset.avg_tokens_per_example
    assumed = dataset.total_tokens is None and examples is None
    if dataset.total_tokens is not None:
        tokens = dataset.total_tokens
        examples = examples or max(1, tokens // (per_example or DEFAULT_TOKENS_PER_EXAMPLE))
    else:
        examples = examples or DEFAULT_EXAMPLES
        tokens = examples * min(seq, per_example or DEFAULT_TOKENS_PER_EXAMPLE)
    if training.objective == "dpo":
        # A pair a record: its chosen and rejected rows, each padded to the sequence length.
        sequences = examples
        processed = examples * seq * ROWS_PER_PAIR
    elif training.packing:
        sequences = max(1, math.ceil(tokens / seq))
        processed = sequences * seq
    else:
        sequences = examples
        processed = examples * seq  # padded to the sequence length
    return DatasetSize(tokens_per_epoch=processed, sequences_per_epoch=sequences, assumed=assumed)


def total_steps(size: DatasetSize, training: TrainingSettings) -> int:
    if training.max_steps is not None:
        return training.max_steps
    steps_per_epoch = size.sequences_per_epoch / training.global_batch_size
    return max(1, math.ceil(steps_per_epoch * training.epochs))


ROWS_PER_PAIR = 2
"""DPO trains on a chosen and a rejected row per preference pair."""


def reference_passes(training: TrainingSettings, method: Method) -> float:
    """Extra forward passes per token (in units of 1 = 2·params FLOPs, as `flops_per_token`
    counts them) for DPO's reference model: LoRA/QLoRA run the base with the adapters off on
    every step; full fine-tuning computes the reference log-probs once per start, a forward
    over the data, spread here over the epochs."""
    if training.objective != "dpo":
        return 0.0
    if method != "full":
        return 2.0
    return 2.0 / max(1.0, training.epochs)


def flops_per_token(
    active_params: int,
    num_layers: int,
    hidden: int,
    seq_len: int,
    method: Method,
    grad_ckpt: bool,
    extra_passes: float = 0.0,
) -> float:
    passes = (6.0 if method == "full" else 4.0) + extra_passes
    if grad_ckpt:
        passes += 2.0
    attention = 12.0 * num_layers * hidden * seq_len * (passes / 6.0)
    return passes * active_params + attention


def micro_batch_efficiency(tokens_per_micro_batch: int) -> float:
    """Share of the method's MFU reached with this many tokens per forward pass."""
    return tokens_per_micro_batch / (tokens_per_micro_batch + SATURATION_TOKENS)


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_s: float
    step_s: float
    tokens_per_s: float
    mfu: float


def step_time(
    *,
    gpu: GPUSpec,
    network_gbps: float,
    nodes: int,
    gpus_per_node: int,
    method: Method,
    sharding: str,
    flops_token: float,
    tokens_per_step: int,
    micro_batch_tokens: int,
    weight_bytes: float,
    grad_bytes: float,
    offload_bytes: float = 0.0,
) -> StepTime:
    """Seconds per optimizer step for one configuration.

    `weight_bytes` is what FSDP gathers (the whole model's working copy), `grad_bytes`
    the gradients that are reduced (all parameters for full, adapters for LoRA),
    `offload_bytes` what activation offloading moves to host memory per step and GPU (it
    comes back in backward: twice over the host link, not overlapped).
    """
    n = nodes * gpus_per_node
    mfu = MFU[method] * micro_batch_efficiency(micro_batch_tokens)
    compute = flops_token * tokens_per_step / (n * gpu.bf16_tflops * 1e12 * mfu)
    comm = 0.0
    if n > 1:
        # Ring collectives move (n-1)/n of the data through each GPU's link.
        ring = (n - 1) / n
        if sharding == "full":
            volume = 2 * weight_bytes + grad_bytes
        elif sharding == "grad-op":
            volume = weight_bytes + grad_bytes
        else:
            volume = 2 * grad_bytes
        link_bytes_per_s = gpu.interconnect_gbps * 1e9
        if nodes > 1:
            link_bytes_per_s = min(link_bytes_per_s, network_gbps * 1e9 / 8 / gpus_per_node)
        comm = ring * volume / link_bytes_per_s
    exposed = max(comm - COMM_OVERLAP * compute, comm * (1 - COMM_OVERLAP))
    step = compute + exposed + 2 * offload_bytes / HOST_LINK_BYTES_PER_S
    return StepTime(
        compute_s=compute,
        comm_s=comm,
        step_s=step,
        tokens_per_s=tokens_per_step / step,
        mfu=mfu * compute / step,
    )


def startup_seconds(model_bytes: float) -> float:
    """Image pull, process start and model load before the first step."""
    return STARTUP_SECONDS + model_bytes / LOAD_BANDWIDTH_BYTES_PER_S


def cost_usd(duration_s: float, total_gpus: int, price_per_gpu_hour: float) -> float:
    return duration_s / 3600.0 * total_gpus * price_per_gpu_hour
