"""Unit tests for the VRAM estimator: hand-computed cases and the calibration gate."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kubetune.planning.arch import ModelArch
from kubetune.planning.estimator import (
    BREAKDOWN_COMPONENTS,
    GIB,
    NF4_ABSMAX_BYTES_PER_PARAM,
    NF4_DQ_ABSMAX_BYTES_PER_PARAM,
    TRAINER_QLORA_MATMUL_KEEPS_INPUT,
    EstimatorError,
    TrainingSetup,
    VramEstimate,
    comparable_bytes,
    estimate_vram,
    fused_ce_chunk_tokens,
    lora_target_names,
    offloaded_bytes,
    resolve_lora_targets,
    trainable_params,
    trainer_attention,
)
from kubetune.sources import load_arch
from kubetune_trainer.contract import loss_chunk_tokens
from support.scripts import load_script

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

TINY = ModelArch(
    name="tiny",
    model_type="llama",
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=4,
    head_dim=16,
    intermediate_size=128,
    vocab_size=100,
    tie_embeddings=False,
)

TINY_MOE = ModelArch(
    name="tiny-moe",
    model_type="mixtral",
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=100,
    tie_embeddings=False,
    num_experts=8,
    experts_per_token=2,
)

SINGLE = TrainingSetup(gpus=1, sharding="none")


# Two micro-batches per optimizer step: the gradients exist whole at every moment of the step
# (one GPU), whichever moment holds the peak.
WHOLE_GRADIENTS = replace(SINGLE, grad_accumulation=2)


def _static(est: VramEstimate) -> int:
    b = est.breakdown
    return b["weights"] + b["gradients"] + b["optimizer_states"]


# --------------------------------------------------------------------------- parameter counts


def test_tiny_arch_param_count_by_hand() -> None:
    h, i, v, layers = 64, 128, 100, 2
    per_layer = 4 * h * h + 3 * h * i + 2 * h  # q,k,v,o + gate,up,down + two RMSNorms
    expected = v * h + layers * per_layer + h + v * h  # embeddings, blocks, final norm, lm_head
    assert TINY.total_params == expected


def test_lora_trainable_params_llama2_7b_r8_qv_matches_peft() -> None:
    # PEFT prints 4,194,304 trainable parameters for r=8 on q_proj,v_proj of Llama-2-7B:
    # 32 layers x 2 modules x 8 x (4096 + 4096).
    setup = TrainingSetup(method="lora", lora_rank=8, lora_targets=("q_proj", "v_proj"))
    assert trainable_params(load_arch("meta-llama/Llama-2-7b-hf"), setup) == 4_194_304


def test_lora_trainable_params_llama31_8b_gqa() -> None:
    arch = load_arch("meta-llama/Llama-3.1-8B")
    # v_proj is 4096 -> 1024 (8 KV heads): 32 x r x ((4096 + 4096) + (4096 + 1024))
    r8 = TrainingSetup(method="lora", lora_rank=8, lora_targets=("q_proj", "v_proj"))
    assert trainable_params(arch, r8) == 32 * 8 * (8192 + 5120) == 3_407_872
    assert trainable_params(arch, replace(r8, lora_rank=16)) == 6_815_744


def test_all_linear_excludes_lm_head_but_explicit_lm_head_is_allowed() -> None:
    all_linear = TrainingSetup(method="lora", lora_rank=4, lora_targets=("all-linear",))
    names = {layer.name for layer in resolve_lora_targets(TINY, all_linear.lora_targets)}
    assert "lm_head" not in names
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    h, i, layers, r = 64, 128, 2, 4
    block = layers * r * (4 * (h + h) + 2 * (h + i) + (i + h))
    assert trainable_params(TINY, all_linear) == block
    with_head = replace(all_linear, lora_targets=("all-linear", "lm_head"))
    assert trainable_params(TINY, with_head) == block + r * (h + 100)


def test_full_method_trains_every_parameter() -> None:
    assert trainable_params(TINY, TrainingSetup(method="full")) == TINY.total_params


# --------------------------------------------------------------------------- static state


def test_full_amp_bf16_adamw_is_16_bytes_per_param() -> None:
    setup = replace(WHOLE_GRADIENTS, method="full", precision="amp-bf16", optimizer="adamw")
    est = estimate_vram(TINY, setup)
    # fp32 master weights (4) + fp32 grads (4) + fp32 exp_avg and exp_avg_sq (8)
    assert _static(est) == 16 * TINY.total_params


def test_full_pure_bf16_adamw_is_8_bytes_per_param() -> None:
    setup = replace(WHOLE_GRADIENTS, method="full", precision="bf16", optimizer="adamw")
    est = estimate_vram(TINY, setup)
    # bf16 weights (2) + bf16 grads (2) + bf16 states (4)
    assert _static(est) == 8 * TINY.total_params
    assert est.breakdown["autocast_weight_copies"] == 0


def test_full_fp32_and_8bit_optimizer_states() -> None:
    fp32 = estimate_vram(TINY, replace(SINGLE, method="full", precision="fp32"))
    assert fp32.breakdown["optimizer_states"] == 8 * TINY.total_params
    eight = estimate_vram(
        TINY, replace(SINGLE, method="full", precision="amp-bf16", optimizer="adamw-8bit")
    )
    per_param = eight.breakdown["optimizer_states"] / TINY.total_params
    # Two uint8 moments and an fp32 absmax per 256 values for each (bitsandbytes' blocks).
    assert per_param == pytest.approx(2 + 2 * 4 / 256)


def test_amp_single_gpu_keeps_bf16_copies_of_linear_weights() -> None:
    est = estimate_vram(TINY, replace(SINGLE, method="full", precision="amp-bf16"))
    linear_weights = sum(
        lay.in_features * lay.out_features * lay.count for lay in TINY.linear_layers()
    )
    assert est.breakdown["autocast_weight_copies"] == 2 * linear_weights


def test_lora_base_follows_precision_unless_overridden() -> None:
    setup = replace(SINGLE, method="lora", grad_ckpt=True)
    assert estimate_vram(TINY, setup).breakdown["weights"] == 2 * TINY.total_params
    amp = estimate_vram(TINY, replace(setup, precision="amp-bf16"))
    assert amp.breakdown["weights"] == 4 * TINY.total_params
    # autocast casts the frozen fp32 weights; with checkpointing one layer's casts are kept
    per_layer = 4 * 64 * 64 + 3 * 64 * 128
    assert amp.breakdown["autocast_weight_copies"] == 2 * (per_layer + 64 * 100)
    bf16_base = estimate_vram(TINY, replace(setup, precision="amp-bf16", lora_base_dtype="bf16"))
    assert bf16_base.breakdown["weights"] == 2 * TINY.total_params
    assert bf16_base.breakdown["autocast_weight_copies"] == 0


def test_qlora_weight_bytes_double_quant_by_hand() -> None:
    setup = replace(
        SINGLE, method="qlora", qlora_double_quant=True, qlora_upcast_non_quantized=True
    )
    est = estimate_vram(TINY, setup)
    h, i, layers = 64, 128, 2
    quantized = layers * (4 * h * h + 3 * h * i)  # every block linear weight
    rest = TINY.total_params - quantized  # embeddings, lm_head, norms: fp32 after upcast
    dq = 0.5 + 1 / 64 + 4 / (64 * 256)  # NF4 + 8-bit absmax + fp32 second-level constants
    assert dq * 8 == pytest.approx(4.127, abs=1e-3)  # ~0.127 bit/param of constants
    assert est.breakdown["weights"] == round(quantized * dq + rest * 4)


def test_qlora_weight_bytes_without_double_quant_or_upcast() -> None:
    setup = replace(
        SINGLE, method="qlora", qlora_double_quant=False, qlora_upcast_non_quantized=False
    )
    est = estimate_vram(TINY, setup)
    quantized = 2 * (4 * 64 * 64 + 3 * 64 * 128)
    rest = TINY.total_params - quantized
    assert est.breakdown["weights"] == round(quantized * (0.5 + 4 / 64) + rest * 2)
    assert NF4_ABSMAX_BYTES_PER_PARAM == 4 / 64
    assert NF4_DQ_ABSMAX_BYTES_PER_PARAM < NF4_ABSMAX_BYTES_PER_PARAM


def test_qlora_7b_is_far_below_lora() -> None:
    arch = load_arch("meta-llama/Llama-2-7b-hf")
    lora = estimate_vram(arch, replace(SINGLE, method="lora"))
    qlora = estimate_vram(arch, replace(SINGLE, method="qlora"))
    assert lora.breakdown["weights"] == 2 * arch.total_params
    assert qlora.breakdown["weights"] < 0.4 * lora.breakdown["weights"]
    assert qlora.breakdown["dequant_workspace"] > 0


def test_sharded_qlora_keeps_the_whole_quantization_state_on_every_rank() -> None:
    """FSDP2 shards the packed 4-bit weights; their absmax is the layer's, whole on every
    rank (as the simulated sharded step shows)."""
    arch = load_arch("meta-llama/Llama-3.1-8B")
    one = estimate_vram(arch, replace(SINGLE, method="qlora", qlora_double_quant=False))
    setup = replace(SINGLE, method="qlora", qlora_double_quant=False, gpus=8, sharding="full")
    eight = estimate_vram(arch, setup)
    quantized = sum(
        layer.in_features * layer.out_features * layer.count
        for layer in arch.linear_layers()
        if layer.name != "lm_head"
    )
    state = quantized * NF4_ABSMAX_BYTES_PER_PARAM
    assert eight.breakdown["weights"] == pytest.approx(
        one.breakdown["weights"] / 8 + state * 7 / 8, rel=1e-3
    )


def test_the_trainers_qlora_holds_one_dequantized_copy_while_a_block_runs() -> None:
    """The trainer's bitsandbytes (the planner's setting): one copy of the largest 4-bit weight,
    and none when the step's peak is where only the unquantized root works; the published
    setups (older bitsandbytes, other trainers) keep two at every moment."""
    arch = load_arch("meta-llama/Llama-3.1-8B")
    setup = replace(
        SINGLE, method="qlora", qlora_matmul_keeps_input=TRAINER_QLORA_MATMUL_KEEPS_INPUT
    )
    largest = 4096 * 14336 * 2  # gate_proj / up_proj in bf16
    assert estimate_vram(arch, setup).breakdown["dequant_workspace"] == largest
    published = estimate_vram(arch, replace(setup, qlora_matmul_keeps_input=True))
    assert published.breakdown["dequant_workspace"] == 2 * largest
    # Phi-3-mini on 8 GPUs, 4 x 512 tokens: the peak is the root's all-gather for the output
    # projection's backward (unquantized), where no 4-bit weight is dequantized.
    phi3 = load_arch("microsoft/Phi-3-mini-4k-instruct")
    sharded = replace(setup, gpus=8, sharding="full", micro_batch=4, seq_len=512)
    assert estimate_vram(phi3, sharded).breakdown["dequant_workspace"] == 0


def test_lora_adapters_fp32_by_default_and_bf16_on_request() -> None:
    setup = replace(WHOLE_GRADIENTS, method="lora", lora_rank=8)
    fp32 = estimate_vram(TINY, setup)
    n = fp32.trainable_params
    assert fp32.breakdown["lora_adapters"] == 4 * n
    assert fp32.breakdown["gradients"] == 4 * n
    assert fp32.breakdown["optimizer_states"] == 8 * n
    bf16 = estimate_vram(TINY, replace(setup, adapter_fp32=False))
    assert bf16.breakdown["lora_adapters"] == 2 * n
    assert bf16.breakdown["optimizer_states"] == 4 * n


# --------------------------------------------------------------------------- activations


def test_fp32_activations_are_twice_bf16() -> None:
    # What each layer saves for backward (the part activation offloading moves).
    base = replace(SINGLE, method="full", micro_batch=2, seq_len=64, grad_ckpt=False)
    base = replace(base, activation_offload=True)
    bf16 = offloaded_bytes(TINY, replace(base, precision="bf16"))
    fp32 = offloaded_bytes(TINY, replace(base, precision="fp32"))
    assert bf16 > 0
    assert fp32 == 2 * bf16


def test_the_peak_is_the_largest_moment_of_the_step() -> None:
    """Full fine-tuning of a small model at a short sequence: the gradients of the tied
    embedding at the end of backward outweigh the activations and logits of the start."""
    arch = load_arch("meta-llama/Llama-3.2-1B")
    assert arch.tie_embeddings
    setup = replace(SINGLE, method="full", micro_batch=1, seq_len=512, grad_ckpt=True)
    est = estimate_vram(arch, setup)
    table = arch.vocab_size * arch.hidden_size * 2
    # the output projection's gradient, the embedding's and their sum
    assert est.breakdown["activations"] == 3 * table
    assert est.breakdown["logits"] == 0
    assert est.breakdown["gradients"] == arch.total_params * 2
    # a long sequence: the start of backward (activations and logits) is the peak
    long = estimate_vram(arch, replace(setup, micro_batch=4, seq_len=8192))
    assert long.breakdown["logits"] == 4 * 8192 * arch.vocab_size * 12
    assert long.breakdown["activations"] < 3 * table * 4


def test_without_accumulation_no_gradient_exists_at_the_loss() -> None:
    """One micro-batch per optimizer step: the trainer freed the gradients after the last
    step, so the loss (the peak at a long sequence) has none; with four, the earlier
    micro-batches' gradients are there, full fine-tuning's and LoRA's alike."""
    arch = load_arch("meta-llama/Llama-3.2-1B")
    full = replace(SINGLE, method="full", micro_batch=4, seq_len=8192, grad_ckpt=True)
    one = estimate_vram(arch, full)
    four = estimate_vram(arch, replace(full, grad_accumulation=4))
    logits = 4 * 8192 * arch.vocab_size * 12
    assert one.breakdown["logits"] == four.breakdown["logits"] == logits
    assert one.breakdown["gradients"] == 0
    assert four.breakdown["gradients"] == arch.total_params * 2  # bf16, as param.grad
    assert one.per_gpu_bytes < four.per_gpu_bytes

    lora = replace(full, method="lora", lora_dropout=0.0)
    one = estimate_vram(arch, lora)
    four = estimate_vram(arch, replace(lora, grad_accumulation=4))
    assert one.breakdown["gradients"] == 0
    assert four.breakdown["gradients"] == four.trainable_params * 4  # fp32 adapters
    assert four.per_gpu_bytes - one.per_gpu_bytes >= four.trainable_params * 4


