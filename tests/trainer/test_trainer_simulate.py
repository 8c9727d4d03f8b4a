"""`kubetune estimate --simulate`: the trainer's step on fake tensors (kubetune_trainer.simulate).

The simulation allocates what a real run allocates (same tracker, real CPU tensors), on one
GPU and as rank 0 of an FSDP2-sharded run, its 1+2 block extrapolation (3+4 sharded) equals a
whole-model simulation, each rank holds 1/N of the weights and optimizer states, it reports
the build's trainable parameters, QLoRA's 4-bit layers are the trainer's and dequantize as on
CUDA, the chunked loss shrinks the logits term, and the CLI prints both breakdowns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("peft", reason="trainer tests need the trainer extra")

from click.testing import CliRunner

from kubetune.cli import main
from kubetune.planning.estimator import BREAKDOWN_COMPONENTS
from kubetune_trainer.simulate import (
    MEASURED_COMPONENTS,
    PHASES,
    SimulationError,
    SimulationSetup,
    simulate,
)
from kubetune_trainer.simulate.kernels import _dropout_as_on_cuda
from kubetune_trainer.simulate.step import _run_once

pytestmark = pytest.mark.trainer


# Fake and real tensors allocate the same storages, with one exception: on real data
# transformers sees that the rows are not packed and lets SDPA apply the causal mask itself;
# on fake tensors it cannot look, and builds the (batch, 1, seq, seq) boolean mask a packed
# batch gets, and masks derived from it while backward recomputes the checkpointed first
# block (7 mask-sized tensors measured on this tiny model). The simulation may exceed the real
# run by at most 8 such masks: 2.5 % here, 0.1 % of a 1B model's step at 2,048 tokens.
def _mask_bytes(setup: SimulationSetup) -> int:
    return 8 * setup.micro_batch * setup.seq_len**2


# Memory is affine in the number of blocks: extrapolation is exact up to rounding.
EXTRAPOLATION_RTOL = 1e-3

TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def _totals(phases: dict[str, dict[str, int]]) -> dict[str, int]:
    return {name: sum(b.values()) for name, b in phases.items()}


@pytest.mark.parametrize("method", ["full", "lora"])
def test_fake_step_allocates_what_a_real_cpu_step_does(method: str) -> None:
    setup = SimulationSetup(method=method, micro_batch=2, seq_len=32)  # type: ignore[arg-type]
    fake = _totals(_run_once(setup, TINY_LLAMA, None, fake=True).phases)
    real = _totals(_run_once(setup, TINY_LLAMA, None, fake=False).phases)
    assert fake.keys() == real.keys()
    for name in fake:
        assert 0 <= fake[name] - real[name] <= _mask_bytes(setup), name
    backward = max(v for k, v in real.items() if k.startswith("peak:backward:"))
    assert backward > real["forward"] > real["weights"] > 0


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_qlora_fake_step_allocates_what_a_real_cpu_step_does(precision: str) -> None:
    """The 4-bit layers quantized by bitsandbytes' own operators, on fake and on real tensors."""
    setup = SimulationSetup(method="qlora", micro_batch=2, seq_len=32, precision=precision)  # type: ignore[arg-type]
    fake = _totals(_run_once(setup, TINY_LLAMA, None, fake=True).phases)
    real = _totals(_run_once(setup, TINY_LLAMA, None, fake=False).phases)
    # In fp32 the masks derived while backward recomputes the first block are fp32 (4 bytes
    # an element): plain LoRA at fp32 shows the same 26 KiB here.
    masks = _mask_bytes(setup) * (4 if precision == "fp32" else 1)
    assert fake.keys() == real.keys()
    for name in fake:
        assert 0 <= fake[name] - real[name] <= masks, name
    backward = max(v for k, v in real.items() if k.startswith("peak:backward:"))
    assert backward > real["forward"] > real["weights"] > 0


