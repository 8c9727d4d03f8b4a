"""The fine-tuning recipe: one object with setup, train, save_checkpoint, save_output, cleanup.

Loss is normalised by the number of trained tokens in the whole optimizer step, over all
micro-batches and all ranks: every token weighs the same whatever the padding, packing or
rank it landed on, so 1, 2 or 8 processes with the same global batch follow one loss curve.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import resource
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kubetune_trainer import backward_step
from kubetune_trainer.backward_step import OptimizerInBackward
from kubetune_trainer.checkpoint import (
    QUARANTINE_MARK,
    STATE_FILE,
    Checkpointer,
    capture_rng,
    complete_checkpoints,
    quarantined_checkpoints,
    restore_rng,
)
from kubetune_trainer.contract import (
    EARLY_STOPPED,
    OOM_PHASES,
    TrainerConfig,
    checkpoint_dir_name,
)
from kubetune_trainer.data import (
    IGNORE_INDEX,
    Batch,
    DataPosition,
    PairRows,
    PreparedData,
    StepBatches,
    eval_batches,
    prepare_data,
    prepare_preference_data,
    read_records,
)
from kubetune_trainer.datacache import tokenized_data
from kubetune_trainer.distributed import (
    DistEnv,
    all_reduce_max,
    all_reduce_sum,
    barrier,
    destroy_distributed,
    init_distributed,
)
from kubetune_trainer.dpo import (
    REFERENCE_FILE,
    DpoSums,
    DpoTerms,
    dpo_loss,
    read_reference,
    write_reference,
)
from kubetune_trainer.early_stopping import STATE_KEY as EARLY_STOPPING_KEY
from kubetune_trainer.early_stopping import EarlyStopping
from kubetune_trainer.errors import (
    CheckpointFailed,
    ConfigError,
    OutOfMemory,
    Preempted,
    StopRequested,
)
from kubetune_trainer.identity import (
    IDENTITY_KEY,
    RESUME_FIELD,
    changed_fields,
    describe,
    identity,
    whose,
)
from kubetune_trainer.loss import loss_sum, sequence_logps
from kubetune_trainer.metrics import ADDR_ENV, DEFAULT_ADDR, TrainerMetrics
from kubetune_trainer.modeling import (
    BuiltModel,
    build_model,
    from_hub,
    import_bitsandbytes,
    load_tokenizer,
    model_source,
    peak_flops,
    prefetch_hub_model,
)

log = logging.getLogger(__name__)

MAX_GRAD_NORM = 1.0


class SignalFlags:
    """SIGTERM/SIGINT: preempt (checkpoint, exit 42). SIGUSR1: stop (checkpoint, exit 44)."""

    def __init__(self) -> None:
        self.term = False
        self.stop = False
        self.received_at: float | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in (
            (signal.SIGTERM, self._on_term),
            (signal.SIGINT, self._on_term),
            (signal.SIGUSR1, self._on_stop),
        ):
            self._previous[sig] = signal.signal(sig, handler)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_term(self, signum: int, _frame: Any) -> None:
        if self.term and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C means now
        self.term = True
        self.received_at = self.received_at or time.monotonic()

    def _on_stop(self, _signum: int, _frame: Any) -> None:
        self.stop = True
        self.received_at = self.received_at or time.monotonic()


def warmup_cosine(warmup_steps: int, total_steps: int) -> Any:
    """Linear warmup from 0, then cosine decay to 0 at total_steps (as HF's default)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def build_optimizer(
    cfg: TrainerConfig, model: nn.Module, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW over trainable parameters; biases and norms get no weight decay."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups: list[dict[str, Any]] = [
        {"params": decay, "weight_decay": cfg.training.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    lr = cfg.training.learning_rate
    name = cfg.training.optimizer
    optimizer_cls: Any
    if name == "adamw":
        optimizer_cls = torch.optim.AdamW
        fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    else:
        bnb: Any = import_bitsandbytes()
        optimizer_cls = {
            "adamw-8bit": bnb.optim.AdamW8bit,
            "paged-adamw-8bit": bnb.optim.PagedAdamW8bit,
            "paged-adamw-32bit": bnb.optim.PagedAdamW32bit,
        }[name]
        fast = {}
    optimizer: torch.optim.Optimizer = optimizer_cls(
        groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, **fast
    )
    return optimizer


def peak_memory(device: torch.device) -> tuple[int, int]:
    """(allocated, reserved) peak bytes; on CPU both are the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return rss, rss


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

    def termination_message(self) -> str | None:
        """The line rank 0 leaves in the termination message on success: how early
        stopping ended (None without early stopping)."""
        es = self.early_stopping
        if es is None or es.best_step is None:
            return None
        head = EARLY_STOPPED if self.stopped_early else "completed"
        return (
            f"{head} step={self.step} best_step={es.best_step} metric={es.metric} "
            f"value={es.best_value!r} patience={es.patience} "
            f"evaluations_without_improvement={es.evaluations_without_improvement}"
        )


class FineTuneRecipe:
    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self.signals = SignalFlags()
        self.env: DistEnv
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
        self._dpo_values: dict[str, float] = {}
        self._last_save_time = time.monotonic()
        self.phase = "load"
        """What the run is doing (a key of `contract.OOM_PHASES`): an out-of-memory error
        names it."""
        self._faults_fired: set[str] = set()

    @contextlib.contextmanager
    def _in_phase(self, phase: str) -> Iterator[None]:
        """Record `phase` while the block runs. An exception leaves it recorded (no
        `finally`), so `run` can say where the run was when it failed."""
        before = self.phase
        self.phase = phase
        if phase == self.cfg.faults.oom_in_phase and phase not in self._faults_fired:
            self._faults_fired.add(phase)
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (simulated by faults.oom_in_phase={phase})"
            )
        yield
        self.phase = before

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        with self._in_phase("load"):
            self._setup()

    def _setup(self) -> None:
        cfg = self.cfg
        self.signals.install()
        self.env = init_distributed()
        env = self.env
        torch.manual_seed(cfg.training.seed)  # same LoRA init on every rank
        random.seed(cfg.training.seed)

        prefetch_hub_model(cfg, env)
        self.tokenizer = load_tokenizer(cfg)
        self.dpo = cfg.training.objective == "dpo"

        def prepare() -> PreparedData:
            records = read_records(cfg.dataset.source, cfg.dataset.kind, cfg.dataset.revision)
            if self.dpo:
                # Pairs are never packed (docs/dpo.md): `packing` is the SFT rows' setting.
                return prepare_preference_data(
                    records,
                    tokenizer=self.tokenizer,
                    sequence_length=cfg.training.sequence_length,
                    validation_split=cfg.dataset.validation_split,
                    seed=cfg.training.seed,
                )
            return prepare_data(
                records,
                fmt=cfg.dataset.format,
                tokenizer=self.tokenizer,
                sequence_length=cfg.training.sequence_length,
                packing=cfg.training.packing,
                validation_split=cfg.dataset.validation_split,
                seed=cfg.training.seed,
            )

        # One tokenized copy per node, memory-mapped by every rank (kubetune_trainer.datacache).
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
        self._check_early_stopping()
        t = cfg.training
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.batches = StepBatches(
            self.data.train,
            micro_batch=t.micro_batch_size,
            grad_accum=t.gradient_accumulation,
            world_size=env.world_size,
            rank=env.rank,
            seed=t.seed,
            pad_id=self.pad_id,
        )
        if self.batches.global_batch != t.global_batch_size:
            log.warning(
                "global batch is micro %d × accumulation %d × %d ranks = %d rows, not the "
                "configured global_batch_size %d",
                t.micro_batch_size,
                t.gradient_accumulation,
                env.world_size,
                self.batches.global_batch,
                t.global_batch_size,
            )
        self.total_steps = self._total_steps()

        self.built: BuiltModel = build_model(cfg, env)
        self.model = self.built.model
        self.optimizer = build_optimizer(cfg, self.model, env.device)
        self.in_backward: OptimizerInBackward | None = None
        if t.optimizer_in_backward:
            why = backward_step.refusal(cfg)
            if why is not None:
                raise ConfigError(why)
            self.in_backward = OptimizerInBackward(self.model, self.optimizer)
        warmup = math.ceil(t.warmup_ratio * self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(warmup, self.total_steps)
        )
        self.checkpointer = Checkpointer(
            cfg.checkpoint.dir,
            keep=cfg.checkpoint.keep,
            env=env,
            adapter_only=self.built.adapter_only,
        )
        self.checkpointer.full_at_step = cfg.faults.disk_full_at_step
        self.metrics = TrainerMetrics(
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
        self.peak_flops = peak_flops(env.device)
        if self.dpo and not self.built.adapter_only:
            with self._in_phase("eval"):
                self._precompute_reference()
        with self._in_phase("resume"):
            self._resume()
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
            wrap=self.built.wrap,
            params=self.built.n_params,
            trainable_params=self.built.n_trainable,
            flops_per_token=self.built.flops_per_token,
            varlen_attention=self.built.varlen_attention,
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
            self.built.wrap,
            self.built.n_params / 1e6,
            self.built.n_trainable / 1e6,
            self.total_steps,
            self.batches.global_batch,
        )

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
        if es.metric == "eval_reward_accuracy" and not self.dpo:
            raise ConfigError(
                "training.early_stopping.metric eval_reward_accuracy needs objective dpo. "
                "To fix: use metric eval_loss, or objective dpo"
            )

    def _total_steps(self) -> int:
        t = self.cfg.training
        if t.max_steps is not None:
            return max(1, t.max_steps)
        return max(1, math.ceil(t.epochs * self.batches.steps_per_epoch))

    def _resume(self) -> None:
        """Resume from the newest checkpoint that matches its manifest and loads; quarantine
        the ones that do not and try the next older one. Another job's checkpoints are moved
        aside first (`_claim_checkpoints`)."""
        from torch.distributed.checkpoint.api import CheckpointException

        ck = self.checkpointer
        ck.remove_leftovers()
        if not self._claim_checkpoints():
            return
        configured = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
        ]
        failed: list[str] = []
        for step, path in reversed(complete_checkpoints(ck.root)):
            problem = ck.verify(path)
            state: dict[str, Any] | None = None
            if problem is None:
                try:
                    saved = json.loads((path / STATE_FILE).read_text())
                except (OSError, ValueError) as e:
                    saved, problem = {}, f"{STATE_FILE} is unreadable ({_first_line(e)})"
                if problem is None and bool(saved.get("adapter_only")) != self.built.adapter_only:
                    log.warning(
                        "%s holds %s weights but this run trains %s; starting from the base model",
                        path,
                        "adapter" if saved.get("adapter_only") else "full",
                        self.cfg.method,
                    )
                    break
            if problem is None:
                try:
                    state = self.checkpointer.load(path, self.model, self.optimizer)
                except (Exception, CheckpointException) as e:  # DCP's error is a BaseException
                    if "out of memory" in str(e).lower():
                        raise  # not the checkpoint's fault: never quarantine for it
                    problem = f"cannot be loaded: {_first_line(e)}"
            if all_reduce_max([int(problem is not None)], self.env)[0]:
                problem = problem or "another rank could not load it"
                moved = ck.quarantine(path, problem)
                self.metrics.event(
                    "checkpoint_quarantined",
                    checkpoint=path.name,
                    moved_to=moved.name,
                    reason=problem,
                )
                log.warning("cannot resume from %s (%s); trying an older one", path, problem)
                failed.append(f"{path.name}: {problem}")
                continue
            assert state is not None
            self.scheduler.load_state_dict(state["scheduler"])
            self._configured_hyperparameters(configured)
            self.step = int(state["step"])
            self.batches.position = DataPosition(**state["data"])
            self.tokens_seen = int(state["tokens_seen"])
            self.samples_seen = int(state["samples_seen"])
            self.last_loss = float(state.get("loss") or math.nan)
            if self.early_stopping is not None:
                self.early_stopping.restore(state.get(EARLY_STOPPING_KEY))
                self.checkpointer.protected = self.early_stopping.best_step
                self._show_early_stopping()
            self.last_checkpoint_step = step
            self.resumed_from = path
            ck.mark_verified(path)
            self.metrics.add_tokens(self.tokens_seen)
            log.info(
                "resumed from %s (step %d, epoch %.3f)", path, step, self.batches.epoch_progress
            )
            return
        if failed:
            # A failed load may have written part of a checkpoint into the model: do not train.
            raise CheckpointFailed(
                f"no checkpoint in {ck.root} can be loaded ({'; '.join(failed)}); each was "
                f"quarantined as <name>{QUARANTINE_MARK}<time>. To fix: delete the quarantined "
                "folders to start over from step 0, or put a good step-N folder back"
            )
        earlier = quarantined_checkpoints(ck.root)
        if earlier and self.resumed_from is None and not complete_checkpoints(ck.root):
            raise CheckpointFailed(
                f"no checkpoint in {ck.root} to resume: {', '.join(p.name for p in earlier)} "
                "could not be loaded earlier and was quarantined. To fix: delete the "
                "quarantined folders to start over from step 0, or put a good step-N folder back"
            )

    def _claim_checkpoints(self) -> bool:
        """Whose the checkpoints in the folder are, by the newest one's identity. This job's,
        the job `checkpoint.resume_from_uid` names (adopted) and an older trainer's (no
        identity) are resumed: True. Another job's are moved aside: False, start at step 0."""
        cfg, ck, main = self.cfg, self.checkpointer, self.env.is_main
        newest = ck.newest_identity()
        if newest is None:
            self._wanted_not_found(None)
            return True
        path, saved = newest
        owner = whose(saved, cfg)
        if saved is None or owner == "unknown":
            if main:
                log.warning(
                    "%s records no job uid (an older trainer, or a run without one, wrote it): "
                    "resumed as this job's",
                    path,
                )
            return True
        old_uid, old_job = str(saved["job_uid"]), saved.get("job_name")
        changed = changed_fields(saved, cfg)
        if owner == "own":
            if changed and main:
                log.info(
                    "resuming this job's checkpoints; changed since they were written: %s",
                    describe(changed),
                )
            return True
        if owner == "adopted":
            self.metrics.event(
                "checkpoint_adopted",
                old_uid=old_uid,
                old_job=old_job,
                checkpoint=path.name,
                changed=changed,
            )
            if main:
                log.warning(
                    "resuming the checkpoints of job %s (uid %s), as %s asks; changed since "
                    "they were written: %s",
                    old_job,
                    old_uid,
                    RESUME_FIELD,
                    describe(changed),
                )
            return True
        target, count = ck.move_aside(old_uid, Path(cfg.output.dir))
        self.metrics.event(
            "checkpoints_moved_aside",
            old_uid=old_uid,
            old_job=old_job,
            moved_to=str(target),
            count=count,
        )
        if main:
            log.warning(
                "%s held checkpoints of another job, %s (uid %s, newest %s): moved to %s "
                "and this run starts at step 0. To resume them instead, set %s: %s on "
                "this job",
                ck.root,
                old_job,
                old_uid,
                path.name,
                target,
                RESUME_FIELD,
                old_uid,
            )
        self._wanted_not_found(old_uid)
        return False

    def _wanted_not_found(self, found_uid: str | None) -> None:
        """Warn when `checkpoint.resume_from_uid` names a job none of whose checkpoints is
        here (the run starts at step 0)."""
        wanted = self.cfg.checkpoint.resume_from_uid
        if not wanted or wanted == self.cfg.job.uid:
            return
        self.metrics.event(
            "resume_from_uid_not_found",
            resume_from_uid=wanted,
            found_uid=found_uid,
            checkpoint_dir=str(self.checkpointer.root),
        )
        if self.env.is_main:
            log.warning(
                "%s is %s but %s holds no checkpoint of that job: this run starts at step 0",
                RESUME_FIELD,
                wanted,
                self.checkpointer.root,
            )

    def _configured_hyperparameters(self, configured: list[dict[str, Any]]) -> None:
        """Loading a checkpoint restores the optimizer's learning rate, weight decay and the
        like; this run's config sets them (they differ only in an adopted checkpoint of another
        job), the checkpoint only the place in the schedule."""
        sched = self.scheduler
        groups = self.optimizer.param_groups
        for group, mine in zip(groups, configured, strict=True):
            group.update(mine)
        sched.base_lrs = [g["initial_lr"] for g in groups]
        lrs = [
            b * f(sched.last_epoch) for b, f in zip(sched.base_lrs, sched.lr_lambdas, strict=True)
        ]
        for group, lr in zip(groups, lrs, strict=True):
            group["lr"] = lr
        sched._last_lr = lrs

    # ------------------------------------------------------------------ train

    def train(self) -> TrainResult:
        cfg = self.cfg
        t_start = time.monotonic()
        interval_steps = cfg.checkpoint.interval_steps
        self._last_save_time = time.monotonic()
        while self.step < self.total_steps and not self._patience_ran_out():
            self._check_flags(at_step_start=True)
            rng_at_start = capture_rng()
            t0 = time.monotonic()
            if cfg.faults.hang_at_step is not None and self.step + 1 == cfg.faults.hang_at_step:
                _hang(self.step + 1)
            if self.step + 1 == cfg.faults.kill_at_step and self.env.rank == cfg.faults.kill_rank:
                _kill_once(Path(cfg.checkpoint.dir), self.step + 1, self.env.rank)
            if self.step + 1 == cfg.faults.host_memory_at_step and self.env.is_main:
                _exhaust_host_memory_once(Path(cfg.checkpoint.dir), self.step + 1)
            with self._in_phase("train"):
                if cfg.faults.oom_at_step is not None and self.step + 1 == cfg.faults.oom_at_step:
                    raise torch.OutOfMemoryError(
                        "CUDA out of memory (simulated by faults.oom_at_step="
                        f"{cfg.faults.oom_at_step})"
                    )
                stats = (
                    self._dpo_train_step(rng_at_start)
                    if self.dpo
                    else self._train_step(rng_at_start)
                )
            if cfg.faults.min_step_seconds is not None:
                time.sleep(max(0.0, cfg.faults.min_step_seconds - (time.monotonic() - t0)))
            dt = time.monotonic() - t0
            self.step += 1
            self.batches.advance()
            loss, tokens, rows = stats
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
        return TrainResult(
            step=self.step,
            total_steps=self.total_steps,
            loss=self.last_loss,
            eval_loss=self.last_eval_loss,
            tokens_seen=self.tokens_seen,
            seconds=time.monotonic() - t_start,
            early_stopping=self.early_stopping,
            stopped_early=self.stopped_early,
        )

    def _checkpoint_and_evaluate(self) -> None:
        """Checkpoint and evaluate. Without early stopping the checkpoint comes first (it is
        safe before an evaluation can fail); with it the evaluation comes first, so the
        checkpoint records the early-stopping counters of its own step (a resumed run goes
        on counting) and pruning already knows the best step."""
        es = self.early_stopping
        if es is None:
            self.save_checkpoint()
            self.evaluate()
            return
        if self.evaluate() is not None:
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
        self.save_checkpoint()

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
        if stopped_early:
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

    def _forward_loss(self, batch: Batch) -> torch.Tensor:
        """Summed cross-entropy over the batch's trained tokens (`kubetune_trainer.loss`)."""
        b = batch.to(self.env.device)
        return loss_sum(
            self.model,
            input_ids=b.input_ids,
            labels=b.labels,
            attention_mask=b.attention_mask,
            position_ids=b.position_ids,
            autocast_dtype=self.built.autocast_dtype,
            chunked=self.built.chunked_loss,
            offload=self.built.offload if self.model.training else None,
            documents=b.documents if self.built.varlen_attention else None,
        )

    def _train_step(self, rng_at_start: dict[str, Any]) -> tuple[float, float, float]:
        env = self.env
        micro = self.batches.next_step()
        local_targets = sum(int((b.labels[:, 1:] != IGNORE_INDEX).sum()) for b in micro)
        (targets,) = all_reduce_sum([float(local_targets)], env)
        scale = env.world_size / max(targets, 1.0)
        loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
        for j, batch in enumerate(micro):
            if j > 0:
                self._check_flags(at_step_start=False, rng=rng_at_start)
            last = j == len(micro) - 1
            with self._grad_sync(last):
                loss = self._forward_loss(batch)
                scaled: Any = loss * scale
                scaled.backward()
            loss_sum += loss.detach()  # no host sync per micro-batch
        self._optimizer_step()
        tokens = sum(b.tokens for b in micro)
        rows = sum(int(b.input_ids.size(0)) for b in micro)
        total_loss, total_tokens, total_rows = all_reduce_sum(
            [float(loss_sum), float(tokens), float(rows)], env
        )
        return total_loss / max(targets, 1.0), total_tokens, total_rows

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

    # ------------------------------------------------------------------ DPO

    def _policy_logps(self, batch: Batch) -> torch.Tensor:
        """Summed log-probabilities of each row's response under the model being trained."""
        b = batch.to(self.env.device)
        return sequence_logps(
            self.model,
            input_ids=b.input_ids,
            labels=b.labels,
            attention_mask=b.attention_mask,
            autocast_dtype=self.built.autocast_dtype,
            chunked=self.built.chunked_loss,
            offload=self.built.offload if self.model.training else None,
        )

    def _reference_logps(self, batch: Batch) -> torch.Tensor:
        """The reference model's: precomputed (full), or the model with its adapters
        switched off (LoRA, QLoRA), without gradients and in eval mode (deterministic)."""
        if batch.ref_logps is not None:
            return batch.ref_logps.to(self.env.device)
        assert self.built.adapter_only, "full fine-tuning precomputes its reference"
        core: Any = self.built.core
        training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), core.disable_adapter():
                b = batch.to(self.env.device)
                logps: torch.Tensor = sequence_logps(
                    self.model,
                    input_ids=b.input_ids,
                    labels=b.labels,
                    attention_mask=b.attention_mask,
                    autocast_dtype=self.built.autocast_dtype,
                    chunked=self.built.chunked_loss,
                )
        finally:
            self.model.train(training)
        return logps

    def _dpo_terms(self, batch: Batch) -> DpoTerms:
        ref = self._reference_logps(batch)
        logps = self._policy_logps(batch)
        half = logps.size(0) // 2
        d = self.cfg.training.dpo
        return dpo_loss(
            logps[:half],
            logps[half:],
            ref[:half],
            ref[half:],
            beta=d.beta,
            label_smoothing=d.label_smoothing,
        )

    def _dummy_pairs(self) -> Batch:
        """One pair of padding, for a rank with nothing left to evaluate: FSDP's all-gathers
        need every rank in every forward."""
        return Batch(
            input_ids=torch.full((2, 2), self.pad_id, dtype=torch.long),
            labels=torch.full((2, 2), IGNORE_INDEX, dtype=torch.long),
            attention_mask=None,
            position_ids=None,
            tokens=0,
            ref_logps=torch.zeros(2),
        )

    def _precompute_reference(self) -> None:
        """Full fine-tuning's reference: every pair's log-probabilities under the initial
        weights, before any checkpoint is loaded (`kubetune_trainer.dpo`). Ranks split the
        pairs and sum what they computed."""
        t0 = time.monotonic()
        env, micro = self.env, self.cfg.training.micro_batch_size
        splits = {
            name: rows
            for name, rows in (("train", self.data.train), ("validation", self.data.validation))
            if isinstance(rows, PairRows)
        }
        folder, fingerprint = self.checkpointer.root, identity(self.cfg)["fingerprint"]
        kept = read_reference(folder, fingerprint, {k: len(v) for k, v in splits.items()})
        # Every rank reads the same file; all use it or all compute (they compute together).
        (readers,) = all_reduce_sum([float(kept is not None)], env)
        if kept is not None and readers == env.world_size:
            for name, rows in splits.items():
                n = len(rows)
                rows.ref_chosen, rows.ref_rejected = kept[name][:n], kept[name][n:]
            self.metrics.event("dpo_reference", source="read", seconds=time.monotonic() - t0)
            log.info("DPO reference log-probabilities read from %s", folder / REFERENCE_FILE)
            return
        computed: dict[str, list[float]] = {}
        self.model.eval()
        for name, rows in splits.items():
            n = len(rows)
            values = [0.0] * (2 * n)
            with torch.no_grad():
                batches = eval_batches(
                    rows,
                    micro_batch=micro,
                    world_size=env.world_size,
                    rank=env.rank,
                    pad_id=self.pad_id,
                )
                for k, batch in enumerate(batches):
                    logps = self._policy_logps(batch if batch is not None else self._dummy_pairs())
                    if batch is None:
                        continue
                    start = (k * env.world_size + env.rank) * micro
                    got = logps.double().cpu().tolist()
                    half = len(got) // 2
                    for j in range(half):
                        values[start + j] = got[j]
                        values[n + start + j] = got[half + j]
            total = all_reduce_sum(values, env) if env.world_size > 1 else values
            rows.ref_chosen, rows.ref_rejected = total[:n], total[n:]
            computed[name] = list(total)
        self.model.train()
        if env.is_main:
            write_reference(folder, fingerprint, computed)
        barrier()
        self.metrics.event("dpo_reference", source="computed", seconds=time.monotonic() - t0)
        log.info("DPO reference log-probabilities precomputed in %.1fs", time.monotonic() - t0)

    def _dpo_train_step(self, rng_at_start: dict[str, Any]) -> tuple[float, float, float]:
        """One optimizer step of DPO: the loss is the mean over the step's pairs, over all
        micro-batches and ranks."""
        env = self.env
        micro = self.batches.next_step()
        local_pairs = sum(int(b.input_ids.size(0)) // 2 for b in micro)
        (pairs,) = all_reduce_sum([float(local_pairs)], env)
        scale = env.world_size / max(pairs, 1.0)
        sums = DpoSums()
        for j, batch in enumerate(micro):
            if j > 0:
                self._check_flags(at_step_start=False, rng=rng_at_start)
            last = j == len(micro) - 1
            with self._grad_sync(last):
                terms = self._dpo_terms(batch)
                scaled: Any = terms.losses.sum() * scale
                scaled.backward()
            sums.add(terms)
        self._optimizer_step()
        tokens = float(sum(b.tokens for b in micro))
        reduced = all_reduce_sum([*sums.as_list(), tokens], env)
        total = DpoSums.from_list(reduced[:-1])
        self._dpo_values = total.means()
        return total.loss / max(total.pairs, 1.0), reduced[-1], total.pairs

    def _grad_sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Reduce gradients only on the last micro-batch of a step."""
        model: Any = self.model
        if self.built.wrap == "fsdp":
            model.set_requires_gradient_sync(last)
        elif self.built.wrap == "ddp" and not last:
            no_sync: contextlib.AbstractContextManager[Any] = model.no_sync()
            return no_sync
        return contextlib.nullcontext()

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
        return OutOfMemory(
            f"out of GPU memory while {where} (step {step}, rank {rank}): {_first_line(e)[:300]}",
            peak_bytes=max(allocated, reserved),
            step=step,
            phase=self.phase,
        )

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
        values.update(self._dpo_values)
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

    # ------------------------------------------------------------------ eval

    def evaluate(self) -> float | None:
        rows = self.data.validation
        if rows is None:
            return None
        with self._in_phase("eval"):
            return self._evaluate(rows)

    def _evaluate(self, rows: Any) -> float:
        if self.dpo:
            return self._evaluate_dpo(rows)
        self.model.eval()
        with torch.no_grad():
            loss_sum, targets = self._eval_sums(rows)
        self.model.train()
        total, n = all_reduce_sum([loss_sum, targets], self.env)
        self.last_eval_loss = total / max(n, 1.0)
        self.eval_values = {"eval_loss": self.last_eval_loss}
        self.metrics.set(eval_loss=self.last_eval_loss)
        self.metrics.event("eval")
        log.info("step %d eval_loss %.4f", self.step, self.last_eval_loss)
        return self.last_eval_loss

    def _evaluate_dpo(self, rows: PairRows) -> float:
        """The DPO loss and rewards on the validation pairs."""
        sums = DpoSums()
        self.model.eval()
        with torch.no_grad():
            for batch in eval_batches(
                rows,
                micro_batch=self.cfg.training.micro_batch_size,
                world_size=self.env.world_size,
                rank=self.env.rank,
                pad_id=self.pad_id,
            ):
                terms = self._dpo_terms(batch if batch is not None else self._dummy_pairs())
                if batch is not None:
                    sums.add(terms)
        self.model.train()
        total = DpoSums.from_list(all_reduce_sum(sums.as_list(), self.env))
        self.last_eval_loss = total.loss / max(total.pairs, 1.0)
        means = total.means("eval_")
        self.eval_values = {
            "eval_loss": self.last_eval_loss,
            "eval_reward_accuracy": means["eval_dpo_reward_accuracy"],
        }
        self.metrics.set(eval_loss=self.last_eval_loss, **means)
        self.metrics.event("eval")
        log.info(
            "step %d eval_loss %.4f reward accuracy %.3f margin %.4f",
            self.step,
            self.last_eval_loss,
            means["eval_dpo_reward_accuracy"],
            means["eval_dpo_reward_margin"],
        )
        return self.last_eval_loss

    def _eval_sums(self, rows: Any) -> tuple[float, float]:
        loss_sum, targets = 0.0, 0.0
        dummy = Batch(
            input_ids=torch.full((1, 2), self.pad_id, dtype=torch.long),
            labels=torch.full((1, 2), IGNORE_INDEX, dtype=torch.long),
            attention_mask=None,
            position_ids=None,
            tokens=0,
        )
        for batch in eval_batches(
            rows,
            micro_batch=self.cfg.training.micro_batch_size,
            world_size=self.env.world_size,
            rank=self.env.rank,
            pad_id=self.pad_id,
        ):
            # An idle rank still runs a forward: FSDP's all-gathers need every rank.
            b = batch if batch is not None else dummy
            loss_sum += float(self._forward_loss(b))
            targets += float((b.labels[:, 1:] != IGNORE_INDEX).sum())
        return loss_sum, targets

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
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        out = Path(self.cfg.output.dir)
        env = self.env
        core: Any = self.built.core
        full = StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.built.adapter_only
        )
        sd = get_model_state_dict(self.model, options=full)
        if self.built.adapter_only:
            if env.is_main:
                adapter_dir = out / "adapter"
                core.save_pretrained(str(adapter_dir), state_dict=sd, safe_serialization=True)
                self.tokenizer.save_pretrained(str(adapter_dir))
                if self.cfg.output.merge_adapter:
                    self._merge(adapter_dir, out / "merged")
        elif env.is_main:
            self._save_full(sd, out / "model")
        barrier()
        if env.is_main:
            summary = {
                "job": self.cfg.job.name,
                "method": self.cfg.method,
                "step": self.step,
                "total_steps": self.total_steps,
                "loss": None if math.isnan(self.last_loss) else self.last_loss,
                "eval_loss": self.last_eval_loss,
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
            (out / "trainer_summary.json").write_text(json.dumps(summary, indent=2))
            readable_by_all(out)
        self.metrics.event("output", path=str(out))
        return out

    def _merge(self, adapter_dir: Path, merged_dir: Path) -> None:
        """Merge into a freshly loaded full-precision base (for QLoRA: not the 4-bit one)."""
        import_bitsandbytes()  # peft imports it where it is installed
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        src, kwargs = model_source(self.cfg)
        base = from_hub(
            self.cfg,
            "model",
            lambda: AutoModelForCausalLM.from_pretrained(src, dtype="auto", **kwargs),
        )
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
        merged.config.use_cache = True
        merged.save_pretrained(str(merged_dir), safe_serialization=True)
        # The chat template goes into tokenizer_config.json, not chat_template.jinja: TGI reads
        # it only there; transformers, vLLM and llama.cpp's converter read it there too.
        self.tokenizer.save_pretrained(str(merged_dir), save_jinja_files=False)
        log.info("merged model written to %s", merged_dir)

    def _save_full(self, sd: dict[str, Any], model_dir: Path) -> None:
        import transformers

        auto_model: Any = transformers.AutoModelForCausalLM

        config = self.built.hf_config
        config.use_cache = True
        with torch.device("meta"):
            clean = auto_model.from_config(config)
        clean.load_state_dict(sd, assign=True, strict=False)
        clean.tie_weights()
        clean.save_pretrained(str(model_dir), safe_serialization=True)
        # As for merged/: the chat template in tokenizer_config.json, where TGI reads it.
        self.tokenizer.save_pretrained(str(model_dir), save_jinja_files=False)
        log.info("model written to %s", model_dir)

    # ------------------------------------------------------------------ cleanup

    def cleanup(self) -> None:
        if hasattr(self, "metrics"):
            self.metrics.close()
        self.signals.restore()
        destroy_distributed()


def readable_by_all(folder: Path) -> None:
    """Give the output the modes the process's umask allows (0644 and 0755 under the usual
    022): safetensors writes its files 0600, which a serving pod running as another user
    (vLLM, TGI, KServe reading the claim) could not open."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        mode = (0o777 if path.is_dir() else 0o666) & ~umask
        path.chmod(path.stat().st_mode & 0o7000 | mode)