def test_without_accumulation_the_end_of_backward_holds_every_gradient() -> None:
    """A short sequence peaks at the end of backward, where this micro-batch's gradients all
    exist: accumulation changes nothing on one GPU."""
    arch = load_arch("meta-llama/Llama-3.2-1B")
    setup = replace(SINGLE, method="full", micro_batch=1, seq_len=512, grad_ckpt=True)
    one = estimate_vram(arch, setup)
    four = estimate_vram(arch, replace(setup, grad_accumulation=4))
    assert one.breakdown["gradients"] == four.breakdown["gradients"] == arch.total_params * 2
    assert one.per_gpu_bytes == four.per_gpu_bytes


def test_fsdp_accumulates_unsharded_fp32_gradients() -> None:
    """FSDP2 without gradient sync keeps each parameter's whole gradient in the reduce dtype
    (fp32) until the last micro-batch reduce-scatters it: not divided by the GPU count."""
    arch = load_arch("meta-llama/Llama-3.2-1B")
    full = TrainingSetup(
        method="full", gpus=8, sharding="full", micro_batch=4, seq_len=8192, lora_dropout=0.0
    )
    one = estimate_vram(arch, full)
    four = estimate_vram(arch, replace(full, grad_accumulation=4))
    assert four.breakdown["gradients"] == arch.total_params * 4
    # without accumulation only the sharded bf16 gradients, from backward on
    assert one.breakdown["gradients"] == 0
    assert four.per_gpu_bytes - one.per_gpu_bytes > arch.total_params * 3

    lora = replace(full, method="lora", gpus=2)
    one = estimate_vram(arch, lora)
    four = estimate_vram(arch, replace(lora, grad_accumulation=4))
    assert one.breakdown["gradients"] == 0
    assert four.breakdown["gradients"] == four.trainable_params * 4


