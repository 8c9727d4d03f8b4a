"""Model build in a fixed order.

    load (meta on ranks > 0 when sharding) → 4-bit quantization (QLoRA) → LoRA adapters
    → activation checkpointing → `fully_shard` per decoder block, then the root (FSDP2)
    → weights broadcast from rank 0 into the shards

Why this order: adapters must exist before sharding so FSDP2 manages their parameters with the
block they belong to; checkpointing wraps the block's forward, which FSDP2's hooks then wrap, so
a recomputed block re-gathers its parameters; and only rank 0 reads the checkpoint from disk,
so host memory holds one copy of the model per node instead of one per GPU.

QLoRA is sharded with FSDP2 too: bitsandbytes stores NF4 weights in a bf16 `quant_storage`
(so every parameter of a block has one dtype) and its Linear4bit re-attaches the quantization
state after FSDP2 swaps the parameter object, which is the combination bitsandbytes documents
for FSDP. Its weights cannot be built on the meta device (quantization happens while loading),
so every rank loads the 4-bit model itself; at a quarter of bf16 that is the cheap case.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from kubetune_trainer import attention
from kubetune_trainer.bnb import import_bitsandbytes
from kubetune_trainer.contract import TrainerConfig, peak_bf16_tflops
from kubetune_trainer.distributed import DistEnv, barrier
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.hub import hub_call
from kubetune_trainer.loss import ChunkedLoss, ChunkedLossUnsupported, OffloadActivations

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class BuiltModel:
    model: nn.Module  # what forward/backward/optimizer see (may be DDP- or FSDP-wrapped)
    core: nn.Module  # the PeftModel or HF model underneath any DDP wrapper
    wrap: str  # "fsdp", "ddp" or "none"
    adapter_only: bool  # LoRA/QLoRA: only adapters are trained and checkpointed
    n_params: int  # dense-equivalent parameter count (4-bit counted unpacked)
    n_trainable: int
    flops_per_token: float  # model FLOPs per trained token (forward + backward)
    autocast_dtype: torch.dtype | None  # set for amp-bf16 without FSDP's mixed precision
    hf_config: Any
    chunked_loss: ChunkedLoss | None = None  # training.chunked_cross_entropy
    offload: OffloadActivations | None = None  # training.activation_offloading
    varlen_attention: bool = False  # packed rows by document bounds (kubetune_trainer.attention)


def model_source(cfg: TrainerConfig) -> tuple[str, dict[str, Any]]:
    """The `from_pretrained` name and keyword arguments for the configured model."""
    ref = cfg.model
    if ref.kind == "path":
        path = Path(ref.source)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"model.source {ref.source}: no config.json there; to fix: point it at a "
                "Hugging Face model folder (config.json, *.safetensors, tokenizer files)"
            )
        return str(path), {}
    if ref.kind == "hub":
        kwargs: dict[str, Any] = {}
        if ref.revision:
            kwargs["revision"] = ref.revision
        if ref.token_env:
            token = os.environ.get(ref.token_env)
            if not token:
                raise ConfigError(f"model.token_env {ref.token_env} is not set or empty")
            kwargs["token"] = token
        return ref.source, kwargs
    raise ConfigError(
        f"model.source {ref.source}: s3 models are not read by the trainer; to fix: copy the "
        "model to a volume (pvc://) or use a hub id"
    )


def prefetch_hub_model(cfg: TrainerConfig, env: DistEnv) -> None:
    """Rank 0 downloads a hub model into the shared cache ($HF_HOME) before anyone loads it,
    so N ranks do not race N downloads; the others wait at the barrier, then read the cache."""
    if cfg.model.kind != "hub":
        return
    if env.is_main:
        import huggingface_hub

        src, kwargs = model_source(cfg)
        hub: Any = huggingface_hub
        from_hub(
            cfg,
            "model",
            lambda: hub.snapshot_download(
                src,
                revision=kwargs.get("revision"),
                token=kwargs.get("token"),
                allow_patterns=[
                    "*.json",
                    "*.safetensors",
                    "*.model",
                    "*.txt",
                    "*.jinja",
                    "*.tiktoken",
                ],
            ),
        )
    barrier()


def from_hub(cfg: TrainerConfig, what: str, fn: Callable[[], T]) -> T:
    """`fn()` that reads the configured model: a hub model's calls are retried on transient
    hub errors, and refusals and missing repositories become config errors (`hub.hub_call`)."""
    ref = cfg.model
    if ref.kind != "hub":
        return fn()
    return hub_call(
        fn,
        what=what,
        uri=ref.source,
        field="model.uri",
        revision=ref.revision,
        token_env=ref.token_env,
    )


def load_tokenizer(cfg: TrainerConfig) -> Any:
    from transformers import AutoTokenizer

    src, kwargs = model_source(cfg)
    try:
        tok = from_hub(
            cfg, "tokenizer of model", lambda: AutoTokenizer.from_pretrained(src, **kwargs)
        )
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.source {src}: cannot load the tokenizer: {e}") from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _param_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


def _bnb_config(cfg: TrainerConfig) -> Any:
    import transformers

    import_bitsandbytes()

    BitsAndBytesConfig: Any = transformers.BitsAndBytesConfig

    compute = torch.float32 if cfg.training.precision == "fp32" else torch.bfloat16
    double_quant = cfg.lora.double_quant if cfg.lora else True
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=compute,
        # One dtype for packed 4-bit weights and the rest, so FSDP2 can flatten a block.
        bnb_4bit_quant_storage=compute,
    )


def _load(cfg: TrainerConfig, env: DistEnv, *, on_meta: bool) -> Any:
    import transformers

    auto_config: Any = transformers.AutoConfig
    auto_model: Any = transformers.AutoModelForCausalLM

    src, kwargs = model_source(cfg)
    dtype = _param_dtype(cfg.training.precision)

    def load() -> Any:
        if on_meta:
            config = auto_config.from_pretrained(src, **kwargs)
            with torch.device("meta"):
                return auto_model.from_config(config, dtype=dtype)
        if cfg.method == "qlora":
            qcfg = _bnb_config(cfg)
            return auto_model.from_pretrained(
                src,
                quantization_config=qcfg,
                dtype=qcfg.bnb_4bit_compute_dtype,
                device_map={"": env.device},
                **kwargs,
            )
        return auto_model.from_pretrained(src, dtype=dtype, **kwargs)

    try:
        return from_hub(cfg, "model", load)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.source {src}: cannot load the model: {e}") from e


def _add_lora(model: nn.Module, cfg: TrainerConfig) -> Any:
    import_bitsandbytes()  # peft imports it where it is installed
    import peft

    peft_any: Any = peft

    lora = cfg.lora
    if lora is None:
        raise ConfigError(f"method {cfg.method} needs a `lora` section")
    targets: str | list[str] = (
        "all-linear" if lora.target_modules == ["all-linear"] else list(lora.target_modules)
    )
    peft_cfg = peft_any.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return peft_any.get_peft_model(model, peft_cfg)
    except ValueError as e:
        raise ConfigError(f"lora.target_modules {lora.target_modules}: {e}") from e


def _hf_model(model: nn.Module) -> Any:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _enable_activation_checkpointing(model: nn.Module) -> None:
    hf = _hf_model(model)
    kwargs = {"use_reentrant": False}
    if hasattr(hf, "activation_checkpointing_enable"):
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers < 5
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def prepare_for_training(model: nn.Module, cfg: TrainerConfig) -> ChunkedLoss | None:
    """After the adapters, before sharding: activation checkpointing, the chunked loss (when
    configured; returned), training mode."""
    if cfg.training.gradient_checkpointing:
        _enable_activation_checkpointing(model)
    chunked: ChunkedLoss | None = None
    fused = cfg.training.fused_cross_entropy
    if cfg.training.chunked_cross_entropy or fused:
        field = "fused_cross_entropy" if fused else "chunked_cross_entropy"
        try:
            chunked = ChunkedLoss.install(model, fused=fused)
        except ChunkedLossUnsupported as e:
            raise ConfigError(f"training.{field}: {e}; to fix: turn it off for this model") from e
    model.train()
    return chunked


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: the classes HF marks as not-to-be-split."""
    names = set(getattr(_hf_model(model), "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def _count_params(model: nn.Module) -> tuple[int, int]:
    counter = getattr(model, "get_nb_trainable_parameters", None)
    if callable(counter):  # PEFT counts packed 4-bit weights at their real size
        trainable, total = counter()
        return int(total), int(trainable)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable


def _head_is_tied(model: nn.Module) -> bool:
    """Whether the output projection shares the input embedding's weight."""
    get_base = getattr(model, "get_base_model", None)
    hf: Any = get_base() if callable(get_base) else model
    try:
        head, embed = hf.get_output_embeddings(), hf.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return False
    weight = getattr(head, "weight", None)
    return weight is not None and weight is getattr(embed, "weight", None)


def _flops_per_token(
    config: Any, n_params: int, seq_len: int, full: bool, tied: bool = False
) -> float:
    """6N (+ attention) for full fine-tuning; 4N for adapters (no weight grads of the base).

    N counts the weights that take part in a matmul: the input embedding is a lookup, so its
    table is left out, except where the output projection shares it (`tied`): `n_params`
    counts a shared table once, and the output projection multiplies by it."""
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    dense = n_params if tied else max(n_params - vocab * hidden, 1)
    attention = 2 * layers * hidden * seq_len  # QK^T and AV, forward, per token
    if full:
        return 6 * dense + 3 * attention
    return 4 * dense + 2 * attention


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of one accelerator, or None on CPU (no MFU there)."""
    override = os.environ.get("KUBETUNE_PEAK_TFLOPS")
    if override:
        return float(override) * 1e12
    if device.type != "cuda":
        return None
    tflops = peak_bf16_tflops(torch.cuda.get_device_name(device))
    return None if tflops is None else tflops * 1e12


def build_model(cfg: TrainerConfig, env: DistEnv) -> BuiltModel:
    """Build the model for this rank, in the order the module docstring gives."""
    method = cfg.method
    adapters = method in ("lora", "qlora")
    if adapters and cfg.lora is None:
        raise ConfigError(f"method {method} needs a `lora` section")
    sharded = env.world_size > 1 and cfg.parallel.sharding != "none"
    # Ranks > 0 of a sharded, non-quantized run build on meta and receive weights from rank 0.
    meta = sharded and method != "qlora" and not env.is_main

    model: Any = _load(cfg, env, on_meta=meta)
    hf_config = model.config
    hf_config.use_cache = False
    if adapters:
        model = _add_lora(model, cfg)
    n_params, n_trainable = _count_params(model)
    tied_head = _head_is_tied(model)
    chunked = prepare_for_training(model, cfg)
    packed = cfg.training.packing and cfg.training.objective == "sft"
    varlen = attention.use_varlen(cfg.training.packed_attention, packed, hf_config, env.device)
    if varlen:
        attention.install(model)
    elif packed and cfg.training.packed_attention == "varlen":
        log.warning(
            "training.packed_attention varlen: %s; packed rows use the mask",
            attention.supports(hf_config),
        )

    autocast: torch.dtype | None = None
    wrap = "none"
    if sharded:
        full_sd = _full_state_on_rank0(model, env) if method != "qlora" else None
        blocks = shard_model(model, cfg, _mesh(env))
        if full_sd is not None:
            _load_from_rank0(model, full_sd, env)
        wrap = "fsdp"
        log.info("FSDP2: %d blocks + root sharded over %d ranks", len(blocks), env.world_size)
    else:
        if method != "qlora":
            model.to(env.device)
        if cfg.training.precision == "amp-bf16":
            autocast = torch.bfloat16
        if env.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [env.device.index] if env.device.type == "cuda" else None
            model = DDP(model, device_ids=ids)
            wrap = "ddp"
    core = model.module if wrap == "ddp" else model
    return BuiltModel(
        model=model,
        core=core,
        wrap=wrap,
        adapter_only=adapters,
        n_params=n_params,
        n_trainable=n_trainable,
        flops_per_token=_flops_per_token(
            hf_config, n_params, cfg.training.sequence_length, full=not adapters, tied=tied_head
        ),
        autocast_dtype=autocast,
        hf_config=hf_config,
        chunked_loss=chunked,
        offload=OffloadActivations() if cfg.training.activation_offloading else None,
        varlen_attention=varlen,
    )


def shard_model(model: nn.Module, cfg: TrainerConfig, mesh: Any) -> list[nn.Module]:
    """FSDP2 over `mesh`: `fully_shard` per decoder block, then the root; parameters gathered
    in bf16 (fp32 with `precision: fp32`), gradients reduced in fp32, and with `full` sharding
    each block's gathered parameters freed after its forward. Returns the sharded blocks."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(
        param_dtype=None if cfg.training.precision == "fp32" else torch.bfloat16,
        reduce_dtype=torch.float32,
    )
    reshard = cfg.parallel.sharding == "full"
    blocks = decoder_blocks(model)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    return blocks


def _mesh(env: DistEnv) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(env.device.type, (env.world_size,))


def _full_state_on_rank0(model: nn.Module, env: DistEnv) -> dict[str, Any] | None:
    """Rank 0's full weights, taken before sharding replaces them with its shard."""
    return dict(model.state_dict()) if env.is_main else {}


def _load_from_rank0(model: nn.Module, full_sd: dict[str, Any], env: DistEnv) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    with torch.no_grad():
        if not env.is_main:
            model.to_empty(device=env.device)
        set_model_state_dict(
            model,
            full_sd,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        # Non-persistent buffers (rotary inv_freq) are in no state dict: copy them from rank 0.
        for buf in model.buffers():
            dist.broadcast(buf, src=0)
