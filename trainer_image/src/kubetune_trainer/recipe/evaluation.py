"""Evaluation as every objective shares it, and early stopping, which reads its results.

Each objective evaluates its own way (`_evaluate`: SFT's cross-entropy, DPO's loss and
rewards); here is when an evaluation counts for early stopping, what the run reports of it,
and how the best step's weights come back at the end (docs/trainer.md, "Early stopping").
"""

from __future__ import annotations

import logging
import math
from abc import abstractmethod
from typing import Any

from kubetune_trainer.checkpoint import complete_checkpoints
from kubetune_trainer.contract import EARLY_STOPPED, checkpoint_dir_name
from kubetune_trainer.errors import CheckpointFailed, ConfigError
from kubetune_trainer.recipe.state import RecipeState

log = logging.getLogger(__name__)


class Evaluation(RecipeState):
    def evaluate(self) -> float | None:
        rows = self.data.validation
        if rows is None:
            return None
        with self._in_phase("eval"):
            return self._evaluate(rows)

    @abstractmethod
    def _evaluate(self, rows: Any) -> float:
        """Evaluate on this rank's share of the validation `rows`; set `last_eval_loss` and
        `eval_values`, report them, and return the loss (the same on every rank)."""

    def _check_early_stopping(self) -> None:
        es = self.early_stopping
        if es is None:
            return
        if self.data.validation is None:
            raise ConfigError(
                "training.early_stopping needs validation data, and dataset.validation_split "
                f"is {self.cfg.dataset.validation_split}. To fix: set a validation split "
                "(e.g. 0.05), or turn early stopping off"
            )
        if es.metric == "eval_reward_accuracy" and self.cfg.training.objective != "dpo":
            raise ConfigError(
                "training.early_stopping.metric eval_reward_accuracy needs objective dpo. "
                "To fix: use metric eval_loss, or objective dpo"
            )

    def _record_evaluation(self) -> None:
        """Count the evaluation just made for early stopping; its best step's checkpoint is
        never pruned."""
        es = self.early_stopping
        assert es is not None
        value = self.eval_values.get(es.metric, math.nan)
        improved = es.update(value, self.step)
        self.checkpointer.protected = es.best_step
        self._show_early_stopping()
        if self.env.is_main:
            log.info(
                "early stopping: %s %.6g at step %d, %s; best %.6g at step %s, "
                "%d of %d evaluations without improvement",
                es.metric,
                value,
                self.step,
                "improved" if improved else "no improvement",
                es.best_value if es.best_value is not None else math.nan,
                es.best_step,
                es.evaluations_without_improvement,
                es.patience,
            )

    def _show_early_stopping(self) -> None:
        es = self.early_stopping
        if es is None:
            return
        self.metrics.set(
            early_stopping_best_step=float(es.best_step if es.best_step is not None else -1),
            early_stopping_best_value=math.nan if es.best_value is None else es.best_value,
            early_stopping_evaluations_without_improvement=es.evaluations_without_improvement,
        )

    def _patience_ran_out(self) -> bool:
        return self.early_stopping is not None and self.early_stopping.exhausted

    def _end_early_stopping(self, stopped_early: bool) -> None:
        """Put the best step's weights back in the model (the output is made from them),
        and say how early stopping ended."""
        es = self.early_stopping
        assert es is not None
        best = es.best_step
        if best is not None and best != self.step:
            self._load_best(best)
        if not stopped_early:
            return
        self.metrics.set(early_stopped=1.0)
        self.metrics.event(
            EARLY_STOPPED,
            stopped_at_step=self.step,
            best_step=best,
            metric=es.metric,
            best_value=es.best_value,
            patience=es.patience,
            min_delta=es.min_delta,
        )
        if self.env.is_main:
            log.info(
                "early stopped at step %d of %d: %s did not improve for %d evaluations; "
                "the output is step %s's (%s %.6g)",
                self.step,
                self.total_steps,
                es.metric,
                es.evaluations_without_improvement,
                best,
                es.metric,
                es.best_value if es.best_value is not None else math.nan,
            )

    def _load_best(self, best: int) -> None:
        """Load the model (and optimizer) state of the best step's checkpoint on every rank,
        as a resume does. Pruning kept it (`Checkpointer.protected`)."""
        path = self.checkpointer.root / checkpoint_dir_name(best)
        if all(step != best for step, _ in complete_checkpoints(self.checkpointer.root)):
            raise CheckpointFailed(
                f"early stopping: the best step's checkpoint {path} is missing or incomplete, "
                "so the output cannot be made from it. To fix: put the folder back and run "
                "the job again (it resumes and exports), or turn early stopping off"
            )
        with self._in_phase("resume"):
            self.checkpointer.load(path, self.model, self.optimizer)
        self.metrics.event("best_checkpoint_loaded", checkpoint=path.name, step=best)
        if self.env.is_main:
            log.info("loaded %s, the best evaluation's weights, for the output", path)
