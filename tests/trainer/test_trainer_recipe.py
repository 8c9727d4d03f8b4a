"""Single-process training through the real entry point: methods, precisions, output, resume,
signals, OOM, bad config, keep-last-K, metrics."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("peft", reason="trainer tests need the trainer extra")

import torch

from kubetune_trainer.__main__ import main
from kubetune_trainer.contract import (
    EXIT_CONFIG_ERROR,
    EXIT_OK,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
)
from kubetune_trainer.recipe import SftRecipe, recipe_for
from support.trainer import (
    checkpoint_names,
    load_config,
    read_log,
    step_losses,
    trainer_config,
    trainer_results,
    worker_env,
    write_config,
)
from support.waiting import wait_for

pytestmark = pytest.mark.trainer

# Step-exact resume: same process count and order of operations, so losses match bit for bit
# in fp32 on CPU; the bound leaves room for nothing but float noise.
RESUME_TOLERANCE = 1e-6


def run_main(tmp: Path, cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch | None = None) -> int:
    term_log = tmp / "termination-log"
    if monkeypatch is not None:
        monkeypatch.setenv("KUBETUNE_TERMINATION_LOG", str(term_log))
    return main(["--config", str(write_config(tmp, cfg))])


def signal_at_forward(monkeypatch: pytest.MonkeyPatch, n: int, sig: int = signal.SIGTERM) -> None:
    """Deliver a real signal to this process during the n-th micro-batch forward."""
    original = SftRecipe._forward_loss
    calls = {"n": 0}

    def forward(self: SftRecipe, batch: Any) -> torch.Tensor:
        if self.model.training:
            calls["n"] += 1
            if calls["n"] == n:
                os.kill(os.getpid(), sig)
        return original(self, batch)

    monkeypatch.setattr(SftRecipe, "_forward_loss", forward)


# ------------------------------------------------------------------ methods


@pytest.mark.parametrize(
    ("method", "arch", "precision"),
    [
        ("full", "qwen2", "fp32"),
        ("lora", "llama", "fp32"),
        ("qlora", "llama", "bf16"),
        ("lora", "qwen2", "bf16"),
        ("full", "llama", "amp-bf16"),
    ],
)
def test_each_method_trains_and_exports(
    tmp_path: Path,
    request: pytest.FixtureRequest,
    alpaca_data: Path,
    monkeypatch: pytest.MonkeyPatch,
    method: str,
    arch: str,
    precision: str,
) -> None:
    from transformers import AutoModelForCausalLM

    model_dir: Path = request.getfixturevalue(f"tiny_{arch}")
    cfg = trainer_config(
        tmp_path,
        model_dir,
        alpaca_data,
        method,
        training={"precision": precision, "learning_rate": 5e-3 if method != "full" else 2e-3},
    )
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_OK
    losses = step_losses(tmp_path / "metrics.jsonl")
    assert sorted(losses) == list(range(1, 9))
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[8] < losses[1], losses
    out = tmp_path / "out"
    summary = json.loads((out / "trainer_summary.json").read_text())
    assert summary["step"] == 8 and summary["method"] == method
    # The result the operator reads: the trainer's own numbers of its last step.
    (result,) = trainer_results(tmp_path / "termination-log")
    assert result.outcome == "completed" and result.early_stopping is None
    assert (result.step, result.total_steps) == (8, 8)
    assert result.loss == losses[8] == summary["loss"]
    assert result.tokens_seen == summary["tokens_seen"] > 0
    if method == "full":
        trained = AutoModelForCausalLM.from_pretrained(str(out / "model"))
        base = AutoModelForCausalLM.from_pretrained(str(model_dir))
        assert trained.config.tie_word_embeddings == base.config.tie_word_embeddings
        w0 = base.model.layers[0].mlp.up_proj.weight
        w1 = trained.model.layers[0].mlp.up_proj.weight.float()
        assert not torch.allclose(w0, w1)
        assert (out / "model" / "tokenizer.json").is_file()
        tok_config = json.loads((out / "model" / "tokenizer_config.json").read_text())
        assert (
            tok_config.get("chat_template") and not (out / "model" / "chat_template.jinja").exists()
        )
    else:
        from peft import PeftModel

        assert (out / "adapter" / "adapter_model.safetensors").is_file()
        base = AutoModelForCausalLM.from_pretrained(str(model_dir))
        peft = PeftModel.from_pretrained(base, str(out / "adapter"))
        lora_b = [p for n, p in peft.named_parameters() if "lora_B" in n]
        assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # B starts at zero


def test_qlora_gradients_match_dequantized_weights(tiny_llama: Path, alpaca_data: Path) -> None:
    """QLoRA's adapter gradients equal those of the same adapters on the dequantized base."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from kubetune_trainer.distributed import init_distributed
    from kubetune_trainer.modeling import build_model

    cfg = load_config(
        trainer_config(
            Path("/unused"),
            tiny_llama,
            alpaca_data,
            "qlora",
            training={"gradient_checkpointing": False},
            lora={"rank": 4, "alpha": 8, "dropout": 0.0},
        )
    )
    torch.manual_seed(0)
    built = build_model(cfg, init_distributed())
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    for name, module in built.core.get_base_model().named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            w = bnbf.dequantize_4bit(module.weight.data, module.weight.quant_state)
            target = reference.get_submodule(name.replace(".base_layer", ""))
            target.weight.data.copy_(w.reshape(target.weight.shape).float())
    reference = get_peft_model(
        reference, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    )
    qlora_params = dict(built.core.named_parameters())
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "lora_" in name:
                p.copy_(qlora_params[name].float() + 0.01 * torch.randn_like(p))
                qlora_params[name].copy_(p)  # non-zero B, so gradients reach every A
    ids = torch.randint(10, 400, (2, 24))
    for model in (built.core, reference):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    ref_grads = dict(reference.named_parameters())
    for name, p in qlora_params.items():
        if p.requires_grad:
            want = ref_grads[name].grad
            assert p.grad is not None and want is not None
            torch.testing.assert_close(p.grad.float(), want, rtol=0.05, atol=2e-4)


