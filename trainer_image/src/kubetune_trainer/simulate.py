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
this module also tags the storages whose last dimension is the vocabulary (logits and their
gradients) and, under `amp-bf16`, the autocast copies of parameters, so that the result maps
onto the analytical estimator's breakdown keys (`kubetune.planning.estimator`).

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
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.utils._python_dispatch import TorchDispatchMode

from kubetune_trainer import backward_step
from kubetune_trainer.backward_step import OptimizerInBackward
from kubetune_trainer.contract import (
    DatasetRef,
    JobRef,
    LoraConfig,
    Method,
    ModelRef,
    Objective,
    Optimizer,
    ParallelConfig,
    Precision,
    Sharding,
    TrainerConfig,
    TrainingConfig,
)
from kubetune_trainer.dpo import dpo_loss
from kubetune_trainer.loss import ChunkedLoss, loss_sum, sequence_logps
from kubetune_trainer.modeling import (
    _add_lora,
    _bnb_config,
    _hf_model,
    _param_dtype,
    decoder_blocks,
    prepare_for_training,
    shard_model,
)
from kubetune_trainer.recipe import MAX_GRAD_NORM, build_optimizer

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

PHASES: tuple[str, ...] = ("weights", "forward", "backward_peak", "optimizer", "peak")
"""The reported phases: after the model build (`weights`, plus optimizer construction, which
allocates nothing), after forward and loss (`forward`), the highest point while backward runs
(`backward_peak`), after the optimizer step and `zero_grad` (`optimizer`), and the highest
point of the whole step (`peak`)."""

MEASURED_COMPONENTS: tuple[str, ...] = (
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
)
"""The estimator's breakdown keys a simulation measures (the rest are runtime overheads)."""

_DEVICE = torch.device("cpu")


class SimulationError(ValueError):
    """A setup the simulation does not cover; the message says what to use instead."""


@dataclass(frozen=True)
class SimulationSetup:
    """One training layout; the field names are those of the estimator's `TrainingSetup`."""

    method: Method = "lora"
    micro_batch: int = 1
    seq_len: int = 2048
    gpus: int = 1
    sharding: Sharding = "full"
    cpu_offload: bool = False
    precision: Precision = "bf16"
    optimizer: Optimizer = "adamw"
    grad_ckpt: bool = True
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = ("all-linear",)
    lora_dropout: float = 0.05
    attention: Literal["sdpa", "eager"] = "sdpa"
    chunked_ce: bool = False
    fused_ce: bool = False
    activation_offload: bool = False
    loss_chunk_tokens: int | None = None
    fused_experts: bool = True
    optimizer_in_backward: bool = False
    objective: Objective = "sft"
    """`dpo`: `micro_batch` counts preference pairs, each a chosen and a rejected row; the
    step is the trainer's DPO step (the estimator's `TrainingSetup` counts rows instead)."""


@dataclass(frozen=True)
class SimulationResult:
    """Simulated bytes of one GPU's training step (fake tensors, no runtime overheads)."""

    breakdown: dict[str, int]
    """`MEASURED_COMPONENTS` → bytes at the step's peak; sums to `phases["peak"]`."""
    phases: dict[str, int]
    """`PHASES` → bytes of live tensors at that point of the step."""
    phase_breakdowns: dict[str, dict[str, int]]
    """The breakdown at each phase (and at the forward and optimizer-step peaks)."""
    peak_phase: str
    """Where the peak is: `forward_peak`, `backward_peak` or `optimizer_peak`."""
    total_params: int
    trainable_params: int
    num_layers: int
    simulated_layers: tuple[int, ...]
    """(1, 2) when extrapolated, (num_layers,) for a whole-model simulation."""
    seconds: float
    method: str = field(default="")

    @property
    def peak_bytes(self) -> int:
        return self.phases["peak"]

    def to_dict(self) -> dict[str, object]:
        return {
            "peakBytes": self.peak_bytes,
            "breakdown": dict(self.breakdown),
            "phases": dict(self.phases),
            "peakPhase": self.peak_phase,
            "totalParams": self.total_params,
            "trainableParams": self.trainable_params,
            "numLayers": self.num_layers,
            "simulatedLayers": list(self.simulated_layers),
            "method": self.method,
            "seconds": round(self.seconds, 2),
        }


# --------------------------------------------------------------------------- configs


def hf_config(fields: Mapping[str, Any], num_layers: int | None = None) -> Any:
    """A transformers config from `config.json` fields (the built-in table's entries are such
    fields), with `num_layers` decoder blocks when given (per-layer lists cut to match)."""
    import transformers

    auto: Any = transformers.AutoConfig
    raw = dict(fields)
    model_type = raw.pop("model_type", None)
    if not model_type:
        raise SimulationError("the model's config has no model_type; cannot build it")
    raw.pop("architectures", None)
    if num_layers is not None:
        raw["num_hidden_layers"] = num_layers
        for key in ("layer_types", "mlp_only_layers"):
            value = raw.get(key)
            if isinstance(value, list) and key == "layer_types":
                raw[key] = value[:num_layers]
            elif isinstance(value, list):
                raw[key] = [i for i in value if isinstance(i, int) and i < num_layers]
    try:
        config = auto.for_model(model_type, **raw)
    except (KeyError, ValueError) as e:
        raise SimulationError(f"transformers cannot build a {model_type!r} config: {e}") from e
    if num_layers is not None and isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:num_layers]
    return config