def test_a_blocks_backward_peaks_at_the_first_or_the_last_block() -> None:
    """Without checkpointing, backward frees each block's saved activations as it leaves its
    gradients: the first block backward runs has every saved activation and one block's
    gradients (and the untied output projection's), the last one block's activations and
    every gradient but the embedding's.  Neither holds both whole.  (A small vocabulary, so
    that the chunked loss's own moments, tested below, stay below the blocks'.)"""
    arch = replace(load_arch("mistralai/Mistral-7B-v0.3"), vocab_size=1024)
    assert not arch.tie_embeddings
    setup = replace(
        SINGLE, method="full", micro_batch=2, seq_len=2048, grad_ckpt=False, chunked_ce=True
    )
    long = estimate_vram(arch, setup)
    whole = estimate_vram(arch, replace(setup, grad_accumulation=2))
    per_block = (arch.total_params - 2 * arch.embedding_params - arch.hidden_size) / 32
    # a long micro-batch: the first block, with every saved activation
    assert long.breakdown["activations"] >= whole.breakdown["activations"]  # the loss's and more
    first_block = per_block + arch.lm_head_params
    assert long.breakdown["gradients"] == pytest.approx(first_block * 2, rel=1e-6)
    # a short one: the last block (every gradient but the embedding's) or the end of backward
    short = estimate_vram(arch, replace(setup, micro_batch=1, seq_len=512))
    assert short.breakdown["gradients"] >= (arch.total_params - arch.embedding_params) * 2
    assert short.breakdown["activations"] < whole.breakdown["activations"] / 8
    # what the older rule counted (every saved activation and every gradient) is more
    assert long.per_gpu_bytes < whole.per_gpu_bytes


