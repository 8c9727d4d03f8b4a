"""Early stopping: which evaluation was best, and how many since did not improve on it.

The trainer evaluates at every checkpoint step. With `training.early_stopping` set it
evaluates *before* writing that checkpoint, so the checkpoint's trainer_state.json records
this tracker with the evaluation of its own step: a resumed run goes on counting where the
interrupted one was, and a run resumed after patience ran out stops again at once. The best
step's checkpoint is never pruned (`Checkpointer.protected`), and the run's output is that
step's weights, whether patience ran out or the run reached its last step.

As in HF Transformers' EarlyStoppingCallback, an evaluation improves only when it beats the
best so far by more than `min_delta`; a NaN never does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kubetune_trainer.contract import HIGHER_IS_BETTER, EarlyStoppingConfig, EarlyStoppingMetric

STATE_KEY = "early_stopping"
"""Where a checkpoint's trainer_state.json keeps the tracker."""


@dataclass
class EarlyStopping:
    metric: EarlyStoppingMetric
    patience: int
    min_delta: float = 0.0
    best_value: float | None = None
    best_step: int | None = None
    evaluations_without_improvement: int = 0

    @classmethod
    def from_config(cls, cfg: EarlyStoppingConfig) -> EarlyStopping:
        return cls(metric=cfg.metric, patience=cfg.patience, min_delta=cfg.min_delta)

    @property
    def higher_is_better(self) -> bool:
        return self.metric in HIGHER_IS_BETTER

    def improves(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best_value is None:
            return True
        gain = value - self.best_value if self.higher_is_better else self.best_value - value
        return gain > self.min_delta

    def update(self, value: float, step: int) -> bool:
        """Record the evaluation of `step`; True when it is the new best."""
        if self.improves(value):
            self.best_value, self.best_step = value, step
            self.evaluations_without_improvement = 0
            return True
        self.evaluations_without_improvement += 1
        return False

    @property
    def exhausted(self) -> bool:
        """Patience ran out: `patience` evaluations in a row did not improve."""
        return self.evaluations_without_improvement >= self.patience

    def state(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "best_value": self.best_value,
            "best_step": self.best_step,
            "evaluations_without_improvement": self.evaluations_without_improvement,
        }

    def restore(self, saved: dict[str, Any] | None) -> bool:
        """Take the counters a checkpoint recorded; a checkpoint of a run that watched another
        metric (or none) leaves them at their start. True when restored."""
        if not saved or saved.get("metric") != self.metric:
            return False
        best = saved.get("best_value")
        step = saved.get("best_step")
        self.best_value = None if best is None else float(best)
        self.best_step = None if step is None else int(step)
        self.evaluations_without_improvement = int(saved.get("evaluations_without_improvement", 0))
        return True