def is_out_of_memory(e: BaseException) -> bool:
    """Whether `e` is CUDA running out of memory, however torch raised it: its
    OutOfMemoryError, a RuntimeError saying "out of memory" (the CUDA caching allocator,
    cuBLAS, NCCL, bitsandbytes), or an error raised from one (a failed checkpoint save or
    load, which reports each rank's error)."""
    seen: list[BaseException] = []
    todo: list[BaseException] = [e]
    while todo and len(seen) < 32:
        err = todo.pop()
        if any(err is s for s in seen):
            continue
        seen.append(err)
        if isinstance(err, torch.OutOfMemoryError):
            return True
        if isinstance(err, RuntimeError) and "out of memory" in str(err).lower():
            return True
        failures = getattr(err, "failures", None)  # DCP: rank → (error, trace)
        if isinstance(failures, dict):
            for failure in failures.values():
                first = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(first, BaseException):
                    todo.append(first)
        if err.__cause__ is not None:
            todo.append(err.__cause__)
    return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


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


def run(cfg: TrainerConfig) -> TrainResult:
    """Setup, train, export, cleanup: what the entry point calls."""
    recipe = FineTuneRecipe(cfg)
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


__all__ = ["ConfigError", "FineTuneRecipe", "TrainResult", "run"]


def _first_time(checkpoints: Path, fault: str) -> bool:
    """Whether a test fault fires for the first time in this job; marks it fired. The marker
    lives on the checkpoint volume, so the pod that replaces a killed one (same config) does
    not fire it again."""
    marker = checkpoints / ".faults" / fault
    if marker.exists():
        return False
    marker.parent.mkdir(parents=True, exist_ok=True)
    with open(marker, "w") as f:
        f.write(f"{time.time():.0f}\n")
        f.flush()
        os.fsync(f.fileno())
    return True


