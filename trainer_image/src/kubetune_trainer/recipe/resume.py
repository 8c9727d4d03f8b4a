"""Resuming: which checkpoint a run starts from, and whose checkpoints it may take.

The newest checkpoint that matches its manifest and loads on every rank wins; one that does
not is quarantined and the next older one tried. Another job's checkpoints are moved aside
first, unless `checkpoint.resume_from_uid` adopts them (docs/trainer.md).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kubetune_trainer.checkpoint import (
    QUARANTINE_MARK,
    STATE_FILE,
    Checkpointer,
    complete_checkpoints,
    quarantined_checkpoints,
)
from kubetune_trainer.contract import TrainerConfig
from kubetune_trainer.distributed import DistEnv, all_reduce_max
from kubetune_trainer.errors import CheckpointFailed, StorageUnavailable, first_line, transient
from kubetune_trainer.identity import RESUME_FIELD, changed_fields, describe, whose
from kubetune_trainer.metrics import TrainerMetrics
from kubetune_trainer.recipe.optim import configured_hyperparameters

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run resumed from: model, optimizer and schedule are loaded; the
    caller takes its counters from `state` (trainer_state.json)."""

    path: Path
    step: int
    state: dict[str, Any]


class _OtherWeights(Exception):
    """The newest checkpoint holds adapter weights and the run trains the full model, or
    the other way round: the run starts from the base model."""


@dataclass
class _Resume:
    cfg: TrainerConfig
    env: DistEnv
    ck: Checkpointer
    metrics: TrainerMetrics
    model: nn.Module
    optimizer: torch.optim.Optimizer
    adapter_only: bool


def resume_newest(
    cfg: TrainerConfig,
    env: DistEnv,
    checkpointer: Checkpointer,
    metrics: TrainerMetrics,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    adapter_only: bool,
) -> Resumed | None:
    """Load the newest checkpoint that matches its manifest and loads into `model`,
    `optimizer` and `scheduler` (the hyperparameters stay this run's); None: start at step 0.
    Raises CheckpointFailed when checkpoints exist and none can be loaded."""
    from torch.distributed.checkpoint.api import CheckpointException

    r = _Resume(cfg, env, checkpointer, metrics, model, optimizer, adapter_only)
    ck = r.ck
    ck.claim()  # before anything in the folder changes: a stale attempt stops here
    ck.remove_leftovers()
    if not _claim_checkpoints(r):
        return None
    configured = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    failed: list[str] = []
    for step, path in reversed(complete_checkpoints(ck.root)):
        unavailable: StorageUnavailable | None = None
        try:
            state, problem = _load(r, path)
        except _OtherWeights:
            break
        except StorageUnavailable as e:
            state, problem, unavailable = None, None, e
        except CheckpointException as e:  # DCP's error is a BaseException
            if "out of memory" in str(e).lower():
                raise  # not the checkpoint's fault: never quarantine for it
            state, problem = None, f"cannot be loaded: {first_line(e)}"
            if transient(e):
                problem, unavailable = None, _unavailable(path, e)
        flags = [int(problem is not None), int(unavailable is not None)]
        damaged, cannot_read = all_reduce_max(flags, env)
        if cannot_read:  # on every rank: a restart reads the volume again
            raise unavailable or _unavailable(path, RuntimeError("another rank could not read"))
        if damaged:
            problem = problem or "another rank could not load it"
            moved = ck.quarantine(path, problem)
            metrics.event(
                "checkpoint_quarantined", checkpoint=path.name, moved_to=moved.name, reason=problem
            )
            log.warning("cannot resume from %s (%s); trying an older one", path, problem)
            failed.append(f"{path.name}: {problem}")
            continue
        assert state is not None
        scheduler.load_state_dict(state["scheduler"])
        configured_hyperparameters(optimizer, scheduler, configured)
        ck.mark_verified(path)
        return Resumed(path, step, state)
    _none_loaded(ck.root, failed)
    return None


