"""The checkpoint folder's writer epoch: one attempt of a job writes there at a time.

The operator starts attempt N+1 only once attempt N's pods have stopped, but a node cut off
from the control plane and not from the volume (an NFS or EFS share mounted ReadWriteMany)
keeps its trainer running: its saves and its pruning would remove the folders attempt N+1
writes and loads. So the folder names its writer in `writer.json`, `{"job_uid", "attempt"}`:

- at start-up rank 0 claims the folder, writing this attempt there, unless a later attempt of
  the same job already did (then this one is stale and stops: `Superseded`, exit 46); a
  folder another job wrote (a same-name job's, an adopted one's) is claimed;
- before a save starts and again before its rename, every rank learns whether the folder
  still names this attempt; before pruning, quarantining or moving folders aside rank 0
  checks the same. A stale attempt stops there, having deleted and renamed nothing.

A check and the deletion after it are two operations, so this narrows the window of a stale
writer to the time between them (milliseconds), where a lock would need a lock service the
volume does not offer. A run outside the operator has no attempt number and no fence.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubetune_trainer.contract import TrainerConfig
from kubetune_trainer.distributed import DistEnv, all_reduce_max
from kubetune_trainer.errors import Superseded

log = logging.getLogger(__name__)

WRITER_FILE = "writer.json"


@dataclass(frozen=True)
class Writer:
    job_uid: str
    attempt: int

    def describe(self) -> str:
        return f"attempt {self.attempt} of job uid {self.job_uid}"


def read_writer(root: Path) -> Writer | None:
    """The writer `root` names; None when none is recorded (or the record is unreadable as
    JSON: an interrupted write of an older trainer, claimed over)."""
    try:
        data: Any = json.loads((root / WRITER_FILE).read_text())
        return Writer(job_uid=str(data["job_uid"]), attempt=int(data["attempt"]))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        log.warning("%s: unreadable %s, claimed over", root, WRITER_FILE)
        return None


def _write(root: Path, writer: Writer) -> None:
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{WRITER_FILE}.{writer.attempt}.{os.getpid()}"
    with tmp.open("w") as fh:
        json.dump({"job_uid": writer.job_uid, "attempt": writer.attempt}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, root / WRITER_FILE)


class WriterFence:
    """This attempt's claim on a checkpoint folder, and the checks before each change."""

    def __init__(self, root: Path, mine: Writer, env: DistEnv) -> None:
        self.root = root
        self.mine = mine
        self.env = env

    def claim(self) -> None:
        """Rank 0 records this attempt as the folder's writer; every rank raises Superseded
        when a later attempt of this job already has."""
        later = None
        if self.env.is_main:
            current = read_writer(self.root)
            if (
                current is not None
                and current.job_uid == self.mine.job_uid
                and current.attempt > self.mine.attempt
            ):
                later = current
            else:
                _write(self.root, self.mine)
                log.info("%s: writer is %s", self.root, self.mine.describe())
        self._agree(later, "starting")

    def other(self) -> Writer | None:
        """Rank 0: the writer the folder names when it is not this attempt (None: it is, or
        the record cannot be read now, in which case the change that follows fails on its
        own read)."""
        try:
            current = read_writer(self.root)
        except OSError as e:
            log.warning("%s: %s cannot be read (%s); going on", self.root, WRITER_FILE, e)
            return None
        return None if current is None or current == self.mine else current

    def check(self, what: str) -> None:
        """On every rank: raise Superseded when the folder names another writer."""
        self._agree(self.other() if self.env.is_main else None, what)

    def _agree(self, other: Writer | None, what: str) -> None:
        if not all_reduce_max([int(other is not None)], self.env)[0]:
            return
        who = other.describe() if other is not None else "a later attempt"
        message = (
            f"{self.root} is written by {who}, not by this {self.mine.describe()}: this "
            f"attempt stopped while {what} and changed nothing there (it was superseded; the "
            "operator runs the later one). To fix, only if no later attempt of this job "
            f"runs (its status was reset): delete {WRITER_FILE} from the checkpoint folder "
            "and resume the job"
        )
        log.error("%s", message)
        raise Superseded(message)


def writer_fence(cfg: TrainerConfig, env: DistEnv) -> WriterFence | None:
    """The fence of this run's checkpoint folder; None outside the operator (no attempt)."""
    if cfg.checkpoint.attempt is None or not cfg.job.uid:
        return None
    mine = Writer(job_uid=cfg.job.uid, attempt=cfg.checkpoint.attempt)
    return WriterFence(Path(cfg.checkpoint.dir), mine, env)