def _kill_once(checkpoints: Path, step: int, rank: int) -> None:
    """SIGKILL this rank before `step` (test-only, `faults.kill_at_step`), once per job."""
    if _first_time(checkpoints, f"killed-before-step-{step}"):
        log.warning("rank %d SIGKILLs itself before step %d (faults.kill_at_step)", rank, step)
        os.kill(os.getpid(), signal.SIGKILL)


CGROUP_MEMORY_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2: a number, or "max"
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # v1: a number near 2**63 if none
)


def _memory_limit() -> int | None:
    """This container's memory limit in bytes, if it has one."""
    for path in CGROUP_MEMORY_LIMITS:
        with contextlib.suppress(OSError):
            text = path.read_text().strip()
            return int(text) if text.isdigit() and int(text) < 1 << 60 else None
    return None


def _exhaust_host_memory_once(checkpoints: Path, step: int) -> None:
    """Allocate host memory until the kernel kills the container for its memory limit
    (test-only, `faults.host_memory_at_step`), once per job. Without a limit to reach it
    allocates nothing: it must never take a shared machine's memory."""
    limit = _memory_limit()
    if limit is None:
        log.warning("faults.host_memory_at_step: no cgroup memory limit here, nothing done")
        return
    if not _first_time(checkpoints, f"host-memory-before-step-{step}"):
        return
    log.warning("allocating host memory past the limit of %s bytes before step %d "
                "(faults.host_memory_at_step)", limit, step)  # fmt: skip
    hoard, chunk = [], 64 << 20
    for _ in range(2 * limit // chunk + 1):
        hoard.append(bytearray(chunk))  # zero-filled: every page touched
    log.warning("faults.host_memory_at_step: twice the limit allocated and not killed")


def _hang(step: int) -> None:
    """Stop making progress for good, deaf to stop requests: a rank stuck in a collective
    (test-only, `faults.hang_at_step`). Only SIGKILL ends it."""
    log.warning("hanging before step %d (simulated by faults.hang_at_step)", step)
    while True:
        time.sleep(60)