def trainer_config(setup: SimulationSetup, source: str = "simulated") -> TrainerConfig:
    """The `TrainerConfig` the operator would render for `setup` (one step, one rank)."""
    lora = (
        LoraConfig(
            rank=setup.lora_rank,
            dropout=setup.lora_dropout,
            target_modules=list(setup.lora_targets),
        )
        if setup.method != "full"
        else None
    )
    return TrainerConfig(
        job=JobRef(name="simulate"),
        method=setup.method,
        model=ModelRef(source=source),
        dataset=DatasetRef(source="simulated"),
        lora=lora,
        training=TrainingConfig(
            total_steps=1,
            max_steps=1,
            sequence_length=setup.seq_len,
            micro_batch_size=setup.micro_batch,
            global_batch_size=setup.micro_batch * setup.gpus,
            gradient_checkpointing=setup.grad_ckpt,
            precision=setup.precision,
            optimizer=setup.optimizer,
            chunked_cross_entropy=setup.chunked_ce,
            optimizer_in_backward=setup.optimizer_in_backward,
            objective=setup.objective,
            packing=setup.objective != "dpo",
        ),
        parallel=ParallelConfig(gpus_per_node=setup.gpus, sharding=setup.sharding),
    )


def _refuse_unsupported(setup: SimulationSetup) -> None:
    if not isinstance(setup.gpus, int) or setup.gpus < 1:
        raise SimulationError(f"gpus must be a positive integer, got {setup.gpus!r}")
    if setup.gpus > 1 and setup.sharding == "none":
        raise SimulationError(
            f"gpus={setup.gpus} with sharding none (DDP) is not simulated; simulate sharding "
            "full or grad-op (FSDP2), or use the analytical estimate (without --simulate)"
        )
    if setup.cpu_offload:
        raise SimulationError("cpu_offload is not simulated; use the analytical estimate")
    if setup.activation_offload:
        raise SimulationError(
            "activation offloading is not simulated: every fake tensor lives on the CPU, so what "
            "would wait in host memory cannot be told apart; use the analytical estimate"
        )
    if setup.fused_ce:
        raise SimulationError(
            "the fused loss is not simulated: it is a Triton kernel, which fake tensors cannot "
            "run; use the analytical estimate"
        )
    if setup.loss_chunk_tokens is not None:
        raise SimulationError(
            "loss_chunk_tokens is not simulated: the trainer picks its own chunk "
            "(kubetune_trainer.contract.loss_chunk_tokens); leave it unset"
        )
    if not setup.fused_experts:
        raise SimulationError(
            "fused_experts=False describes other trainers' MoE models; the trainer builds "
            "stacked experts, which is what is simulated"
        )
    if setup.optimizer not in ("adamw", "adamw-8bit"):
        raise SimulationError(
            f"optimizer {setup.optimizer} is not simulated (a paged optimizer keeps its states "
            "in CUDA managed memory, outside PyTorch's allocator, which fake tensors cannot "
            "tell apart); simulate adamw or adamw-8bit, or use the analytical estimate"
        )
    for name in ("micro_batch", "seq_len"):
        value = getattr(setup, name)
        if not isinstance(value, int) or value < 1:
            raise SimulationError(f"{name} must be a positive integer, got {value!r}")


# --------------------------------------------------------------------------- tracking


