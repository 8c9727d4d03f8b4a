"""Early stopping (`training.early_stopping`): the counters, a run that stops on a plateau and
exports the best step's weights (SFT and DPO), resume across it, and refusals.

The plateau is made without faults: a `min_delta` larger than any change the metric can make
(a loss never falls by 10, an accuracy never rises by more than 1) means no evaluation after
the first improves, so a run with patience P stops at its (P+1)-th evaluation, whatever the
loss curve looks like."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("peft", reason="trainer tests need the trainer extra")

import torch

from kubetune_trainer.__main__ import main
from kubetune_trainer.contract import (
    EARLY_STOPPED,
    EXIT_CONFIG_ERROR,
    EXIT_OK,
    EXIT_PREEMPTED,
    EarlyStoppingConfig,
)
from kubetune_trainer.early_stopping import EarlyStopping
from kubetune_trainer.recipe import SftRecipe
from kubetune_trainer.tiny import make_preference_records, write_jsonl
from support.trainer import (
    checkpoint_names,
    read_log,
    step_losses,
    trainer_config,
    trainer_results,
    write_config,
)

pytestmark = pytest.mark.trainer

RESUME_TOLERANCE = 1e-6
PLATEAU = {"patience": 2, "min_delta": 10.0, "metric": "eval_loss"}
"""Evaluations at steps 2, 4, 6: step 2 is the best, 4 and 6 do not improve by 10: stop at 6."""


def es_config(tmp: Path, model: Path, data: Path, method: str = "lora", **over: Any) -> dict:
    training = {"max_steps": 10, "total_steps": 10, "early_stopping": PLATEAU}
    training.update(over.pop("training", {}))
    checkpoint = {"interval_steps": 2, "keep": 1, **over.pop("checkpoint", {})}
    return trainer_config(
        tmp,
        model,
        data,
        method,
        dataset={"validation_split": 0.1, **over.pop("dataset", {})},
        training=training,
        checkpoint=checkpoint,
        **over,
    )


def run_main(tmp: Path, cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setenv("KUBETUNE_TERMINATION_LOG", str(tmp / "termination-log"))
    return main(["--config", str(write_config(tmp, cfg))])


def checkpoint_model(path: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint folder, by the trainer's state-dict keys."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = path.parent / f"{path.name}.pt"
    dcp_to_torch_save(str(path), str(flat))
    bundle = torch.load(flat, weights_only=False)
    flat.unlink()
    return {k: v for k, v in bundle["model"].items() if isinstance(v, torch.Tensor)}


def adapter_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    """The exported adapter's tensors, keyed as in the training state dict (PEFT drops the
    adapter name `default` when it saves)."""
    from safetensors.torch import load_file

    out = load_file(str(adapter_dir / "adapter_model.safetensors"))
    return {
        k.replace(".lora_A.weight", ".lora_A.default.weight").replace(
            ".lora_B.weight", ".lora_B.default.weight"
        ): v
        for k, v in out.items()
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got and set(got) <= set(want), sorted(set(got) - set(want))[:3]
    for key, value in got.items():
        assert torch.equal(value.float(), want[key].float()), key


def differs(got: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(v.float(), other[k].float()) for k, v in got.items())


# ------------------------------------------------------------------ the counters


def test_counters_improve_by_more_than_min_delta_and_reset() -> None:
    es = EarlyStopping.from_config(EarlyStoppingConfig(patience=2, min_delta=0.01))
    assert es.update(2.0, 10) and es.best_step == 10
    assert not es.update(1.995, 20)  # better, but not by more than min_delta
    assert es.evaluations_without_improvement == 1 and not es.exhausted
    assert es.update(1.9, 30)  # resets the count
    assert es.evaluations_without_improvement == 0 and es.best_value == 1.9
    assert not es.update(math.nan, 40) and not es.update(1.95, 50)
    assert es.exhausted and es.best_step == 30
    acc = EarlyStopping.from_config(EarlyStoppingConfig(metric="eval_reward_accuracy"))
    assert acc.higher_is_better and acc.update(0.5, 1) and acc.update(0.6, 2)
    assert not acc.update(0.4, 3)
    again = EarlyStopping.from_config(EarlyStoppingConfig(patience=2, min_delta=0.01))
    assert again.restore(json.loads(json.dumps(es.state())))
    assert again.state() == es.state() and again.exhausted
    assert not acc.restore(es.state())  # another metric's counters are not taken


# ------------------------------------------------------------------ runs


def test_plateau_stops_and_exports_the_best_steps_adapter(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = es_config(tmp_path, tiny_llama, alpaca_data, "lora", training={"learning_rate": 5e-3})
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_OK
    assert sorted(step_losses(tmp_path / "metrics.jsonl")) == list(range(1, 7))
    ckpt = tmp_path / "ckpt"
    # keep: 1 prunes every older checkpoint but the best one.
    assert checkpoint_names(ckpt) == ["step-2", "step-6"]
    state = json.loads((ckpt / "step-6" / "trainer_state.json").read_text())
    assert state["early_stopping"]["best_step"] == 2
    assert state["early_stopping"]["evaluations_without_improvement"] == 2

    out = tmp_path / "out"
    exported = adapter_tensors(out / "adapter")
    assert_same(exported, checkpoint_model(ckpt / "step-2"))
    assert differs(exported, checkpoint_model(ckpt / "step-6"))

    summary = json.loads((out / "trainer_summary.json").read_text())
    es = summary["early_stopping"]
    assert summary["step"] == 6 and es["stopped_early"] and es["output_step"] == 2
    assert es["metric"] == "eval_loss" and es["best_value"] == pytest.approx(
        read_log(tmp_path / "metrics.jsonl", "eval")[0]["eval_loss"]
    )
    (event,) = read_log(tmp_path / "metrics.jsonl", EARLY_STOPPED)
    assert event["stopped_at_step"] == 6 and event["best_step"] == 2
    assert event["early_stopped"] == 1.0
    (result,) = trainer_results(tmp_path / "termination-log")
    stopped = result.early_stopping
    assert result.outcome == EARLY_STOPPED and (result.step, result.total_steps) == (6, 10)
    assert stopped is not None and stopped.stopped_early and stopped.best_step == 2
    assert stopped.metric == "eval_loss" and stopped.best_value == es["best_value"]
    assert stopped.patience == 2 and stopped.evaluations_without_improvement == 2
    assert result.loss == summary["loss"] == step_losses(tmp_path / "metrics.jsonl")[6]


def test_full_fine_tune_exports_the_best_steps_model(
    tmp_path: Path, tiny_qwen2: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file

    cfg = es_config(tmp_path, tiny_qwen2, alpaca_data, "full")
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_OK
    exported = load_file(str(tmp_path / "out" / "model" / "model.safetensors"))
    best = checkpoint_model(tmp_path / "ckpt" / "step-2")
    last = checkpoint_model(tmp_path / "ckpt" / "step-6")
    assert_same(exported, best)
    assert differs(exported, last)


def test_improving_run_is_not_stopped_and_exports_its_best_step(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Patience that never runs out: the run trains to the end; the output is still the
    best evaluation's (here the last one, as the loss falls)."""
    cfg = es_config(
        tmp_path,
        tiny_llama,
        alpaca_data,
        training={"max_steps": 6, "learning_rate": 5e-3, "early_stopping": {"patience": 5}},
    )
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_OK
    assert not read_log(tmp_path / "metrics.jsonl", EARLY_STOPPED)
    summary = json.loads((tmp_path / "out" / "trainer_summary.json").read_text())["early_stopping"]
    evals = {int(e["step"]): e["eval_loss"] for e in read_log(tmp_path / "metrics.jsonl", "eval")}
    assert sorted(evals) == [2, 4, 6]
    best = min(evals, key=lambda s: evals[s])
    assert not summary["stopped_early"] and summary["output_step"] == best
    assert_same(
        adapter_tensors(tmp_path / "out" / "adapter"),
        checkpoint_model(tmp_path / "ckpt" / f"step-{best}"),
    )
    (result,) = trainer_results(tmp_path / "termination-log")
    assert result.outcome == "completed" and result.step == 6
    assert result.early_stopping is not None and not result.early_stopping.stopped_early
    assert result.early_stopping.best_step == best


