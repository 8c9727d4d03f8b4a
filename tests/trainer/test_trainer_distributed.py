"""Two processes on CPU (gloo, FSDP2) through `python -m kubetune_trainer.launch`.

With the same global batch, one process and two must follow the same loss curve: the loss is
normalised by trained tokens over all ranks, and FSDP2 averages gradients. That equality is the
check that sharding, the rank-0 weight broadcast and the gradient scaling are right.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("peft", reason="trainer tests need the trainer extra")

from kubetune_trainer.contract import EXIT_CONFIG_ERROR, EXIT_OK, EXIT_OOM, EXIT_PREEMPTED
from kubetune_trainer.launch import EXIT_SIGNALLED

pytestmark = pytest.mark.trainer

# Two ranks sum gradients in a different order than one rank accumulating micro-batches.
CROSS_WORLD_TOLERANCE = 1e-4
RESUME_TOLERANCE = 1e-6

Runner = Callable[..., subprocess.CompletedProcess[str]]


pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("peft", reason="trainer tests need the trainer extra")

from kubetune_trainer.__main__ import main  # noqa: E402
from support.trainer import (  # noqa: E402
    TINY_TIMEOUT_S,
    checkpoint_names,
    launcher_cmd,
    read_log,
    step_losses,
    trainer_config,
    trainer_results,
    worker_env,
    write_config,
)
from support.waiting import wait_for  # noqa: E402


def one_process(tmp: Path, cfg: dict[str, Any]) -> dict[int, float]:
    assert main(["--config", str(write_config(tmp, cfg))]) == EXIT_OK
    return step_losses(tmp / "metrics.jsonl")


def assert_close(want: dict[int, float], got: dict[int, float], tol: float) -> float:
    assert sorted(want) == sorted(got)
    diff = max(abs(want[s] - got[s]) for s in want)
    assert diff <= tol, (diff, want, got)
    return diff


def two_rank_config(tmp: Path, model: Path, data: Path, method: str, **over: Any) -> dict[str, Any]:
    over.setdefault("training", {})
    over["training"] = {
        "micro_batch_size": 2,
        "gradient_accumulation": 1,
        "max_steps": 6,
        **over["training"],
    }
    if method != "full":
        over.setdefault("lora", {"rank": 4, "alpha": 8, "dropout": 0.0})
    return trainer_config(tmp, model, data, method, **over)


def one_rank_twin(cfg: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """The same global batch on one rank: micro-batches become accumulation steps."""
    twin = {**cfg, "training": {**cfg["training"], "gradient_accumulation": 2}}
    twin["checkpoint"] = {**cfg["checkpoint"], "dir": str(tmp / "ckpt")}
    twin["output"] = {**cfg["output"], "dir": str(tmp / "out")}
    twin["metrics"] = {**cfg["metrics"], "log_path": str(tmp / "metrics.jsonl")}
    return twin


def start_launcher(config: Path, nproc: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        launcher_cmd(config, nproc),
        env=worker_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_a_step(launcher: subprocess.Popen[str], log: Path) -> None:
    """Wait until the run's metrics log has its first step (failing if the launcher ends)."""

    def stepped() -> bool:
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        return log.exists() and bool(read_log(log, "step"))

    wait_for("the first step", stepped, TINY_TIMEOUT_S, 0.02)


@pytest.mark.parametrize(
    ("method", "arch", "precision", "chunked"),
    [
        ("full", "qwen2", "fp32", False),
        ("qlora", "llama", "fp32", False),
        ("lora", "qwen2", "bf16", False),
        # The chunked loss runs inside the FSDP2 root's forward (tied embeddings as its head);
        # the one-process twin below computes the plain loss.
        ("full", "qwen2", "fp32", True),
    ],
)
def test_two_processes_follow_the_one_process_curve(
    tmp_path: Path,
    request: pytest.FixtureRequest,
    alpaca_data: Path,
    run_launcher: Runner,
    method: str,
    arch: str,
    precision: str,
    chunked: bool,
) -> None:
    model: Path = request.getfixturevalue(f"tiny_{arch}")
    cfg = two_rank_config(
        tmp_path / "two",
        model,
        alpaca_data,
        method,
        training={"precision": precision, "chunked_cross_entropy": chunked},
    )
    proc = run_launcher(write_config(tmp_path / "two", cfg), nproc=2)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    assert "[fsdp]" in proc.stderr
    two = step_losses(tmp_path / "two" / "metrics.jsonl")
    twin = one_rank_twin(cfg, tmp_path / "one")
    twin["training"]["chunked_cross_entropy"] = False
    one = one_process(tmp_path / "one", twin)
    # bf16 compute rounds differently when the batch is split differently.
    tol = CROSS_WORLD_TOLERANCE if precision == "fp32" else 2e-2
    diff = assert_close(one, two, tol)
    print(f"{method}/{arch}/{precision}: 1 vs 2 processes, max |loss diff| = {diff:.3g}")
    out = tmp_path / "two" / "out"
    assert (
        out
        / ("model/model.safetensors" if method == "full" else "adapter/adapter_model.safetensors")
    ).is_file()


