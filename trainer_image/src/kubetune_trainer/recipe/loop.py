"""The loop every objective shares: setup, then step → evaluate → checkpoint until the last
step (or early stopping), then the output.

Loss is normalised by the number of trained tokens (DPO: pairs) in the whole optimizer step,
over all micro-batches and all ranks: every token weighs the same whatever the padding,
packing or rank it landed on, so 1, 2 or 8 processes with the same global batch follow one
loss curve. What a step computes is the objective's (`sft.SftRecipe`, `dpo.DpoRecipe`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
from abc import abstractmethod
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kubetune_trainer import backward_step
from kubetune_trainer.backward_step import OptimizerInBackward
from kubetune_trainer.checkpoint import Checkpointer, capture_rng, restore_rng
from kubetune_trainer.data import DataPosition, PreparedData, Record, StepBatches, read_records
from kubetune_trainer.datacache import tokenized_data
from kubetune_trainer.distributed import all_reduce_max, all_reduce_sum, init_distributed
from kubetune_trainer.early_stopping import STATE_KEY as EARLY_STOPPING_KEY
from kubetune_trainer.errors import ConfigError, Preempted, StopRequested
from kubetune_trainer.fence import writer_fence
from kubetune_trainer.identity import IDENTITY_KEY, identity
from kubetune_trainer.metrics import ADDR_ENV, DEFAULT_ADDR, TrainerMetrics
from kubetune_trainer.modeling import build_model, load_tokenizer, peak_flops, prefetch_hub_model
from kubetune_trainer.recipe.evaluation import Evaluation
from kubetune_trainer.recipe.memory import peak_memory
from kubetune_trainer.recipe.optim import MAX_GRAD_NORM, build_optimizer, build_scheduler
from kubetune_trainer.recipe.output import write_output
from kubetune_trainer.recipe.result import TrainResult
from kubetune_trainer.recipe.resume import resume_newest

log = logging.getLogger(__name__)


class FineTuneRecipe(Evaluation):
    """One run: `setup`, `train`, `save_checkpoint`, `save_output`, `cleanup`. An objective
    subclasses it with how it prepares its data (`_prepare`), takes a step (`_train_step`)
    and evaluates (`_evaluate`); `recipe_for` picks the one a config asks for."""

    # ------------------------------------------------------------------ the objective's

    @abstractmethod
    def _prepare(self, records: list[Record]) -> PreparedData:
        """The dataset's records as this objective trains on them (tokenized, split)."""

    @abstractmethod
    def _train_step(self, rng_at_start: dict[str, Any]) -> tuple[float, float, float]:
        """One optimizer step: (its loss, tokens, rows), summed over all ranks."""

    def _before_resume(self) -> None:
        """What the objective needs from the initial weights before a checkpoint loads."""

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        with self._in_phase("load"):
            self._setup()

    def _setup(self) -> None:
        cfg = self.cfg
        self.signals.install()
        self.env = init_distributed()
        torch.manual_seed(cfg.training.seed)  # same LoRA init on every rank
        random.seed(cfg.training.seed)
        prefetch_hub_model(cfg, self.env)
        self.tokenizer = load_tokenizer(cfg)
        tokenized = self._load_data()
        self._check_early_stopping()
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.batches = _step_batches(self, self.pad_id)
        self.total_steps = self._total_steps()
        self._build()
        self.metrics = _trainer_metrics(self)
        self.peak_flops = peak_flops(self.env.device)
        self._before_resume()
        with self._in_phase("resume"):
            self._resume()
        self._started(tokenized)

    def _load_data(self) -> float:
        """Read and prepare the data: one tokenized copy per node, memory-mapped by every
        rank (kubetune_trainer.datacache). Returns how many ranks tokenized."""
        cfg, env = self.cfg, self.env

        def prepare() -> PreparedData:
            ds = cfg.dataset
            return self._prepare(read_records(ds.source, ds.kind, ds.revision))

        self.data, self.data_cache = tokenized_data(cfg, env, self.tokenizer, prepare)
        (tokenized,) = all_reduce_sum([float(self.data_cache.source != "read")], env)
        st = self.data.stats
        log.info(
            "data: %d records → %d examples → %d train rows, %d validation rows "
            "(%d truncated, %d without response dropped) in %.1fs (cache: %s%s)%s",
            st.records,
            st.examples,
            st.train_rows,
            st.validation_rows,
            st.truncated,
            st.dropped_no_target,
            self.data_cache.seconds,
            self.data_cache.source,
            f" {self.data_cache.folder}" if self.data_cache.folder else "",
            "".join(f"; {n}" for n in st.notes),
        )
        return tokenized

    def _total_steps(self) -> int:
        t = self.cfg.training
        if t.max_steps is not None:
            return max(1, t.max_steps)
        return max(1, math.ceil(t.epochs * self.batches.steps_per_epoch))

    def _build(self) -> None:
        """The model, its optimizer and schedule, and the checkpointer."""
        cfg, env = self.cfg, self.env
        self.built = build_model(cfg, env)
        self.model = self.built.model
        self.optimizer = build_optimizer(cfg, self.model, env.device)
        self.in_backward = None
        if cfg.training.optimizer_in_backward:
            why = backward_step.refusal(cfg)
            if why is not None:
                raise ConfigError(why)
            self.in_backward = OptimizerInBackward(self.model, self.optimizer)
        self.scheduler = build_scheduler(cfg, self.optimizer, self.total_steps)
        self.checkpointer = Checkpointer(
            cfg.checkpoint.dir,
            keep=cfg.checkpoint.keep,
            env=env,
            adapter_only=self.built.adapter_only,
            fence=writer_fence(cfg, env),
        )
        self.faults.arm(self.checkpointer)

    def _resume(self) -> None:
        """Resume from the newest checkpoint that loads (`recipe.resume`), if any."""
        resumed = resume_newest(
            self.cfg,
            self.env,
            self.checkpointer,
            self.metrics,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            adapter_only=self.built.adapter_only,
        )
        if resumed is None:
            return
        state = resumed.state
        self.step = int(state["step"])
        self.batches.position = DataPosition(**state["data"])
        self.tokens_seen = int(state["tokens_seen"])
        self.samples_seen = int(state["samples_seen"])
        self.last_loss = float(state.get("loss") or math.nan)
        if self.early_stopping is not None:
            self.early_stopping.restore(state.get(EARLY_STOPPING_KEY))
            self.checkpointer.protected = self.early_stopping.best_step
            self._show_early_stopping()
        self.last_checkpoint_step = resumed.step
        self.resumed_from = resumed.path
        self.metrics.add_tokens(self.tokens_seen)
        log.info(
            "resumed from %s (step %d, epoch %.3f)",
            resumed.path,
            resumed.step,
            self.batches.epoch_progress,
        )

    def _started(self, tokenized: float) -> None:
        """Report the run as set up: metrics, the `start` event, a log line."""
        cfg, env, built, st = self.cfg, self.env, self.built, self.data.stats
        self.metrics.set(
            total_steps=self.total_steps,
            step=self.step,
            epoch=self.batches.epoch_progress,
            world_size=env.world_size,
            last_checkpoint_step=self.last_checkpoint_step,
        )
        self.metrics.event(
            "start",
            method=cfg.method,
            objective=cfg.training.objective,
            wrap=built.wrap,
            params=built.n_params,
            trainable_params=built.n_trainable,
            flops_per_token=built.flops_per_token,
            varlen_attention=built.varlen_attention,
            train_rows=st.train_rows,
            validation_rows=st.validation_rows,
            data_cache=self.data_cache.source,
            data_seconds=round(self.data_cache.seconds, 3),
            data_tokenized_ranks=int(tokenized),
            resumed_from=str(self.resumed_from) if self.resumed_from else None,
            metrics_port=self.metrics.port,
        )
        log.info(
            "%s on %d process(es) [%s]: %.1fM params, %.2fM trainable; %d steps of %d rows",
            cfg.method,
            env.world_size,
            built.wrap,
            built.n_params / 1e6,
            built.n_trainable / 1e6,
            self.total_steps,
            self.batches.global_batch,
        )

    # ------------------------------------------------------------------ train

    def train(self) -> TrainResult:
        t_start = time.monotonic()
        interval_steps = self.cfg.checkpoint.interval_steps
        self._last_save_time = time.monotonic()
        while self.step < self.total_steps and not self._patience_ran_out():
            self._check_flags(at_step_start=True)
            rng_at_start = capture_rng()
            t0 = time.monotonic()
            self.faults.before_step(self.step + 1, self.env)
            with self._in_phase("train"):
                self.faults.in_step(self.step + 1)
                loss, tokens, rows = self._train_step(rng_at_start)
            self.faults.pace(t0)
            dt = time.monotonic() - t0
            self.step += 1
            self.batches.advance()
            self.tokens_seen += int(tokens)
            self.samples_seen += int(rows)
            self.last_loss = loss
            self._log_step(loss, tokens, rows, dt)
            due_steps = interval_steps is not None and self.step % interval_steps == 0
            if due_steps or self._time_due():
                self._checkpoint_and_evaluate()
        if self.last_checkpoint_step != self.step:
            self._checkpoint_and_evaluate()
        if self.last_eval_loss is None:
            self.evaluate()
        self.stopped_early = self.step < self.total_steps and self._patience_ran_out()
        if self.early_stopping is not None:
            self._end_early_stopping(self.stopped_early)
        self.metrics.event("finish")
        return self._result(time.monotonic() - t_start)

    def _result(self, seconds: float) -> TrainResult:
        return TrainResult(
            step=self.step,
            total_steps=self.total_steps,
            loss=self.last_loss,
            eval_loss=self.last_eval_loss,
            tokens_seen=self.tokens_seen,
            seconds=seconds,
            early_stopping=self.early_stopping,
            stopped_early=self.stopped_early,
        )

    def _checkpoint_and_evaluate(self) -> None:
        """Checkpoint and evaluate. Without early stopping the checkpoint comes first (it is
        safe before an evaluation can fail); with it the evaluation comes first, so the
        checkpoint records the early-stopping counters of its own step (a resumed run goes
        on counting) and pruning already knows the best step."""
        if self.early_stopping is None:
            self.save_checkpoint()
            self.evaluate()
            return
        if self.evaluate() is not None:
            self._record_evaluation()
        self.save_checkpoint()

    def _time_due(self) -> bool:
        """Rank 0's clock decides, so every rank checkpoints at the same step."""
        minutes = self.cfg.checkpoint.interval_minutes
        due = int(
            self.env.is_main
            and minutes > 0
            and time.monotonic() - self._last_save_time >= minutes * 60
        )
        return bool(all_reduce_max([due], self.env)[0])

    def _check_flags(self, *, at_step_start: bool, rng: dict[str, Any] | None = None) -> None:
        term, stop = all_reduce_max([int(self.signals.term), int(self.signals.stop)], self.env)
        if not (term or stop):
            return
        if not at_step_start:
            # Abort the step in flight: drop its gradients and rewind the RNG it used, so the
            # checkpoint is exactly the state after the last finished step.
            self.optimizer.zero_grad(set_to_none=True)
            if rng is not None:
                restore_rng(rng)
            log.warning("signal received mid-step: step %d aborted", self.step + 1)
        if self.step == 0 and self.resumed_from is None:
            # Nothing trained yet: a relaunch starting over loses nothing.
            raise (Preempted if term else StopRequested)("signal before the first step")
        path = self.save_checkpoint()
        since = time.monotonic() - (self.signals.received_at or time.monotonic())
        kind = "preempted" if term else "stopped"
        self.metrics.event(kind, checkpoint=str(path), signal_to_checkpoint_seconds=since)
        log.warning("%s: checkpoint %s written %.2fs after the signal", kind, path, since)
        if term:
            raise Preempted(f"preempted at step {self.step}; checkpoint {path.name}")
        raise StopRequested(f"stopped at step {self.step}; checkpoint {path.name}")

    def _grad_sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Reduce gradients only on the last micro-batch of a step."""
        model: Any = self.model
        if self.built.wrap == "fsdp":
            model.set_requires_gradient_sync(last)
        elif self.built.wrap == "ddp" and not last:
            no_sync: contextlib.AbstractContextManager[Any] = model.no_sync()
            return no_sync
        return contextlib.nullcontext()

    def _optimizer_step(self) -> None:
        if self.in_backward is not None:
            # Every parameter was stepped by its hook during backward; nothing to clip.
            self._grad_norm = self.in_backward.finish(sharded=self.built.wrap == "fsdp")
            self._lr = float(self.scheduler.get_last_lr()[0])
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            return
        grad_norm = nn.utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.requires_grad], MAX_GRAD_NORM
        )
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self._grad_norm = float(grad_norm)
        self._lr = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _log_step(self, loss: float, tokens: float, rows: float, dt: float) -> None:
        tps = tokens / dt if dt > 0 else 0.0
        allocated, reserved = peak_memory(self.env.device)
        values = {
            "loss": loss,
            "learning_rate": self._lr,
            "step": self.step,
            "epoch": self.batches.epoch_progress,
            "tokens_per_second": tps,
            "samples_per_second": rows / dt if dt > 0 else 0.0,
            "memory_allocated_peak_bytes": allocated,
            "memory_reserved_peak_bytes": reserved,
        }
        if self.peak_flops:
            values["mfu_ratio"] = (
                self.built.flops_per_token * tps / (self.peak_flops * self.env.world_size)
            )
        values.update(self._step_values)
        self.metrics.set(**values)
        self.metrics.add_tokens(tokens)
        extra: dict[str, Any] = {}
        if self.built.offload is not None:  # per micro-batch: what the PCIe link carried
            extra["offloaded_bytes"] = self.built.offload.offloaded_bytes
        self.metrics.event("step", grad_norm=self._grad_norm, step_seconds=dt, **extra)
        if self.env.is_main and (
            self.step == 1 or self.step % 10 == 0 or self.step == self.total_steps
        ):
            log.info(
                "step %d/%d loss %.4f lr %.2e %.0f tok/s",
                self.step,
                self.total_steps,
                loss,
                values["learning_rate"],
                tps,
            )

    # ------------------------------------------------------------------ checkpoint

    def save_checkpoint(self) -> Path:
        with self._in_phase("save"):
            return self._save_checkpoint()

    def _save_checkpoint(self) -> Path:
        state = {
            "step": self.step,
            "total_steps": self.total_steps,
            "epoch": self.batches.epoch_progress,
            "data": self.batches.position.as_dict(),
            "tokens_seen": self.tokens_seen,
            "samples_seen": self.samples_seen,
            "scheduler": _jsonable(self.scheduler.state_dict()),
            "method": self.cfg.method,
            "seed": self.cfg.training.seed,
            "global_batch": self.batches.global_batch,
            "loss": None if math.isnan(self.last_loss) else self.last_loss,
            "job": self.cfg.job.name,
            IDENTITY_KEY: identity(self.cfg),
        }
        if self.early_stopping is not None:
            state[EARLY_STOPPING_KEY] = self.early_stopping.state()
        path, seconds = self.checkpointer.save(
            self.step, self.model, self.optimizer, state, capture_rng()
        )
        self.last_checkpoint_step = self.step
        self._last_save_time = time.monotonic()
        self.metrics.set(checkpoint_save_seconds=seconds, last_checkpoint_step=self.step)
        self.metrics.event(
            "checkpoint",
            path=str(path),
            seconds=seconds,
            bytes=self.checkpointer.last_bytes,
            checksum_seconds=self.checkpointer.last_hash_seconds,
        )
        log.info("checkpoint %s in %.2fs", path, seconds)
        return path

    # ------------------------------------------------------------------ output

    def save_output(self) -> Path:
        """Adapter (PEFT safetensors), merged model if asked, or the full model; rank 0 writes."""
        with self._in_phase("export"):
            return self._save_output()

    def _save_output(self) -> Path:
        summary = self._result(seconds=0.0).summary(self.cfg)
        out = write_output(self.cfg, self.env, self.model, self.built, self.tokenizer, summary)
        self.metrics.event("output", path=str(out))
        return out


def _step_batches(recipe: FineTuneRecipe, pad_id: int) -> StepBatches:
    """This rank's share of every step's rows, in the run's deterministic order."""
    t, env = recipe.cfg.training, recipe.env
    batches = StepBatches(
        recipe.data.train,
        micro_batch=t.micro_batch_size,
        grad_accum=t.gradient_accumulation,
        world_size=env.world_size,
        rank=env.rank,
        seed=t.seed,
        pad_id=pad_id,
    )
    if batches.global_batch != t.global_batch_size:
        log.warning(
            "global batch is micro %d × accumulation %d × %d ranks = %d rows, not the "
            "configured global_batch_size %d",
            t.micro_batch_size,
            t.gradient_accumulation,
            env.world_size,
            batches.global_batch,
            t.global_batch_size,
        )
    return batches


def _trainer_metrics(recipe: FineTuneRecipe) -> TrainerMetrics:
    """Rank 0's metrics endpoint and JSON-lines log (the other ranks' record nothing)."""
    cfg, env = recipe.cfg, recipe.env
    return TrainerMetrics(
        enabled=env.is_main,
        # Port 0 picks a free port (tests); a negative port turns the endpoint off.
        port=cfg.metrics.port if env.is_main and cfg.metrics.port >= 0 else None,
        addr=os.environ.get(ADDR_ENV) or DEFAULT_ADDR,
        log_path=cfg.metrics.log_path,
        labels={
            "job": cfg.job.name,
            "namespace": cfg.job.namespace,
            "method": cfg.method,
            "world_size": str(env.world_size),
        },
    )


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    return repr(value)