def _load(r: _Resume, path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(trainer_state.json, None) when `path` checks out and loads on this rank, else (None,
    the problem); `_OtherWeights` when it holds the other kind of weights."""
    problem = r.ck.verify(path)
    if problem is not None:
        return None, problem
    try:
        saved = json.loads((path / STATE_FILE).read_text())
    except ValueError as e:
        return None, f"{STATE_FILE} is unreadable ({first_line(e)})"
    except OSError as e:
        raise _unavailable(path, e) from e
    if bool(saved.get("adapter_only")) != r.adapter_only:
        log.warning(
            "%s holds %s weights but this run trains %s; starting from the base model",
            path,
            "adapter" if saved.get("adapter_only") else "full",
            r.cfg.method,
        )
        raise _OtherWeights
    try:
        return r.ck.load(path, r.model, r.optimizer), None
    except Exception as e:
        if "out of memory" in str(e).lower():
            raise  # not the checkpoint's fault: never quarantine for it
        if transient(e):
            raise _unavailable(path, e) from e
        return None, f"cannot be loaded: {first_line(e)}"


def _unavailable(path: Path, e: BaseException) -> StorageUnavailable:
    """A load the storage or the network failed: nothing is quarantined for it."""
    return StorageUnavailable(
        f"checkpoint {path.name} could not be read ({first_line(e)}); nothing was "
        "quarantined, and a restart reads it again. To fix: if this repeats, check the "
        "checkpoint volume (its storage, its mount on the node)"
    )


def _none_loaded(root: Path, failed: list[str]) -> None:
    """Refuse to train from step 0 when checkpoints exist and none could be loaded."""
    if failed:
        # A failed load may have written part of a checkpoint into the model: do not train.
        raise CheckpointFailed(
            f"no checkpoint in {root} can be loaded ({'; '.join(failed)}); each was "
            f"quarantined as <name>{QUARANTINE_MARK}<time>. To fix: delete the quarantined "
            "folders to start over from step 0, or put a good step-N folder back"
        )
    earlier = quarantined_checkpoints(root)
    if earlier and not complete_checkpoints(root):
        raise CheckpointFailed(
            f"no checkpoint in {root} to resume: {', '.join(p.name for p in earlier)} "
            "could not be loaded earlier and was quarantined. To fix: delete the "
            "quarantined folders to start over from step 0, or put a good step-N folder back"
        )


def _claim_checkpoints(r: _Resume) -> bool:
    """Whose the checkpoints in the folder are, by the newest one's identity. This job's,
    the job `checkpoint.resume_from_uid` names (adopted) and an older trainer's (no
    identity) are resumed: True. Another job's are moved aside: False, start at step 0."""
    cfg, ck, main = r.cfg, r.ck, r.env.is_main
    newest = ck.newest_identity()
    if newest is None:
        _wanted_not_found(r, None)
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
        r.metrics.event(
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
    _move_aside(r, path, old_uid, old_job)
    return False


def _move_aside(r: _Resume, newest: Path, old_uid: str, old_job: Any) -> None:
    """Move another job's checkpoints out of the way; this run starts at step 0."""
    ck = r.ck
    target, count = ck.move_aside(old_uid, Path(r.cfg.output.dir))
    r.metrics.event(
        "checkpoints_moved_aside",
        old_uid=old_uid,
        old_job=old_job,
        moved_to=str(target),
        count=count,
    )
    if r.env.is_main:
        log.warning(
            "%s held checkpoints of another job, %s (uid %s, newest %s): moved to %s "
            "and this run starts at step 0. To resume them instead, set %s: %s on "
            "this job",
            ck.root,
            old_job,
            old_uid,
            newest.name,
            target,
            RESUME_FIELD,
            old_uid,
        )
    _wanted_not_found(r, old_uid)


def _wanted_not_found(r: _Resume, found_uid: str | None) -> None:
    """Warn when `checkpoint.resume_from_uid` names a job none of whose checkpoints is
    here (the run starts at step 0)."""
    wanted = r.cfg.checkpoint.resume_from_uid
    if not wanted or wanted == r.cfg.job.uid:
        return
    r.metrics.event(
        "resume_from_uid_not_found",
        resume_from_uid=wanted,
        found_uid=found_uid,
        checkpoint_dir=str(r.ck.root),
    )
    if r.env.is_main:
        log.warning(
            "%s is %s but %s holds no checkpoint of that job: this run starts at step 0",
            RESUME_FIELD,
            wanted,
            r.ck.root,
        )
