"""Progress, ETA, checkpoint and cost of a running job, from the trainer's metrics (pure).

The trainer serves `kubetune_trainer_*` metrics; the controller scrapes the rank-0 pod and
hands the samples to `reconcile`, which keeps `status.progress`, `status.checkpoint` and
`status.cost` current with the functions here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime

from kubetune.api.v1alpha1 import (
    CheckpointStatus,
    CostStatus,
    FineTuneJobSpec,
    FineTuneJobStatus,
    PlanStatus,
    ProgressStatus,
)
from kubetune.control.conditions import now_rfc3339
from kubetune.control.pods import Interval, parse_time
from kubetune_trainer.contract import TrainerResult, checkpoint_dir_name

DPO_PROGRESS = (
    "dpo_reward_accuracy",
    "dpo_reward_margin",
    "dpo_rewards_chosen",
    "dpo_rewards_rejected",
    "eval_dpo_reward_accuracy",
    "eval_dpo_reward_margin",
)
"""Trainer gauges of a DPO run copied to `status.progress` under the same names."""


def human_duration(seconds: float) -> str:
    """1h20m, 4m10s, 35s."""
    total = int(max(0.0, seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def _summary(progress: ProgressStatus) -> str:
    return f"{progress.step}/{progress.total_steps} ({progress.percent}%)"


def start_attempt(status: FineTuneJobStatus, plan: PlanStatus, now: datetime) -> None:
    """Progress and cost as a new attempt of `plan` starts: its total steps, price and rate."""
    progress = status.progress or ProgressStatus()
    progress.total_steps = plan.total_steps
    progress.summary = f"{progress.step}/{plan.total_steps} ({progress.percent}%)"
    status.progress = progress
    cost = status.cost or CostStatus()
    cost.estimated_usd = plan.estimated_cost_usd
    cost.rate_usd_per_hour = plan.price_per_hour_usd
    cost.updated_at = now_rfc3339(now)
    status.cost = cost


def stalled_for(status: FineTuneJobStatus, now: datetime) -> float | None:
    """Seconds the current attempt was seen not to move: from when its step count last
    moved to when its metrics were last read (`progress.updatedAt`), not to now. A trainer
    the operator cannot read for a while (a NetworkPolicy, the operator's own network, its
    restart) is not stalled for it: the timer counts only time it was seen, and a read that
    shows the same step again counts the whole gap. None before it trained past its
    checkpoint."""
    progress = status.progress
    if progress is None or progress.step_changed_attempt != status.attempt:
        return None
    since = parse_time(progress.step_changed_at)
    if since is None:
        return None
    seen = parse_time(progress.updated_at) or now
    return max(0.0, (min(now, seen) - since).total_seconds())


def accrue(
    cost: CostStatus | None, now: datetime, trainers: Sequence[Interval], nodes: int
) -> None:
    """Add the plan's price for the time since the last update, for the part of it each of
    the attempt's `nodes` trainer pods ran (`trainers`: when each ran, by the kubelet's
    start and finish times).

    A job counts as training, and costs, only while its trainers run: a pod that waits for
    room, for its image or for a Secret costs the job nothing (the startup timeout bounds how
    long a bound pod may wait). By the pods' own times, a gap between updates (an operator
    down for a while) is billed for what ran in it, not at the share seen at its end.
    Timestamps have one-second resolution: measure against the whole second that is
    recorded, or every update would add up to a second too much.
    """
    if cost is None or cost.rate_usd_per_hour is None:
        return
    whole = now.replace(microsecond=0)
    last = parse_time(cost.updated_at) or whole
    ran = 0.0
    for started, finished in trainers:
        begin = max(started or last, last)
        end = min(finished or whole, whole)
        ran += max(0.0, (end - begin).total_seconds())
    share_seconds = ran / max(1, nodes)
    cost.accrued_usd = round(cost.accrued_usd + cost.rate_usd_per_hour * share_seconds / 3600, 6)
    cost.updated_at = now_rfc3339(whole)


def read_metrics(
    status: FineTuneJobStatus,
    spec: FineTuneJobSpec,
    metrics: Mapping[str, float],
    now: datetime,
) -> int | None:
    """Progress, ETA and the newest checkpoint from the trainer's own metrics; returns the
    step of a checkpoint that is new since the last look, else None. The first step the
    attempt trains past its checkpoint, and every change after it, restart the stall timer
    (`step_changed_at`)."""
    m = {k: v for k, v in metrics.items() if math.isfinite(v)}  # NaN is not valid JSON
    plan = status.plan
    assert plan is not None
    progress = status.progress or ProgressStatus()
    step_now = int(m.get("step", progress.step))
    # The stall timer runs once the attempt trained past the checkpoint it resumed from:
    # loading the model and the checkpoint (the step still at or below it) is not timed.
    # (Stamped with the attempt, since a status patch cannot clear a field.)
    resumed = status.checkpoint.latest_step if status.checkpoint else 0
    moved = step_now != progress.step or progress.step_changed_attempt != status.attempt
    if "step" in m and step_now > resumed and moved:
        progress.step_changed_at = now_rfc3339(now)
        progress.step_changed_attempt = status.attempt
    progress.step = step_now
    progress.total_steps = int(m.get("total_steps") or plan.total_steps)
    progress.epoch = round(float(m.get("epoch", progress.epoch)), 3)
    progress.percent = min(100, int(100 * progress.step / max(1, progress.total_steps)))
    if "loss" in m:
        progress.loss = round(float(m["loss"]), 4)
    if "eval_loss" in m:
        progress.eval_loss = round(float(m["eval_loss"]), 4)
    for key in DPO_PROGRESS:  # NaN (dropped above) in SFT runs
        if key in m:
            setattr(progress, key, round(float(m[key]), 4))
    tps = float(m.get("tokens_per_second", 0.0))
    if tps > 0:
        progress.tokens_per_second = round(tps, 1)
        tokens_per_step = spec.training.global_batch_size * spec.training.sequence_length
        left = (progress.total_steps - progress.step) * tokens_per_step / tps
        progress.eta_seconds = round(left, 1)
        progress.eta = human_duration(left)
    progress.summary = _summary(progress)
    progress.updated_at = now_rfc3339(now)
    status.progress = progress
    step = int(m.get("last_checkpoint_step", 0))
    if step > 0 and (status.checkpoint is None or status.checkpoint.latest_step != step):
        status.checkpoint = CheckpointStatus(
            latest_step=step, time=now_rfc3339(now), path=checkpoint_dir_name(step)
        )
        return step
    return None


def complete(status: FineTuneJobStatus, now: datetime) -> None:
    """Progress at 100 % and the last step's checkpoint, once the trainer exited 0.

    The trainer exits 0 only after it checkpointed the last step (its contract); the last
    metrics read may have come before that checkpoint. A run that stopped early
    (status.earlyStopped) checkpointed the step it stopped at, and its progress stays there.
    The loss is the last one read, or the trainer's own if `record_result` took its result.
    """
    total = (status.progress or status.plan or ProgressStatus()).total_steps
    stopped = status.early_stopped
    last = stopped.step if stopped is not None else total
    if last and (status.checkpoint is None or status.checkpoint.latest_step != last):
        status.checkpoint = CheckpointStatus(
            latest_step=last, time=now_rfc3339(now), path=checkpoint_dir_name(last)
        )
    if status.progress is not None:
        progress = status.progress
        progress.step = last if stopped is not None else progress.total_steps
        progress.percent = (
            100
            if stopped is None
            else min(100, int(100 * progress.step / max(1, progress.total_steps)))
        )
        progress.eta_seconds = 0
        progress.eta = "0s"
        progress.summary = _summary(progress)
        if stopped is not None:
            progress.summary += f" early stopped, best step {stopped.best_step}"


def record_result(status: FineTuneJobStatus, result: TrainerResult) -> None:
    """The finished trainer's own numbers (`pods.trainer_result`) into status.progress,
    over the last ones its metrics gave (read every few seconds, they may be steps behind):
    the total steps, the training loss of its last step, the last evaluation's loss.
    Progress is made if no metrics were ever read."""
    progress = status.progress or ProgressStatus(
        total_steps=status.plan.total_steps if status.plan else 0
    )
    if result.total_steps:
        progress.total_steps = result.total_steps
    if result.loss is not None and math.isfinite(result.loss):
        progress.loss = round(result.loss, 4)
    if result.eval_loss is not None and math.isfinite(result.eval_loss):
        progress.eval_loss = round(result.eval_loss, 4)
    status.progress = progress