def test_resume_keeps_the_counters_and_stops_where_an_uninterrupted_run_does(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM during step 5: step-4 holds best step 2 and one evaluation without
    improvement; the resumed run stops at step 6 (one more, not two) with the same losses
    and exports step 2. Run once more after that, it trains nothing and exports again."""
    a = es_config(tmp_path / "a", tiny_llama, alpaca_data)
    assert run_main(tmp_path / "a", a, monkeypatch) == EXIT_OK

    b = es_config(tmp_path / "b", tiny_llama, alpaca_data)
    original = SftRecipe._forward_loss
    calls = {"n": 0}

    def forward(self: SftRecipe, batch: Any) -> torch.Tensor:
        if self.model.training:
            calls["n"] += 1
            if calls["n"] == 2 * 4 + 1:  # the first micro-batch of step 5
                os.kill(os.getpid(), signal.SIGTERM)
        return original(self, batch)

    monkeypatch.setattr(SftRecipe, "_forward_loss", forward)
    assert run_main(tmp_path / "b", b, monkeypatch) == EXIT_PREEMPTED
    monkeypatch.undo()
    ckpt = tmp_path / "b" / "ckpt"
    assert checkpoint_names(ckpt) == ["step-2", "step-4"]
    saved = json.loads((ckpt / "step-4" / "trainer_state.json").read_text())["early_stopping"]
    assert saved["best_step"] == 2 and saved["evaluations_without_improvement"] == 1

    assert run_main(tmp_path / "b", b, monkeypatch) == EXIT_OK
    start = read_log(tmp_path / "b" / "metrics.jsonl", "start")[-1]
    assert start["resumed_from"].endswith("step-4")
    assert start["early_stopping_best_step"] == 2
    assert start["early_stopping_evaluations_without_improvement"] == 1
    want = step_losses(tmp_path / "a" / "metrics.jsonl")
    got = step_losses(tmp_path / "b" / "metrics.jsonl")
    assert sorted(got) == sorted(want) == list(range(1, 7))
    assert max(abs(want[s] - got[s]) for s in want) <= RESUME_TOLERANCE
    (event,) = read_log(tmp_path / "b" / "metrics.jsonl", EARLY_STOPPED)
    assert event["stopped_at_step"] == 6 and event["best_step"] == 2
    best = checkpoint_model(ckpt / "step-2")
    assert_same(adapter_tensors(tmp_path / "b" / "out" / "adapter"), best)

    # After the stop: a relaunch (say, preempted while exporting) trains no further.
    steps_before = len(read_log(tmp_path / "b" / "metrics.jsonl", "step"))
    (tmp_path / "b" / "out" / "adapter" / "adapter_model.safetensors").unlink()
    assert run_main(tmp_path / "b", b, monkeypatch) == EXIT_OK
    assert len(read_log(tmp_path / "b" / "metrics.jsonl", "step")) == steps_before
    assert_same(adapter_tensors(tmp_path / "b" / "out" / "adapter"), best)
    assert len(read_log(tmp_path / "b" / "metrics.jsonl", EARLY_STOPPED)) == 2


def test_dpo_stops_on_reward_accuracy(
    tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_jsonl(tmp_path / "pref.jsonl", make_preference_records(120, seed=1))
    cfg = es_config(
        tmp_path,
        tiny_llama,
        data,
        training={
            "objective": "dpo",
            "packing": False,
            "early_stopping": {"patience": 1, "min_delta": 1.0, "metric": "eval_reward_accuracy"},
        },
    )
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_OK
    (event,) = read_log(tmp_path / "metrics.jsonl", EARLY_STOPPED)
    assert event["stopped_at_step"] == 4 and event["best_step"] == 2
    first_eval = read_log(tmp_path / "metrics.jsonl", "eval")[0]
    assert event["best_value"] == pytest.approx(first_eval["eval_dpo_reward_accuracy"])
    assert_same(
        adapter_tensors(tmp_path / "out" / "adapter"),
        checkpoint_model(tmp_path / "ckpt" / "step-2"),
    )


@pytest.mark.parametrize(
    ("over", "words"),
    [
        ({"dataset": {"validation_split": 0.0}}, "needs validation data"),
        (
            {"training": {"early_stopping": {"metric": "eval_reward_accuracy"}}},
            "needs objective dpo",
        ),
    ],
)
def test_early_stopping_without_what_it_needs_exits_2(
    tmp_path: Path,
    tiny_llama: Path,
    alpaca_data: Path,
    monkeypatch: pytest.MonkeyPatch,
    over: dict[str, Any],
    words: str,
) -> None:
    cfg = es_config(tmp_path, tiny_llama, alpaca_data, **over)
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_CONFIG_ERROR
    message = (tmp_path / "termination-log").read_text()
    assert words in message and "To fix:" in message


def test_two_fsdp_processes_export_the_best_step(
    tmp_path: Path, tiny_qwen2: Path, alpaca_data: Path, run_launcher: Any
) -> None:
    """Under FSDP2 on two processes every rank loads its shards of the best checkpoint
    before the export gathers the full model; rank 0 alone leaves the termination message."""
    from safetensors.torch import load_file

    cfg = es_config(
        tmp_path,
        tiny_qwen2,
        alpaca_data,
        "full",
        training={"micro_batch_size": 1, "gradient_accumulation": 2},
        parallel={"nodes": 1, "gpus_per_node": 2, "sharding": "full"},
    )
    proc = run_launcher(
        write_config(tmp_path, cfg),
        nproc=2,
        KUBETUNE_TERMINATION_LOG=str(tmp_path / "termination-log"),
    )
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    assert "[fsdp]" in proc.stderr
    exported = load_file(str(tmp_path / "out" / "model" / "model.safetensors"))
    assert_same(exported, checkpoint_model(tmp_path / "ckpt" / "step-2"))
    assert differs(exported, checkpoint_model(tmp_path / "ckpt" / "step-6"))
    (result,) = trainer_results(tmp_path / "termination-log")
    assert result.outcome == EARLY_STOPPED and result.step == 6
    assert result.early_stopping is not None and result.early_stopping.best_step == 2
