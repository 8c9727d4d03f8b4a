"""Per-GPU memory estimate for one fine-tuning configuration (pure, stdlib only).

The planner calls :func:`estimate_vram` for every candidate layout (method, GPU count,
sharding, micro-batch, activation checkpointing) and keeps the ones whose estimate, times a
safety factor, fits the GPU.  The estimate is the *peak* memory one GPU needs during a
training step, split into named components whose sum is exactly
:attr:`VramEstimate.per_gpu_bytes`.

Every term, its formula and its source is documented in ``docs/estimator.md``; the constants
were checked against published measurements (``kubetune/planning/data/measurements.yaml``, report in
``docs/estimator-calibration.md``).  In short:

* **static state**: weights (bf16 / fp32, or NF4 plus quantization constants), LoRA adapter
  weights, gradients and optimizer states of the trainable parameters, divided by the
  sharding degree where FSDP shards them and moved off the GPU by CPU offload;
* **activations** saved for backward, counted per decoder layer from the tensors autograd
  keeps (Korthikanti et al. 2022, adapted to RMSNorm, SwiGLU, grouped-query attention and
  LoRA); activation checkpointing keeps each layer's input plus one layer's working set;
* **logits** for the loss (first order for 128k+ vocabularies);
* **runtime overheads**: FSDP all-gather buffers, QLoRA dequantization buffers, CUDA context,
  NCCL buffers and caching-allocator slack.

Static state (weights, adapters, optimizer states) is there for the whole step; the gradients
and the transient terms (activations, logits, FSDP buffers) are taken at the moment of the step
where their sum is largest (the loss, the root's all-gather, the first and the last block's
backward, the end of backward: :func:`_transient_moments`), and the allocator slack keeps what
the caching allocator holds from the other moments.  Gradients depend on the gradient
accumulation (:attr:`TrainingSetup.grad_accumulation`): with one micro-batch per optimizer step
the trainer frees them after every step (``zero_grad(set_to_none=True)``), so they exist from
backward on only, made block by block as the saved activations are freed
(:func:`_gradients_made`); with more, the earlier micro-batches' gradients are there at every
moment, and under FSDP they are held unsharded in fp32 (:func:`_accumulated_gradient_bytes`).

Activations and logits belong to the micro-batch each GPU processes and are *never* divided
by the number of GPUs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Literal, get_args

from pydantic.alias_generators import to_camel

from kubetune.planning.arch import LinearLayer, ModelArch
from kubetune_trainer.contract import (
    METHODS,
    OPTIMIZERS,
    PRECISIONS,
    SHARDINGS,
    Method,
    Optimizer,
    Precision,
    Sharding,
    loss_chunk_tokens,
)

__all__ = [
    "ALL_LINEAR",
    "ATTENTIONS",
    "BREAKDOWN_COMPONENTS",
    "GIB",
    "Attention",
    "EstimatorError",
    "MeasuredMetric",
    "TrainingSetup",
    "VramEstimate",
    "comparable_bytes",
    "estimate_vram",
    "lora_target_names",
    "offloaded_bytes",
    "quantized_params",
    "resolve_lora_targets",
    "trainable_params",
    "trainer_attention",
]

Attention = Literal["sdpa", "eager", "varlen"]
"""``sdpa``: fused attention kernels, packed rows kept apart by an explicit mask; ``eager``:
materialized scores; ``varlen``: packed rows by document bounds through the variable-length
kernel (the trainer's ``training.packed_attention: varlen``), no mask at all."""
ATTENTIONS: tuple[Attention, ...] = get_args(Attention)
# Families whose transformers implementation trains with eager attention by default (the
# trainer loads models with the default): Gemma 2's attention-logit soft-cap has no SDPA path.
_EAGER_ATTENTION_MODEL_TYPES = frozenset({"gemma2"})


def trainer_attention(arch: ModelArch) -> Attention:
    """The attention the trainer runs for `arch`: ``eager`` (scores kept) or ``sdpa``."""
    return "eager" if arch.model_type in _EAGER_ATTENTION_MODEL_TYPES else "sdpa"


BaseDtype = Literal["bf16", "fp32"]
MeasuredMetric = Literal["allocated", "reserved", "device"]
"""What a published peak measured: ``torch.cuda.max_memory_allocated`` (tensors only),
``torch.cuda.max_memory_reserved`` (the caching allocator's pool), or ``device`` (what
``nvidia-smi`` shows: the pool plus CUDA context and NCCL buffers)."""

GIB = 1024**3
ALL_LINEAR = "all-linear"

# --------------------------------------------------------------------------- constants
BF16_BYTES = 2
FP32_BYTES = 4

# QLoRA (Dettmers et al. 2023, sec. 3): NF4 packs two weights per byte with one absmax per
# block of 64 weights.  Without double quantization the absmax is fp32 (32/64 = 0.5 bit per
# weight); with it the absmax is 8-bit plus one fp32 second-level constant per 256 blocks
# (8/64 + 32/(64*256) = 0.127 bit per weight).
NF4_BYTES_PER_PARAM = 0.5
NF4_BLOCK = 64
NF4_DQ_BLOCK2 = 256
NF4_ABSMAX_BYTES_PER_PARAM = FP32_BYTES / NF4_BLOCK
NF4_DQ_ABSMAX_BYTES_PER_PARAM = 1 / NF4_BLOCK + FP32_BYTES / (NF4_BLOCK * NF4_DQ_BLOCK2)
# bitsandbytes dequantizes a 4-bit weight to the compute dtype for each matmul (forward,
# recomputation and backward alike) and frees it once the matmul is done: one copy of the
# largest weight at a time in the trainer's step, as the simulation shows (docs/simulate.md).
# The published QLoRA measurements (older bitsandbytes, other trainers; the setups with
# `qlora_matmul_keeps_input`) are sized with two, which their calibration rows need.
DEQUANT_COPIES = 1
DEQUANT_COPIES_PUBLISHED = 2
# Whether bitsandbytes' 4-bit matmul (``MatMul4Bit``) keeps its input for backward in the
# trainer: the bitsandbytes the trainer runs keeps only the packed weight (the input would
# serve the frozen weight's gradient), which the simulated QLoRA step confirms
# (docs/simulate-grid.md).  Older bitsandbytes releases, under the published QLoRA
# measurements the estimator is calibrated on, kept it: ``TrainingSetup``'s default.
TRAINER_QLORA_MATMUL_KEEPS_INPUT = False

# bitsandbytes' paged optimizers keep their states in CUDA managed memory, outside PyTorch's
# caching allocator (the driver pages them to host memory under pressure).
PAGED_OPTIMIZERS: frozenset[str] = frozenset({"paged-adamw-8bit", "paged-adamw-32bit"})

# bitsandbytes 8-bit optimizers (Dettmers et al. 2022): two uint8 states plus one fp32
# absmax per block for each state; the paper's blocks hold 2048 values, the bitsandbytes the
# trainer runs makes them 256 (`Optimizer2State.init_state`; the simulated step shows it).
# Tensors under 4,096 values keep 32-bit states (norms, biases: a rounding here).
ADAM8BIT_BLOCK = 256
ADAM8BIT_BYTES_PER_PARAM = 2 + 2 * FP32_BYTES / ADAM8BIT_BLOCK

# Activations: elements of the compute dtype kept per token per decoder layer (the inventory
# is in docs/estimator.md, "Activations").  Each norm keeps its input upcast to fp32 (two
# bf16-element equivalents) and its output: 3 h.  When the norm weight trains (full
# fine-tuning) the normalized input of the weight multiply is kept as well.
NORM_ELEMS_PER_HIDDEN = 3
NORM_WEIGHT_INPUT_ELEMS_PER_HIDDEN = 1
# Attention without the scores: rotated Q, attention output and o_proj input (3 q) plus K and
# V expanded to every query head (2 q, the repeat_kv path taken whenever an attention mask
# is passed).
ATTN_Q_SIZED_TENSORS = 3
ATTN_KV_TENSORS = 2
# Models that project Q, K and V with one fused matmul (Phi-3 and Falcon in transformers)
# keep the whole fused output alive because V is a view of it: its Q and K slices (q + kv
# elements) stay next to the rotated copies.  Separate projections leave nothing of the kind:
# RoPE and the K/V expansion keep only their own outputs.
FUSED_QKV_ELEMS = 1
# Gated MLP (SwiGLU/GeGLU): gate output, activation output, up output, their product: 4 I.
GATED_MLP_ELEMS_PER_INTERMEDIATE = 4
# Plain MLP: fc1 output, activation output and the tanh-GELU temporaries: 3 I.
PLAIN_MLP_ELEMS_PER_INTERMEDIATE = 3
_PLAIN_MLP_MODEL_TYPES = frozenset({"phi", "falcon"})
# Phi's ``gelu_new`` (`ModelArch.python_tanh_gelu`) is transformers' Python tanh formula,
# ``0.5 * x * (1 + tanh(c * (x + 0.044715 * x**3)))``, whose autograd keeps five I-sized
# tensors: the fc1 output (for the power), the tanh output, ``0.5 * x``, ``1 + tanh`` (the
# final product keeps both factors) and the product itself (fc2's input).
PYTHON_TANH_GELU_ELEMS_PER_INTERMEDIATE = 5
# MoE: the dispatched copy of a token (h) per active expert, router logits and softmax in
# fp32 (2 + 2 bf16-element equivalents per expert).
MOE_DISPATCH_ELEMS_PER_HIDDEN = 1
# The routing-weight multiply keeps each active expert's output (h) for the gradient of the
# routing weight (transformers' experts scale each expert's output before summing them).
MOE_WEIGHTED_OUTPUT_ELEMS_PER_HIDDEN = 1
# Per-head Q/K norms (Qwen3, Gemma 3) keep the fp32 upcast of Q and K (2 bf16-element
# equivalents each); their output is the tensor RoPE keeps in place of the projection's.
QK_NORM_ELEMS = 2
MOE_ROUTER_ELEMS_PER_EXPERT = 4
# Eager attention keeps the fp32 softmax output (2) and its bf16 copy (1) per score.
EAGER_SCORE_ELEMS = 3
# Attention-logit soft-capping (Gemma 2: ``tanh(scores / cap) * cap``) keeps the tanh output
# as well, one more element per score.
SOFTCAP_SCORE_ELEMS = 1
_SOFTCAP_MODEL_TYPES = frozenset({"gemma2"})
# Packed rows (the trainer's default) restart their position ids, so transformers builds an
# explicit (micro-batch, 1, seq, seq) boolean causal mask (1 byte per entry, once), and each
# attention call converts it to an additive mask in the compute dtype, which the attention
# keeps for backward: one element per (row, query, key) and layer, in every layer without
# checkpointing, in the recomputed one with it.  The eager layers of Gemma 2 keep theirs
# under checkpointing as well (measured with the simulation, docs/simulate.md).
MASK_BYTES_PER_ENTRY = 1
LAYER_MASK_ELEMS_PER_ENTRY = 1
# Gradient buffers alive while one layer runs backward: gradients w.r.t. the layer output
# and input (2 h) and the MLP intermediates (2 I).
BACKWARD_HIDDEN_ELEMS = 2
BACKWARD_INTERMEDIATE_ELEMS = 2
# Outside the blocks: the final norm (3 h) and the embedding output (1 h).
NON_LAYER_ELEMS_PER_HIDDEN = NORM_ELEMS_PER_HIDDEN + 1

# Logits per (token, vocab) entry at the start of backward with an unchunked loss: the fp32
# log-softmax kept by cross_entropy (4), the gradient of the loss w.r.t. it (4) and
# log-softmax's backward output, the gradient w.r.t. the fp32 logits (4).  The bf16 logits and
# their fp32 upcast are freed when the loss returns (the trainer keeps no reference to the
# model's output); during forward they peak at 2 + 4 + 4 = 10 bytes, below this.
LOGITS_BYTES_FULL = 12
# Final-logit soft-capping (Gemma 2: ``tanh(logits / cap) * cap``) keeps the tanh output in
# the compute dtype for backward: one more compute-dtype element per entry (per chunk's entry
# with the chunked loss, which applies the cap chunk by chunk).
_LOGIT_SOFTCAP_MODEL_TYPES = frozenset({"gemma2"})
# Chunked cross-entropy (kubetune_trainer.loss, LitGPT, torchtune) keeps 4 bytes per entry
# for backward (the fp32 log-softmax of each chunk, or the compute-dtype logits plus a
# same-sized gradient); one chunk's bf16 logits and their fp32 copy (6 bytes per entry) are
# alive while it is computed.
LOGITS_BYTES_CHUNKED = 4
LOGITS_BYTES_CHUNK_WORKING = BF16_BYTES + FP32_BYTES
# A chunk's backward: the fp32 gradients w.r.t. its log-softmax and w.r.t. its logits.
LOGITS_BYTES_CHUNK_BACKWARD = 2 * FP32_BYTES
# Trained, the output projection's weight gradient is made once per chunk: autograd's buffer
# holds the sum so far while the chunk's own is made (two tables of the compute dtype).
CHUNKED_HEAD_GRAD_TABLES = 2

# The fused loss (Liger's fused linear cross-entropy) projects ``chunk`` tokens at a time into
# one compute-dtype buffer of chunk x vocabulary entries, the kernel turns it into the logits'
# gradient in place, and that chunk's share of the gradients w.r.t. the hidden states (tokens x
# hidden, compute dtype) and, trained, the output projection's weight (one table) is added at
# once: those two are kept from the forward to the backward, which only hands them on.
FUSED_CE_KEPT_TABLES = 1


def fused_ce_chunk_tokens(tokens: int, vocab_size: int, hidden_size: int) -> int:
    """Liger's chunk: about tokens x hidden entries of logits, so ``tokens / ceil(V / h)``
    tokens rounded up to a power of two, never more than ``tokens``."""
    per = -(-vocab_size // hidden_size)
    share = -(-tokens // per)
    return min(tokens, 1 << (share - 1).bit_length())


def fused_ce_blocker(
    arch: ModelArch, method: Method, lora_targets: tuple[str, ...] = (ALL_LINEAR,)
) -> str | None:
    """Why the kubetune trainer cannot run the fused loss for this model and method (None: it
    can). `kubetune_trainer.loss` refuses an output projection with an adapter (the kernel
    takes a plain weight) and soft-capped logits (not verified there); other trainers may
    fuse both, which ``TrainingSetup.fused_ce`` still describes."""
    if arch.model_type in _LOGIT_SOFTCAP_MODEL_TYPES:
        return (
            f"{arch.model_type} soft-caps its logits, which the trainer's fused loss is not "
            "verified for"
        )
    if method != "full" and any(
        layer.name == "lm_head" for layer in resolve_lora_targets(arch, lora_targets)
    ):
        return "a LoRA adapter on the output layer (lm_head), which the fused kernel cannot apply"
    return None


# The moments of the step (`_transient_moments`) at which a 4-bit block runs.
_DEQUANT_MOMENTS = frozenset({"loss", "first block backward", "last block backward"})

# FSDP keeps the current unit and the prefetched next one unsharded.
FSDP_GATHERED_UNITS = 2
# The trainer's FSDP2 policy reduces gradients in fp32 (`MixedPrecisionPolicy(reduce_dtype=
# torch.float32)`): a block's gradients are copied to fp32 for the reduce-scatter.
FSDP_REDUCE_BYTES = FP32_BYTES
# FSDP2 all-gathers into a flat buffer and copies out into the unsharded parameters: both
# exist for a moment.
FSDP_ROOT_GATHER_COPIES = 2
# Tied embeddings, full fine-tuning, end of backward: the output projection's gradient, the
# embedding's, and their sum (autograd adds them before accumulating).
EMBEDDING_GRAD_TABLES_TIED = 3

# Fixed overheads.  The CUDA context (driver state, kernel images, cuBLAS/cuDNN handles) is
# 0.3-1 GiB depending on the GPU, the driver and CUDA lazy module loading.
CUDA_CONTEXT_BYTES = int(0.75 * GIB)
# NCCL communicator buffers (channels x peers x NCCL_BUFFSIZE) plus proxy state.
NCCL_BYTES = int(0.5 * GIB)
# The caching allocator rounds, splits and caches blocks: reserved memory exceeds allocated
# memory by a share of everything whose size changes during a step.
ALLOCATOR_SLACK_FRACTION = 0.15
ALLOCATOR_SLACK_MIN_BYTES = int(0.25 * GIB)

BREAKDOWN_COMPONENTS: tuple[str, ...] = (
    "weights",
    "autocast_weight_copies",
    "lora_adapters",
    "gradients",
    "ddp_grad_buckets",
    "optimizer_states",
    "activations",
    "logits",
    "fsdp_buffers",
    "dequant_workspace",
    "cuda_context",
    "nccl_buffers",
    "allocator_slack",
)
"""The keys of :attr:`VramEstimate.breakdown`, in display order (always all present)."""

_OUTSIDE_ALLOCATOR: tuple[str, ...] = ("cuda_context", "nccl_buffers")


class EstimatorError(ValueError):
    """Invalid estimator input; the message says what is wrong and ends with ``To fix:``."""


# --------------------------------------------------------------------------- inputs/outputs


@dataclass(frozen=True)
class TrainingSetup:
    """One training configuration, as the planner enumerates it."""

    method: Method = "lora"
    micro_batch: int = 1
    seq_len: int = 2048
    gpus: int = 1
    """World size the model is sharded over (FSDP) or replicated across (DDP)."""
    sharding: Sharding = "full"
    grad_accumulation: int = 1
    """Micro-batches per optimizer step on each GPU (micro-batch × data-parallel GPUs ×
    accumulation = global batch).  1: the gradients exist from backward on only (the trainer
    frees them after every optimizer step); more: the earlier micro-batches' gradients exist at
    every moment of the step, unsharded in fp32 under FSDP (docs/estimator.md, "Peak timing")."""
    cpu_offload: bool = False
    precision: Precision = "bf16"
    optimizer: Optimizer = "adamw"
    grad_ckpt: bool = True
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = (ALL_LINEAR,)
    """``all-linear`` (every decoder-block linear, not ``lm_head``, as in PEFT) or names."""
    qlora_double_quant: bool = True
    qlora_matmul_keeps_input: bool = True
    """QLoRA: the 4-bit matmul keeps its input for backward, as older bitsandbytes releases do
    (the published QLoRA measurements, which are also sized with two dequantized copies of the
    largest weight, :data:`DEQUANT_COPIES_PUBLISHED`); the planner passes the trainer's
    (``TRAINER_QLORA_MATMUL_KEEPS_INPUT``: it does not), which drops the inputs a frozen base
    linear drops under LoRA (:func:`_dropped_input_elems`) and holds one copy."""
    attention: Attention = "sdpa"
    chunked_ce: bool = False
    """Loss computed over sequence chunks, never materializing full fp32 logits."""
    fused_ce: bool = False
    """The output projection and the loss in one kernel, Liger's fused linear cross-entropy
    (the trainer's ``training.fused_cross_entropy``, and other trainers' ``use_liger_kernel``):
    the gradients are made during the forward, chunk by chunk, and nothing of vocabulary size
    waits for backward (:data:`FUSED_CE_KEPT_TABLES`)."""
    activation_offload: bool = False
    """Tensors saved for backward wait in host memory (``kubetune_trainer.loss``); the GPU
    holds one decoder layer's worth at a time."""
    loss_chunk_tokens: int | None = None
    """Tokens per chunk of the chunked loss; None: the kubetune trainer's
    (`kubetune_trainer.contract.loss_chunk_tokens`; LitGPT uses 128)."""
    lora_dropout: float = 0.05
    """A non-zero LoRA dropout keeps a dropped copy of each adapted layer's input."""
    adapter_fp32: bool = True
    """LoRA weights, grads and optimizer states in fp32 (PEFT's ``autocast_adapter_dtype``
    default); False keeps them in the compute dtype."""
    qlora_upcast_non_quantized: bool = False
    """QLoRA: cast the parameters that stay unquantized (embeddings, norms, ``lm_head``) to
    fp32, as ``peft.prepare_model_for_kbit_training`` does.  The kubetune trainer keeps them
    in the compute dtype (``bnb_4bit_quant_storage`` = compute dtype, FSDP-compatible)."""
    fused_experts: bool = True
    """MoE: experts stored as stacked parameters, as transformers >= 5 (the kubetune trainer)
    builds them: QLoRA leaves them (and the router) in the compute dtype, and LoRA
    ``all-linear`` adapts them as PEFT maps each family (:func:`resolve_lora_targets`).  False:
    one ``nn.Linear`` per expert (transformers < 5), quantized and adapted like any linear."""
    lora_base_dtype: BaseDtype | None = None
    """LoRA: dtype of the frozen base weights.  None follows the trainer: bf16 for ``bf16``
    precision, fp32 for ``amp-bf16`` and ``fp32``."""
    optimizer_in_backward: bool = False
    """Each parameter's optimizer step runs as soon as its gradient is made, during backward,
    and the gradient is freed (the trainer's ``training.optimizer_in_backward``): at most one
    parameter's gradient exists at a time.  No gradient accumulation, no DDP."""
    fused_qkv: bool | None = None
    """Q, K and V projected by one fused matmul, whose output stays alive for backward.  None
    follows the trainer's (transformers') model: fused for the families whose checkpoint has
    one projection (Phi-3, Falcon); True describes stacks that fuse it for every model
    (LitGPT)."""


@dataclass(frozen=True)
class VramEstimate:
    """Peak memory of one GPU and where it goes."""

    per_gpu_bytes: int
    breakdown: dict[str, int]
    """Component name -> bytes (see :data:`BREAKDOWN_COMPONENTS`); sums to per_gpu_bytes."""
    trainable_params: int
    total_params: int
    setup: TrainingSetup

    @property
    def per_gpu_gib(self) -> float:
        return self.per_gpu_bytes / GIB

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready view (plain ints, floats, strings, lists and dicts), its keys in
        the API's camelCase; the breakdown's keys are component names, as in
        `status.plan.memoryBreakdownGiB`."""
        setup = {to_camel(k): v for k, v in asdict(self.setup).items()}
        setup["loraTargets"] = list(self.setup.lora_targets)
        return {
            "perGPUBytes": self.per_gpu_bytes,
            "perGPUGiB": round(self.per_gpu_gib, 3),
            "breakdown": dict(self.breakdown),
            "breakdownGiB": {k: round(v / GIB, 3) for k, v in self.breakdown.items()},
            "trainableParams": self.trainable_params,
            "totalParams": self.total_params,
            "setup": setup,
        }


# --------------------------------------------------------------------------- validation


def _fail(problem: str, fix: str) -> EstimatorError:
    return EstimatorError(f"{problem}. To fix: {fix}")


def _check_choice(name: str, value: object, allowed: tuple[object, ...]) -> None:
    if value not in allowed:
        shown = ", ".join(str(a) for a in allowed if a is not None)
        raise _fail(f"{name} {value!r} is not supported", f"use one of {shown}")


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(f"{name} must be a positive integer, got {value!r}", f"set {name} to 1 or more")


def _validate(setup: TrainingSetup) -> None:
    _check_choice("method", setup.method, METHODS)
    _check_choice("precision", setup.precision, PRECISIONS)
    _check_choice("optimizer", setup.optimizer, OPTIMIZERS)
    _check_choice("sharding", setup.sharding, SHARDINGS)
    _check_choice("attention", setup.attention, ATTENTIONS)
    _check_choice("lora_base_dtype", setup.lora_base_dtype, (*get_args(BaseDtype), None))
    for name in ("micro_batch", "seq_len", "gpus", "grad_accumulation"):
        _check_positive_int(name, getattr(setup, name))
    if setup.loss_chunk_tokens is not None:
        _check_positive_int("loss_chunk_tokens", setup.loss_chunk_tokens)
    if setup.optimizer_in_backward:
        _check_optimizer_in_backward(setup)
    if setup.chunked_ce and setup.fused_ce:
        raise _fail(
            "the chunked loss and the fused loss are two ways to compute the same loss",
            "choose one (the fused loss keeps less: nothing of vocabulary size)",
        )
    if setup.method == "full":
        return
    rank = setup.lora_rank
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise _fail(
            f"lora_rank must be a positive integer, got {rank!r}",
            "set the LoRA rank to a positive integer such as 8, 16 or 64",
        )
    if not 0.0 <= setup.lora_dropout < 1.0:
        raise _fail(
            f"lora_dropout must be in [0, 1), got {setup.lora_dropout}",
            "set lora_dropout to a probability such as 0.05 (0 disables it)",
        )


def _check_optimizer_in_backward(setup: TrainingSetup) -> None:
    if setup.grad_accumulation > 1:
        raise _fail(
            f"the optimizer in backward steps each parameter once its gradient is made, and "
            f"gradient accumulation {setup.grad_accumulation} needs every micro-batch's first",
            "use a micro-batch that makes the global batch in one pass (accumulation 1), or "
            "turn the optimizer in backward off",
        )
    if setup.gpus > 1 and setup.sharding == "none":
        raise _fail(
            "the optimizer in backward would step on gradients DDP has not averaged yet",
            "shard the model (sharding full or grad-op), or turn the optimizer in backward off",
        )
    if setup.cpu_offload:
        raise _fail(
            "the optimizer in backward runs on the GPU, and CPU offload steps on the CPU",
            "turn one of them off",
        )


# --------------------------------------------------------------------------- LoRA targets


def lora_target_names(arch: ModelArch) -> list[str]:
    """Module names a LoRA target list may use for ``arch`` (besides ``all-linear``)."""
    names: list[str] = []
    for layer in arch.linear_layers():
        if layer.name not in names:
            names.append(layer.name)
    return names


def resolve_lora_targets(
    arch: ModelArch, targets: Iterable[str], *, fused_experts: bool = True
) -> list[LinearLayer]:
    """The linears a LoRA target list selects.

    ``all-linear`` selects every decoder-block linear but not ``lm_head`` (PEFT's rule),
    except, for a MoE family whose stacked experts PEFT does not map
    (``ModelArch.peft_adapts_experts``), the experts and the router; explicit names select
    every linear with that leaf name, ``lm_head`` included when the model has an untied
    output projection.
    """
    wanted = [targets.strip()] if isinstance(targets, str) else [t.strip() for t in targets]
    if not wanted or any(not t for t in wanted):
        raise _fail(
            "the LoRA target list is empty or contains an empty name",
            f"use ['{ALL_LINEAR}'] or module names such as ['q_proj', 'v_proj']",
        )
    valid = lora_target_names(arch)
    unknown = [t for t in wanted if t != ALL_LINEAR and t not in valid]
    if unknown:
        raise _fail(
            f"LoRA target module(s) {', '.join(repr(u) for u in unknown)} do not exist in "
            f"{arch.name} ({arch.model_type}); its linear modules are: {', '.join(valid)}",
            f"use '{ALL_LINEAR}' or names from that list",
        )
    skip_moe = fused_experts and not arch.peft_adapts_experts
    return [
        layer
        for layer in arch.linear_layers()
        if (
            ALL_LINEAR in wanted
            and layer.name != "lm_head"
            and not (skip_moe and (layer.per_expert or layer.router))
        )
        or layer.name in wanted
    ]


def trainable_params(arch: ModelArch, setup: TrainingSetup) -> int:
    """Parameters the optimizer updates: all of them (full) or the LoRA A and B matrices.

    A LoRA adapter on a ``d_in -> d_out`` linear adds ``r * (d_in + d_out)`` parameters.
    """
    _validate(setup)
    if setup.method == "full":
        return arch.total_params
    return _adapter_params(arch, setup, _targets(arch, setup))


def _targets(arch: ModelArch, setup: TrainingSetup) -> list[LinearLayer]:
    if setup.method == "full":
        return []
    targets = resolve_lora_targets(arch, setup.lora_targets, fused_experts=setup.fused_experts)
    moe = [layer for layer in targets if layer.per_expert or layer.router]
    if setup.fused_experts and moe and setup.lora_dropout > 0:
        raise _fail(
            f"LoRA dropout {setup.lora_dropout:g} cannot be used with adapters on the stacked "
            f"experts and router of {arch.name} ({arch.model_type}): PEFT adapts those "
            "parameters only without dropout",
            "set the LoRA dropout to 0 (spec.lora.dropout; kubetune estimate --lora-dropout 0), "
            "or list spec.lora.targetModules without "
            f"{', '.join(sorted({layer.name for layer in moe}))}",
        )
    return targets


def _adapter_params(arch: ModelArch, setup: TrainingSetup, targets: list[LinearLayer]) -> int:
    """``r * (d_in + d_out)`` per adapted linear; a stacked expert gate/up projection
    (``E x 2w x h``) is adapted once with rank ``2r`` (PEFT's mapping of fused weights):
    ``r * (h + 2w)`` for each of gate and up."""
    r = setup.lora_rank
    total = 0
    for layer in targets:
        fused_gate_up = (
            setup.fused_experts and layer.per_expert and layer.in_features == arch.hidden_size
        )
        out = 2 * layer.out_features if fused_gate_up else layer.out_features
        total += r * (layer.in_features + out) * layer.count
    return total


# --------------------------------------------------------------------------- model pieces


@dataclass(frozen=True)
class _Params:
    total: int
    block_linear_weights: int
    """Weight matrices of the decoder-block linears (no biases)."""
    quantized_weights: int
    """What QLoRA stores in 4 bits: the block linears that are ``nn.Linear`` modules."""
    matmul_weights: int
    """Block linear weights plus an untied ``lm_head``: what autocast casts to bf16."""
    root: int
    """Parameters outside the decoder blocks: embeddings, untied lm_head, final norm."""
    per_block: int
    """Parameters of one decoder block (one FSDP unit)."""
    per_block_linear_weights: int
    per_block_quantized_weights: int
    largest_quantized: int
    """Weight elements of the largest quantized linear (dequantized for each matmul)."""


def _is_linear_module(layer: LinearLayer, fused_experts: bool) -> bool:
    """Whether the trainer's model holds `layer` as an ``nn.Linear`` (what bitsandbytes
    quantizes): stacked experts and the router are not, when the experts are fused."""
    return not (fused_experts and (layer.per_expert or layer.router))


@lru_cache(maxsize=64)
def _param_groups(arch: ModelArch, fused_experts: bool = True) -> _Params:
    """Derived from the (frozen) architecture alone: computed once per architecture."""
    block = [layer for layer in arch.linear_layers() if layer.name != "lm_head"]
    block_linear = sum(layer.in_features * layer.out_features * layer.count for layer in block)
    linear = [layer for layer in block if _is_linear_module(layer, fused_experts)]
    quantized = sum(layer.in_features * layer.out_features * layer.count for layer in linear)
    final_norm = arch.hidden_size * (2 if arch.norm_bias else 1)
    root = arch.embedding_params + arch.lm_head_params + final_norm
    return _Params(
        total=arch.total_params,
        block_linear_weights=block_linear,
        quantized_weights=quantized,
        matmul_weights=block_linear + arch.lm_head_params,
        root=root,
        per_block=-(-(arch.total_params - root) // arch.num_layers),
        per_block_linear_weights=-(-block_linear // arch.num_layers),
        per_block_quantized_weights=-(-quantized // arch.num_layers),
        largest_quantized=max(layer.in_features * layer.out_features for layer in linear),
    )


def _mask_entries(setup: TrainingSetup) -> int:
    """(row, query, key) entries of the causal mask the attention is given; none with
    document bounds (``varlen``)."""
    return 0 if setup.attention == "varlen" else setup.micro_batch * setup.seq_len**2


def offloaded_bytes(arch: ModelArch, setup: TrainingSetup) -> int:
    """Bytes activation offloading moves to host memory (and back) per micro-batch, per GPU:
    the saved tensors of every layer but the one kept on the GPU."""
    if not setup.activation_offload:
        return 0
    tokens = setup.micro_batch * setup.seq_len
    e = _compute_bytes(setup)
    layer_mask = LAYER_MASK_ELEMS_PER_ENTRY * _mask_entries(setup) * e
    if setup.grad_ckpt:
        per_layer = tokens * arch.hidden_size * e
        per_layer += layer_mask if setup.attention == "eager" else 0
    else:
        saved, _backward = _layer_bytes_per_token(arch, setup)
        lora, _head = _lora_bytes_per_token(arch, setup, _targets(arch, setup))
        per_layer = round(tokens * (saved + lora)) + layer_mask
    return (arch.num_layers - 1) * per_layer


def quantized_params(arch: ModelArch, setup: TrainingSetup) -> int:
    """Weights QLoRA stores in 4 bits (0 for other methods)."""
    if setup.method != "qlora":
        return 0
    return _param_groups(arch, setup.fused_experts).quantized_weights


def _compute_bytes(setup: TrainingSetup) -> int:
    return FP32_BYTES if setup.precision == "fp32" else BF16_BYTES


def _trainable_bytes(setup: TrainingSetup) -> int:
    """Bytes per trainable parameter (and per gradient): master weights or adapters."""
    if setup.method == "full":
        return BF16_BYTES if setup.precision == "bf16" else FP32_BYTES
    if setup.adapter_fp32 or setup.precision != "bf16":
        return FP32_BYTES
    return BF16_BYTES


def _lora_base_bytes(setup: TrainingSetup) -> int:
    if setup.lora_base_dtype is not None:
        return FP32_BYTES if setup.lora_base_dtype == "fp32" else BF16_BYTES
    return BF16_BYTES if setup.precision == "bf16" else FP32_BYTES


def _nf4_bytes_per_param(setup: TrainingSetup) -> float:
    dq = setup.qlora_double_quant
    return NF4_BYTES_PER_PARAM + (
        NF4_DQ_ABSMAX_BYTES_PER_PARAM if dq else NF4_ABSMAX_BYTES_PER_PARAM
    )


def _unquantized_bytes(setup: TrainingSetup) -> int:
    """QLoRA: bytes of each parameter left unquantized (embeddings, norms, lm_head, biases)."""
    if setup.qlora_upcast_non_quantized or setup.precision == "fp32":
        return FP32_BYTES
    return BF16_BYTES


def _quant_state_bytes(p: _Params, setup: TrainingSetup) -> float:
    """QLoRA: the 4-bit weights' quantization state (absmax per block, with double
    quantization its second level); part of `_frozen_bytes`."""
    dq = setup.qlora_double_quant
    per_param = NF4_DQ_ABSMAX_BYTES_PER_PARAM if dq else NF4_ABSMAX_BYTES_PER_PARAM
    return float(p.quantized_weights * per_param)


def _frozen_bytes(p: _Params, setup: TrainingSetup, *, per_block: bool = False) -> float:
    """Bytes of the frozen base model (LoRA/QLoRA): the whole model or one block."""
    total = p.per_block if per_block else p.total
    if setup.method != "qlora":
        return float(total * _lora_base_bytes(setup))
    quantized = p.per_block_quantized_weights if per_block else p.quantized_weights
    rest = total - quantized
    return quantized * _nf4_bytes_per_param(setup) + rest * _unquantized_bytes(setup)


def _layer_bytes_per_token(arch: ModelArch, setup: TrainingSetup) -> tuple[float, float]:
    """(saved activation bytes, backward gradient-buffer bytes) per token, one decoder layer.

    Averaged over layers for MoE models that also have dense layers.
    """
    e = _compute_bytes(setup)
    h = arch.hidden_size
    q = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    norm_elems = NORM_ELEMS_PER_HIDDEN
    if setup.method == "full":
        norm_elems += NORM_WEIGHT_INPUT_ELEMS_PER_HIDDEN
    norms = norm_elems * h * max(arch.norms_per_layer, 1)
    fused_qkv = setup.fused_qkv
    if fused_qkv is None:
        fused_qkv = any(layer.out_features == q + 2 * kv for layer in _attention_inputs(arch))
    attn = ATTN_Q_SIZED_TENSORS * q + ATTN_KV_TENSORS * q
    attn += FUSED_QKV_ELEMS * (q + kv) if fused_qkv else 0
    if arch.qk_norm:
        attn += QK_NORM_ELEMS * (q + kv)
    plain = arch.model_type in _PLAIN_MLP_MODEL_TYPES
    per_width = PLAIN_MLP_ELEMS_PER_INTERMEDIATE if plain else GATED_MLP_ELEMS_PER_INTERMEDIATE
    if arch.python_tanh_gelu:
        per_width = PYTHON_TANH_GELU_ELEMS_PER_INTERMEDIATE
    dense_mlp = per_width * arch.intermediate_size
    if arch.moe_layers:
        k = arch.experts_per_token
        moe_mlp = (
            k
            * (
                per_width * arch.expert_intermediate_size
                + (MOE_DISPATCH_ELEMS_PER_HIDDEN + MOE_WEIGHTED_OUTPUT_ELEMS_PER_HIDDEN) * h
            )
            + per_width * arch.shared_expert_intermediate_size
            + MOE_ROUTER_ELEMS_PER_EXPERT * arch.num_experts
        )
        moe_width = k * arch.expert_intermediate_size + arch.shared_expert_intermediate_size
        dense = arch.num_layers - arch.moe_layers
        mlp = (moe_mlp * arch.moe_layers + dense_mlp * dense) / arch.num_layers
        width = (moe_width * arch.moe_layers + arch.intermediate_size * dense) / arch.num_layers
    else:
        mlp = float(dense_mlp)
        width = float(arch.intermediate_size)
    saved = (norms + attn + mlp - _dropped_input_elems(arch, setup)) * e
    backward = (BACKWARD_HIDDEN_ELEMS * h + BACKWARD_INTERMEDIATE_ELEMS * width) * e
    return saved, backward


def _dense_block_linears(arch: ModelArch) -> tuple[list[LinearLayer], list[LinearLayer]]:
    """(attention linears, dense MLP linears) of a decoder block, each in forward order (the
    input projections first, the output projection last); the MLP list is empty for a model
    whose every layer is MoE."""
    block = [
        layer
        for layer in arch.linear_layers()
        if layer.name != "lm_head" and not layer.per_expert and not layer.router
    ]
    prefix = block[0].path.rpartition(".")[0]
    attention = [layer for layer in block if layer.path.rpartition(".")[0] == prefix]
    dense = arch.num_layers - arch.moe_layers
    mlp = [layer for layer in block if layer not in attention and layer.count == dense]
    return attention, mlp


def _attention_inputs(arch: ModelArch) -> list[LinearLayer]:
    """The Q/K/V projection(s): every attention linear but the output projection."""
    return _dense_block_linears(arch)[0][:-1]


def _adapter_input_copied(setup: TrainingSetup) -> bool:
    """Whether a LoRA adapter's ``A`` sees a copy of its linear's input (the dropout output,
    or the cast to fp32 adapters) rather than the input itself: then it keeps the copy, not
    the input (see :func:`_lora_bytes_per_token`)."""
    adapter = _trainable_bytes(setup)
    if setup.gpus > 1 and setup.sharding in ("full", "grad-op"):
        adapter = _compute_bytes(setup)
    return setup.lora_dropout > 0.0 or adapter != _compute_bytes(setup)


def _dropped_input_elems(arch: ModelArch, setup: TrainingSetup) -> float:
    """Elements per token per layer of linear inputs autograd does not keep under LoRA.

    A matmul keeps its input only for its weight's gradient (``MmBackward`` saves ``self``
    only when ``mat2`` requires grad), so a frozen base linear drops it; the adapter keeps it
    only when ``A`` sees the input itself (bf16 adapters without dropout), and otherwise keeps
    its own copy (counted by :func:`_lora_bytes_per_token`).  Full fine-tuning keeps every
    input.  QLoRA's 4-bit matmul (bitsandbytes ``MatMul4Bit``) keeps its input in older
    bitsandbytes releases (``qlora_matmul_keeps_input``, the default) and drops it as a
    frozen base linear does in the trainer's (``TRAINER_QLORA_MATMUL_KEEPS_INPUT``; the
    simulated QLoRA step shows it).  No other operation keeps these inputs: the
    pre-norm outputs (``h`` each) feed only the projections, the output projection reads a
    contiguous copy of the attention output (``q``; the attention keeps its own), and the
    down projection the product of the MLP's branches (``I``).  MoE layers are left as
    counted (the router and the dispatch read the norm output).
    """
    if setup.method == "full" or (setup.method == "qlora" and setup.qlora_matmul_keeps_input):
        return 0.0
    targets = set(_targets(arch, setup))
    copied = _adapter_input_copied(setup)

    def kept(layers: list[LinearLayer]) -> bool:
        return any(layer in targets and not copied for layer in layers)

    attention, mlp = _dense_block_linears(arch)
    q_in, o = attention[:-1], attention[-1]
    dense_share = (arch.num_layers - arch.moe_layers) / arch.num_layers
    h = arch.hidden_size
    dropped = 0.0
    if not kept([o]):
        dropped += o.in_features
    if mlp and not kept(mlp[-1:]):
        dropped += mlp[-1].in_features * dense_share
    if arch.norms_per_layer == 1:  # attention and MLP read one norm's output (Phi, Falcon)
        dropped += 0.0 if kept(q_in + mlp[:-1]) else h
    elif arch.norms_per_layer >= 2:
        dropped += 0.0 if kept(q_in) else h
        if mlp and not kept(mlp[:-1]):
            dropped += h * dense_share
    return dropped


def _lora_bytes_per_token(
    arch: ModelArch, setup: TrainingSetup, targets: list[LinearLayer]
) -> tuple[float, float]:
    """(per decoder layer, for lm_head) bytes per token that LoRA adapters keep.

    Per adapted linear: a copy of its input when the adapter sees something different from
    the base layer (PEFT's dropout output, or its cast to fp32 adapters; under autocast the
    matmul keeps the bf16 re-cast), a 1-byte dropout mask, and the rank-r output of ``A``.
    """
    if setup.method == "full":
        return 0.0, 0.0
    adapter = _trainable_bytes(setup)
    compute = _compute_bytes(setup)
    if setup.gpus > 1 and setup.sharding in ("full", "grad-op"):
        # FSDP2 gathers every parameter, the fp32 adapters included, in the compute dtype
        # (the trainer's `MixedPrecisionPolicy(param_dtype=bfloat16)`): the adapters compute
        # in it and PEFT makes no fp32 copy of their input.
        adapter = compute
    dropout = setup.lora_dropout > 0.0
    needs_copy = _adapter_input_copied(setup)
    copy_bytes = compute if setup.precision == "amp-bf16" else adapter
    per_in = (copy_bytes if needs_copy else 0) + (1 if dropout else 0)
    block = 0.0
    head = 0.0
    for layer in targets:
        per_token = layer.in_features * per_in + setup.lora_rank * adapter
        if layer.name == "lm_head":
            head += per_token
        elif layer.per_expert and setup.fused_experts:
            # PEFT adapts a stacked expert parameter by merging its update into the weight
            # (`_stacked_expert_delta_bytes`): no per-token adapter path, nothing per token.
            continue
        elif layer.per_expert:
            block += per_token * layer.count * arch.experts_per_token / arch.num_experts
        else:
            block += per_token * layer.count
    return block / arch.num_layers, head


def _stacked_expert_delta_bytes(
    arch: ModelArch, setup: TrainingSetup, targets: list[LinearLayer]
) -> float:
    """Bytes of one MoE layer's merged LoRA updates of its stacked experts (0 without them):
    PEFT forms ``W + scale * B @ A`` for the whole stacked parameter in the compute dtype."""
    if not setup.fused_experts or not arch.moe_layers:
        return 0.0
    stacked = [layer for layer in targets if layer.per_expert]
    weights = sum(layer.in_features * layer.out_features * layer.count for layer in stacked)
    return weights / arch.moe_layers * _compute_bytes(setup)


def _expert_padding_params(arch: ModelArch, setup: TrainingSetup) -> float:
    """Parameters FSDP2's padding adds to one GPU's shard of the stacked experts: each
    stacked tensor's first dimension (the expert count E) padded to ceil(E / N) * N."""
    if not setup.fused_experts or arch.num_experts <= 1:
        return 0.0
    n = setup.gpus
    stacked = sum(
        layer.in_features * layer.out_features * layer.count
        for layer in arch.linear_layers()
        if layer.per_expert
    )
    padded = -(-arch.num_experts // n) * n
    return stacked * (padded - arch.num_experts) / arch.num_experts / n


def _stacked_expert_delta_grad_bytes(
    arch: ModelArch, setup: TrainingSetup, targets: list[LinearLayer]
) -> float:
    """Bytes of the gradient of one merged stacked-expert update (0 without them): backward
    of ``W + scale * B @ A`` makes a gradient the size of the stacked weight, one stacked
    parameter (the fused gate/up projection, or the down projection) at a time."""
    if not setup.fused_experts or not arch.moe_layers:
        return 0.0
    gate_up = down = 0
    for layer in targets:
        if layer.per_expert:
            size = layer.in_features * layer.out_features * layer.count
            if layer.in_features == arch.hidden_size:
                gate_up += size
            else:
                down += size
    return max(gate_up, down) / arch.moe_layers * _compute_bytes(setup)


def _state_bytes_per_param(setup: TrainingSetup) -> float:
    if setup.optimizer == "adamw":
        return 2.0 * _trainable_bytes(setup)  # exp_avg and exp_avg_sq in the parameter dtype
    if setup.optimizer == "paged-adamw-32bit":
        return 2.0 * FP32_BYTES  # bitsandbytes' 32-bit states are fp32 whatever the params
    return ADAM8BIT_BYTES_PER_PARAM


def _accumulated_gradient_bytes(
    setup: TrainingSetup, trainable: int, after_backward: float, fsdp: bool
) -> float:
    """Gradient bytes that exist before a micro-batch's backward starts (0 without gradient
    accumulation: the trainer's ``zero_grad(set_to_none=True)`` after every optimizer step
    leaves none).

    With accumulation the earlier micro-batches' gradients are there.  One GPU and DDP keep
    them as ``param.grad`` (what the optimizer then reads: ``after_backward``).  FSDP2 under
    ``set_requires_gradient_sync(False)`` (the trainer's ``_grad_sync`` on every micro-batch
    but the last) skips the reduce-scatter and keeps each parameter's *unsharded* gradient,
    upcast to the reduce dtype (fp32, the trainer's ``MixedPrecisionPolicy``) to accumulate
    in: every trainable parameter in fp32 on every GPU, not divided by the GPU count, until the
    last micro-batch's backward reduce-scatters them block by block into the sharded
    gradients.  CPU offload too: FSDP2 moves a gradient to the CPU only after its reduction.
    """
    if setup.grad_accumulation <= 1:
        return 0.0
    if fsdp:
        return float(trainable * FSDP_REDUCE_BYTES)
    return after_backward


_Moments = dict[str, tuple[float, float, float]]
"""Moment of the step -> (activations, logits, FSDP buffers) bytes."""


def _transient_moments(
    arch: ModelArch,
    setup: TrainingSetup,
    p: _Params,
    acts: _Activations,
    loss: _LossTerms,
    weights: _Weights,
) -> _Moments:
    """(activations, logits, FSDP buffers) at each moment of the step that can hold the peak,
    on top of the static state and the gradients (docs/estimator.md, "Peak timing"); the
    gradients at each moment are :func:`_gradients_made`'s.

    Backward runs the blocks from the last to the first: each frees what it saved and leaves
    its gradients, so memory during block ``j``'s backward is affine in ``j`` and its largest
    value is at one end: the **first block backward** runs (the model's last layer: every
    saved activation, one block's gradients) or the **last** (the model's first layer: one
    block's saved activations, every block's gradients).
    """
    pending, end = _embedding_gradients(arch, setup)
    if setup.cpu_offload:
        return _offloaded_moments(setup, p, acts, loss, weights, pending, end)
    if not (setup.gpus > 1 and setup.sharding == "full"):
        return _unsharded_moments(acts, loss, pending, end)
    return _full_shard_moments(setup, p, acts, loss, weights, pending, end)


def _embedding_gradients(arch: ModelArch, setup: TrainingSetup) -> tuple[float, float]:
    """(pending, end): the output projection's gradient waiting through backward, and the
    embedding's gradients at the end of backward.

    Full fine-tuning trains the embedding table.  Tied to the output projection, the
    projection's gradient waits in autograd's input buffer for the embedding's, from the
    start of backward to its end (one table), and the end adds the embedding's gradient and
    the sum of the two (three tables).  Untied, the output projection's gradient is a
    gradient like any other, except under FSDP, where the root's gradients stay unsharded
    until its reduce-scatter after the last block; the embedding's gradient (one table) is
    made at the end.
    """
    if setup.method != "full":
        return 0.0, 0.0
    table = float(arch.embedding_params * _compute_bytes(setup))
    if arch.tie_embeddings:
        return table, EMBEDDING_GRAD_TABLES_TIED * table
    sharded = setup.gpus > 1 and setup.sharding in ("full", "grad-op")
    pending = float(arch.lm_head_params * _compute_bytes(setup)) if sharded else 0.0
    return pending, pending + table


def _offloaded_moments(
    setup: TrainingSetup,
    p: _Params,
    acts: _Activations,
    loss: _LossTerms,
    weights: _Weights,
    pending: float,
    end: float,
) -> _Moments:
    """CPU offload: the parameters are on the CPU, and the gathered units, their gradients
    and the root are on the GPU for the whole step, counted at every moment."""
    buffers = FSDP_GATHERED_UNITS * weights.unit + weights.root
    if setup.method == "full":
        buffers += p.per_block * _trainable_bytes(setup)
    activations = acts.saved + acts.working
    moments = {
        "loss": (activations + pending, loss.logits, buffers),
        "end": (end, 0.0, buffers),
    }
    if loss.backward is not None:
        moments["loss backward"] = (*loss.backward, buffers)
    return moments


def _unsharded_moments(
    acts: _Activations, loss: _LossTerms, pending: float, end: float
) -> _Moments:
    """One GPU, DDP, or SHARD_GRAD_OP (whose gathered parameters are in `weights`)."""
    activations = acts.saved + acts.working
    moments = {
        "loss": (acts.saved, loss.logits, 0.0),
        "first block backward": (activations + pending, 0.0, 0.0),
        "last block backward": (activations - acts.released + pending, 0.0, 0.0),
        "end": (end, 0.0, 0.0),
    }
    if loss.backward is not None:
        moments["loss backward"] = (*loss.backward, 0.0)
    return moments


def _full_shard_moments(
    setup: TrainingSetup,
    p: _Params,
    acts: _Activations,
    loss: _LossTerms,
    weights: _Weights,
    pending: float,
    end: float,
) -> _Moments:
    """FULL_SHARD (FSDP2, `reshard_after_forward=True` for the blocks and the root, as
    `modeling.shard_model` sets): each block's parameters are gathered for its forward and
    again for its backward, with the next block prefetched; the root is gathered for the
    forward, freed after it, and gathered again when the output projection's backward
    starts, until the end of backward.  While gathered, the root costs its whole unsharded
    size next to this GPU's shard.  During backward a block's gradients exist in the compute
    dtype (autograd's) and in fp32 (the reduce-scatter input: `reduce_dtype=float32`)."""
    e = _compute_bytes(setup)
    root = weights.root
    activations = acts.saved + acts.working
    blocks = FSDP_GATHERED_UNITS * weights.unit
    full = setup.method == "full"
    block_grads = float(p.per_block * (e + FSDP_REDUCE_BYTES)) if full else 0.0
    moments = {
        # the loss: every saved activation and the logits; nothing gathered
        "loss": (acts.saved, loss.logits, 0.0),
        # the root's all-gather for backward, when the gradient of the logits reaches the
        # output projection: its output buffer and the unsharded parameters it fills
        "root all-gather": (acts.saved, loss.logits_grad, FSDP_ROOT_GATHER_COPIES * root),
        # a block's backward (the first and the last backward runs): the gathered root, two
        # gathered blocks and one's gradients
        "first block backward": (activations + pending, 0.0, root + blocks + block_grads),
        "last block backward": (
            activations - acts.released + pending,
            0.0,
            root + blocks + block_grads,
        ),
        # the end of backward: the embedding's gradients, the root and two blocks gathered
        "end": (end, 0.0, root + blocks),
    }
    if loss.backward is not None:
        # the chunks' backward, the root gathered for it
        moments["loss backward"] = (*loss.backward, root)
    return moments


def _gradients_made(
    arch: ModelArch,
    setup: TrainingSetup,
    p: _Params,
    targets: list[LinearLayer],
    after_backward: float,
) -> dict[str, float]:
    """Bytes of this micro-batch's gradients (where they stay: sharded under FSDP) at each
    moment of :func:`_transient_moments`.

    None at the loss and the root's all-gather.  At the first block backward runs: that
    block's, and the untied output projection's on one GPU or DDP (under FSDP the root's
    gradients wait unsharded for the root's reduce-scatter, counted with the activations as
    the pending gradient; tied, the projection's gradient waits in autograd's buffer for the
    embedding's, counted there too).  At the last block: every gradient but the embedding's,
    which the end of backward makes; at the end: all of them (``after_backward``).
    LoRA's adapters are split the same way: an adapted ``lm_head``'s before the blocks, the
    rest a block at a time.
    """
    if after_backward == 0.0:
        return dict.fromkeys(_MOMENT_NAMES, 0.0)
    if setup.method == "full":
        whole = float(p.total)
        first = float(p.per_block)
        if not arch.tie_embeddings and not (setup.gpus > 1 and setup.sharding != "none"):
            first += arch.lm_head_params
        last = whole - arch.embedding_params
    else:
        whole = float(_adapter_params(arch, setup, targets))
        head = _adapter_params(arch, setup, [t for t in targets if t.name == "lm_head"])
        first = head + (whole - head) / arch.num_layers
        last = whole
    share = after_backward / whole if whole else 0.0
    return {
        "loss": 0.0,
        "loss backward": 0.0,  # the output projection's, counted with the activations
        "root all-gather": 0.0,
        "first block backward": min(first, whole) * share,
        "last block backward": last * share,
        "end": after_backward,
    }


_MOMENT_NAMES = (
    "loss",
    "loss backward",
    "root all-gather",
    "first block backward",
    "last block backward",
    "end",
)


def _largest_gradient(arch: ModelArch, setup: TrainingSetup, targets: list[LinearLayer]) -> int:
    """Parameters of the largest single trainable tensor: what the optimizer in backward
    leaves of the gradients at any moment (stacked experts are one tensor per layer)."""
    if setup.method != "full":
        r = setup.lora_rank
        return max((r * max(t.in_features, t.out_features) for t in targets), default=0)
    sizes = [arch.embedding_params]
    for layer in arch.linear_layers():
        stacked = setup.fused_experts and layer.per_expert
        sizes.append(layer.params * (arch.num_experts if stacked else 1))
    return max(sizes)


def _gradients_at(accumulated: float, made: float) -> float:
    """Gradient bytes at a moment: the earlier micro-batches' (`accumulated`) and this one's
    made so far (`made`).  Under FSDP with accumulation the unsharded fp32 gradients of the
    earlier micro-batches are replaced block by block by the smaller sharded ones: the larger
    of the two bounds every moment; on one GPU and DDP this micro-batch's gradients accumulate
    into the earlier ones' (``param.grad``), which are whole at every moment."""
    return max(accumulated, made)


# --------------------------------------------------------------------------- the estimate


def estimate_vram(arch: ModelArch, setup: TrainingSetup) -> VramEstimate:
    """Peak per-GPU memory of training ``arch`` with ``setup``."""
    _validate(setup)
    p = _param_groups(arch, setup.fused_experts)
    targets = _targets(arch, setup)
    trainable = (
        arch.total_params if setup.method == "full" else _adapter_params(arch, setup, targets)
    )
    weights = _weight_terms(arch, setup, p)
    state = _trainable_state(setup, trainable, weights.padding)
    acts = _activation_terms(arch, setup, targets)
    loss = _loss_terms(arch, setup, acts.saved)
    # ---- the moment of the peak: static state is there throughout; the gradients and the
    # transient terms are those of the largest moment of the step (docs/estimator.md, "Peak
    # timing"): with one micro-batch per optimizer step no gradient exists at the loss.
    moments = _transient_moments(arch, setup, p, acts, loss, weights)
    peak = _peak_terms(arch, setup, p, targets, trainable, state.gradients, moments)
    breakdown_f: dict[str, float] = {
        "weights": weights.weights,
        "autocast_weight_copies": weights.autocast_copies,
        "lora_adapters": state.adapters,
        "gradients": peak.gradients,
        "ddp_grad_buckets": state.ddp_buckets,
        "optimizer_states": state.optimizer_states,
        "activations": peak.activations,
        "logits": peak.logits,
        "fsdp_buffers": peak.fsdp_buffers,
        "dequant_workspace": peak.dequant_workspace,
        "cuda_context": float(CUDA_CONTEXT_BYTES),
        "nccl_buffers": float(NCCL_BYTES if setup.gpus > 1 else 0),
        "allocator_slack": peak.allocator_slack,
    }
    breakdown = {name: round(value) for name, value in breakdown_f.items()}
    return VramEstimate(
        per_gpu_bytes=sum(breakdown.values()),
        breakdown=breakdown,
        trainable_params=trainable,
        total_params=arch.total_params,
        setup=setup,
    )


@dataclass(frozen=True)
class _Weights:
    """The model's weights on one GPU, and what FSDP gathers of them."""

    weights: float
    """What one GPU holds for the whole step: its shard, or every weight."""
    autocast_copies: float
    """The bf16 casts autocast keeps for backward."""
    unit: float
    """One gathered decoder block (an FSDP unit)."""
    root: float
    """The gathered root: embeddings, final norm, untied ``lm_head``."""
    padding: float
    """Parameters FSDP2's padding adds to this GPU's shard of the stacked experts."""


def _weight_terms(arch: ModelArch, setup: TrainingSetup, p: _Params) -> _Weights:
    """What is stored, what FSDP gathers, what autocast casts."""
    n = setup.gpus
    full_shard = n > 1 and setup.sharding == "full"
    grad_op = n > 1 and setup.sharding == "grad-op"
    offload = setup.cpu_offload
    e = _compute_bytes(setup)
    a = _trainable_bytes(setup)
    autocast = setup.precision == "amp-bf16" and not (full_shard or grad_op or offload)
    autocast_copies = 0.0
    if setup.method == "full":
        stored = float(p.total * a)
        unit = float(p.per_block * e)  # FSDP gathers the compute-dtype copy
        root = float(p.root * e)
        unsharded = float(p.total * e)
        if autocast:
            # autocast caches a bf16 copy of every trainable weight it casts for the rest of
            # the forward pass, and autograd keeps them for backward.
            autocast_copies = float(p.matmul_weights * BF16_BYTES)
    else:
        stored = _frozen_bytes(p, setup)
        unit = _frozen_bytes(p, setup, per_block=True)
        root_bytes = (
            _unquantized_bytes(setup) if setup.method == "qlora" else _lora_base_bytes(setup)
        )
        root = float(p.root * root_bytes)
        unsharded = stored
        if autocast and setup.method == "lora" and _lora_base_bytes(setup) == FP32_BYTES:
            # A frozen fp32 weight is cast per matmul and the bf16 cast is kept for backward
            # (it multiplies the incoming gradient): every layer, or one recomputed layer.
            layers = p.block_linear_weights if not setup.grad_ckpt else p.per_block_linear_weights
            autocast_copies = float((layers + arch.lm_head_params) * BF16_BYTES)
    # FSDP2 shards each parameter along its first dimension, padded to a multiple of the GPU
    # count: stacked experts (first dimension = the expert count) are padded to
    # ceil(E / N) experts per GPU.  Negligible for every other parameter.
    padding = _expert_padding_params(arch, setup) if (full_shard or grad_op) else 0.0
    if offload:
        weights = 0.0
    elif full_shard:
        weights = stored / n
    elif grad_op:
        weights = stored / n + unsharded  # SHARD_GRAD_OP keeps gathered params until backward
    else:
        weights = stored
    if setup.method == "qlora" and (full_shard or grad_op) and not offload:
        # The quantization state is the layer's, not a parameter: every rank keeps it whole.
        weights += _quant_state_bytes(p, setup) * (1 - 1 / n)
    if not offload:
        weights += padding * (a if setup.method == "full" else e)
    return _Weights(weights, autocast_copies, unit, root, padding)


@dataclass(frozen=True)
class _TrainableState:
    adapters: float
    gradients: float
    """Once backward has made them (where FSDP leaves them: sharded; offload: CPU)."""
    ddp_buckets: float
    optimizer_states: float


def _trainable_state(setup: TrainingSetup, trainable: int, padding: float) -> _TrainableState:
    n = setup.gpus
    offload = setup.cpu_offload
    shard = n if (n > 1 and setup.sharding in ("full", "grad-op")) else 1
    a = _trainable_bytes(setup)
    adapters = 0.0 if (setup.method == "full" or offload) else trainable * a / shard
    gradients = 0.0 if offload else trainable * a / shard
    ddp_buckets = float(trainable * a) if (n > 1 and setup.sharding == "none") else 0.0
    optimizer_states = 0.0 if offload else trainable * _state_bytes_per_param(setup) / shard
    if setup.method == "full" and not offload:
        gradients += padding * a
        optimizer_states += padding * _state_bytes_per_param(setup)
    return _TrainableState(adapters, gradients, ddp_buckets, optimizer_states)


@dataclass(frozen=True)
class _Activations:
    """Activation bytes of one micro-batch on one GPU (never divided by the GPU count)."""

    saved: float
    """What forward leaves for backward."""
    working: float
    """What exists only while one layer's backward runs: its recomputation under
    checkpointing, and its gradient buffers."""
    released: float
    """The part of ``saved`` that the blocks run before the last one free (every block's
    saved tensors but the first block's)."""


def _activation_terms(
    arch: ModelArch, setup: TrainingSetup, targets: list[LinearLayer]
) -> _Activations:
    e = _compute_bytes(setup)
    tokens = setup.micro_batch * setup.seq_len
    per_layer, backward = _layer_bytes_per_token(arch, setup)
    lora_layer, lora_head = _lora_bytes_per_token(arch, setup, targets)
    non_layer = NON_LAYER_ELEMS_PER_HIDDEN * arch.hidden_size * e + lora_head
    scores = 0.0
    entries = _mask_entries(setup)
    layer_mask = float(LAYER_MASK_ELEMS_PER_ENTRY * entries * e)
    mask = float(MASK_BYTES_PER_ENTRY * entries)
    if setup.attention == "eager":
        per_score = EAGER_SCORE_ELEMS + (
            SOFTCAP_SCORE_ELEMS if arch.model_type in _SOFTCAP_MODEL_TYPES else 0
        )
        scores = float(per_score * e * setup.micro_batch * arch.num_heads * setup.seq_len**2)
    # With activation offloading the tensors saved for backward wait in host memory: the GPU
    # holds the layer whose backward runs (its input, or all it saved), not all of them.
    kept_layers = 1 if setup.activation_offload else arch.num_layers
    # PEFT adapts stacked experts by adding the merged low-rank update to the whole stacked
    # weight in each forward: an expert-sized tensor per MoE layer, kept for backward.
    delta = _stacked_expert_delta_bytes(arch, setup, targets)
    delta_grad = _stacked_expert_delta_grad_bytes(arch, setup, targets)
    if setup.grad_ckpt:
        layer_inputs = kept_layers * tokens * arch.hidden_size * e
        eager = setup.attention == "eager"
        saved = layer_inputs + tokens * non_layer + mask
        saved += kept_layers * layer_mask if eager else 0.0
        working = tokens * (per_layer + lora_layer + backward) + scores + delta + delta_grad
        working += 0.0 if eager else layer_mask
        # the inputs (and Gemma 2's masks) of the layers whose backward is done
        released = (kept_layers - 1) * (saved - tokens * non_layer - mask) / kept_layers
    else:
        moe_kept = min(kept_layers, arch.moe_layers)
        every_layer = kept_layers * (tokens * (per_layer + lora_layer) + scores + layer_mask)
        saved = every_layer + moe_kept * delta + tokens * non_layer + mask
        working = tokens * backward + delta_grad
        # what the layers whose backward is done saved (MoE: the first layer counted dense)
        released = every_layer * (kept_layers - 1) / kept_layers + max(moe_kept - 1, 0) * delta
    return _Activations(saved, working, released)


@dataclass(frozen=True)
class _LossTerms:
    logits: float
    """The loss's largest footprint."""
    logits_grad: float
    """The gradient of the logits the output projection's backward receives."""
    backward: tuple[float, float] | None
    """The chunked loss only: the (activations, logits) beyond the static state while the
    chunks run backward one by one, every chunk's saved log-softmax still there, the output
    projection's weight gradient growing chunk by chunk."""


def _loss_terms(arch: ModelArch, setup: TrainingSetup, saved: float) -> _LossTerms:
    """The logits for the loss, plain, chunked or fused (``saved``: the activations)."""
    e = _compute_bytes(setup)
    tokens = setup.micro_batch * setup.seq_len
    softcap_logits = arch.model_type in _LOGIT_SOFTCAP_MODEL_TYPES
    fused_kept = 0.0
    if setup.fused_ce:
        # The kernel soft-caps in place: no extra entry for Gemma 2.
        chunk = fused_ce_chunk_tokens(tokens, arch.vocab_size, arch.hidden_size)
        fused_kept = float(tokens * arch.hidden_size * e)
        if setup.method == "full":
            head = arch.embedding_params if arch.tie_embeddings else arch.lm_head_params
            fused_kept += float(FUSED_CE_KEPT_TABLES * head * e)
        logits = fused_kept + float(chunk * arch.vocab_size * e)
    elif setup.chunked_ce:
        chunk = min(tokens, setup.loss_chunk_tokens or loss_chunk_tokens(arch.vocab_size))
        kept = tokens * LOGITS_BYTES_CHUNKED * (e // BF16_BYTES)
        working_entry = LOGITS_BYTES_CHUNK_WORKING + (e if softcap_logits else 0)
        logits = float((kept + chunk * working_entry) * arch.vocab_size)
    else:
        per_entry = LOGITS_BYTES_FULL + (e if softcap_logits else 0)
        logits = float(tokens * arch.vocab_size * per_entry)
    # The fp32 gradient of the logits the output projection's backward receives.
    logits_grad = min(logits, float(tokens * arch.vocab_size * FP32_BYTES))
    if setup.fused_ce:
        logits_grad = fused_kept  # the gradients the forward made, handed on
    loss_backward = None
    if setup.chunked_ce:
        # Chunk by chunk backward (kubetune_trainer.loss): every chunk's log-softmax is still
        # kept; one chunk's gradients; a trained output projection's weight gradient, summed
        # in autograd's buffer as each chunk adds its own (tied: the embedding's table).
        chunk_backward = LOGITS_BYTES_CHUNK_BACKWARD + (e if softcap_logits else 0)
        head_grads = 0.0
        if setup.method == "full":
            head = arch.embedding_params if arch.tie_embeddings else arch.lm_head_params
            head_grads = float(CHUNKED_HEAD_GRAD_TABLES * head * e)
        loss_backward = (
            saved + head_grads,
            float((kept + chunk * chunk_backward) * arch.vocab_size),
        )
    return _LossTerms(logits, logits_grad, loss_backward)


@dataclass(frozen=True)
class _Peak:
    """The terms taken at the moment of the peak, and the allocator's slack."""

    gradients: float
    activations: float
    logits: float
    fsdp_buffers: float
    dequant_workspace: float
    allocator_slack: float


def _peak_terms(
    arch: ModelArch,
    setup: TrainingSetup,
    p: _Params,
    targets: list[LinearLayer],
    trainable: int,
    gradients: float,
    moments: _Moments,
) -> _Peak:
    """The largest moment of the step, given the gradients once backward has made them."""
    fsdp = setup.gpus > 1 and setup.sharding in ("full", "grad-op")
    accumulated = _accumulated_gradient_bytes(
        setup, trainable, gradients, fsdp=fsdp or setup.cpu_offload
    )
    made = _gradients_made(arch, setup, p, targets, gradients)
    if setup.optimizer_in_backward and gradients:
        # One parameter's gradient at a time, stepped and freed at once (sharded under FSDP).
        one = _largest_gradient(arch, setup, targets) * gradients / trainable
        made = {moment: min(value, one) for moment, value in made.items()}
    # QLoRA: in the trainer's step, one dequantized copy of a 4-bit weight while a block runs
    # (its forward, with the loss moment standing for the last block's, its recomputation or
    # its backward) and none while only the unquantized root works (its all-gather, the
    # chunks' backward, the end). The published setups keep two at every moment (other
    # trainers quantize more than the blocks, e.g. LitGPT's output projection).
    published = setup.qlora_matmul_keeps_input
    copies = DEQUANT_COPIES_PUBLISHED if published else DEQUANT_COPIES
    e = _compute_bytes(setup)
    dequant = float(copies * p.largest_quantized * e) if setup.method == "qlora" else 0.0
    dequant_moments = frozenset(moments) if published else _DEQUANT_MOMENTS

    def at(moment: str) -> float:
        held = dequant if moment in dequant_moments else 0.0
        return sum(moments[moment]) + _gradients_at(accumulated, made[moment]) + held

    at_peak = max(moments, key=at)
    activations, logits, fsdp_buffers = moments[at_peak]
    # Each transient term's largest value over the moments: the caching allocator keeps what
    # one moment frees (the logits at the start of backward, the gathered root) as cached
    # segments, which later, differently sized requests reuse only in part.
    # (The root's all-gather is a moment of its own: its buffer is freed before anything else
    # is allocated.)
    cacheable = [moment for name, moment in moments.items() if name != "root all-gather"]
    peak = activations + logits + fsdp_buffers
    largest = max(peak, sum(max(moment[i] for moment in cacheable) for i in range(3)))
    cached = largest - peak
    if not (setup.chunked_ce or setup.fused_ce):
        # The compute-dtype logits freed when the loss returns leave a segment half the size
        # of the fp32 gradients backward then allocates: it stays cached beside them.
        cached += setup.micro_batch * setup.seq_len * arch.vocab_size * e
    slack = cached + max(
        float(ALLOCATOR_SLACK_MIN_BYTES), ALLOCATOR_SLACK_FRACTION * (largest + dequant)
    )
    return _Peak(
        gradients=_gradients_at(accumulated, made[at_peak]),
        activations=activations,
        logits=logits,
        fsdp_buffers=fsdp_buffers,
        dequant_workspace=dequant if at_peak in dequant_moments else 0.0,
        allocator_slack=slack,
    )


def comparable_bytes(estimate: VramEstimate, metric: MeasuredMetric) -> int:
    """The part of an estimate that a published peak of kind ``metric`` measures.

    ``allocated`` leaves out what the caching allocator holds but has not handed out (its
    slack), memory outside the allocator (CUDA context, NCCL) and paged optimizer states
    (bitsandbytes allocates those as CUDA managed memory, outside PyTorch's allocator);
    ``reserved`` keeps the slack; ``device`` is the whole estimate.
    """
    if metric == "device":
        return estimate.per_gpu_bytes
    if metric not in ("allocated", "reserved"):
        raise _fail(f"metric {metric!r} is not supported", "use allocated, reserved or device")
    excluded = sum(estimate.breakdown.get(name, 0) for name in _OUTSIDE_ALLOCATOR)
    if estimate.setup.optimizer in PAGED_OPTIMIZERS:
        excluded += estimate.breakdown.get("optimizer_states", 0)
    if metric == "allocated":
        excluded += estimate.breakdown.get("allocator_slack", 0)
    return estimate.per_gpu_bytes - excluded
