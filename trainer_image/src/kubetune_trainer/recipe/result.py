"""What a run ended with: the numbers `run` returns, the summary written beside the output,
and the contract's `TrainerResult` that rank 0 leaves in its termination message."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubetune_trainer.contract import (
    EARLY_STOPPED,
    EarlyStoppingResult,
    TrainerConfig,
    TrainerResult,
)
from kubetune_trainer.early_stopping import EarlyStopping


@dataclass
class TrainResult:
    step: int
    total_steps: int
    loss: float
    eval_loss: float | None
    tokens_seen: int
    seconds: float
    output_dir: Path | None = None
    early_stopping: EarlyStopping | None = None
    stopped_early: bool = False
    """Patience ran out before the last step."""

    def result(self) -> TrainerResult:
        """The contract's result of this finished run (the termination message's JSON)."""
        es = self.early_stopping
        outcome = EARLY_STOPPED if self.stopped_early else "completed"
        return TrainerResult(
            outcome=outcome,
            step=self.step,
            total_steps=self.total_steps,
            loss=finite(self.loss),
            eval_loss=self.eval_loss,
            tokens_seen=self.tokens_seen,
            early_stopping=None
            if es is None or es.best_step is None
            else EarlyStoppingResult(
                stopped_early=self.stopped_early,
                best_step=es.best_step,
                metric=es.metric,
                best_value=es.best_value,
                patience=es.patience,
                evaluations_without_improvement=es.evaluations_without_improvement,
            ),
        )

    def summary(self, cfg: TrainerConfig) -> dict[str, Any]:
        """`trainer_summary.json`, written beside the output."""
        summary: dict[str, Any] = {
            "job": cfg.job.name,
            "method": cfg.method,
            "step": self.step,
            "total_steps": self.total_steps,
            "loss": finite(self.loss),
            "eval_loss": self.eval_loss,
            "tokens_seen": self.tokens_seen,
        }
        es = self.early_stopping
        if es is not None:
            summary["early_stopping"] = {
                **es.state(),
                "patience": es.patience,
                "min_delta": es.min_delta,
                "stopped_early": self.stopped_early,
                "stopped_at_step": self.step,
                "output_step": es.best_step,
            }
        return summary


def finite(value: float) -> float | None:
    """`value`, or None for NaN (no step trained yet): JSON has no NaN."""
    return None if math.isnan(value) else value