def test_lora_frozen_linears_drop_their_inputs() -> None:
    """A frozen base linear keeps no input for backward: with fp32 adapters (which keep their
    own fp32 copy) the norm outputs, the output projection's input and the MLP's down input
    are not kept; bf16 adapters without dropout keep the input itself. QLoRA's 4-bit matmul
    keeps it whatever the adapters where bitsandbytes does (the default, older releases) and
    drops it as LoRA's frozen linears do in the trainer's."""
    arch = load_arch("meta-llama/Llama-3.2-1B")
    setup = replace(WHOLE_GRADIENTS, method="lora", lora_dropout=0.0, grad_ckpt=False, seq_len=2048)
    fp32 = estimate_vram(arch, setup).breakdown["activations"]
    bf16 = estimate_vram(arch, replace(setup, adapter_fp32=False)).breakdown["activations"]
    h, q, i = arch.hidden_size, arch.num_heads * arch.head_dim, arch.intermediate_size
    dropped = (2 * h + q + i) * 2 * 2048 * arch.num_layers
    # fp32 adapters keep a 4-byte copy of each adapted input instead: q, k, v, gate and up
    # read h, o_proj q and down_proj i
    inputs = (5 * h + q + i) * 4 * 2048 * arch.num_layers
    lora_a = (
        sum(16 * 4 * layer.count for layer in arch.linear_layers() if layer.name != "lm_head")
        * 2048
    )
    assert fp32 - bf16 == pytest.approx(inputs + lora_a / 2 - dropped, rel=1e-3)
    qlora = estimate_vram(arch, replace(setup, method="qlora")).breakdown["activations"]
    assert qlora - fp32 == pytest.approx(dropped, rel=1e-3)
    trainers = replace(setup, method="qlora", qlora_matmul_keeps_input=False)
    assert estimate_vram(arch, trainers).breakdown["activations"] == fp32
    assert not TRAINER_QLORA_MATMUL_KEEPS_INPUT


def test_only_a_fused_qkv_projection_keeps_its_output() -> None:
    """Phi-3 projects Q, K and V with one matmul whose output stays alive (V is a view of
    it); Llama's separate projections leave nothing of the kind unless a stack fuses them
    (``fused_qkv=True``, LitGPT)."""
    setup = replace(WHOLE_GRADIENTS, method="full", grad_ckpt=False, seq_len=1024)
    for model, fused in (
        ("microsoft/Phi-3-mini-4k-instruct", True),
        ("meta-llama/Llama-3.2-1B", False),
    ):
        arch = load_arch(model)
        default = estimate_vram(arch, setup).breakdown["activations"]
        on = estimate_vram(arch, replace(setup, fused_qkv=True)).breakdown["activations"]
        off = estimate_vram(arch, replace(setup, fused_qkv=False)).breakdown["activations"]
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        assert on - off == pytest.approx((q + kv) * 2 * 1024 * arch.num_layers, rel=1e-6)
        assert default == (on if fused else off)


def test_grad_accumulation_must_be_positive() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(EstimatorError, match=r"grad_accumulation.*To fix"):
            estimate_vram(TINY, replace(SINGLE, grad_accumulation=bad))  # type: ignore[arg-type]


def test_gradient_checkpointing_reduces_activations() -> None:
    arch = load_arch("meta-llama/Llama-3.1-8B")
    setup = replace(SINGLE, method="lora", seq_len=4096)
    with_ckpt = estimate_vram(arch, replace(setup, grad_ckpt=True)).breakdown["activations"]
    without = estimate_vram(arch, replace(setup, grad_ckpt=False)).breakdown["activations"]
    assert with_ckpt < without / 5


def test_checkpointed_activations_keep_each_layer_input() -> None:
    arch = load_arch("meta-llama/Llama-3.1-8B")
    setup = replace(SINGLE, method="lora", seq_len=2048, grad_ckpt=True)
    acts = estimate_vram(arch, setup).breakdown["activations"]
    layer_inputs = arch.num_layers * 2048 * arch.hidden_size * 2
    assert layer_inputs < acts < layer_inputs + 1 * GIB


def test_activations_scale_with_tokens() -> None:
    # With accumulation the gradients are there at every moment, so both peak at the same one.
    setup = replace(SINGLE, method="full", grad_ckpt=False, seq_len=128, grad_accumulation=2)
    one = estimate_vram(TINY, replace(setup, micro_batch=1)).breakdown["activations"]
    four = estimate_vram(TINY, replace(setup, micro_batch=4)).breakdown["activations"]
    assert four == pytest.approx(4 * one, rel=1e-6)


def test_eager_attention_adds_quadratic_scores() -> None:
    arch = load_arch("meta-llama/Llama-2-7b-hf")
    setup = replace(SINGLE, method="lora", seq_len=4096, grad_ckpt=False)
    sdpa = estimate_vram(arch, setup).breakdown["activations"]
    eager = estimate_vram(arch, replace(setup, attention="eager")).breakdown["activations"]
    scores = arch.num_layers * 3 * 2 * arch.num_heads * 4096**2
    assert eager - sdpa == scores


def test_lora_dropout_adds_saved_inputs() -> None:
    setup = replace(SINGLE, method="lora", grad_ckpt=False, adapter_fp32=False)
    no_drop = estimate_vram(TINY, replace(setup, lora_dropout=0.0)).breakdown["activations"]
    drop = estimate_vram(TINY, replace(setup, lora_dropout=0.1)).breakdown["activations"]
    assert drop > no_drop


