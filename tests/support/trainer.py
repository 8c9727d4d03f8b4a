"""Helpers for tests that run the trainer: configs, logs, the environment of its processes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from kubetune_trainer.contract import CONTRACT_VERSION

TINY_TIMEOUT_S = 240


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def trainer_config(
    tmp: Path, model: Path, data: Path, method: str = "lora", **overrides: Any
) -> dict[str, Any]:
    """A small, fast config: fp32, 8 steps, sequence 128, checkpoints under tmp."""
    base: dict[str, Any] = {
        "contract_version": CONTRACT_VERSION,
        "job": {"name": "test", "namespace": "default", "uid": "u1"},
        "method": method,
        "model": {"source": str(model), "kind": "path"},
        "dataset": {
            "source": str(data),
            "kind": "path",
            "format": "alpaca",
            "validation_split": 0.0,
        },
        "lora": None if method == "full" else {"rank": 4, "alpha": 8, "dropout": 0.1},
        "training": {
            "total_steps": 8,
            "max_steps": 8,
            "micro_batch_size": 2,
            "gradient_accumulation": 2,
            "global_batch_size": 4,
            "sequence_length": 128,
            "precision": "fp32",
            "learning_rate": 2e-3,
            "warmup_ratio": 0.1,
            "gradient_checkpointing": True,
            "packing": True,
            "seed": 7,
        },
        "checkpoint": {
            "dir": str(tmp / "ckpt"),
            "interval_steps": 4,
            "interval_minutes": 0,
            "keep": 2,
        },
        "output": {"dir": str(tmp / "out"), "merge_adapter": False},
        "metrics": {"port": 0, "log_path": str(tmp / "metrics.jsonl")},
    }
    return _merge(base, overrides)


def write_config(tmp: Path, cfg: dict[str, Any], name: str = "config.json") -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / name
    path.write_text(json.dumps(cfg, indent=2))
    return path


def load_config(cfg: dict[str, Any]) -> Any:
    from kubetune_trainer.contract import TrainerConfig

    return TrainerConfig.model_validate(cfg)


def trainer_results(path: Path) -> list[Any]:
    """The `TrainerResult`s in a termination-message file, one per line of JSON."""
    from kubetune_trainer.contract import TrainerResult

    return [TrainerResult.model_validate_json(x) for x in path.read_text().splitlines() if x]


def checkpoint_names(folder: Path) -> list[str]:
    """What a checkpoint folder holds, sorted, less the tokenized-data cache (`.data`) that
    every start of the trainer leaves there (kubetune_trainer.datacache)."""
    return sorted(p.name for p in folder.iterdir() if p.name != ".data")


def read_log(path: Path, event: str | None = None) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [x for x in lines if event is None or x["event"] == event]


def step_losses(path: Path) -> dict[int, float]:
    """step → loss from a JSON-lines metrics log (later lines win, as after a resume)."""
    return {int(x["step"]): float(x["loss"]) for x in read_log(path, "step")}


def worker_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra})
    return env


def launcher_cmd(config: Path, nproc: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kubetune_trainer.launch",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "kubetune_trainer",
        "--config",
        str(config),
    ]
