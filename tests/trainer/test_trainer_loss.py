"""The chunked cross-entropy equals the plain one: loss and every gradient, on the models
and wrappings the trainer builds (full, LoRA, LoRA on the output layer, tied embeddings,
packed rows, a soft-capped Gemma 2), and a whole run trains the same curve with it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("peft", reason="trainer tests need the trainer extra")

import torch

from kubetune_trainer.contract import loss_chunk_tokens
from kubetune_trainer.loss import (
    ChunkedLoss,
    ChunkedLossUnsupported,
    OffloadActivations,
    loss_sum,
)
from support.losses import batch as _batch
from support.losses import loss_and_grads as _loss_and_grads
from support.losses import model as _model
from support.losses import tiny_gemma2 as _tiny_gemma2
from support.trainer import read_log, step_losses, trainer_config, write_config

pytestmark = pytest.mark.trainer

# fp32 on CPU: the chunked sum adds the same per-token terms in another order.
LOSS_RTOL = 1e-5
GRAD_ATOL = 1e-6


def _compare(model: Any, batch: dict[str, Any], chunk: int = 8) -> None:
    plain, plain_grads = _loss_and_grads(model, batch, None)
    chunked = ChunkedLoss.install(model)
    chunked.chunk = chunk  # several chunks, one of them prompt only
    got, got_grads = _loss_and_grads(model, batch, chunked)
    assert math.isclose(float(got), float(plain), rel_tol=LOSS_RTOL), (float(got), float(plain))
    assert plain_grads.keys() == got_grads.keys() and plain_grads
    for name, g in plain_grads.items():
        torch.testing.assert_close(got_grads[name], g, atol=GRAD_ATOL, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    ("arch", "method", "targets", "packed"),
    [
        ("llama", "full", None, False),
        ("qwen2", "full", None, True),  # tied embeddings, packed rows
        ("llama", "lora", ["q_proj", "v_proj", "lm_head"], False),  # an adapter on the head
    ],
)
def test_chunked_loss_and_gradients_equal_the_plain_path(
    request: pytest.FixtureRequest,
    arch: str,
    method: str,
    targets: list[str] | None,
    packed: bool,
) -> None:
    model = _model(request.getfixturevalue(f"tiny_{arch}"), method, targets)
    _compare(model, _batch(model.config.vocab_size, packed=packed))


def test_soft_capped_logits_are_capped_per_chunk() -> None:
    torch.manual_seed(0)
    model = _tiny_gemma2(2)
    _compare(model, _batch(300))
    # Outside the loss the model still returns capped logits.
    logits = model(input_ids=torch.tensor([[5, 6, 7]])).logits
    assert float(logits.detach().abs().max()) <= 2.0


def test_a_model_that_rescales_logits_is_refused(tiny_llama: Path) -> None:
    model = _model(tiny_llama, "full")
    model.config.logit_scale = 0.5
    with pytest.raises(ChunkedLossUnsupported, match=r"logit_scale=0\.5"):
        ChunkedLoss.install(model)


def test_chunk_size_bounds_the_fp32_logits() -> None:
    assert loss_chunk_tokens(128_256) == 523  # 256 MiB of fp32 logits
    assert loss_chunk_tokens(128_256) * 128_256 * 4 <= 256 * 1024**2
    assert loss_chunk_tokens(10_000_000) == 64


def test_runs_with_the_memory_savers_follow_the_plain_curve(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path
) -> None:
    """Through the real entry point: the chunked loss's and the offloaded run's per-step
    losses equal the plain run's (the tiny vocabulary fits one chunk of the default size, so
    the chunk is forced small to exercise several)."""
    from kubetune_trainer.__main__ import main

    savers: dict[str, dict[str, bool]] = {
        "plain": {},
        "chunked": {"chunked_cross_entropy": True},
        "offloaded": {"activation_offloading": True},
    }
    losses = {}
    for name, flags in savers.items():
        out = tmp_path / name
        cfg = trainer_config(
            out,
            tiny_llama,
            alpaca_data,
            "lora",
            training={"max_steps": 4, "precision": "fp32", **flags},
        )
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("kubetune_trainer.loss.loss_chunk_tokens", lambda vocab: 16)
            mp.setattr("kubetune_trainer.loss.OffloadActivations.MIN_BYTES", 0)
            assert main(["--config", str(write_config(out, cfg))]) == 0
        losses[name] = step_losses(out / "metrics.jsonl")
    assert sorted(losses["plain"]) == list(range(1, 5))
    steps = read_log(tmp_path / "offloaded" / "metrics.jsonl", "step")
    assert steps and all(s["offloaded_bytes"] > 0 for s in steps)
    for name in ("chunked", "offloaded"):
        for step, want in losses["plain"].items():
            assert math.isclose(losses[name][step], want, rel_tol=1e-5), (name, step, losses)


# ------------------------------------------------------------------ activation offloading


@pytest.mark.parametrize("checkpointing", [False, True])
def test_offloaded_activations_give_the_same_gradients_and_leave_the_blocks_inputs_only(
    tiny_llama: Path, checkpointing: bool
) -> None:
    """Offloading moves what autograd saves to host memory and back: the gradients are
    unchanged; with checkpointing, what is saved is each block's input and the few tensors
    outside the blocks, not the blocks' internals."""
    model = _model(tiny_llama, "full")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = _batch(model.config.vocab_size)
    plain, plain_grads = _loss_and_grads(model, batch, None)

    offload = OffloadActivations(min_bytes=0)  # the tiny model's tensors are all small
    packed: list[torch.Size] = []
    moved = [0]
    pack_hooks = offload.hooks

    def counting(pin_memory: bool) -> Any:
        hooks = pack_hooks(pin_memory)
        pack = hooks.pack_hook

        def spy(t: torch.Tensor) -> Any:
            out = pack(t)
            if out is not t:
                packed.append(t.shape)
                moved[0] += t.numel() * t.element_size()
            return out

        hooks.pack_hook = spy
        return hooks

    offload.hooks = counting  # type: ignore[method-assign]
    model.zero_grad(set_to_none=True)
    loss = loss_sum(model, offload=offload, **batch)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(plain), rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain_grads[name], atol=1e-7, rtol=1e-6, msg=name)

    rows, width = batch["input_ids"].shape
    hidden = torch.Size([rows, width, model.config.hidden_size])
    layers = model.config.num_hidden_layers
    assert sum(1 for s in packed if s == hidden) >= layers
    assert offload.offloaded_bytes == moved[0] > 0
    weights = {p.shape for p in model.parameters()} | {p.t().shape for p in model.parameters()}
    assert not [s for s in packed if s in weights and len(s) == 2], "a weight was offloaded"
    if checkpointing:
        # Not the attention and MLP internals: a handful of tensors per block at most.
        assert len(packed) < 8 * layers, packed
    else:
        assert len(packed) > 20 * layers
