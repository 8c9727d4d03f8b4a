"""MoE models are built as the estimator sizes them: for a tiny random-init model of every
MoE family the estimator knows, the trainer's own build (`modeling.build_model`) has exactly
the trainable parameters the estimator counts for LoRA `all-linear`, its adapters sit where
the estimator puts them (experts and router, or not), and QLoRA stores in 4 bits exactly the
weights the estimator counts as quantized (the stacked experts stay in the compute dtype)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("peft", reason="trainer tests need the trainer extra")

import torch

from kubetune.planning.arch import ModelArch, arch_from_hf_config
from kubetune.planning.estimator import (
    EstimatorError,
    TrainingSetup,
    quantized_params,
    trainable_params,
)
from kubetune_trainer.contract import TrainerConfig
from kubetune_trainer.distributed import DistEnv
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.modeling import BuiltModel, build_model
from support.trainer import trainer_config

pytestmark = pytest.mark.trainer

COMMON = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
}
RANK = 4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def moe_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    family = request.param
    config = AutoConfig.for_model(family, **COMMON, **FAMILIES[family])
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp(family)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    return out


def _arch(path: Path) -> ModelArch:
    # config.json as the pinned transformers writes it (Qwen3-MoE: num_local_experts).
    config = json.loads((path / "config.json").read_text())
    return arch_from_hf_config(config, path.name, source=str(path))


def _build(tmp: Path, model: Path, method: str, dropout: float = 0.0) -> BuiltModel:
    cfg = TrainerConfig.model_validate(
        trainer_config(
            tmp,
            model,
            tmp / "unused.jsonl",
            method,
            lora={"rank": RANK, "alpha": 2 * RANK, "dropout": dropout},
            training={"precision": "bf16"},
        )
    )
    return build_model(cfg, DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))


def test_lora_all_linear_trains_what_the_estimator_counts(tmp_path: Path, moe_model: Path) -> None:
    arch = _arch(moe_model)
    built = _build(tmp_path, moe_model, "lora")
    assert built.n_trainable == trainable_params(
        arch, TrainingSetup(method="lora", lora_rank=RANK, lora_dropout=0.0)
    )
    adapted = {
        name.split(".lora_")[0] for name, p in built.model.named_parameters() if p.requires_grad
    }
    on_experts = any(".experts" in name for name in adapted)
    on_router = any(name.endswith("mlp.gate") for name in adapted)
    assert on_experts == on_router == arch.peft_adapts_experts, sorted(adapted)
    assert any(name.endswith("self_attn.q_proj") for name in adapted)


def test_qlora_quantizes_what_the_estimator_counts(tmp_path: Path, moe_model: Path) -> None:
    import bitsandbytes as bnb

    arch = _arch(moe_model)
    built = _build(tmp_path, moe_model, "qlora")
    four_bit = [m for m in built.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    quantized = sum(math.prod(m.weight.quant_state.shape) for m in four_bit)
    assert quantized == quantized_params(arch, TrainingSetup(method="qlora"))
    stacked = [p for n, p in built.model.named_parameters() if p.ndim == 3]
    assert stacked and all(p.dtype == torch.bfloat16 for p in stacked)
    # What the estimator assumed before it knew: every expert in 4 bits.
    linear_experts = quantized_params(arch, TrainingSetup(method="qlora", fused_experts=False))
    router = [
        p for n, p in built.model.named_parameters() if ".mlp.gate." in n and "lora_" not in n
    ]
    assert router
    assert linear_experts - quantized == sum(p.numel() for p in [*stacked, *router])


def test_lora_dropout_is_refused_where_the_experts_get_adapters(
    tmp_path: Path, moe_model: Path
) -> None:
    """The trainer's build refuses LoRA dropout exactly where the estimator (so the planner,
    before any GPU) does: where PEFT adapts the stacked experts."""
    arch = _arch(moe_model)
    setup = TrainingSetup(method="lora", lora_rank=RANK, lora_dropout=0.05)
    if arch.peft_adapts_experts:
        with pytest.raises(EstimatorError, match="dropout"):
            trainable_params(arch, setup)
        with pytest.raises(ConfigError, match="dropout"):
            _build(tmp_path, moe_model, "lora", dropout=0.05)
    else:
        built = _build(tmp_path, moe_model, "lora", dropout=0.05)
        assert built.n_trainable == trainable_params(arch, setup)