def test_chunked_cross_entropy_reduces_logits() -> None:
    arch = load_arch("meta-llama/Llama-3.1-8B")
    setup = replace(SINGLE, method="lora", seq_len=8192)
    full = estimate_vram(arch, setup).breakdown["logits"]
    chunked = estimate_vram(arch, replace(setup, chunked_ce=True)).breakdown["logits"]
    assert full == 8192 * arch.vocab_size * 12
    assert chunked < 0.4 * full
    # At the chunks' backward: 4 bytes per entry kept for backward, plus one chunk's two fp32
    # gradients (w.r.t. its log-softmax and its logits), more than its forward's bf16 logits
    # and fp32 copy.
    chunk = loss_chunk_tokens(arch.vocab_size)
    assert chunked == (8192 * 4 + chunk * 8) * arch.vocab_size
    litgpt = estimate_vram(arch, replace(setup, chunked_ce=True, loss_chunk_tokens=128))
    assert litgpt.breakdown["logits"] == (8192 * 4 + 128 * 8) * arch.vocab_size
    short = estimate_vram(arch, replace(setup, seq_len=256, chunked_ce=True))
    # one chunk holds every token: as much as the unchunked loss
    assert short.breakdown["logits"] == 256 * 12 * arch.vocab_size


def test_the_fused_loss_chunk_follows_liger() -> None:
    """Liger's chunk: about tokens x hidden logits entries (its own worked example: 16,384
    tokens, a 32,000 vocabulary and 4,096 hidden give 2,048 tokens)."""
    assert fused_ce_chunk_tokens(4096 * 4, 32_000, 4096) == 2048
    assert fused_ce_chunk_tokens(16_384, 128_256, 2048) == 512  # 16,384 / 63 → 261 → 512
    assert fused_ce_chunk_tokens(100, 128_256, 2048) == 2  # 100 / 63 → 2
    assert fused_ce_chunk_tokens(8, 1000, 4096) == 8  # one chunk, never more than the tokens


@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_fused_loss_keeps_nothing_of_vocabulary_size(method: str) -> None:
    """Plain > chunked > fused, and the fused loss's term at any moment is at most the
    gradients it makes in the forward (hidden states, and the trained output projection's
    table) plus one chunk of compute-dtype logits."""
    arch = load_arch("meta-llama/Llama-3.2-1B")
    setup = replace(SINGLE, method=method, micro_batch=8, seq_len=2048, grad_ckpt=False)
    plain = estimate_vram(arch, setup)
    chunked = estimate_vram(arch, replace(setup, chunked_ce=True))
    fused = estimate_vram(arch, replace(setup, fused_ce=True))
    assert plain.per_gpu_bytes > chunked.per_gpu_bytes > fused.per_gpu_bytes
    tokens = 8 * 2048
    chunk = fused_ce_chunk_tokens(tokens, arch.vocab_size, arch.hidden_size)
    table = arch.embedding_params * 2 if method == "full" else 0
    bound = tokens * arch.hidden_size * 2 + table + chunk * arch.vocab_size * 2
    assert 0 <= fused.breakdown["logits"] <= bound
    # 7.8 GiB of kept log-softmax (4 bytes per entry) is what the chunked loss adds back
    kept = tokens * arch.vocab_size * 4
    assert chunked.per_gpu_bytes - fused.per_gpu_bytes >= 0.9 * kept


def test_the_chunked_and_fused_losses_are_exclusive() -> None:
    with pytest.raises(EstimatorError, match="choose one"):
        estimate_vram(TINY, replace(SINGLE, chunked_ce=True, fused_ce=True))


def test_a_trained_output_projection_sums_its_gradient_over_the_chunks() -> None:
    """Full fine-tuning with the chunked loss: while the chunks run backward, autograd's buffer
    holds the output projection's weight gradient summed so far and the chunk adds its own
    (two tables, as the simulated step shows), with every chunk's log-softmax still kept.
    LoRA leaves the projection frozen: no table."""
    arch = load_arch("meta-llama/Llama-3.2-1B")  # tied: the embedding's table
    setup = replace(SINGLE, method="full", micro_batch=4, seq_len=2048, chunked_ce=True)
    est = estimate_vram(arch, setup)
    table = arch.embedding_params * 2
    chunk = loss_chunk_tokens(arch.vocab_size)
    assert est.breakdown["gradients"] == 0  # before any block's backward
    assert est.breakdown["logits"] == (8192 * 4 + chunk * 8) * arch.vocab_size
    lora = estimate_vram(arch, replace(setup, method="lora"))
    assert est.breakdown["activations"] - lora.breakdown["activations"] >= 2 * table


def test_gemma2_is_sized_with_the_eager_attention_it_trains_with() -> None:
    gemma2 = load_arch("google/gemma-2-2b")
    assert trainer_attention(gemma2) == "eager"
    assert trainer_attention(load_arch("meta-llama/Llama-3.2-1B")) == "sdpa"
    setup = TrainingSetup(method="lora", seq_len=4096, grad_ckpt=False)
    eager = estimate_vram(gemma2, replace(setup, attention="eager")).breakdown["activations"]
    sdpa = estimate_vram(gemma2, setup).breakdown["activations"]
    # kept per layer, bf16: the fp32 softmax output, its bf16 copy and the soft-cap's tanh
    scores = 4 * 2 * gemma2.num_heads * 4096**2 * gemma2.num_layers
    assert eager - sdpa == scores


