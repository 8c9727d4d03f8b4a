"""What every part of a recipe shares: the run's counters, the parts setup builds, the
phase it is in (an out-of-memory error names it), and how it ends."""

from __future__ import annotations

import contextlib
import math
import os
import time
from abc import ABC
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kubetune_trainer.backward_step import OptimizerInBackward
from kubetune_trainer.checkpoint import Checkpointer
from kubetune_trainer.contract import (
    OOM_PHASES,
    OutOfMemoryResult,
    TrainerConfig,
    TrainerResult,
)
from kubetune_trainer.data import PreparedData, StepBatches
from kubetune_trainer.datacache import CacheOutcome
from kubetune_trainer.distributed import DistEnv, destroy_distributed
from kubetune_trainer.early_stopping import EarlyStopping
from kubetune_trainer.errors import OutOfMemory, first_line
from kubetune_trainer.metrics import TrainerMetrics
from kubetune_trainer.modeling import BuiltModel
from kubetune_trainer.recipe.faults import Faults
from kubetune_trainer.recipe.memory import peak_memory
from kubetune_trainer.recipe.result import finite
from kubetune_trainer.recipe.signals import SignalFlags


class RecipeState(ABC):
    """The state of one run. The counters start here; the parts below are set by
    `FineTuneRecipe.setup`, in its order."""

    env: DistEnv
    tokenizer: Any
    data: PreparedData
    data_cache: CacheOutcome
    pad_id: int
    batches: StepBatches
    total_steps: int
    built: BuiltModel
    model: nn.Module
    optimizer: torch.optim.Optimizer
    in_backward: OptimizerInBackward | None
    scheduler: torch.optim.lr_scheduler.LambdaLR
    checkpointer: Checkpointer
    metrics: TrainerMetrics
    peak_flops: float | None

    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self.signals = SignalFlags()
        self.faults = Faults(cfg.faults, Path(cfg.checkpoint.dir))
        self.step = 0
        self.tokens_seen = 0
        self.samples_seen = 0
        self.last_loss = math.nan
        self.last_eval_loss: float | None = None
        self.eval_values: dict[str, float] = {}
        """The last evaluation's metrics by early stopping's names (`eval_loss`, ...)."""
        es = cfg.training.early_stopping
        self.early_stopping = EarlyStopping.from_config(es) if es is not None else None
        self.stopped_early = False
        """Patience ran out before the last step (set when training ends)."""
        self.last_checkpoint_step = -1
        self.resumed_from: Path | None = None
        self._grad_norm = math.nan
        self._lr = math.nan
        self._step_values: dict[str, float] = {}
        """What the objective adds to a step's metrics (DPO: its rewards)."""
        self._last_save_time = time.monotonic()
        self.phase = "load"
        """What the run is doing (a key of `contract.OOM_PHASES`): an out-of-memory error
        names it."""

    @contextlib.contextmanager
    def _in_phase(self, phase: str) -> Iterator[None]:
        """Record `phase` while the block runs. An exception leaves it recorded (no
        `finally`), so `run` can say where the run was when it failed."""
        before = self.phase
        self.phase = phase
        self.faults.entering(phase)
        yield
        self.phase = before

    def out_of_memory(self, e: BaseException) -> OutOfMemory:
        """The `OutOfMemory` for a CUDA out-of-memory error `e`, naming the phase it hit."""
        env = getattr(self, "env", None)
        rank = env.rank if env is not None else int(os.environ.get("RANK", "0"))
        allocated, reserved = peak_memory(env.device) if env is not None else (0, 0)
        step = self.step + 1 if self.phase == "train" else self.step
        if hasattr(self, "metrics"):
            self.metrics.set(
                memory_allocated_peak_bytes=allocated, memory_reserved_peak_bytes=reserved
            )
            self.metrics.event("oom", error=str(e)[:500], phase=self.phase)
        where = OOM_PHASES.get(self.phase, self.phase)
        message = (
            f"out of GPU memory while {where} (step {step}, rank {rank}): {first_line(e)[:300]}"
        )
        oom = OutOfMemoryResult(
            peak_gib=round(max(allocated, reserved) / 2**30, 3),
            step=step,
            rank=rank,
            phase=self.phase,
            message=message,
        )
        result = TrainerResult(
            outcome="out_of_memory",
            step=self.step,
            total_steps=getattr(self, "total_steps", None),
            loss=finite(self.last_loss),
            eval_loss=self.last_eval_loss,
            tokens_seen=self.tokens_seen,
            out_of_memory=oom,
        )
        return OutOfMemory(message, result)

    def cleanup(self) -> None:
        if hasattr(self, "metrics"):
            self.metrics.close()
        self.signals.restore()
        destroy_distributed()