def test_two_process_sigterm_checkpoint_and_resume(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, run_launcher: Runner
) -> None:
    """SIGTERM to the launcher → workers checkpoint → launcher exits 42 → resume on two
    processes reproduces the uninterrupted curve; resuming the same checkpoint on ONE process
    (a re-plan to fewer GPUs) reproduces it within the cross-world tolerance."""
    over = {
        "training": {"max_steps": 16},
        "checkpoint": {"interval_steps": None},
    }
    a = two_rank_config(tmp_path / "a", tiny_llama, alpaca_data, "lora", **over)
    proc = run_launcher(write_config(tmp_path / "a", a), nproc=2)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    want = step_losses(tmp_path / "a" / "metrics.jsonl")

    b = two_rank_config(tmp_path / "b", tiny_llama, alpaca_data, "lora", **over)
    path = write_config(tmp_path / "b", b)
    log = tmp_path / "b" / "metrics.jsonl"
    launcher = start_launcher(path, 2)
    wait_for_a_step(launcher, log)
    sent = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=TINY_TIMEOUT_S)
    elapsed = time.monotonic() - sent
    assert launcher.returncode == EXIT_PREEMPTED, err[-3000:]
    event = read_log(log, "preempted")[0]
    step = int(event["step"])
    assert 0 < step < 16, "the signal must land mid-run"
    assert (tmp_path / "b" / "ckpt" / f"step-{step}" / "trainer_state.json").is_file()
    print(
        f"2 processes: SIGTERM → checkpoint {event['signal_to_checkpoint_seconds']:.2f}s "
        f"(step {step}), launcher exit after {elapsed:.2f}s"
    )
    # The same checkpoint, resumed on one process (DCP re-shards 2 → 1).
    c_dir = tmp_path / "c"
    shutil.copytree(tmp_path / "b" / "ckpt", c_dir / "ckpt")
    shutil.copy(log, c_dir / "metrics.jsonl")

    proc = run_launcher(path, nproc=2)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    got = step_losses(log)
    diff = assert_close(want, got, RESUME_TOLERANCE)
    print(f"2-process resume: max |loss diff| = {diff:.3g}")

    c = one_rank_twin(b, c_dir)
    resumed_one = one_process(c_dir, c)
    diff = assert_close(want, resumed_one, CROSS_WORLD_TOLERANCE)
    print(f"2 → 1 process resume: max |loss diff| = {diff:.3g}")


def test_one_worker_runs_in_the_launcher_with_the_same_exit_contract(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, run_launcher: Runner
) -> None:
    """A single-process pod has no torchrun agent: the trainer runs in the launcher's process
    as the one rank of a process group. SIGTERM reaches it directly and it checkpoints and
    exits 42 itself; the relaunch resumes onto the uninterrupted curve."""
    over = {"training": {"max_steps": 12}, "checkpoint": {"interval_steps": None}}
    want = one_process(
        tmp_path / "a", two_rank_config(tmp_path / "a", tiny_llama, alpaca_data, "lora", **over)
    )
    b = two_rank_config(tmp_path / "b", tiny_llama, alpaca_data, "lora", **over)
    path = write_config(tmp_path / "b", b)
    log = tmp_path / "b" / "metrics.jsonl"
    launcher = start_launcher(path, 1)
    wait_for_a_step(launcher, log)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=TINY_TIMEOUT_S)
    assert launcher.returncode == EXIT_PREEMPTED, err[-3000:]
    assert "the trainer runs in the launcher's process" in err
    assert "worker exit codes" not in err  # torchrun's path was not taken
    step = int(read_log(log, "preempted")[0]["step"])
    assert 0 < step < 12, "the signal must land mid-run"
    assert read_log(log, "start")[0]["world_size"] == 1

    proc = run_launcher(path, nproc=1)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    assert "done: step 12/12" in proc.stderr  # flushed before the exit that skips teardown
    assert read_log(log, "start")[-1]["resumed_from"] is not None
    diff = assert_close(want, step_losses(log), RESUME_TOLERANCE)
    print(f"1 process in the launcher: SIGTERM at step {step}, resume max |loss diff| = {diff:.3g}")


def test_one_worker_ends_at_sigterm_before_training_begins(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path
) -> None:
    """In a container the launcher is PID 1, which ignores a signal it has no handler for:
    a SIGTERM while torch is still being imported must end the process (143, what the
    launcher reported when the signal ended its workers under torchrun), not leave it to the
    kubelet's SIGKILL after the grace period."""
    cfg = two_rank_config(tmp_path, tiny_llama, alpaca_data, "lora")
    launcher = start_launcher(write_config(tmp_path, cfg), 1)
    assert launcher.stderr is not None
    for line in launcher.stderr:
        if "the trainer runs in the launcher's process" in line:
            break
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=TINY_TIMEOUT_S)
    assert launcher.returncode == EXIT_SIGNALLED, err[-3000:]
    assert "before the trainer took over" in err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_launcher_reports_oom_and_config_errors(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, run_launcher: Runner
) -> None:
    term = tmp_path / "termination-log"
    cfg = two_rank_config(
        tmp_path / "oom", tiny_llama, alpaca_data, "lora", faults={"oom_at_step": 2}
    )
    proc = run_launcher(
        write_config(tmp_path / "oom", cfg), nproc=2, KUBETUNE_TERMINATION_LOG=str(term)
    )
    assert proc.returncode == EXIT_OOM, proc.stderr[-3000:]
    results = trainer_results(term)  # one per rank that ran out
    assert results and all(r.out_of_memory and r.out_of_memory.peak_gib > 0 for r in results)
    assert {r.out_of_memory.rank for r in results if r.out_of_memory} <= {0, 1}
    assert (tmp_path / "oom" / "ckpt").exists() is False or not checkpoint_names(
        tmp_path / "oom" / "ckpt"
    )

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": null}\n')
    cfg = two_rank_config(tmp_path / "bad", tiny_llama, bad, "lora")
    proc = run_launcher(write_config(tmp_path / "bad", cfg), nproc=2)
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr[-3000:]
    assert "bad.jsonl:2: alpaca record needs a string field 'output'" in proc.stderr