def test_stacked_expert_updates_are_kept_per_moe_layer() -> None:
    """PEFT forms an expert-sized update per MoE layer and keeps it for backward: every
    layer's without checkpointing, one with it; backward adds the gradient of one stacked
    parameter's update (the fused gate/up projection: two thirds of a layer's experts).
    Gradients whole at every moment (accumulation): the peak is the first block backward
    runs, with every saved activation."""
    mixtral = load_arch("mistralai/Mixtral-8x7B-v0.1")
    setup = TrainingSetup(method="lora", lora_dropout=0.0, seq_len=512, grad_accumulation=2)
    q_only = replace(setup, lora_targets=("q_proj",))
    per_layer = mixtral.expert_params / mixtral.moe_layers * 2
    for ckpt, layers in ((True, 1), (False, mixtral.moe_layers)):
        all_linear = estimate_vram(mixtral, replace(setup, grad_ckpt=ckpt)).breakdown
        attention = estimate_vram(mixtral, replace(q_only, grad_ckpt=ckpt)).breakdown
        grown = all_linear["activations"] - attention["activations"]
        updates = layers * per_layer + per_layer * 2 / 3
        assert grown > updates  # the updates, plus the other adapters' own activations
        assert grown < updates * 1.05


def test_lora_dropout_on_stacked_experts_is_refused_before_any_gpu() -> None:
    """PEFT adapts Mixtral's stacked experts and router only without dropout (the trainer
    would exit with a config error once its pods run); the estimate, and so the plan, says
    so first, naming what to change. Qwen2-MoE's routed experts get no adapter: no conflict."""
    mixtral = load_arch("mistralai/Mixtral-8x7B-v0.1")
    with pytest.raises(EstimatorError, match=r"dropout 0\.05 .* To fix: set the LoRA dropout to 0"):
        estimate_vram(mixtral, TrainingSetup(method="lora", lora_dropout=0.05))
    estimate_vram(mixtral, TrainingSetup(method="lora", lora_dropout=0.0))
    estimate_vram(mixtral, TrainingSetup(method="lora", lora_targets=("q_proj", "v_proj")))
    estimate_vram(load_arch("Qwen/Qwen1.5-MoE-A2.7B"), TrainingSetup(method="lora"))


@pytest.mark.parametrize("grad_ckpt", [True, False])
def test_activation_offloading_keeps_one_layer_on_the_gpu(grad_ckpt: bool) -> None:
    arch = load_arch("meta-llama/Llama-3.1-8B")
    setup = replace(SINGLE, method="lora", seq_len=8192, grad_ckpt=grad_ckpt)
    kept = estimate_vram(arch, setup)
    moved = estimate_vram(arch, replace(setup, activation_offload=True))
    moved_bytes = offloaded_bytes(arch, replace(setup, activation_offload=True))
    assert offloaded_bytes(arch, setup) == 0
    if grad_ckpt:  # one input per layer: (L - 1) of them wait in host memory
        assert moved_bytes == (arch.num_layers - 1) * 8192 * arch.hidden_size * 2
    assert kept.breakdown["activations"] - moved.breakdown["activations"] == pytest.approx(
        moved_bytes, abs=arch.num_layers
    )
    assert kept.breakdown["logits"] == moved.breakdown["logits"]


def test_paged_32bit_adamw_keeps_fp32_states_outside_the_allocator() -> None:
    arch = load_arch("meta-llama/Llama-3.2-1B")
    setup = replace(SINGLE, method="full", precision="bf16")
    plain = estimate_vram(arch, setup)
    paged = estimate_vram(arch, replace(setup, optimizer="paged-adamw-32bit"))
    assert plain.breakdown["optimizer_states"] == arch.total_params * 2 * 2  # bf16 states
    assert paged.breakdown["optimizer_states"] == arch.total_params * 2 * 4  # fp32 states
    assert comparable_bytes(paged, "reserved") == (
        paged.per_gpu_bytes - paged.breakdown["optimizer_states"] - paged.breakdown["cuda_context"]
    )


def test_moe_keeps_all_experts_but_activates_top_k() -> None:
    setup = replace(SINGLE, method="lora", grad_ckpt=False, seq_len=64, lora_dropout=0.0)
    est = estimate_vram(TINY_MOE, setup)
    assert est.breakdown["weights"] == 2 * TINY_MOE.total_params
    top1 = estimate_vram(replace(TINY_MOE, experts_per_token=1), setup)
    assert top1.breakdown["weights"] == est.breakdown["weights"]
    assert top1.breakdown["activations"] < est.breakdown["activations"]


# --------------------------------------------------------------------------- sharding


def test_full_shard_divides_static_state_but_not_activations_or_logits() -> None:
    arch = load_arch("meta-llama/Llama-2-7b-hf")
    base = TrainingSetup(method="full", precision="amp-bf16", seq_len=2048, grad_ckpt=True)
    one = estimate_vram(arch, replace(base, gpus=1, sharding="none"))
    four = estimate_vram(arch, replace(base, gpus=4, sharding="full"))
    for name in ("weights", "optimizer_states"):
        assert four.breakdown[name] == pytest.approx(one.breakdown[name] / 4, abs=1)
    # the gradients at the peak moment: at most a quarter of all of them
    whole = estimate_vram(arch, replace(base, gpus=1, sharding="none", grad_accumulation=2))
    assert 0 < four.breakdown["gradients"] <= whole.breakdown["gradients"] / 4 + 1
    # activations and logits belong to the micro-batch: on top of them, the gathered blocks
    transient = ("activations", "logits", "fsdp_buffers")
    assert sum(four.breakdown[k] for k in transient) > sum(one.breakdown[k] for k in transient)
    assert four.breakdown["fsdp_buffers"] > 0
    assert four.breakdown["nccl_buffers"] > 0
    assert one.breakdown["nccl_buffers"] == 0
    assert four.per_gpu_bytes < one.per_gpu_bytes


def test_grad_op_shards_grads_and_states_but_keeps_params() -> None:
    arch = load_arch("meta-llama/Llama-2-7b-hf")
    base = TrainingSetup(method="full", precision="bf16")
    one = estimate_vram(arch, replace(base, gpus=1, sharding="none"))
    grad_op = estimate_vram(arch, replace(base, gpus=4, sharding="grad-op"))
    assert grad_op.breakdown["gradients"] == pytest.approx(one.breakdown["gradients"] / 4, abs=1)
    assert grad_op.breakdown["optimizer_states"] == pytest.approx(
        one.breakdown["optimizer_states"] / 4, abs=1
    )
    assert grad_op.breakdown["weights"] >= one.breakdown["weights"]


