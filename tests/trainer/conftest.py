"""Fixtures for the trainer tests: tiny models built once per session, and a launcher runner.

Nothing here imports torch at import time, so collecting the suite without the trainer extra
works (each test module skips itself).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from support.trainer import TINY_TIMEOUT_S, launcher_cmd, worker_env


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> None:
    """One intra-op thread: on a shared 2-core machine, spinning OpenMP threads that are
    oversubscribed make tiny-model steps a hundred times slower."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kubetune_trainer.tiny import make_model

    return make_model(tmp_path_factory.mktemp("models") / "llama", arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kubetune_trainer.tiny import make_model

    return make_model(tmp_path_factory.mktemp("models") / "qwen2", arch="qwen2")


@pytest.fixture(scope="session")
def alpaca_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kubetune_trainer.tiny import make_records, write_jsonl

    return write_jsonl(
        tmp_path_factory.mktemp("data") / "alpaca.jsonl", make_records("alpaca", 160)
    )


@pytest.fixture
def run_launcher() -> Callable[..., subprocess.CompletedProcess[str]]:
    def run(config: Path, nproc: int = 2, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            launcher_cmd(config, nproc),
            env=worker_env(**env),
            capture_output=True,
            text=True,
            timeout=TINY_TIMEOUT_S,
        )

    return run