class _Tracker(MemTracker):  # type: ignore[no-untyped-call]
    """`MemTracker` that also tags logits and autocast weight copies, keeps the tagged bytes
    at every peak, and hooks only parameters that have gradients (frozen LoRA bases).

    `_FSDPTracker` is the same on `FSDPMemTracker` (extra arguments go to its constructor)."""

    def __init__(self, vocab_size: int, *args: Any) -> None:
        super().__init__(*args)
        self.vocab_size = vocab_size
        self.tagged: dict[str, int] = dict.fromkeys(_TAGS, 0)
        self._dequantize_4bit = _dequantize_4bit_op()  # looked up once, not per operator
        self._tag_of: dict[int, tuple[str, Any]] = {}  # id(winfo) → (tag, winfo)
        self._func: Any = None
        self._args: Any = ()
        self.stage = "weights"
        """`forward`, `backward` or `step` (clipping and the optimizer), set by the driver."""
        self.blocks: list[nn.Module] = []
        self._block_fqns: dict[int, str] = {}
        self._seen_first: set[str] = set()
        self._seen_last: set[str] = set()
        self.windows: dict[str, tuple[int, dict[Any, int], dict[str, int]]] = {}
        """Window → (peak bytes, MemTracker snapshot at it, tagged bytes at it)."""

    # -- tags
    def _tag(self, t: torch.Tensor) -> str | None:
        func, args = self._func, self._args
        if func is not None and func is self._dequantize_4bit:
            return "dequant_workspace"
        if (
            func is torch.ops.aten._to_copy.default
            and args
            and isinstance(args[0], nn.Parameter)
            and not self._in_opt
        ):
            return "autocast_weight_copies"
        if t.dim() >= 1 and t.shape[-1] == self.vocab_size and not isinstance(t, nn.Parameter):
            return "logits"
        return None

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        new = [st for st in _storages(t) if st not in self._WINFO]
        super()._track(reftype, t)
        if not new or reftype.name not in _TRANSIENT:
            return
        tag = self._tag(t)
        if tag is None:
            return
        for st in new:
            winfo, _ = self._WINFO.get(st, (None, None))  # type: ignore[no-untyped-call]
            if winfo is not None and winfo.mem_consumed > 0:
                self._tag_of[id(winfo)] = (tag, winfo)
                self.tagged[tag] += winfo.mem_consumed

    def _delete_callback(self, winfo: Any, w_st: Any) -> None:
        hit = self._tag_of.pop(id(winfo), None)
        if hit is not None:
            self.tagged[hit[0]] -= winfo.mem_consumed
        super()._delete_callback(winfo, w_st)

    def _update_and_maybe_create_winfos(
        self, t: torch.Tensor, reftype: Any, update_existing: bool = False
    ) -> Any:
        winfos = super()._update_and_maybe_create_winfos(t, reftype, update_existing)
        if reftype.name not in _TRANSIENT:
            for winfo in winfos:  # re-classified: no longer an activation
                hit = self._tag_of.pop(id(winfo), None)
                if hit is not None:
                    self.tagged[hit[0]] -= winfo.mem_consumed
        return winfos

    # -- peaks, per window of the step
    def _active_block(self) -> int | None:
        parents = self._mod_tracker.parents
        for i, block in enumerate(self.blocks):
            fqn = self._block_fqns.get(i)
            if fqn is None:
                known = self._mod_tracker.get_known_fqn(block)  # type: ignore[no-untyped-call]
                if known is None:
                    continue
                fqn = self._block_fqns[i] = known
            if fqn in parents:
                return i
        return None

    def _window_names(self) -> list[str]:
        """`<stage>:before|first|middle|last|after`: the decoder block running (first and last
        in execution order: backward runs the blocks in reverse) or the part outside them."""
        stage = self.stage
        if stage not in ("forward", "backward"):
            return [stage]
        idx = self._active_block()
        if idx is None:
            if stage in self._seen_last:
                return [f"{stage}:after"]
            return [f"{stage}:middle" if stage in self._seen_first else f"{stage}:before"]
        self._seen_first.add(stage)
        n = len(self.blocks)
        first, last = (0, n - 1) if stage == "forward" else (n - 1, 0)
        names = []
        if idx == first:
            names.append(f"{stage}:first")
        if idx == last:
            names.append(f"{stage}:last")
            self._seen_last.add(stage)
        return names or [f"{stage}:middle"]

    def _update_peak_stats(self, peak_state: Any) -> None:
        super()._update_peak_stats(peak_state)
        snap = self._curr_mem_snap.get(_DEVICE)
        if snap is None:
            return
        total = int(snap.get("Total", 0))
        for name in self._window_names():
            if total > self.windows.get(name, (-1, {}, {}))[0]:
                self.windows[name] = (total, dict(snap), dict(self.tagged))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self._func, self._args = func, args
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[no-untyped-call]
        finally:
            self._func, self._args = None, ()

    # -- frozen parameters get no gradient hooks
    def _track_module_params_and_buffers(
        self, module: nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        params, buffers = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for param in module.parameters():
                if not param.requires_grad or param in self._param_to_grad_hook_handles:
                    continue

                def grad_hook(grad: torch.Tensor) -> None:
                    self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

                self._param_to_grad_hook_handles[param] = (
                    param.register_hook(grad_hook),  # type: ignore[no-untyped-call]
                    param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        lambda p: grad_hook(p.grad) if p.grad is not None else None
                    ),
                )
        return params, buffers


class _FSDPTracker(_Tracker, FSDPMemTracker):  # type: ignore[no-untyped-call]
    """`_Tracker` on `FSDPMemTracker`: sharded and unsharded parameters and gradients, FSDP2's
    all-gather and reduce-scatter buffers as their own kinds (`_breakdown` maps them)."""


_TRANSIENT = frozenset({"ACT", "TEMP", "OTH"})
"""Tracker kinds of the tensors a step creates and frees (where logits and casts are tagged)."""

