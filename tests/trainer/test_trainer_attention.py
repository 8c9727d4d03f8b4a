"""Packed rows without a block-diagonal mask (`kubetune_trainer.attention`): the loss of a
packed batch equals the loss of its examples run one by one, on both attention paths, and a
whole run trains the same curve with document bounds as with the mask.

On CPU the variable-length path runs each document through SDPA (the flash kernel needs
CUDA); the GPU benchmark (benchmarks/gpu_trainer.py) runs the kernel itself."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("transformers", reason="trainer tests need the trainer extra")

import numpy as np
import torch

from kubetune_trainer import attention
from kubetune_trainer.data import IGNORE_INDEX, pack
from kubetune_trainer.loss import loss_sum
from support.trainer import step_losses, trainer_config, write_config

pytestmark = pytest.mark.trainer

# fp32 on CPU: the same per-token terms, summed in another order.
LOSS_RTOL = 1e-5
GRAD_ATOL = 1e-6


def test_document_bounds_start_at_every_restart_and_every_row() -> None:
    pos = np.array(
        [
            [0, 1, 2, 0, 1, 0, 1, 2],
            [3, 4, 0, 1, 2, 3, 4, 5],  # a row may begin mid-count: it still starts a document
        ]
    )
    bounds = attention.document_bounds(pos)
    assert bounds.cu_seqlens.tolist() == [0, 3, 5, 8, 10, 16]
    assert bounds.cu_seqlens.dtype == torch.int32
    assert bounds.max_len == 6
    kwargs = bounds.model_kwargs()
    assert kwargs["cu_seq_lens_q"] is kwargs["cu_seq_lens_k"] is bounds.cu_seqlens
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 6


def _examples(vocab: int) -> list[tuple[list[int], list[int]]]:
    """Five examples of different lengths, each with a prompt that is not trained."""
    g = torch.Generator().manual_seed(1)
    out = []
    for n in (9, 14, 6, 11, 17):
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        labels = [IGNORE_INDEX] * 3 + ids[3:]
        out.append((ids, labels))
    return out


def _model(path: Path, packed_attention: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.train()
    if packed_attention == "varlen":
        attention.install(model)
    return model


def _loss_and_grads(model: Any, **batch: Any) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_sum(model, **batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # grouped KV heads; tied embeddings
@pytest.mark.parametrize("packed_attention", ["mask", "varlen"])
def test_packed_loss_and_gradients_equal_the_examples_one_by_one(
    request: pytest.FixtureRequest, arch: str, packed_attention: str
) -> None:
    from kubetune_trainer.data import Example, collate

    model = _model(request.getfixturevalue(f"tiny_{arch}"), packed_attention)
    examples = _examples(model.config.vocab_size)

    # One by one: each example its own batch, no mask (nothing to hide).
    want_loss = 0.0
    want_grads: dict[str, torch.Tensor] = {}
    for ids, labels in examples:
        t = torch.tensor([ids])
        loss, grads = _loss_and_grads(
            model,
            input_ids=t,
            labels=torch.tensor([labels]),
            attention_mask=None,
            position_ids=None,
        )
        want_loss += loss
        for n, g in grads.items():
            want_grads[n] = want_grads[n] + g if n in want_grads else g

    # Packed: rows of 32 tokens, several examples per row, padding as its own document.
    rows = pack([Example(ids, labels) for ids, labels in examples], seq_len=32, pad_id=0)
    assert len(rows.input_ids) == 2
    batch = collate(rows, [0, 1], pad_id=0)
    assert batch.documents is not None
    got_loss, got_grads = _loss_and_grads(
        model,
        input_ids=batch.input_ids,
        labels=batch.labels,
        attention_mask=None,
        position_ids=batch.position_ids,
        documents=batch.documents if packed_attention == "varlen" else None,
    )
    assert math.isclose(got_loss, want_loss, rel_tol=LOSS_RTOL), (got_loss, want_loss)
    assert want_grads.keys() == got_grads.keys() and want_grads
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, atol=GRAD_ATOL, rtol=1e-4, msg=name)


def test_without_document_bounds_attention_is_causal_over_each_row(tiny_llama: Path) -> None:
    """A forward with no bounds (evaluation by another caller, generation) is the model's
    ordinary causal attention."""
    plain = _model(tiny_llama, "mask").eval()
    varlen = _model(tiny_llama, "varlen").eval()
    ids = torch.randint(3, plain.config.vocab_size, (2, 12), generator=torch.Generator())
    with torch.no_grad():
        torch.testing.assert_close(varlen(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_models_that_need_more_than_causal_attention_stay_on_the_mask() -> None:
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

    assert attention.supports(LlamaConfig()) is None
    assert attention.supports(Qwen2Config(use_sliding_window=False)) is None
    why = attention.supports(MistralConfig(sliding_window=4096))
    assert why is not None and "sliding-window" in why
    assert attention.supports(Gemma2Config()) is not None
    cpu = torch.device("cpu")
    assert not attention.use_varlen("varlen", True, MistralConfig(sliding_window=4096), cpu)
    assert attention.use_varlen("varlen", True, LlamaConfig(), cpu)
    assert not attention.use_varlen("varlen", False, LlamaConfig(), cpu)  # nothing packed
    assert not attention.use_varlen("mask", True, LlamaConfig(), cpu)
    # auto: the kernel only (CUDA); on CPU the mask stays.
    assert not attention.use_varlen("auto", True, LlamaConfig(), cpu)


def test_kernel_arguments_follow_the_installed_signature() -> None:
    """`varlen_attn` spelled causal masking, scale and GQA differently across PyTorch
    releases; each spelling is met, and one that cannot say what is needed is not used."""

    def v29(
        q: Any, k: Any, v: Any, cq: Any, ck: Any, mq: int, mk: int, is_causal: bool = False
    ) -> None:
        return None

    def v210(
        q: Any,
        k: Any,
        v: Any,
        cq: Any,
        ck: Any,
        mq: int,
        mk: int,
        *,
        scale: Any = None,
        window_size: Any = (-1, -1),
    ) -> None:
        return None

    def v212(
        q: Any,
        k: Any,
        v: Any,
        cq: Any,
        ck: Any,
        mq: int,
        mk: int,
        *,
        scale: Any = None,
        window_size: Any = (-1, -1),
        enable_gqa: bool = False,
    ) -> None:
        return None

    default = 64**-0.5
    assert attention._kernel_kwargs(v29, default, 64) == {"is_causal": True}
    assert attention._kernel_kwargs(v29, 0.1, 64) is None  # no way to pass another scale
    assert attention._kernel_kwargs(v210, 0.1, 64) == {"window_size": (-1, 0), "scale": 0.1}
    assert attention._kernel_kwargs(v212, 0.1, 64) == {
        "window_size": (-1, 0),
        "scale": 0.1,
        "enable_gqa": True,
    }


def test_a_run_with_document_bounds_follows_the_masked_curve(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path
) -> None:
    """Through the real entry point, fp32 on CPU: packed_attention varlen (each document
    through SDPA here) trains the same per-step losses as the block-diagonal mask."""
    from kubetune_trainer.__main__ import main

    losses = {}
    for mode in ("mask", "varlen"):
        out = tmp_path / mode
        cfg = trainer_config(
            out,
            tiny_llama,
            alpaca_data,
            "lora",
            training={"max_steps": 4, "precision": "fp32", "packed_attention": mode},
        )
        assert main(["--config", str(write_config(out, cfg))]) == 0
        losses[mode] = step_losses(out / "metrics.jsonl")
    assert sorted(losses["mask"]) == list(range(1, 5))
    for step, want in losses["mask"].items():
        assert math.isclose(losses["varlen"][step], want, rel_tol=1e-5), (step, losses)
