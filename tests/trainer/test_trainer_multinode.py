"""Two nodes on CPU: two launchers (one per node) rendezvous through c10d and train as one
FSDP2 world over gloo, as the pods of a multi-node plan do (`--nnodes=2 --rdzv-backend=c10d`,
operator/src/kubetune/control/build/trainer.py). Both "nodes" are processes of this machine and
share the checkpoint folder, as pods share a ReadWriteMany volume.

With the same global batch the two-node curve is the one-node curve, and a checkpoint moves
between layouts (what a re-plan onto more or fewer nodes does): two nodes → one node and one
node → two nodes resume step-exactly, the losses within the tolerance of a different data
parallel split (gradients summed in another order).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("peft", reason="trainer tests need the trainer extra")

from kubetune_trainer.contract import EXIT_OK, EXIT_PREEMPTED
from support.trainer import (
    TINY_TIMEOUT_S,
    launcher_cmd,
    read_log,
    step_losses,
    trainer_config,
    worker_env,
    write_config,
)
from support.waiting import wait_for

pytestmark = pytest.mark.trainer

NODES = 2
PROCS_PER_NODE = 2
MICRO_BATCH = 2
GLOBAL_BATCH = NODES * PROCS_PER_NODE * MICRO_BATCH
STEPS = 10
CROSS_LAYOUT_TOLERANCE = 1e-4
"""fp32: four ranks sum gradients in another order than two ranks accumulating two
micro-batches each; the same layout resumes to 1e-6 (test_trainer_distributed.py)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_cmd(config: Path, port: int, rdzv_id: str) -> list[str]:
    """One node's launcher, as a trainer pod of a two-node plan runs it."""
    return [
        sys.executable,
        "-m",
        "kubetune_trainer.launch",
        f"--nnodes={NODES}",
        f"--nproc-per-node={PROCS_PER_NODE}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={rdzv_id}",
        "--rdzv-conf=join_timeout=120",
        "--max-restarts=0",
        "-m",
        "kubetune_trainer",
        "--config",
        str(config),
    ]


