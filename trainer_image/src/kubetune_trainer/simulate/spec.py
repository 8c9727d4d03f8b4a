"""What a simulation takes and gives: the setup, the result, and the setups it refuses.

The setup's field names are the estimator's (`kubetune.planning.estimator.TrainingSetup`), so
`kubetune estimate --simulate` passes its own setup on; the result's breakdown keys are the
estimator's too. `trainer_config` renders the `TrainerConfig` the operator would, so that the
simulated step builds the model and optimizer from the trainer's own configuration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

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
"""Where every fake tensor lives (the tracker reads this device's snapshot)."""


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
