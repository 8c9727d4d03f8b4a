"""Peak memory of one training step, simulated on fake tensors (`kubetune estimate --simulate`).

The trainer's own code builds the model and runs one whole step, with no weights and no GPU:

    model from its config on the meta device → LoRA adapters (`modeling._add_lora`) → activation
    checkpointing (`modeling._enable_activation_checkpointing`) → chunked loss
    (`loss.ChunkedLoss.install`) → parameters and buffers become fake CPU tensors (tied weights
    stay tied) → optimizer (`recipe.build_optimizer`) → forward and loss (`loss.loss_sum`) →
    backward → gradient clipping → optimizer step → `zero_grad(set_to_none=True)`

in the order `modeling.build_model` and `FineTuneRecipe._train_step` use, under
`torch._subclasses.fake_tensor.FakeTensorMode`: every tensor has its shape, dtype and storage
size but no data, so the step costs seconds on CPU whatever the model size. A `MemTracker`
(`torch.distributed._tools.mem_tracker`) sees every allocation and free and sorts each storage
into parameters, buffers, gradients, activations, backward temporaries and optimizer states;
the package's tracker also tags the storages whose last dimension is the vocabulary (logits
and their gradients) and, under `amp-bf16`, the autocast copies of parameters, so that the
result maps onto the analytical estimator's breakdown keys (`kubetune.planning.estimator`).

The model is built on the meta device and then given fake storages, not built under the fake
mode directly: PyTorch cannot swap a fake parameter that the fake mode's converter still
references, which is what `nn.Module.to` (called by PEFT while it adds adapters) does.

**Per-block extrapolation.** Memory is affine in the number of decoder blocks for every phase
(each block adds its weights, gradients, optimizer states and saved activations; the embedding,
final norm, output projection and logits are paid once), so the step is simulated with 1 and 2
blocks and every measured quantity is extrapolated: `m(L) = m(1) + (L - 1) * (m(2) - m(1))`.
The peak of each window of the step (before, first, middle, last
block, after; forward and backward; the optimizer step) is extrapolated on its own and the
overall peak is the largest of them, so a peak that moves from the first block backward runs
to the last one as the model gets deeper (full fine-tuning) is still found.
Sharded setups use 3 and 4 blocks instead (FSDP2's first and last blocks differ from the
rest: nothing to prefetch after the last, no reduce-scatter pending before the first).
`layers="all"` simulates the whole model instead (what `benchmarks/simulate_accuracy.py`
compares against; `docs/simulate.md` has the measured error).

What fake tensors cannot see (CUDA context, NCCL buffers, caching-allocator slack) is not part of
the result; the CLI adds those terms from the estimator's constants and says so.

DPO (`objective="dpo"`, `micro_batch` pairs) runs the trainer's DPO step instead: the
reference log-probabilities first (LoRA: the same model with its adapters off, without
gradients; full: precomputed once per start, so zeros here), then the policy's over the
pair's two rows, then the sigmoid loss.

**Several GPUs** (`gpus > 1`, sharding `full` or `grad-op`): the process is rank 0 of `gpus`
on PyTorch's fake process group (collectives move nothing, their buffers are allocated), and
the model is sharded by the trainer's `modeling.shard_model` (FSDP2 `fully_shard` per block,
then the root, the trainer's mixed-precision policy) after it gets its fake storages; the
tracker is the same on `FSDPMemTracker`, and FSDP2's gathered parameters, unsharded gradients
and communication buffers are the estimator's `fsdp_buffers`. A process that already has a
default process group simulates in a spawned one.

**QLoRA** (one GPU): transformers' bitsandbytes quantizer swaps in `Linear4bit` layers on the
meta device as `from_pretrained` does, and each weight is quantized by bitsandbytes' own
`quantize_4bit` on a fake tensor (`_quantized_weight`); the 4-bit matmul dequantizes the weight
first as bitsandbytes' CUDA kernel does (`_gemm_4bit_as_on_cuda`), tagged `dequant_workspace`.

Limits: DDP (`sharding="none"` on several GPUs) and QLoRA on several GPUs are not simulated;
the attention kernel is the CPU one of
`scaled_dot_product_attention` (saved tensors of the same size as the CUDA flash kernel's:
output and log-sum-exp).

The modules, in the order a simulation uses them: `spec` (the setup, the result, the setups
refused), `model` (the model on the meta device, given fake storages), `kernels` (where CPU
and fake tensors would run the step otherwise than CUDA), `tracker` (the memory accounting
and the map onto the estimator's keys), `step` (one tracked step), `extrapolate` (`simulate`:
the runs, the per-block extrapolation, the result).
"""

from __future__ import annotations

from kubetune_trainer.simulate.extrapolate import simulate
from kubetune_trainer.simulate.spec import (
    MEASURED_COMPONENTS,
    PHASES,
    SimulationError,
    SimulationResult,
    SimulationSetup,
    hf_config,
    trainer_config,
)

__all__ = [
    "MEASURED_COMPONENTS",
    "PHASES",
    "SimulationError",
    "SimulationResult",
    "SimulationSetup",
    "hf_config",
    "simulate",
    "trainer_config",
]