def test_merged_adapter_matches_base_plus_adapter(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = trainer_config(
        tmp_path,
        tiny_llama,
        alpaca_data,
        "lora",
        output={"merge_adapter": True},
        training={"max_steps": 4, "learning_rate": 1e-2},
    )
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_OK
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out" / "merged")).eval()
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    peft = PeftModel.from_pretrained(base, str(tmp_path / "out" / "adapter")).eval()
    ids = torch.tensor([[1, 20, 30, 40, 50, 60]])
    with torch.no_grad():
        torch.testing.assert_close(
            merged(input_ids=ids).logits, peft(input_ids=ids).logits, atol=1e-4, rtol=1e-4
        )
    assert (tmp_path / "out" / "merged" / "tokenizer.json").is_file()


@pytest.mark.parametrize("fmt", ["sharegpt", "chat", "instruction-response", "text"])
def test_other_formats_train(
    tmp_path: Path, tiny_qwen2: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    from kubetune_trainer.tiny import make_records, write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", make_records(fmt, 48))
    cfg = trainer_config(
        tmp_path,
        tiny_qwen2,
        data,
        "lora",
        dataset={"format": fmt, "validation_split": 0.1},
        training={"max_steps": 3, "packing": fmt != "chat"},
        checkpoint={"interval_steps": None},
    )
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_OK
    evals = read_log(tmp_path / "metrics.jsonl", "eval")
    assert evals and math.isfinite(evals[-1]["eval_loss"])


@pytest.mark.parametrize("optimizer", ["adamw-8bit", "paged-adamw-32bit"])
def test_bitsandbytes_optimizer_checkpoints_and_resumes(
    tmp_path: Path,
    tiny_llama: Path,
    alpaca_data: Path,
    monkeypatch: pytest.MonkeyPatch,
    optimizer: str,
) -> None:
    cfg = trainer_config(
        tmp_path,
        tiny_llama,
        alpaca_data,
        "lora",
        training={"optimizer": optimizer, "max_steps": 4},
        checkpoint={"interval_steps": 2},
    )
    signal_at_forward(monkeypatch, 5)  # during step 3
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_PREEMPTED
    monkeypatch.undo()
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_OK
    start = read_log(tmp_path / "metrics.jsonl", "start")
    assert start[-1]["resumed_from"].endswith("step-2")


@pytest.mark.parametrize(
    ("optimizer", "cls", "state_dtype"),
    [
        ("adamw", "AdamW", torch.float32),
        ("adamw-8bit", "AdamW8bit", torch.uint8),
        ("paged-adamw-8bit", "PagedAdamW8bit", torch.uint8),
        ("paged-adamw-32bit", "PagedAdamW32bit", torch.float32),
    ],
)
def test_each_optimizer_name_builds_its_optimizer(
    optimizer: str, cls: str, state_dtype: torch.dtype
) -> None:
    from kubetune_trainer.contract import TrainerConfig
    from kubetune_trainer.recipe import build_optimizer

    cfg = TrainerConfig.model_validate(
        trainer_config(Path("/tmp"), Path("/m"), Path("/d"), training={"optimizer": optimizer})
    )
    model = torch.nn.Linear(64, 64, bias=False)
    opt = build_optimizer(cfg, model, torch.device("cpu"))
    assert type(opt).__name__ == cls
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    state = opt.state[model.weight]
    first = state.get("exp_avg", state.get("state1"))
    assert first is not None and first.dtype == state_dtype


# ------------------------------------------------------------------ resume


def test_interrupted_and_resumed_run_matches_uninterrupted(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM in the middle of step 4 (between micro-batches): the step is aborted, step-3 is
    written, and the resumed run reproduces the uninterrupted loss curve (LoRA dropout on, so
    the RNG state must be restored exactly too)."""
    base = {"training": {"max_steps": 8}, "checkpoint": {"interval_steps": None}}
    a = trainer_config(tmp_path / "a", tiny_llama, alpaca_data, "lora", **base)
    assert run_main(tmp_path / "a", a, monkeypatch) == EXIT_OK

    b = trainer_config(tmp_path / "b", tiny_llama, alpaca_data, "lora", **base)
    signal_at_forward(monkeypatch, 2 * 3 + 1)  # 1st micro-batch of step 4; seen before the 2nd
    assert run_main(tmp_path / "b", b, monkeypatch) == EXIT_PREEMPTED
    monkeypatch.undo()
    ckpts = checkpoint_names(tmp_path / "b" / "ckpt")
    assert ckpts == ["step-3"]
    preempted = read_log(tmp_path / "b" / "metrics.jsonl", "preempted")
    assert preempted and preempted[0]["signal_to_checkpoint_seconds"] < 30
    assert run_main(tmp_path / "b", b, monkeypatch) == EXIT_OK

    want = step_losses(tmp_path / "a" / "metrics.jsonl")
    got = step_losses(tmp_path / "b" / "metrics.jsonl")
    assert sorted(got) == sorted(want) == list(range(1, 9))
    diff = max(abs(want[s] - got[s]) for s in want)
    print(f"resume max |loss diff| = {diff:.3g}")
    assert diff <= RESUME_TOLERANCE
    ta = json.loads((tmp_path / "a" / "ckpt" / "step-8" / "trainer_state.json").read_text())
    tb = json.loads((tmp_path / "b" / "ckpt" / "step-8" / "trainer_state.json").read_text())
    assert ta["tokens_seen"] == tb["tokens_seen"] and ta["data"] == tb["data"]


def test_killed_run_resumes_from_last_checkpoint(
    tmp_path: Path, tiny_qwen2: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL (no chance to checkpoint) after step-4 exists: resume from it, same curve."""
    common = {
        "training": {"max_steps": 12, "micro_batch_size": 4, "gradient_accumulation": 4},
        "checkpoint": {"interval_steps": 4},
    }
    a = trainer_config(tmp_path / "a", tiny_qwen2, alpaca_data, "full", **common)
    assert run_main(tmp_path / "a", a, monkeypatch) == EXIT_OK

    b = trainer_config(tmp_path / "b", tiny_qwen2, alpaca_data, "full", **common)
    path = write_config(tmp_path / "b", b)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kubetune_trainer", "--config", str(path)],
        env=worker_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    first = tmp_path / "b" / "ckpt" / "step-4" / "trainer_state.json"

    def checkpointed() -> bool:
        assert proc.poll() is None, "trainer ended before its first checkpoint"
        return first.exists()

    try:
        wait_for("the first checkpoint", checkpointed, 120, 0.05)
        proc.kill()
    finally:
        proc.wait(timeout=30)
    assert run_main(tmp_path / "b", b, monkeypatch) == EXIT_OK
    want = step_losses(tmp_path / "a" / "metrics.jsonl")
    got = step_losses(tmp_path / "b" / "metrics.jsonl")
    assert max(abs(want[s] - got[s]) for s in want) <= RESUME_TOLERANCE


def test_keep_last_k_and_incomplete_checkpoints_are_ignored(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = trainer_config(
        tmp_path,
        tiny_llama,
        alpaca_data,
        "lora",
        training={"max_steps": 6},
        checkpoint={"interval_steps": 1, "keep": 3},
    )
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_OK
    ckpt = tmp_path / "ckpt"
    assert checkpoint_names(ckpt) == ["step-4", "step-5", "step-6"]
    # A half-written newer folder, an interrupted temp folder and a damaged newest checkpoint:
    (ckpt / "step-99").mkdir()
    (ckpt / "step-99" / ".metadata").write_bytes(b"partial")
    (ckpt / ".tmp-step-7").mkdir()
    for f in (ckpt / "step-6").glob("*.distcp"):
        f.unlink()
    cfg["training"]["max_steps"] = 8
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_OK
    start = read_log(tmp_path / "metrics.jsonl", "start")[-1]
    assert start["resumed_from"].endswith("step-5")
    names = checkpoint_names(ckpt)
    # Leftovers pruned; the damaged step-6 quarantined (kept for inspection) and rewritten.
    assert [n for n in names if ".corrupt-" not in n] == ["step-6", "step-7", "step-8"], names
    assert len([n for n in names if n.startswith("step-6.corrupt-")]) == 1, names


def test_checkpoint_interval_in_minutes(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = trainer_config(
        tmp_path,
        tiny_llama,
        alpaca_data,
        "lora",
        training={"max_steps": 5},
        checkpoint={"interval_steps": None, "interval_minutes": 1e-6, "keep": 10},
    )
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_OK
    assert len(read_log(tmp_path / "metrics.jsonl", "checkpoint")) == 5


def test_resume_after_finish_only_exports(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = trainer_config(tmp_path, tiny_llama, alpaca_data, "lora", training={"max_steps": 2})
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_OK
    shutil.rmtree(tmp_path / "out")
    monkeypatch.setenv("KUBETUNE_CONFIG", str(tmp_path / "config.json"))  # no --config this time
    assert main([]) == EXIT_OK
    assert len(read_log(tmp_path / "metrics.jsonl", "step")) == 2
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()


# ------------------------------------------------------------------ signals and faults


def test_sigterm_in_subprocess_checkpoints_and_exits_42(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path
) -> None:
    cfg = trainer_config(
        tmp_path,
        tiny_llama,
        alpaca_data,
        "full",
        training={"max_steps": 100000, "total_steps": 100000},
        checkpoint={"interval_steps": None},
    )
    path = write_config(tmp_path, cfg)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kubetune_trainer", "--config", str(path)],
        env=worker_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    log_path = tmp_path / "metrics.jsonl"

    def three_steps() -> bool:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        return log_path.exists() and len(read_log(log_path, "step")) >= 3

    wait_for("three steps", three_steps, 120, 0.05)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - sent
    assert proc.returncode == EXIT_PREEMPTED, err[-2000:]
    event = read_log(log_path, "preempted")[0]
    step = int(event["step"])
    assert (tmp_path / "ckpt" / f"step-{step}" / "trainer_state.json").is_file()
    print(
        f"SIGTERM → checkpoint {event['signal_to_checkpoint_seconds']:.2f}s, → exit {elapsed:.2f}s"
    )
    assert elapsed < 60


def test_sigusr1_stops_with_44(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = trainer_config(
        tmp_path, tiny_llama, alpaca_data, "lora", checkpoint={"interval_steps": None}
    )
    signal_at_forward(monkeypatch, 3, signal.SIGUSR1)
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_STOPPED
    assert (tmp_path / "ckpt" / "step-1" / "trainer_state.json").is_file()


def test_simulated_oom_exits_43_with_peak_memory(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = trainer_config(tmp_path, tiny_llama, alpaca_data, "lora", faults={"oom_at_step": 3})
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_OOM
    (result,) = trainer_results(tmp_path / "termination-log")
    oom = result.out_of_memory
    assert result.outcome == "out_of_memory" and oom is not None
    assert oom.peak_gib > 0 and oom.step == 3 and oom.phase == "train"
    assert "step 3, rank 0" in oom.message
    # Two steps finished before the one that ran out.
    assert (result.step, result.total_steps) == (2, 8) and result.tokens_seen
    assert read_log(tmp_path / "metrics.jsonl", "oom")


def test_min_step_seconds_paces_every_step(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = trainer_config(
        tmp_path, tiny_llama, alpaca_data, "lora", faults={"min_step_seconds": 0.3}
    )
    assert run_main(tmp_path, cfg, monkeypatch) == 0
    steps = read_log(tmp_path / "metrics.jsonl", "step")
    assert len(steps) == 8
    assert all(e["step_seconds"] >= 0.3 for e in steps), [e["step_seconds"] for e in steps]
    assert steps[-1]["time"] - steps[0]["time"] >= 7 * 0.3


def test_bad_config_and_bad_data_exit_2(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a"}\n')
    cfg = trainer_config(tmp_path, tiny_llama, bad, "lora")
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_CONFIG_ERROR
    assert (
        "bad.jsonl:2: alpaca record needs a string field 'output'"
        in (tmp_path / "termination-log").read_text()
    )

    cfg = trainer_config(tmp_path, tmp_path / "no-model", alpaca_data, "lora")
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_CONFIG_ERROR
    cfg = trainer_config(tmp_path, tiny_llama, alpaca_data, "lora", contract_version=99)
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_CONFIG_ERROR
    cfg = trainer_config(tmp_path, tiny_llama, alpaca_data, "lora", lora=None)
    assert run_main(tmp_path, cfg, monkeypatch) == EXIT_CONFIG_ERROR
    monkeypatch.delenv("KUBETUNE_CONFIG", raising=False)
    assert main([]) == EXIT_CONFIG_ERROR


# ------------------------------------------------------------------ metrics


def test_metrics_endpoint_and_json_log(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    monkeypatch.setenv("KUBETUNE_METRICS_ADDR", "127.0.0.1")

    cfg = trainer_config(
        tmp_path,
        tiny_llama,
        alpaca_data,
        "lora",
        dataset={"validation_split": 0.1},
        training={"max_steps": 4},
    )
    recipe = recipe_for(load_config(cfg))
    try:
        recipe.setup()
        recipe.train()
        port = recipe.metrics.port
        assert port
        # Bound to loopback only, as KUBETUNE_METRICS_ADDR asks.
        assert recipe.metrics._server.server_address[0] == "127.0.0.1"
        body = (
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        )
    finally:
        recipe.cleanup()
    samples = {s.name: s.value for fam in text_string_to_metric_families(body) for s in fam.samples}
    for name in (
        "loss",
        "eval_loss",
        "learning_rate",
        "step",
        "total_steps",
        "epoch",
        "tokens_per_second",
        "samples_per_second",
        "mfu_ratio",
        "memory_allocated_peak_bytes",
        "memory_reserved_peak_bytes",
        "checkpoint_save_seconds",
        "last_checkpoint_step",
        "tokens_seen_total",
    ):
        assert f"kubetune_trainer_{name}" in samples, name
    assert samples["kubetune_trainer_step"] == 4 == samples["kubetune_trainer_total_steps"]
    assert samples["kubetune_trainer_last_checkpoint_step"] == 4
    assert samples["kubetune_trainer_epoch"] > 0
    assert samples["kubetune_trainer_tokens_seen_total"] == recipe.tokens_seen > 0
    assert samples["kubetune_trainer_tokens_per_second"] > 0
    assert math.isfinite(samples["kubetune_trainer_eval_loss"])
    assert math.isnan(samples["kubetune_trainer_mfu_ratio"])  # no MFU on CPU
    assert samples["kubetune_trainer_memory_reserved_peak_bytes"] > 2**20
    assert samples["kubetune_trainer_run_info"] == 1.0
    assert read_log(tmp_path / "metrics.jsonl", "start")[0]["metrics_port"] == port
    steps = read_log(tmp_path / "metrics.jsonl", "step")
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert {"loss", "learning_rate", "tokens_per_second", "tokens_seen_total"} <= set(steps[-1])