def start_nodes(config: Path) -> list[subprocess.Popen[str]]:
    port, rdzv_id = free_port(), uuid.uuid4().hex[:8]
    return [
        subprocess.Popen(
            node_cmd(config, port, rdzv_id),
            env=worker_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(NODES)
    ]


def wait_nodes(nodes: list[subprocess.Popen[str]]) -> list[tuple[int, str]]:
    out = []
    for proc in nodes:
        try:
            _, err = proc.communicate(timeout=TINY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in nodes:
                p.kill()
            raise
        out.append((int(proc.returncode), err))
    return out


def config(tmp: Path, model: Path, data: Path, *, nodes: int, **faults: Any) -> dict[str, Any]:
    """The same job (global batch 8) laid out on `nodes` × 2 processes: one node makes up
    the missing ranks by accumulating micro-batches."""
    accumulation = GLOBAL_BATCH // (nodes * PROCS_PER_NODE * MICRO_BATCH)
    return trainer_config(
        tmp,
        model,
        data,
        "lora",
        lora={"rank": 4, "alpha": 8, "dropout": 0.0},
        training={
            "total_steps": STEPS,
            "max_steps": STEPS,
            "micro_batch_size": MICRO_BATCH,
            "gradient_accumulation": accumulation,
            "global_batch_size": GLOBAL_BATCH,
        },
        checkpoint={"interval_steps": None},
        faults=faults,
    )


def assert_close(want: dict[int, float], got: dict[int, float]) -> float:
    assert sorted(want) == sorted(got) == list(range(1, STEPS + 1))
    diff = max(abs(want[s] - got[s]) for s in want)
    assert diff <= CROSS_LAYOUT_TOLERANCE, (diff, want, got)
    return diff


def assert_resumed(log: Path, step: int) -> None:
    start = read_log(log, "start")[-1]
    assert str(start["resumed_from"]).endswith(f"step-{step}"), start


def run_two_nodes(path: Path) -> None:
    results = wait_nodes(start_nodes(path))
    for code, err in results:
        assert code == EXIT_OK, err[-3000:]
    assert "[fsdp]" in "".join(err for _, err in results)


def run_one_node(path: Path) -> None:
    proc = subprocess.run(
        launcher_cmd(path, PROCS_PER_NODE),
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=TINY_TIMEOUT_S,
    )
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]


def preempt_mid_run(path: Path, log: Path, nodes: int) -> int:
    """Start the layout, SIGTERM one launcher (one node's pod) after the first step; every
    rank checkpoints and every launcher exits 42. Returns the checkpoint's step."""
    procs = (
        start_nodes(path)
        if nodes == NODES
        else [
            subprocess.Popen(
                launcher_cmd(path, PROCS_PER_NODE),
                env=worker_env(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        ]
    )

    def stepped() -> bool:
        for p in procs:
            assert p.poll() is None, p.communicate()[1][-3000:]
        return log.exists() and bool(read_log(log, "step"))

    wait_for("the first step", stepped, TINY_TIMEOUT_S, 0.02)
    sent = time.monotonic()
    procs[-1].send_signal(signal.SIGTERM)
    results = wait_nodes(procs)
    for code, err in results:
        assert code == EXIT_PREEMPTED, err[-3000:]
    step = int(read_log(log, "preempted")[0]["step"])
    assert 0 < step < STEPS, "the signal must land mid-run"
    assert (log.parent / "ckpt" / f"step-{step}" / "trainer_state.json").is_file()
    print(
        f"{nodes} node(s): SIGTERM to one launcher → every launcher exited 42 after "
        f"{time.monotonic() - sent:.1f}s, checkpoint at step {step}"
    )
    return step


@pytest.fixture(scope="module")
def two_node_curve(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, alpaca_data: Path
) -> dict[int, float]:
    """The uninterrupted run on two nodes × two processes."""
    tmp = tmp_path_factory.mktemp("two-nodes")
    t0 = time.monotonic()
    run_two_nodes(write_config(tmp, config(tmp, tiny_llama, alpaca_data, nodes=NODES)))
    print(f"two nodes × {PROCS_PER_NODE} processes, {STEPS} steps: {time.monotonic() - t0:.1f}s")
    return step_losses(tmp / "metrics.jsonl")


def test_two_nodes_follow_the_one_node_curve(
    tmp_path: Path, tiny_llama: Path, alpaca_data: Path, two_node_curve: dict[int, float]
) -> None:
    run_one_node(write_config(tmp_path, config(tmp_path, tiny_llama, alpaca_data, nodes=1)))
    diff = assert_close(two_node_curve, step_losses(tmp_path / "metrics.jsonl"))
    print(f"2 nodes vs 1 node: max |loss diff| = {diff:.3g}")


@pytest.mark.parametrize(("before", "after"), [(NODES, 1), (1, NODES)])
def test_a_checkpoint_moves_between_one_and_two_nodes(
    tmp_path: Path,
    tiny_llama: Path,
    alpaca_data: Path,
    two_node_curve: dict[int, float],
    before: int,
    after: int,
) -> None:
    """A run preempted on one layout resumes on the other (a re-plan onto fewer or more
    nodes): the same volume and log, the other number of ranks."""
    a = tmp_path / "a"
    cfg = config(a, tiny_llama, alpaca_data, nodes=before, min_step_seconds=0.5)
    step = preempt_mid_run(write_config(a, cfg), a / "metrics.jsonl", before)
    b = tmp_path / "b"
    shutil.copytree(a / "ckpt", b / "ckpt")
    shutil.copy(a / "metrics.jsonl", b / "metrics.jsonl")
    path = write_config(b, config(b, tiny_llama, alpaca_data, nodes=after))
    if after == NODES:
        run_two_nodes(path)
    else:
        run_one_node(path)
    assert_resumed(b / "metrics.jsonl", step)
    diff = assert_close(two_node_curve, step_losses(b / "metrics.jsonl"))
    print(f"{before} → {after} node(s) at step {step}: max |loss diff| = {diff:.3g}")
