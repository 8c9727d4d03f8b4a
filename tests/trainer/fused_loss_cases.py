"""The fused loss (Liger's fused linear cross-entropy, `training.fused_cross_entropy`) equals
the plain one: loss and every gradient, on the models and wrappings the trainer builds.

Liger's kernels are Triton kernels; without a GPU they run under Triton's interpreter, which
executes the same kernel code on CPU tensors one program instance at a time (the arithmetic
the GPU runs, not its speed). Triton reads `TRITON_INTERPRET=1` when it defines a kernel, its
own library's included, so the variable must be set before anything imports triton: this
file runs as a pytest process of its own, started with it by test_trainer_fused_loss.py."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("peft", reason="trainer tests need the trainer extra")
pytest.importorskip("liger_kernel", reason="the fused loss needs liger-kernel (trainer extra)")

import torch

from kubetune_trainer.loss import ChunkedLoss, ChunkedLossUnsupported, sequence_logps
from support.losses import batch as _batch
from support.losses import loss_and_grads as _loss_and_grads
from support.losses import model as _model
from support.losses import tiny_gemma2 as _tiny_gemma2

pytestmark = pytest.mark.trainer

# fp32 on CPU: the kernel sums the same per-token terms in another order, and accumulates the
# weight's gradient chunk by chunk.
LOSS_RTOL = 1e-5
GRAD_ATOL = 1e-6


@pytest.fixture(scope="module", autouse=True)
def interpreted_kernels() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail(
            "run with TRITON_INTERPRET=1 in the environment (test_trainer_fused_loss.py does): "
            "Triton's kernels cannot run on this CPU otherwise"
        )


def _assert_same(got: Any, want: Any) -> None:
    (loss, grads), (plain, plain_grads) = got, want
    assert math.isclose(float(loss), float(plain), rel_tol=LOSS_RTOL), (float(loss), float(plain))
    assert plain_grads.keys() == grads.keys() and plain_grads
    for name, g in plain_grads.items():
        torch.testing.assert_close(grads[name], g, atol=GRAD_ATOL, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    ("arch", "method"),
    [
        ("llama", "full"),  # the output projection trained: its gradient from the kernel
        ("qwen2", "full"),  # tied embeddings: the kernel's gradient meets the embedding's
        ("llama", "lora"),  # the projection frozen: no weight gradient
    ],
)
def test_fused_loss_and_gradients_equal_the_plain_path(
    request: pytest.FixtureRequest, arch: str, method: str
) -> None:
    model = _model(request.getfixturevalue(f"tiny_{arch}"), method)
    batch = _batch(model.config.vocab_size)
    plain = _loss_and_grads(model, batch, None)
    fused = ChunkedLoss.install(model, fused=True)
    kernel, calls = fused.fused, []

    class Counted:  # the kernel really ran, not the chunked fallback
        @staticmethod
        def apply(*args: Any) -> Any:
            calls.append(args[8])
            return kernel.apply(*args)

    fused.fused = Counted
    _assert_same(_loss_and_grads(model, batch, fused), plain)
    assert calls == ["sum"]


def test_per_row_log_probabilities_equal_the_plain_path(tiny_llama: Path) -> None:
    """DPO's per-sequence log-probabilities: one loss per token, gradients made in backward
    with each row's upstream gradient (here two different weights)."""
    model = _model(tiny_llama, "full")
    batch = _batch(model.config.vocab_size)
    del batch["position_ids"]
    upstream = torch.tensor([1.0, -0.5])

    def run(loss: ChunkedLoss | None) -> Any:
        model.zero_grad(set_to_none=True)
        logps = sequence_logps(model, chunked=loss, **batch)
        (logps * upstream).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logps.detach(), grads

    plain_logps, plain_grads = run(None)
    logps, grads = run(ChunkedLoss.install(model, fused=True))
    assert logps.shape == (2,)
    torch.testing.assert_close(logps, plain_logps, rtol=LOSS_RTOL, atol=1e-5)
    _assert_same((logps.sum(), grads), (plain_logps.sum(), plain_grads))


def test_soft_capped_logits_are_refused() -> None:
    """Gemma 2's final soft-cap: Liger's kernel has one, but Triton's interpreter cannot run
    that branch (a float argument it does not convert), so it is refused, not trusted."""
    with pytest.raises(ChunkedLossUnsupported, match="soft-caps its logits"):
        ChunkedLoss.install(_tiny_gemma2(1), fused=True)


def test_an_adapter_on_the_output_layer_is_refused(tiny_llama: Path) -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _model(tiny_llama, "full"), LoraConfig(r=4, target_modules=["q_proj", "lm_head"])
    )
    with pytest.raises(ChunkedLossUnsupported, match="plain linear output projection"):
        ChunkedLoss.install(model, fused=True)


def test_without_a_kernel_device_the_chunked_path_computes_the_sum(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPU without the interpreter (the local demo) the fused setting falls back."""
    model = _model(tiny_llama, "full")
    batch = _batch(model.config.vocab_size)
    plain = _loss_and_grads(model, batch, None)
    fused = ChunkedLoss.install(model, fused=True)
    monkeypatch.delenv("TRITON_INTERPRET")
    calls: list[Any] = []
    monkeypatch.setattr(fused, "_fused_forward", lambda *a: calls.append(a))
    _assert_same(_loss_and_grads(model, batch, fused), plain)
    assert calls == []


def _gpu_benchmark() -> Any:
    from support.scripts import load_script

    return load_script("benchmarks/gpu_trainer.py")


def test_the_gpu_benchmarks_kernel_probe_tells_a_wrong_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """benchmarks/gpu_trainer.py checks the kernel (soft-capped branch included) against the
    plain loss before timing it: the kernel passes, one that scales its loss by 1 % fails.
    The soft-capped variants cannot run under the interpreter: each is reported on its own."""
    probe = _gpu_benchmark().probe_fused
    got = probe("cpu", tokens=64, hidden=32, vocab=256)
    assert got["float32"]["ok"] and got["bfloat16"]["ok"], got
    assert got["float32"]["loss_rel_diff"] < 1e-6
    assert "error" in got["float32 softcap 30"] and not got["ok"]

    import kubetune_trainer.loss as loss_module

    kernel = loss_module.fused_kernel()

    class Scaled:
        @staticmethod
        def apply(*args: Any) -> Any:
            loss, *rest = kernel.apply(*args)
            return (loss * 1.01, *rest)

    monkeypatch.setattr(loss_module, "fused_kernel", lambda: Scaled)
    wrong = probe("cpu", tokens=64, hidden=32, vocab=256)
    assert not wrong["float32"]["ok"]
    assert wrong["float32"]["loss_rel_diff"] == pytest.approx(0.01, rel=1e-3)