_TAGS: tuple[str, ...] = ("logits", "autocast_weight_copies", "dequant_workspace")
"""Transient tensors told apart from the other activations: the vocabulary-wide ones, the
autocast copies of weights, and QLoRA's weights dequantized for a matmul (each tag is the
breakdown key it is reported under)."""


def _dequantize_4bit_op() -> Any:
    """bitsandbytes' `dequantize_4bit` operator (None until bitsandbytes is imported)."""
    ops = getattr(torch.ops, "bitsandbytes", None)
    if ops is None or not hasattr(ops, "dequantize_4bit"):
        return None
    return ops.dequantize_4bit.default


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    from torch.distributed._tools.common_utils import get_untyped_storages

    return list(get_untyped_storages(t))


class _AssumeTrainedTokens(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Answers the one data-dependent question of the trainer's step, "does this chunk hold a
    trained token?" (`ChunkedLoss`), with yes, the worst case (fake tensors hold no data)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _dropout_as_on_cuda() -> Iterator[None]:
    """Dropout as CUDA runs it: one fused kernel (`native_dropout`) that keeps a 1-byte mask
    for backward. On CPU, `F.dropout` multiplies by a noise tensor of the input's dtype and
    keeps that instead (2 or 4 bytes per element), which for LoRA's dropout on every adapted
    layer's input overstates a step's peak by gigabytes (docs/simulate.md). Swapped in for
    the step, recomputation under activation checkpointing included, then put back."""
    plain = torch.nn.functional.dropout

    def fused(
        input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> torch.Tensor:
        if training and 0.0 < p < 1.0 and not inplace:
            return torch.native_dropout(input, p, True)[0]
        return plain(input, p, training, inplace)

    torch.nn.functional.dropout = fused
    try:
        yield
    finally:
        torch.nn.functional.dropout = plain


@contextlib.contextmanager
def _gemm_4bit_as_on_cuda(method: str) -> Iterator[None]:
    """QLoRA's 4-bit matmul as CUDA runs it. bitsandbytes' CUDA `gemm_4bit` dequantizes the
    whole weight to the input's dtype and then calls `linear` (its fallback, taken past 1,536
    tokens and wherever its fused kernel does not suit the GPU); the fake kernel allocates the
    output only. Each forward (recomputation included) first dequantizes the weight through
    bitsandbytes' own `dequantize_4bit`, which the tracker tags as `dequant_workspace`, and
    frees it once the output exists. Kept for every size: the fused kernel's choice depends on
    the GPU, and counting the copy errs on the safe side.

    Sharded, FSDP2 gathers each packed weight into a plain parameter that has lost its
    quantization state; bitsandbytes' `Linear4bit.forward` re-attaches the layer's state by
    wrapping the gathered tensor in a new `Params4bit`, which a fake tensor cannot become, so
    here the state is set on the gathered parameter as an attribute (what `Linear4bit` then
    reads): the same tensors, no copy."""
    if method != "qlora":
        yield
        return
    import bitsandbytes.functional as bnb_functional
    import bitsandbytes.nn.modules as bnb_modules
    from bitsandbytes.autograd._functions import MatMul4Bit

    plain = MatMul4Bit.forward
    plain_fix = bnb_modules.fix_4bit_weight_quant_state_from_module

    def fix(module: Any) -> None:
        if getattr(module.weight, "quant_state", None) is None:
            module.weight.quant_state = module.quant_state

    def forward(
        ctx: Any,
        A: torch.Tensor,
        B: torch.Tensor,
        out: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        quant_state: Any = None,
    ) -> torch.Tensor:
        workspace = None
        if A.numel() and quant_state is not None:
            workspace = bnb_functional.dequantize_4bit(B.view(-1, 1), quant_state).to(A.dtype)
        result: torch.Tensor = plain(ctx, A, B, out, bias, quant_state)
        del workspace
        return result

    MatMul4Bit.forward = staticmethod(forward)  # type: ignore[method-assign]
    bnb_modules.fix_4bit_weight_quant_state_from_module = fix
    try:
        yield
    finally:
        MatMul4Bit.forward = plain  # type: ignore[method-assign]
        bnb_modules.fix_4bit_weight_quant_state_from_module = plain_fix


# --------------------------------------------------------------------------- one run


@dataclass
class _Run:
    phases: dict[str, dict[str, int]]
    """Each point of the step (PHASES and the per-window peaks) → breakdown."""
    total_params: int
    trainable_params: int
    blocks: int


def _swap_in_4bit_layers(model: Any, qcfg: Any) -> None:
    """What `from_pretrained(quantization_config=...)` does to the model before and after its
    weights load (`modeling._load`): transformers' bitsandbytes quantizer puts `Linear4bit`
    layers where it quantizes (all linear layers but those it keeps, such as the output
    projection) and marks the model as loaded in 4 bits, which is what makes PEFT wrap those
    layers in its 4-bit LoRA layer. The weights stay on the meta device until
    `_fake_storages` quantizes them."""
    from transformers.quantizers.auto import AutoHfQuantizer

    quantizer: Any = AutoHfQuantizer.from_config(qcfg, pre_quantized=False)
    quantizer.preprocess_model(model, device_map={"": _DEVICE.type})
    quantizer.postprocess_model(model)


def _quantized_weight(module: nn.Module, p: nn.Parameter) -> nn.Parameter:
    """A `Params4bit` weight quantized as bitsandbytes does when the trainer loads the model:
    the compute-dtype weight packed two values per byte into the quant-storage dtype, with its
    quantization state (absmax per block; with double quantization those 8-bit, plus the
    second level's constants).

    The result is a plain parameter carrying `Params4bit`'s attributes: a fake tensor cannot
    become a `Params4bit` (a tensor subclass), and `Linear4bit.forward` and PEFT read only
    the attributes. The state's tensors are counted by `_quant_state_bytes`, not by the memory
    tracker: registered as buffers, they were counted a few bytes to megabytes differently from
    run to run (the tracker keys storages by object identity, and the quantization's freed
    temporaries make that identity unreliable), which the per-block extrapolation multiplies."""
    import bitsandbytes.functional as bnb_functional

    dtype = getattr(module, "compute_dtype", None) or torch.bfloat16
    packed, state = bnb_functional.quantize_4bit(
        torch.zeros(p.shape, dtype=dtype, device=_DEVICE),
        blocksize=p.blocksize,  # type: ignore[attr-defined]
        compress_statistics=p.compress_statistics,  # type: ignore[attr-defined]
        quant_type=p.quant_type,  # type: ignore[attr-defined]
        quant_storage=p.quant_storage,  # type: ignore[attr-defined]
    )
    weight = nn.Parameter(packed, requires_grad=False)
    for attr in ("blocksize", "compress_statistics", "quant_type", "quant_storage"):
        setattr(weight, attr, getattr(p, attr))
    weight.quant_state = state  # type: ignore[attr-defined]
    weight.bnb_quantized = True  # type: ignore[attr-defined]
    weight.module = module  # type: ignore[attr-defined]
    module.quant_state = state  # type: ignore[assignment]
    return weight


def _quant_state_bytes(model: nn.Module) -> int:
    """Bytes of the 4-bit layers' quantization states (absmax per block, the code tables;
    with double quantization the second level's), each tensor once. Every rank holds them
    whole: they are the layer's, not a parameter FSDP2 shards."""
    seen: dict[int, int] = {}
    for module in model.modules():
        state = getattr(module, "quant_state", None)
        if state is None:
            continue
        parts = [state.absmax, state.code, state.offset]
        if state.state2 is not None:
            parts += [state.state2.absmax, state.state2.code]
        for t in parts:
            if isinstance(t, torch.Tensor):
                seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


@contextlib.contextmanager
def _bnb_tables(fake_mode: Any) -> Iterator[None]:
    """bitsandbytes builds its 8-bit quantization tables (for double quantization's absmax,
    and the 8-bit optimizers' states) from data on first use, which a fake tensor has none of:
    the real tables, made fake, for the duration. Entered outside the fake mode."""
    import bitsandbytes.functional as bnb_functional
    from bitsandbytes.optim.optimizer import Optimizer8bit

    create: Any = bnb_functional.create_dynamic_map
    signed, unsigned = create(signed=True), create(signed=False)
    tables: dict[str, torch.Tensor] = bnb_functional.name2qmap
    before = tables.get("dynamic")
    tables["dynamic"] = fake_mode.from_tensor(before if before is not None else signed)

    def fill_qmap(optimizer: Any) -> None:  # `Optimizer8bit.fill_qmap`, with fake tables
        optimizer.name2qmap["dynamic"] = fake_mode.from_tensor(signed)
        optimizer.name2qmap["udynamic"] = fake_mode.from_tensor(unsigned)

    plain = Optimizer8bit.fill_qmap
    Optimizer8bit.fill_qmap = fill_qmap  # type: ignore[method-assign]
    try:
        yield
    finally:
        Optimizer8bit.fill_qmap = plain  # type: ignore[method-assign]
        if before is None:
            tables.pop("dynamic", None)
        else:
            tables["dynamic"] = before


def _fake_storages(model: nn.Module) -> None:
    """Replace every meta parameter and buffer by a fake CPU tensor (inside a fake mode),
    keeping shared ones (tied embeddings) shared; QLoRA's 4-bit weights are quantized."""
    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:
                if type(p).__name__ == "Params4bit":
                    memo[id(p)] = _quantized_weight(module, p)
                else:
                    data = torch.zeros(p.shape, dtype=p.dtype, device=_DEVICE)
                    memo[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
            module._parameters[name] = memo[id(p)]  # type: ignore[assignment]
        for name, b in list(module._buffers.items()):
            if b is None:
                continue
            if id(b) not in memo:
                memo[id(b)] = torch.ones(b.shape, dtype=b.dtype, device=_DEVICE)
            module._buffers[name] = memo[id(b)]


def _build(
    cfg: TrainerConfig, config: Any, attention: str
) -> tuple[Any, ChunkedLoss | None, int, int]:
    """`modeling.build_model`'s order for one rank, on the meta device."""
    import transformers

    auto_model: Any = transformers.AutoModelForCausalLM
    qcfg = _bnb_config(cfg) if cfg.method == "qlora" else None
    # QLoRA loads in the compute dtype (`modeling._load`), the others in the precision's.
    dtype = (
        qcfg.bnb_4bit_compute_dtype if qcfg is not None else _param_dtype(cfg.training.precision)
    )
    # sdpa: transformers' default, as the trainer loads (eager where a model has no sdpa path).
    kwargs = {"attn_implementation": "eager"} if attention == "eager" else {}
    with torch.device("meta"):
        model: Any = auto_model.from_config(config, dtype=dtype, **kwargs)
    model.config.use_cache = False
    if qcfg is not None:
        _swap_in_4bit_layers(model, qcfg)
    if cfg.method in ("lora", "qlora"):
        model = _add_lora(model, cfg)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    chunked = prepare_for_training(model, cfg)
    return model, chunked, total, trainable


def _breakdown(
    snap: Mapping[Any, int], tagged: Mapping[str, int], adapters: int, method: str
) -> dict[str, int]:
    by_name: dict[str, int] = {}
    for kind, size in snap.items():
        name = getattr(kind, "name", None)  # "Total" is a plain string
        if name is not None:
            by_name[name] = by_name.get(name, 0) + int(size)

    def get(*names: str) -> int:
        return sum(by_name.get(name, 0) for name in names)

    # MemTracker's kinds, and FSDPMemTracker's: the rank's shards are the weights, gradients
    # and optimizer states; what FSDP2 gathers or reduces for a while is `fsdp_buffers`.
    params = get("PARAM", "SHARDED_PARAM")
    lora = min(adapters, params) if method != "full" else 0
    tags = {tag: int(tagged.get(tag, 0)) for tag in _TAGS}
    transient = get(*_TRANSIENT, "INP")
    out = dict.fromkeys(MEASURED_COMPONENTS, 0)
    out["weights"] = params - lora + get("BUFFER")
    out["lora_adapters"] = lora
    out["gradients"] = get("GRAD", "SHARDED_GRAD")
    out["optimizer_states"] = get("OPT")
    out["fsdp_buffers"] = get("UNSHARDED_PARAM", "UNSHARDED_GRAD", "ALL_GATHER", "REDUCE_SCATTER")
    out.update(tags)
    out["activations"] = transient - sum(tags.values())
    return out


def _run_once(
    setup: SimulationSetup, fields: Mapping[str, Any], layers: int | None, *, fake: bool = True
) -> _Run:
    """One step with `layers` decoder blocks. `fake=False` runs the same step on real CPU
    tensors (zero weights) under the same tracker: what the tests compare the simulation to."""
    group = _fake_process_group(setup.gpus) if _sharded(setup) else contextlib.nullcontext()
    with warnings.catch_warnings(), group:
        warnings.simplefilter("ignore", FutureWarning)  # transformers' checkpointing renames
        return _step(setup, fields, layers, fake=fake)


def _step(
    setup: SimulationSetup, fields: Mapping[str, Any], layers: int | None, *, fake: bool
) -> _Run:
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = trainer_config(setup)
    config = hf_config(fields, layers)
    model, chunked, total, trainable = _build(cfg, config, setup.attention)
    block_list = decoder_blocks(model)  # before sharding renames their classes
    blocks = len(block_list)
    vocab = int(getattr(_hf_model(model).config, "vocab_size", 0) or 0)
    sharded = _sharded(setup)
    # `modeling.build_model`: FSDP2 casts through its mixed-precision policy, not autocast.
    autocast = torch.bfloat16 if cfg.training.precision == "amp-bf16" and not sharded else None
    # Rank 0 of `setup.gpus` on the fake process group `simulate` set up; the mesh is made
    # outside the fake mode (it holds real rank tensors).
    mesh = _rank0_mesh(setup.gpus) if sharded else None

    fake_mode: contextlib.AbstractContextManager[Any] = (
        FakeTensorMode() if fake else contextlib.nullcontext()
    )
    # Fake tensors hold no labels: the chunked loss's "any trained token here?" is answered yes.
    assume: contextlib.AbstractContextManager[Any] = (
        _AssumeTrainedTokens() if fake else contextlib.nullcontext()  # type: ignore[no-untyped-call]
    )
    # Real tensors build bitsandbytes' tables themselves.
    tables: contextlib.AbstractContextManager[Any] = (
        _bnb_tables(fake_mode)
        if fake and (setup.method == "qlora" or setup.optimizer != "adamw")
        else contextlib.nullcontext()
    )
    with tables, fake_mode:
        _fake_storages(model)
        if mesh is not None:
            shard_model(model, cfg, mesh)
        optimizer = build_optimizer(cfg, model, torch.device("cuda"))
        # The steady state, not the first step: torch creates optimizer states in the first
        # `step()`, and every later step's forward and backward run with them allocated.
        trained = [p for p in _unique_params(model) if p.requires_grad]
        for p in trained:
            p.grad = torch.zeros_like(p)
        _clip_and_step(model, optimizer)
        if cfg.training.optimizer_in_backward:
            # The trainer's hooks (`recipe.FineTuneRecipe`): each parameter stepped and its
            # gradient freed as backward makes it; the step after backward then has none.
            why = backward_step.refusal(cfg)
            if why is not None:
                raise SimulationError(why)
            OptimizerInBackward(model, optimizer)
        adapters = _local_bytes(p for p in _unique_params(model) if p.requires_grad)
        b, s = setup.micro_batch * (2 if setup.objective == "dpo" else 1), setup.seq_len
        input_ids = torch.zeros((b, s), dtype=torch.long, device=_DEVICE)
        labels = torch.zeros((b, s), dtype=torch.long, device=_DEVICE)
        position_ids = torch.arange(s, device=_DEVICE).unsqueeze(0).expand(b, s).contiguous()

    tracker = _FSDPTracker(vocab, model, optimizer) if sharded else _Tracker(vocab)
    tracker.blocks = block_list
    tracker.track_external(model, optimizer)  # FSDPMemTracker: its own hooks, on entry
    lora = adapters if setup.method != "full" else 0
    phases: dict[str, dict[str, int]] = {}

    quant_states = _quant_state_bytes(model)

    def take(name: str) -> None:
        snap = tracker.get_tracker_snapshot("current").get(_DEVICE, {})
        phases[name] = _breakdown(snap, tracker.tagged, lora, setup.method)
        phases[name]["weights"] += quant_states

    # FSDPMemTracker sorts the sharded and unsharded parameters only once it is entered;
    # MemTracker already knows them from track_external.
    if not sharded:
        take("weights")
    with fake_mode, assume, tracker, _dropout_as_on_cuda(), _gemm_4bit_as_on_cuda(setup.method):
        if sharded:
            take("weights")
        tracker.stage = "forward"
        if setup.objective == "dpo":
            # MemTracker follows one forward per module and step: forget the reference's
            # per-module numbers (the windows' peaks stay) before the policy's forward.
            loss = _dpo_forward(
                model, cfg, input_ids, labels, autocast, chunked, between=tracker.reset_mod_stats
            )
        else:
            loss = loss_sum(
                model,
                input_ids=input_ids,
                labels=labels,
                attention_mask=None,
                position_ids=position_ids,
                autocast_dtype=autocast,
                chunked=chunked,
            )
        take("forward")
        tracker.stage = "backward"
        scaled: Any = loss * (1.0 / (b * (s - 1)))
        scaled.backward()
        del loss, scaled
        tracker.stage = "step"
        _clip_and_step(model, optimizer)
        take("optimizer")
    for name, (_, snap, tagged) in tracker.windows.items():
        phases[f"peak:{name}"] = _breakdown(snap, tagged, lora, setup.method)
        phases[f"peak:{name}"]["weights"] += quant_states
    return _Run(phases=phases, total_params=total, trainable_params=trainable, blocks=blocks)


def _dpo_forward(
    model: Any,
    cfg: TrainerConfig,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    autocast: torch.dtype | None,
    chunked: ChunkedLoss | None,
    *,
    between: Callable[[], None],
) -> torch.Tensor:
    """`FineTuneRecipe._dpo_terms`' forward: the reference log-probabilities (LoRA: the model
    with its adapters off, without gradients, in eval mode; full: precomputed once per start,
    here zeros), then the policy's, then the DPO loss summed over the pairs."""
    rows = input_ids.size(0)
    if cfg.method == "full":
        ref = torch.zeros(rows, dtype=torch.float32, device=input_ids.device)
    else:
        model.eval()
        with torch.no_grad(), model.disable_adapter():
            ref = sequence_logps(
                model,
                input_ids=input_ids,
                labels=labels,
                attention_mask=None,
                autocast_dtype=autocast,
                chunked=chunked,
            )
        model.train()
        between()
    logps = sequence_logps(
        model,
        input_ids=input_ids,
        labels=labels,
        attention_mask=None,
        autocast_dtype=autocast,
        chunked=chunked,
    )
    half = rows // 2
    dpo = cfg.training.dpo
    terms = dpo_loss(
        logps[:half],
        logps[half:],
        ref[:half],
        ref[half:],
        beta=dpo.beta,
        label_smoothing=dpo.label_smoothing,
    )
    return terms.losses.sum()


def _clip_and_step(model: nn.Module, optimizer: Any) -> None:
    """`FineTuneRecipe._optimizer_step`. Run once before tracking as well: DTensor (FSDP2's
    sharded parameters) works out each op's output layout on fake tensors of the global shape
    the first time it meets that op, which a tracker under a fake mode cannot tell from the
    step's own tensors; later calls hit its cache."""
    norm = nn.utils.clip_grad_norm_(
        [p for p in model.parameters() if p.requires_grad], MAX_GRAD_NORM
    )
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _sharded(setup: SimulationSetup) -> bool:
    return setup.gpus > 1 and setup.sharding != "none"


def _rank0_mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(_DEVICE.type, (world,))


@contextlib.contextmanager
def _fake_process_group(world: int) -> Iterator[None]:
    """This process as rank 0 of `world` on PyTorch's fake backend: collectives return at once
    and move no data, but their tensors are allocated as on a real group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _local_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of these (distinct) parameters' storages on this rank: a DTensor's local shard
    with FSDP2's padding."""
    total = 0
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.untyped_storage().nbytes()
    return total


def _unique_params(model: nn.Module) -> Iterator[nn.Parameter]:
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield p


# --------------------------------------------------------------------------- public


def _has_process_group() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def _in_subprocess(
    fields: Mapping[str, Any], setup: SimulationSetup, layers: Literal["extrapolate", "all"] | int
) -> SimulationResult:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(simulate, dict(fields), setup, layers=layers).result()


def _finish(
    phases: dict[str, dict[str, int]],
    *,
    total: int,
    trainable: int,
    layers: int,
    simulated: tuple[int, ...],
    seconds: float,
    method: str,
) -> SimulationResult:
    def size(name: str) -> int:
        return sum(phases[name].values())

    windows = [k for k in phases if k.startswith("peak:")]
    best: dict[str, str] = {}  # phase peak → its highest window
    for phase, stage in (("forward_peak", "forward"), ("backward_peak", "backward")):
        best[phase] = max((w for w in windows if w.startswith(f"peak:{stage}:")), key=size)
    best["optimizer_peak"] = "peak:step"
    peak_phase = max(best, key=lambda k: size(best[k]))
    breakdown = dict(phases[best[peak_phase]])
    points = {k: size(k) for k in ("weights", "forward", "optimizer")}
    points["backward_peak"] = size(best["backward_peak"])
    points["peak"] = sum(breakdown.values())
    kept = {k: dict(v) for k, v in phases.items() if not k.startswith("peak:")}
    kept.update({k: dict(phases[w]) for k, w in best.items()})
    return SimulationResult(
        breakdown=breakdown,
        phases={k: points[k] for k in PHASES},
        phase_breakdowns=kept,
        peak_phase=peak_phase,
        total_params=total,
        trainable_params=trainable,
        num_layers=layers,
        simulated_layers=simulated,
        seconds=seconds,
        method=method,
    )


def simulate(
    fields: Mapping[str, Any],
    setup: SimulationSetup,
    *,
    layers: Literal["extrapolate", "all"] | int = "extrapolate",
) -> SimulationResult:
    """Simulate one training step of the model whose `config.json` fields are `fields`.

    `layers="extrapolate"` simulates 1 and 2 decoder blocks (2 and 3 when sharded) and
    extrapolates to the model's `num_hidden_layers`; `"all"` (or a number) simulates that many
    blocks as they are."""
    _refuse_unsupported(setup)
    if _sharded(setup) and _has_process_group():
        # The fake group must be this process's default group: simulate in a fresh process.
        return _in_subprocess(fields, setup, layers)
    start = time.monotonic()
    num_layers = int(hf_config(fields).num_hidden_layers)
    # Under FSDP2 the first and last blocks differ from the others (no block to prefetch
    # after the last, no reduce-scatter pending before the first): a sharded model is
    # simulated with 3 and 4 blocks, so that both runs have a middle block.
    low = 3 if _sharded(setup) else 1
    if layers == "extrapolate" and num_layers > low + 1:
        one = _run_once(setup, fields, low)
        two = _run_once(setup, fields, low + 1)

        def affine(a: int, b: int) -> int:
            return a + (num_layers - low) * (b - a)

        phases = {
            name: {
                key: affine(one.phases[name][key], two.phases[name][key])
                for key in MEASURED_COMPONENTS
            }
            for name in one.phases
            if name in two.phases
        }
        return _finish(
            phases,
            total=affine(one.total_params, two.total_params),
            trainable=affine(one.trainable_params, two.trainable_params),
            layers=num_layers,
            simulated=(low, low + 1),
            seconds=time.monotonic() - start,
            method=(
                f"{low} and {low + 1} of {num_layers} decoder blocks simulated, "
                "extrapolated linearly"
            ),
        )
    count = num_layers if layers in ("all", "extrapolate") else int(layers)
    run = _run_once(setup, fields, count)
    return _finish(
        run.phases,
        total=run.total_params,
        trainable=run.trainable_params,
        layers=count,
        simulated=(count,),
        seconds=time.monotonic() - start,
        method=f"all {count} decoder blocks simulated",
    )