def test_ddp_replicates_everything_and_adds_gradient_buckets() -> None:
    base = TrainingSetup(method="full", precision="bf16", sharding="none", grad_accumulation=2)
    one = estimate_vram(TINY, replace(base, gpus=1))
    ddp = estimate_vram(TINY, replace(base, gpus=2))
    assert ddp.breakdown["weights"] == one.breakdown["weights"]
    assert ddp.breakdown["ddp_grad_buckets"] == one.breakdown["gradients"]
    assert one.breakdown["ddp_grad_buckets"] == 0


def test_single_gpu_ignores_sharding_mode() -> None:
    full = estimate_vram(TINY, TrainingSetup(gpus=1, sharding="full"))
    none = estimate_vram(TINY, TrainingSetup(gpus=1, sharding="none"))
    assert full.per_gpu_bytes == none.per_gpu_bytes


def test_cpu_offload_moves_static_state_off_the_gpu() -> None:
    arch = load_arch("meta-llama/Llama-2-70b-hf")
    base = TrainingSetup(method="qlora", gpus=2, sharding="full", micro_batch=2, seq_len=2048)
    on_gpu = estimate_vram(arch, base)
    offload = estimate_vram(arch, replace(base, cpu_offload=True))
    for name in ("weights", "lora_adapters", "gradients", "optimizer_states"):
        assert offload.breakdown[name] == 0
    # activations and logits stay on the GPU (with the gathered units at every moment)
    kept = ("activations", "logits")
    assert sum(offload.breakdown[k] for k in kept) >= sum(on_gpu.breakdown[k] for k in kept)
    assert offload.breakdown["fsdp_buffers"] > 0
    assert offload.per_gpu_bytes < on_gpu.per_gpu_bytes


# --------------------------------------------------------------------------- output shape


def test_breakdown_sums_to_total_and_has_every_component() -> None:
    arch = load_arch("meta-llama/Llama-3.1-8B")
    for setup in (
        TrainingSetup(),
        TrainingSetup(method="full", precision="amp-bf16", gpus=8),
        TrainingSetup(method="qlora", gpus=2, cpu_offload=True, optimizer="paged-adamw-8bit"),
        TrainingSetup(method="lora", gpus=4, sharding="grad-op", attention="eager"),
    ):
        est = estimate_vram(arch, setup)
        assert tuple(est.breakdown) == BREAKDOWN_COMPONENTS
        assert sum(est.breakdown.values()) == est.per_gpu_bytes
        assert all(v >= 0 for v in est.breakdown.values())
        assert est.per_gpu_gib == est.per_gpu_bytes / GIB


def test_to_dict_is_json_ready() -> None:
    est = estimate_vram(TINY, TrainingSetup(lora_targets=("q_proj", "v_proj")))
    data = json.loads(json.dumps(est.to_dict()))
    assert data["perGPUBytes"] == est.per_gpu_bytes
    assert set(data["breakdown"]) == set(BREAKDOWN_COMPONENTS)
    assert set(data["breakdownGiB"]) == set(BREAKDOWN_COMPONENTS)
    assert data["setup"]["loraTargets"] == ["q_proj", "v_proj"]
    assert data["trainableParams"] == est.trainable_params
    assert data["totalParams"] == TINY.total_params
    # One naming convention with the API's JSON (kubetune plan --json, status.plan).
    keys = [*data, *data["setup"]]  # type: ignore[misc]
    assert not [k for k in keys if "_" in k], keys
    assert data["setup"]["microBatch"] == 1 and data["setup"]["cpuOffload"] is False


def test_comparable_bytes_by_metric() -> None:
    est = estimate_vram(
        load_arch("meta-llama/Llama-2-7b-hf"),
        TrainingSetup(method="qlora", gpus=2, optimizer="paged-adamw-8bit"),
    )
    allocated = comparable_bytes(est, "allocated")
    reserved = comparable_bytes(est, "reserved")
    assert allocated < reserved < comparable_bytes(est, "device") == est.per_gpu_bytes
    b = est.breakdown
    assert (
        reserved
        == est.per_gpu_bytes - b["cuda_context"] - b["nccl_buffers"] - b["optimizer_states"]
    )
    assert reserved - allocated == b["allocator_slack"]


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"lora_rank": 0}, "lora_rank"),
        ({"lora_rank": -4}, "lora_rank"),
        ({"gpus": 0}, "gpus"),
        ({"micro_batch": 0}, "micro_batch"),
        ({"seq_len": -1}, "seq_len"),
        ({"method": "prefix"}, "method"),
        ({"precision": "fp16"}, "precision"),
        ({"optimizer": "sgd"}, "optimizer"),
        ({"sharding": "hybrid"}, "sharding"),
        ({"lora_dropout": 1.0}, "lora_dropout"),
        ({"lora_targets": ()}, "target"),
        ({"lora_base_dtype": "fp16"}, "lora_base_dtype"),
    ],
)
def test_invalid_inputs_raise_with_fix(changes: dict[str, object], needle: str) -> None:
    setup = replace(TrainingSetup(), **changes)  # type: ignore[arg-type]
    with pytest.raises(EstimatorError) as err:
        estimate_vram(TINY, setup)
    assert needle in str(err.value)
    assert "To fix:" in str(err.value)


def test_unknown_target_lists_valid_module_names() -> None:
    arch = load_arch("microsoft/Phi-3-mini-4k-instruct")
    setup = TrainingSetup(method="lora", lora_targets=("q_proj", "v_proj"))
    with pytest.raises(EstimatorError) as err:
        trainable_params(arch, setup)
    message = str(err.value)
    assert "'q_proj'" in message and "'v_proj'" in message
    for name in lora_target_names(arch):
        assert name in message
    assert "qkv_proj" in message and "To fix:" in message


