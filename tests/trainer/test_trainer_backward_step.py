"""The optimizer step inside backward (`kubetune_trainer.backward_step`): the same updates as
the ordinary step without clipping, one gradient alive at a time, the gradient norm still
reported, step-exact resume, FSDP2 over two processes as one process, and the setups it
refuses."""

from __future__ import annotations

import math
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("peft", reason="trainer tests need the trainer extra")

import torch

from kubetune_trainer.__main__ import main
from kubetune_trainer.backward_step import OptimizerInBackward, refusal
from kubetune_trainer.contract import EXIT_CONFIG_ERROR, EXIT_OK, TrainerConfig
from kubetune_trainer.loss import loss_sum
from support.trainer import read_log, step_losses, trainer_config, write_config

pytestmark = pytest.mark.trainer

Runner = Callable[..., subprocess.CompletedProcess[str]]

# fp32 on CPU; two ranks sum a step's gradients in another order than one.
STEP_ATOL = 1e-6
CROSS_WORLD_TOLERANCE = 1e-4


def _model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.train()
    return model


def _batch(vocab: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, 24), generator=g)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": None, "position_ids": None}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: a tied embedding, one hook
def test_the_same_updates_as_the_ordinary_step_without_clipping(
    request: pytest.FixtureRequest, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path: Path = request.getfixturevalue(f"tiny_{arch}")
    plain, hooked = _model(path), _model(path)
    make = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)  # noqa: E731
    plain_opt, hooked_opt = make(plain), make(hooked)
    trained = [p for p in hooked.parameters() if p.requires_grad]

    alive: list[int] = []
    step = OptimizerInBackward._step

    def counting(self: OptimizerInBackward, param: torch.Tensor) -> None:
        alive.append(sum(p.grad is not None for p in trained))
        step(self, param)

    monkeypatch.setattr(OptimizerInBackward, "_step", counting)  # before the hooks bind it
    in_backward = OptimizerInBackward(hooked, hooked_opt)
    unique = len({id(p) for p in trained})
    for i in range(3):
        batch = _batch(plain.config.vocab_size, i)
        loss_sum(plain, **batch).backward()
        want_norm = float(torch.nn.utils.clip_grad_norm_([p for p in plain.parameters()], math.inf))
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

        alive.clear()
        loss_sum(hooked, **batch).backward()
        got_norm = in_backward.finish(sharded=False)
        # every parameter stepped once, each while its own gradient was the only one
        assert len(alive) == unique and set(alive) == {1}
        assert all(p.grad is None for p in trained)
        assert math.isclose(got_norm, want_norm, rel_tol=1e-5), (got_norm, want_norm)
    for (name, want), got in zip(plain.named_parameters(), hooked.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=STEP_ATOL, rtol=1e-5, msg=name)


def _config(tmp: Path, model: Path, data: Path, **training: Any) -> dict[str, Any]:
    return trainer_config(
        tmp,
        model,
        data,
        "full",
        training={
            "micro_batch_size": 4,
            "gradient_accumulation": 1,
            "optimizer_in_backward": True,
            **training,
        },
        checkpoint={"interval_steps": None},
    )


def test_a_preempted_run_resumes_step_exactly(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the real entry point: SIGTERM during step 5's forward. The parameters are
    updated during that step's backward, so the step completes, is checkpointed, and the
    resumed run follows the uninterrupted curve; the gradient norm is reported although
    nothing is clipped."""
    from kubetune_trainer.contract import EXIT_PREEMPTED
    from kubetune_trainer.recipe import SftRecipe

    whole = _config(tmp_path / "whole", tiny_llama, alpaca_data)
    assert main(["--config", str(write_config(tmp_path / "whole", whole))]) == EXIT_OK
    want = step_losses(tmp_path / "whole" / "metrics.jsonl")
    steps = read_log(tmp_path / "whole" / "metrics.jsonl", "step")
    assert all(math.isfinite(s["grad_norm"]) and s["grad_norm"] > 0 for s in steps)

    forward = SftRecipe._forward_loss
    calls = [0]

    def signalled(self: SftRecipe, batch: Any) -> torch.Tensor:
        if self.model.training:
            calls[0] += 1
            if calls[0] == 5:
                os.kill(os.getpid(), signal.SIGTERM)
        return forward(self, batch)

    split = _config(tmp_path / "split", tiny_llama, alpaca_data)
    path = write_config(tmp_path / "split", split)
    with monkeypatch.context() as m:
        m.setattr(SftRecipe, "_forward_loss", signalled)
        assert main(["--config", str(path)]) == EXIT_PREEMPTED
    assert main(["--config", str(path)]) == EXIT_OK
    start = read_log(tmp_path / "split" / "metrics.jsonl", "start")
    assert start[-1]["resumed_from"].endswith("step-5")
    got = step_losses(tmp_path / "split" / "metrics.jsonl")
    assert sorted(got) == sorted(want) == list(range(1, 9))
    diff = max(abs(want[s] - got[s]) for s in want)
    assert diff <= 1e-6, (diff, want, got)


def test_two_sharded_processes_follow_one(
    tmp_path: Path, tiny_qwen2: Path, alpaca_data: Path, run_launcher: Runner
) -> None:
    """FSDP2 runs the hooks on each rank's shard after its reduce-scatter: two processes of
    micro-batch 2 follow one process of micro-batch 4 (the same global batch), tied
    embeddings included."""
    two = _config(tmp_path / "two", tiny_qwen2, alpaca_data, micro_batch_size=2, max_steps=6)
    proc = run_launcher(write_config(tmp_path / "two", two), nproc=2)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    assert "[fsdp]" in proc.stderr
    one = _config(tmp_path / "one", tiny_qwen2, alpaca_data, max_steps=6)
    assert main(["--config", str(write_config(tmp_path / "one", one))]) == EXIT_OK
    want = step_losses(tmp_path / "one" / "metrics.jsonl")
    got = step_losses(tmp_path / "two" / "metrics.jsonl")
    assert sorted(got) == sorted(want) == list(range(1, 7))
    diff = max(abs(want[s] - got[s]) for s in want)
    print(f"optimizer in backward, 1 vs 2 processes: max |loss diff| = {diff:.3g}")
    assert diff <= CROSS_WORLD_TOLERANCE, (diff, want, got)


def test_what_it_cannot_run_is_refused_before_training(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path
) -> None:
    cfg = _config(tmp_path, tiny_llama, alpaca_data, micro_batch_size=2, gradient_accumulation=2)
    assert main(["--config", str(write_config(tmp_path, cfg))]) == EXIT_CONFIG_ERROR
    log = tmp_path / "metrics.jsonl"
    assert not log.exists() or not read_log(log, "step")  # refused before any step

    def why(**parallel: Any) -> str | None:
        base = _config(tmp_path, tiny_llama, alpaca_data)
        return refusal(TrainerConfig.model_validate({**base, "parallel": parallel}))

    assert why() is None
    assert why(nodes=1, gpus_per_node=2, sharding="full") is None
    ddp = why(nodes=1, gpus_per_node=2, sharding="none")
    assert ddp is not None and "DDP" in ddp and "to fix" in ddp
    offload = why(cpu_offload=True)
    assert offload is not None and "cpu_offload" in offload
