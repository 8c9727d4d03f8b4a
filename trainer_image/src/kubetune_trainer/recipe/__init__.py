"""The fine-tuning recipe: one object per run with setup, train, save_checkpoint, save_output
and cleanup; one recipe per objective.

| module | what |
| --- | --- |
| `loop` | `FineTuneRecipe`: setup, the loop (step → evaluate → checkpoint), the output |
| `sft`, `dpo` | `SftRecipe`, `DpoRecipe`: each objective's data, step and evaluation |
| `evaluation` | what evaluations mean for early stopping, and the best step's weights |
| `state` | the run's counters and parts, its phase, an out-of-memory error's report |
| `resume` | which checkpoint a run starts from, and whose it may take |
| `output` | the adapter, merged or full model, and trainer_summary.json |
| `result` | `TrainResult`, and the contract's `TrainerResult` made from it |
| `faults` | every test fault of `faults.*` |
| `signals`, `optim`, `memory` | SIGTERM/SIGUSR1 flags; optimizer and schedule; peak memory |
"""

from __future__ import annotations

from kubetune_trainer.contract import TrainerConfig
from kubetune_trainer.errors import ConfigError, OutOfMemory
from kubetune_trainer.recipe.dpo import DpoRecipe
from kubetune_trainer.recipe.loop import FineTuneRecipe
from kubetune_trainer.recipe.memory import is_out_of_memory
from kubetune_trainer.recipe.optim import MAX_GRAD_NORM, build_optimizer, warmup_cosine
from kubetune_trainer.recipe.result import TrainResult
from kubetune_trainer.recipe.sft import SftRecipe


def recipe_for(cfg: TrainerConfig) -> FineTuneRecipe:
    """The recipe of the config's objective (`training.objective`)."""
    if cfg.training.objective == "dpo":
        return DpoRecipe(cfg)
    return SftRecipe(cfg)


def run(cfg: TrainerConfig) -> TrainResult:
    """Setup, train, export, cleanup: what the entry point calls."""
    recipe = recipe_for(cfg)
    try:
        recipe.setup()
        result = recipe.train()
        result.output_dir = recipe.save_output()
        return result
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        # The one place CUDA out-of-memory becomes the contract's OOM exit, wherever it hit.
        if isinstance(e, OutOfMemory) or not is_out_of_memory(e):
            raise
        raise recipe.out_of_memory(e) from e
    finally:
        recipe.cleanup()


__all__ = [
    "MAX_GRAD_NORM",
    "ConfigError",
    "DpoRecipe",
    "FineTuneRecipe",
    "SftRecipe",
    "TrainResult",
    "build_optimizer",
    "is_out_of_memory",
    "recipe_for",
    "run",
    "warmup_cosine",
]
