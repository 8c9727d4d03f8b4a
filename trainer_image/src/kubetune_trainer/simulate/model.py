"""The model a simulated step runs: built from its config on the meta device in the order
`modeling.build_model` uses (LoRA adapters, activation checkpointing, the chunked loss), then
given fake CPU storages, tied weights kept tied.

It is built on the meta device and then given fake storages, not built under the fake mode
directly: PyTorch cannot swap a fake parameter that the fake mode's converter still
references, which is what `nn.Module.to` (called by PEFT while it adds adapters) does.

QLoRA: transformers' bitsandbytes quantizer swaps in `Linear4bit` layers as `from_pretrained`
does, and each weight is quantized by bitsandbytes' own `quantize_4bit` on a fake tensor; the
8-bit quantization tables bitsandbytes builds from data on first use are made fake for the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from kubetune_trainer.contract import TrainerConfig
from kubetune_trainer.loss import ChunkedLoss
from kubetune_trainer.modeling import (
    _add_lora,
    _bnb_config,
    _param_dtype,
    prepare_for_training,
)
from kubetune_trainer.simulate.spec import _DEVICE


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