def test_lm_head_target_on_tied_model_is_rejected() -> None:
    tied = replace(TINY, tie_embeddings=True)
    with pytest.raises(EstimatorError, match="lm_head"):
        trainable_params(tied, TrainingSetup(method="lora", lora_targets=("lm_head",)))


def test_full_method_ignores_lora_settings() -> None:
    est = estimate_vram(TINY, TrainingSetup(method="full", lora_rank=0, lora_targets=()))
    assert est.trainable_params == TINY.total_params


# --------------------------------------------------------------------------- calibration


def _calibration_module() -> ModuleType:
    return load_script("hack/estimator_calibration.py")


REQUIRED_FIELDS = (
    "id",
    "model",
    "method",
    "precision",
    "optimizer",
    "lora_rank",
    "lora_targets",
    "micro_batch",
    "seq_len",
    "gpus",
    "sharding",
    "grad_ckpt",
    "gpu",
    "metric",
    "measured_value",
    "measured_unit",
    "measured_gib",
    "source",
    "notes",
)


def test_measurements_are_complete_and_consistent() -> None:
    cal = _calibration_module()
    _archs, rows = cal.load_measurements()
    assert len(rows) >= 25
    ids = [row["id"] for row in rows]
    assert len(ids) == len(set(ids))
    assert len({row["source"].split(":")[0] for row in rows}) >= 5
    for row in rows:
        missing = [name for name in REQUIRED_FIELDS if name not in row]
        assert not missing, f"{row['id']} lacks {missing}"
        assert row["metric"] in ("allocated", "reserved", "device")
        scale = {"GB": 1e9 / GIB, "GiB": 1.0}[row["measured_unit"]]
        assert row["measured_gib"] == pytest.approx(row["measured_value"] * scale, abs=0.005)
        assert row["source"] and row["notes"]


def test_calibration_against_published_measurements() -> None:
    cal = _calibration_module()
    comparisons = cal.compare()
    errors = [c.error for c in comparisons]
    median_abs = statistics.median(abs(e) for e in errors)
    under = [c.row["id"] for c in comparisons if c.error < -0.05]
    assert median_abs <= 0.10, f"median absolute error {median_abs:.1%}"
    assert len(under) <= 0.10 * len(errors), f"under-predicted by >5 %: {under}"


def test_calibration_report_is_up_to_date() -> None:
    cal = _calibration_module()
    assert cal.main(["--check"]) == 0, "run: python hack/estimator_calibration.py"


def test_the_optimizer_in_backward_holds_one_gradient_at_a_time() -> None:
    """Each parameter is stepped and its gradient freed as backward makes it: no moment holds
    more than the largest parameter's gradient (Llama-3.1-8B: the 128k x 4,096 embedding),
    where the ordinary step ends backward with all of them (15 GiB in bf16)."""
    arch = load_arch("meta-llama/Llama-3.1-8B")
    setup = replace(SINGLE, method="full", micro_batch=1, seq_len=512, chunked_ce=True)
    plain = estimate_vram(arch, setup)
    stepped = estimate_vram(arch, replace(setup, optimizer_in_backward=True))
    assert plain.breakdown["gradients"] > 10 * GIB
    assert stepped.breakdown["gradients"] <= arch.embedding_params * 2
    assert plain.per_gpu_bytes - stepped.per_gpu_bytes > 10 * GIB
    # Adapters' gradients are small: LoRA gains next to nothing, but is sized the same way.
    lora = replace(setup, method="lora")
    assert estimate_vram(arch, replace(lora, optimizer_in_backward=True)).per_gpu_bytes <= (
        estimate_vram(arch, lora).per_gpu_bytes
    )


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"grad_accumulation": 2}, "gradient accumulation 2"),
        ({"gpus": 2, "sharding": "none"}, "DDP has not averaged"),
        ({"cpu_offload": True}, "CPU offload steps on the CPU"),
    ],
)
def test_the_optimizer_in_backward_refuses_what_it_cannot_step(
    change: dict[str, Any], words: str
) -> None:
    arch = load_arch("meta-llama/Llama-3.2-1B")
    setup = replace(SINGLE, method="full", optimizer_in_backward=True, **change)
    with pytest.raises(EstimatorError, match=words) as info:
        estimate_vram(arch, setup)
    assert "To fix" in str(info.value)


def test_document_bounds_build_no_mask_so_memory_follows_the_tokens() -> None:
    """`varlen` (packed rows by document bounds, the trainer on a GPU): one 16,384-token row
    costs what 8 rows of 2,048 do, as measured on an H200 (55.86 GiB for both, LoRA on
    Llama-3.2-1B, benchmarks/results/gpu_trainer-2026-11-28.md). With the mask (`sdpa`) the
    long row pays the boolean mask once and an additive copy per layer, quadratic in it."""
    arch = load_arch("meta-llama/Llama-3.2-1B")
    lora = replace(SINGLE, method="lora", chunked_ce=True, grad_ckpt=False)
    rows = replace(lora, micro_batch=8, seq_len=2048)
    row = replace(lora, micro_batch=1, seq_len=16384)

    def activations(setup: TrainingSetup) -> int:
        return estimate_vram(arch, setup).breakdown["activations"]

    assert activations(replace(row, attention="varlen")) == activations(
        replace(rows, attention="varlen")
    )
    for setup in (rows, row):
        entries = setup.micro_batch * setup.seq_len**2
        masks = entries * 1 + arch.num_layers * entries * 2  # bool once, bf16 per layer
        gap = activations(setup) - activations(replace(setup, attention="varlen"))
        assert gap == pytest.approx(masks, rel=1e-6)
    measured = 55.857 * GIB
    long_row = comparable_bytes(estimate_vram(arch, replace(row, attention="varlen")), "allocated")
    assert 0 <= long_row / measured - 1 < 0.02
