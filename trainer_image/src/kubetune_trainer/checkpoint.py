"""Step checkpoints: `<dir>/step-<N>/`, written atomically, newest complete one resumed.

A checkpoint is written into `<dir>/.tmp-step-<N>/` by every rank (torch.distributed.checkpoint
shards plus one RNG file per rank); after a barrier rank 0 adds `trainer_state.json`, syncs,
and renames the folder to `step-<N>`. A rename within one directory is atomic on POSIX file
systems (and NFS), so a `step-<N>` folder is complete by construction; a crash mid-write leaves
a `.tmp-` folder that the next save removes. Only folders named `step-<N>` that hold both the
DCP `.metadata` and `trainer_state.json` are ever resumed.

Contents of one checkpoint:

| file | what |
| --- | --- |
| `.metadata`, `__<rank>_0.distcp` | DCP: `model` (adapters only for LoRA/QLoRA) and `optim` |
| `trainer_state.json` | step, epoch, data position, tokens/samples seen, LR scheduler, method |
| `rng/rank-<r>.pt` | Python, torch CPU and CUDA RNG states of rank r |

DCP re-shards on load, so a run re-planned onto a different number of GPUs resumes too (the
RNG of ranks that did not exist before is then seeded from the step).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from kubetune_trainer.contract import CHECKPOINT_NAME, CHECKPOINT_TMP_PREFIX, checkpoint_dir_name
from kubetune_trainer.distributed import DistEnv, barrier

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
FORMAT_VERSION = 1


def _is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / STATE_FILE).is_file()


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = CHECKPOINT_NAME.match(p.name)
        if m and p.is_dir() and _is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass
class Restored:
    step: int
    path: Path
    state: dict[str, Any]  # trainer_state.json


class Checkpointer:
    def __init__(self, root: str | Path, *, keep: int, env: DistEnv, adapter_only: bool) -> None:
        self.root = Path(root)
        self.keep = max(1, keep)
        self.env = env
        self.adapter_only = adapter_only

    def _options(self) -> StateDictOptions:
        # Frozen base weights are never saved for LoRA/QLoRA: they are the input model.
        return StateDictOptions(ignore_frozen_params=self.adapter_only)

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        rng: dict[str, Any],
    ) -> tuple[Path, float]:
        """Write step-<step> atomically; returns its path and the seconds it took."""
        t0 = time.monotonic()
        final = self.root / checkpoint_dir_name(step)
        tmp = self.root / f"{CHECKPOINT_TMP_PREFIX}{step}"
        if self.env.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
        barrier()
        if _is_complete(final):  # e.g. SIGTERM right after resuming: nothing new to save
            return final, 0.0
        model_sd, optim_sd = get_state_dict(model, optimizer, options=self._options())
        dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        (tmp / "rng").mkdir(parents=True, exist_ok=True)
        torch.save(rng, tmp / "rng" / f"rank-{self.env.rank}.pt")
        barrier()
        if self.env.is_main:
            state = {
                "format_version": FORMAT_VERSION,
                "adapter_only": self.adapter_only,
                "world_size": self.env.world_size,
                "saved_at": time.time(),
                **trainer_state,
            }
            state_path = tmp / STATE_FILE
            with state_path.open("w") as fh:
                json.dump(state, fh, indent=2, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            _fsync_dir(tmp)
            if final.exists():  # an incomplete leftover with the final name
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            self._prune()
        barrier()
        return final, time.monotonic() - t0

    def _prune(self) -> None:
        done = complete_checkpoints(self.root)
        for _, path in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(path, ignore_errors=True)
        for p in self.root.iterdir():
            # Leftovers of interrupted saves; a step-N folder is only ever made complete (by
            # rename), so an incomplete one was damaged after the fact and never completes.
            broken = CHECKPOINT_NAME.match(p.name) is not None and not _is_complete(p)
            if p.name.startswith(CHECKPOINT_TMP_PREFIX) or broken:
                shutil.rmtree(p, ignore_errors=True)

    def latest(self) -> tuple[int, Path] | None:
        done = complete_checkpoints(self.root)
        return done[-1] if done else None

    def load(
        self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """Load model/optimizer shards and this rank's RNG; returns trainer_state.json."""
        state = json.loads((path / STATE_FILE).read_text())
        model_sd, optim_sd = get_state_dict(model, optimizer, options=self._options())
        wanted = set(model_sd)
        bundle: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        dcp_load(bundle, checkpoint_id=str(path))
        set_state_dict(
            model,
            optimizer,
            model_state_dict=bundle["model"],
            optim_state_dict=bundle["optim"],
            options=StateDictOptions(ignore_frozen_params=self.adapter_only, strict=False),
        )
        missing = wanted - set(bundle["model"])
        if missing:
            raise RuntimeError(f"{path}: checkpoint lacks {sorted(missing)[:3]}")
        rng_file = path / "rng" / f"rank-{self.env.rank}.pt"
        if rng_file.is_file() and state.get("world_size") == self.env.world_size:
            restore_rng(torch.load(rng_file, weights_only=False))
        else:
            seed = int(state.get("seed", 0)) + int(state["step"]) * 7919 + self.env.rank
            random.seed(seed)
            torch.manual_seed(seed)
            log.warning("%s: no RNG state for rank %d; seeded from the step", path, self.env.rank)
        return dict(state)