def _trainable_sizes(fields: dict[str, Any]) -> list[int]:
    """Element counts of a full fine-tuning's parameters (the model built on meta)."""
    import torch
    import transformers

    from kubetune_trainer.simulate import hf_config

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(fields))
    return [p.numel() for p in model.parameters()]


def test_8bit_adamw_fake_step_allocates_what_a_real_cpu_step_does() -> None:
    """bitsandbytes' AdamW8bit on fake tensors (its quantization tables made fake): the same
    states as on real ones, two uint8 moments and their absmax per 256-value block for the
    weights, 32-bit moments for tensors under its 4,096-element threshold."""
    setup = SimulationSetup(method="full", micro_batch=2, seq_len=32, optimizer="adamw-8bit")
    fake = _run_once(setup, TINY_LLAMA, None, fake=True).phases
    real = _run_once(setup, TINY_LLAMA, None, fake=False).phases
    fake_totals, real_totals = _totals(fake), _totals(real)
    for name in fake_totals:
        assert 0 <= fake_totals[name] - real_totals[name] <= _mask_bytes(setup), name
    sizes = _trainable_sizes(TINY_LLAMA)
    expected = (
        sum(2 * n + 2 * 4 * -(-n // 256) if n >= 4096 else 2 * 4 * n for n in sizes) + 2 * 256 * 4
    )  # the signed and unsigned tables, shared by every parameter
    assert fake["optimizer"]["optimizer_states"] == expected


@pytest.mark.parametrize("grad_ckpt", [True, False])
def test_qlora_dequantizes_one_weight_at_a_time_as_cuda_does(grad_ckpt: bool) -> None:
    """bitsandbytes' CUDA matmul dequantizes the whole 4-bit weight before `linear` (and its
    backward does again): a block's forward and backward peaks hold one dequantized copy of
    the widest weight, outside the blocks none. A wide MLP makes that copy the peak's largest
    transient."""
    fields = {**TINY_LLAMA, "intermediate_size": 4096}
    setup = SimulationSetup(method="qlora", micro_batch=1, seq_len=8, grad_ckpt=grad_ckpt)
    phases = _run_once(setup, fields, None, fake=True).phases
    widest = 64 * 4096 * 2  # hidden × intermediate, bf16
    for window in ("forward:first", "forward:last", "backward:first", "backward:last"):
        assert phases[f"peak:{window}"]["dequant_workspace"] == widest, window
    for window in ("weights", "forward:before", "backward:before", "step"):
        assert phases.get(window, phases.get(f"peak:{window}", {}))["dequant_workspace"] == 0


def test_qlora_builds_what_the_trainer_builds(tiny_llama: Path) -> None:
    """The simulated QLoRA model against the trainer's own (`modeling.build_model` loads the
    tiny model in 4 bits on CPU): the same layers in 4 bits, the same trainable and total
    parameters, and the same bytes of frozen weights with their quantization state."""
    import bitsandbytes as bnb

    built, result = _built_and_simulated(tiny_llama, "qlora")
    fields = json.loads((tiny_llama / "config.json").read_text())
    four_bit = [m for m in built.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == 7 * int(fields["num_hidden_layers"])  # q k v o gate up down
    frozen = sum(
        p.untyped_storage().nbytes() for p in built.model.parameters() if not p.requires_grad
    )
    buffers = sum(b.untyped_storage().nbytes() for b in built.model.buffers())
    state: dict[int, int] = {}  # each tensor once: the 8-bit code table is shared
    for m in four_bit:
        qs = m.weight.quant_state
        parts = [qs.absmax, qs.code, qs.offset]
        if qs.state2 is not None:
            parts += [qs.state2.absmax, qs.state2.code]
        state.update({id(t): t.untyped_storage().nbytes() for t in parts if t is not None})
    simulated = result.phase_breakdowns["weights"]["weights"]
    assert simulated == frozen + buffers + sum(state.values())


@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_dpo_step_is_simulated_as_the_trainer_runs_it(method: str) -> None:
    """Fake and real tensors agree on the DPO step too (the LoRA reference forward runs with
    the adapters off, without gradients), and it allocates what an SFT step on the pairs'
    rows does: what the planner counts for DPO."""
    setup = SimulationSetup(method=method, micro_batch=2, seq_len=32, objective="dpo")  # type: ignore[arg-type]
    fake = _totals(_run_once(setup, TINY_LLAMA, None, fake=True).phases)
    real = _totals(_run_once(setup, TINY_LLAMA, None, fake=False).phases)
    rows = SimulationSetup(method=method, micro_batch=4, seq_len=32)  # type: ignore[arg-type]
    assert fake.keys() == real.keys()
    for name in fake:
        assert 0 <= fake[name] - real[name] <= _mask_bytes(rows), name
    sft = _totals(_run_once(rows, TINY_LLAMA, None, fake=True).phases)
    peak = max(v for k, v in fake.items() if k.startswith("peak:"))
    sft_peak = max(v for k, v in sft.items() if k.startswith("peak:"))
    assert peak == pytest.approx(sft_peak, rel=0.02)


@pytest.mark.parametrize("chunked", [False, True])
def test_extrapolation_from_one_and_two_blocks_equals_the_whole_model(chunked: bool) -> None:
    fields = {**TINY_LLAMA, "num_hidden_layers": 6}
    for method in ("full", "lora"):
        setup = SimulationSetup(method=method, seq_len=64, chunked_ce=chunked)  # type: ignore[arg-type]
        fast = simulate(fields, setup)
        whole = simulate(fields, setup, layers="all")
        assert fast.simulated_layers == (1, 2)
        assert whole.simulated_layers == (6,)
        assert fast.peak_phase == whole.peak_phase
        for phase in PHASES:
            assert fast.phases[phase] == pytest.approx(whole.phases[phase], rel=EXTRAPOLATION_RTOL)
        for key in MEASURED_COMPONENTS:
            assert fast.breakdown[key] == pytest.approx(whole.breakdown[key], abs=1024), key
        assert fast.trainable_params == whole.trainable_params
        assert fast.total_params == whole.total_params


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_sharded_fake_step_allocates_what_a_real_cpu_step_does(method: str) -> None:
    """Rank 0 of 2 under the trainer's FSDP2 wrapping: fake and real CPU tensors (both on
    the fake process group, whose collectives move no data) allocate the same; QLoRA's packed
    weights are sharded and gathered like any other, their quantization state re-attached
    to the gathered weight as bitsandbytes does."""
    setup = SimulationSetup(method=method, micro_batch=2, seq_len=32, gpus=2)  # type: ignore[arg-type]
    fake_run = _run_once(setup, TINY_LLAMA, None, fake=True)
    fake = _totals(fake_run.phases)
    real = _totals(_run_once(setup, TINY_LLAMA, None, fake=False).phases)
    assert fake.keys() == real.keys()
    for name in fake:
        assert 0 <= fake[name] - real[name] <= _mask_bytes(setup), name
    # The blocks' gathered parameters are FSDP2's buffers while each block runs.
    assert fake_run.phases["peak:forward:first"]["fsdp_buffers"] > 0
    assert fake_run.phases["weights"]["fsdp_buffers"] == 0


@pytest.mark.parametrize(
    ("method", "sharding"),
    [("full", "full"), ("lora", "full"), ("qlora", "full"), ("full", "grad-op")],
)
def test_sharded_extrapolation_from_three_and_four_blocks_equals_the_whole_model(
    method: str, sharding: str
) -> None:
    fields = {**TINY_LLAMA, "num_hidden_layers": 7}
    for micro_batch, seq_len in ((2, 128), (1, 64)):
        setup = SimulationSetup(
            method=method,  # type: ignore[arg-type]
            micro_batch=micro_batch,
            seq_len=seq_len,
            gpus=2,
            sharding=sharding,  # type: ignore[arg-type]
        )
        fast = simulate(fields, setup)
        whole = simulate(fields, setup, layers="all")
        assert fast.simulated_layers == (3, 4)
        assert fast.peak_phase == whole.peak_phase
        for phase in PHASES:
            assert fast.phases[phase] == pytest.approx(whole.phases[phase], rel=EXTRAPOLATION_RTOL)
        for key in MEASURED_COMPONENTS:
            assert fast.breakdown[key] == pytest.approx(whole.breakdown[key], abs=1024), key
        assert fast.total_params == whole.total_params


@pytest.mark.parametrize("method", ["full", "lora"])
def test_each_rank_holds_an_nth_of_the_weights_and_optimizer_states(method: str) -> None:
    fields = {**TINY_LLAMA, "num_hidden_layers": 8}
    one = simulate(fields, SimulationSetup(method=method, seq_len=64))  # type: ignore[arg-type]
    for gpus in (2, 8):
        sharded = simulate(fields, SimulationSetup(method=method, seq_len=64, gpus=gpus))  # type: ignore[arg-type]
        assert sharded.total_params == one.total_params
        for phase in ("weights", "optimizer"):
            for key in ("weights", "lora_adapters", "optimizer_states"):
                # FSDP2 pads each parameter's first dimension to a multiple of the GPUs.
                expected = one.phase_breakdowns[phase][key] / gpus
                assert sharded.phase_breakdowns[phase][key] == pytest.approx(expected, rel=0.01)
        assert sharded.phase_breakdowns["optimizer"]["fsdp_buffers"] == 0


def test_a_process_that_has_a_process_group_simulates_in_a_fresh_one(tmp_path: Path) -> None:
    import torch.distributed as dist

    setup = SimulationSetup(method="lora", seq_len=32, gpus=2)
    alone = simulate(TINY_LLAMA, setup)
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        beside = simulate(TINY_LLAMA, setup)
        assert dist.get_world_size() == 1  # this process's group is left as it was
    finally:
        dist.destroy_process_group()
    assert beside.breakdown == alone.breakdown


def test_breakdown_sums_to_the_peak_and_maps_every_measured_term() -> None:
    result = simulate(TINY_LLAMA, SimulationSetup(method="full", seq_len=64))
    assert sum(result.breakdown.values()) == result.peak_bytes
    assert set(result.breakdown) == set(MEASURED_COMPONENTS)
    assert set(MEASURED_COMPONENTS) <= set(BREAKDOWN_COMPONENTS)
    after_step = result.phase_breakdowns["optimizer"]
    # AdamW in bf16: two states of each parameter's size (plus a 4-byte step count per
    # parameter, and the weights include the rotary buffer); no gradients left.
    assert after_step["optimizer_states"] == pytest.approx(2 * after_step["weights"], rel=1e-3)
    assert after_step["gradients"] == 0


def _built_and_simulated(model: Path, method: str) -> tuple[Any, Any]:
    """The trainer's own build of the tiny `model` (`modeling.build_model` on CPU) and the
    simulation of the same setup; both count the same trainable and total parameters."""
    import torch

    from kubetune_trainer.distributed import DistEnv
    from kubetune_trainer.modeling import build_model
    from kubetune_trainer.simulate import trainer_config

    setup = SimulationSetup(method=method, seq_len=32, lora_rank=4)  # type: ignore[arg-type]
    cfg = trainer_config(setup, source=str(model))
    built = build_model(cfg, DistEnv(0, 1, 0, torch.device("cpu")))
    fields = json.loads((model / "config.json").read_text())
    result = simulate(fields, setup, layers="all")
    assert result.trainable_params == built.n_trainable
    assert result.total_params == built.n_params
    return built, result


def test_lora_trainable_params_equal_the_trainers_build(tiny_llama: Path) -> None:
    built, result = _built_and_simulated(tiny_llama, "lora")
    # PEFT keeps adapters in fp32 on a bf16 base.
    assert result.phase_breakdowns["weights"]["lora_adapters"] == 4 * built.n_trainable


def test_chunked_loss_lowers_the_logits_term() -> None:
    # A vocabulary large enough for several chunks (loss_chunk_tokens: 512 tokens here).
    fields = {**TINY_LLAMA, "vocab_size": 131072}
    plain = simulate(fields, SimulationSetup(method="lora", seq_len=1536))
    chunked = simulate(fields, SimulationSetup(method="lora", seq_len=1536, chunked_ce=True))
    assert chunked.breakdown["logits"] < 0.6 * plain.breakdown["logits"]
    assert chunked.peak_bytes < plain.peak_bytes


def test_dropout_keeps_a_one_byte_mask_as_on_cuda() -> None:
    """CUDA's fused dropout keeps a bool mask for backward; CPU's keeps a noise tensor of the
    input's dtype. The simulation runs dropout the CUDA way (LoRA dropout on every adapted
    layer's input: gigabytes at 1B and 2,048 tokens), with the same result and gradient."""
    import torch

    x = torch.randn(64, 32, requires_grad=True)
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    def run() -> torch.Tensor:
        saved.clear()
        torch.manual_seed(0)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            return torch.nn.functional.dropout(x, 0.25, training=True)

    run()
    assert {t.dtype for t in saved} == {torch.float32}  # CPU: the noise, as the input
    with _dropout_as_on_cuda():
        out = run()
        assert torch.nn.functional.dropout(x, 0.25, training=False) is x  # eval: untouched
    assert [t.dtype for t in saved] == [torch.bool]
    kept = out != 0
    torch.testing.assert_close(out[kept], x[kept] / 0.75)
    out.sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, kept.float() / 0.75)
    # put back afterwards
    run()
    assert {t.dtype for t in saved} == {torch.float32}


@pytest.mark.parametrize(
    ("setup", "words"),
    [
        (SimulationSetup(fused_ce=True), "fused loss is not simulated"),
        (SimulationSetup(gpus=2, sharding="none"), r"sharding none \(DDP\) is not simulated"),
        (SimulationSetup(optimizer="paged-adamw-8bit"), "paged-adamw-8bit is not simulated"),
    ],
)
def test_refuses_what_it_does_not_simulate(setup: SimulationSetup, words: str) -> None:
    with pytest.raises(SimulationError, match=words) as info:
        simulate(TINY_LLAMA, setup)
    assert "analytical estimate" in str(info.value)


def test_cli_prints_both_breakdowns(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY_LLAMA, "num_hidden_layers": 4}))
    args = ["estimate", "--config", str(config), "--seq-len", "64", "--method", "lora"]
    runner = CliRunner()

    plain = runner.invoke(main, args)
    assert plain.exit_code == 0, plain.output
    assert "simulated" not in plain.output

    table = runner.invoke(main, [*args, "--simulate"])
    assert table.exit_code == 0, table.output
    assert "estimate  simulated  difference" in table.output
    assert "1 and 2 of 4 decoder blocks" in table.output
    assert "not visible to fake tensors" in table.output

    out = runner.invoke(main, [*args, "--simulate", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    sim = data["simulated"]
    assert set(sim["breakdown"]) == set(BREAKDOWN_COMPONENTS)
    assert sim["perGPUBytes"] == sum(sim["breakdown"].values())
    assert sim["breakdown"]["cuda_context"] == data["breakdown"]["cuda_context"]
    assert sim["trainableParams"] == data["trainableParams"]

    qlora = runner.invoke(main, [*args, "--simulate", "--method", "qlora", "--json"])
    assert qlora.exit_code == 0, qlora.output
    assert json.loads(qlora.output)["simulated"]["breakdown"]["weights"] > 0

    sharded = runner.invoke(main, [*args, "--simulate", "--method", "qlora", "--gpus", "2"])
    assert sharded.exit_code == 0, sharded.output
    # a sharded run extrapolates from 3 and 4 blocks, so 4 are all simulated
    assert "all 4 decoder blocks simulated" in sharded.output

    refused = runner.invoke(main, [*args, "--simulate", "--fused-ce"])
    assert refused.exit_code != 0
    assert "use the analytical estimate" in refused.output
