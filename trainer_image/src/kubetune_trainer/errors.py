"""Errors that end a run with a contract exit code (see `contract.EXIT_*`).

The entry point maps each class to its exit code; everything else is a crash (exit 1) that
the Job's backoffLimit retries.
"""

from __future__ import annotations

from kubetune_trainer.contract import (
    EXIT_CHECKPOINT_FAILED,
    EXIT_CONFIG_ERROR,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    EXIT_SUPERSEDED,
    TrainerResult,
)


class TrainerExit(Exception):
    """Base of the errors that carry a contract exit code."""

    exit_code: int = 1


class ConfigError(TrainerExit):
    """The config or the files it names are wrong; retrying cannot help."""

    exit_code = EXIT_CONFIG_ERROR


class DataError(ConfigError):
    """The dataset is unusable: a missing field, bad encoding, an empty file."""


class Preempted(TrainerExit):
    """SIGTERM arrived; a checkpoint of the last finished step is on disk."""

    exit_code = EXIT_PREEMPTED


class StopRequested(TrainerExit):
    """SIGUSR1 (a requested stop) arrived; a checkpoint is on disk."""

    exit_code = EXIT_STOPPED


class CheckpointFailed(TrainerExit):
    """A checkpoint could not be saved (not enough free space, a write error), or checkpoints
    exist and none of them can be loaded. The message says what and how to fix it; the
    previous checkpoint is left as it was."""

    exit_code = EXIT_CHECKPOINT_FAILED


class Superseded(TrainerExit):
    """A later attempt of this job claimed the checkpoint folder (kubetune_trainer.fence): this
    one stops before it saves, prunes or renames anything there."""

    exit_code = EXIT_SUPERSEDED


class OutOfMemory(TrainerExit):
    """The accelerator ran out of memory. `result` is what the rank leaves in its termination
    message: where it ran out (`out_of_memory`: step, phase, the most memory the run had
    reserved) and how far the run had come."""

    exit_code = EXIT_OOM

    def __init__(self, message: str, result: TrainerResult) -> None:
        super().__init__(message)
        self.result = result


class StorageUnavailable(TrainerExit):
    """The checkpoint volume could not be read for a reason that may pass (EIO, a stale NFS
    handle, a collective timed out while loading): no checkpoint is judged damaged for it.
    The attempt ends (exit 1) and its restart reads the volume again."""


def transient(e: BaseException) -> bool:
    """Whether `e` (or, for DCP's CheckpointException, what any rank raised) is an error of
    the storage or the network, not of a checkpoint's contents: an OSError (a missing file
    excepted: that is the checkpoint's), a timeout, a collective's failure."""
    import torch.distributed as dist

    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        return any(transient(pair[0]) for pair in failures.values())
    if isinstance(e, FileNotFoundError):
        return False
    return isinstance(e, OSError | TimeoutError | dist.DistError)


class HubUnavailable(TrainerExit):
    """The hub could not be reached, or answered with a server error, after a few tries;
    a restart may find it well again (exit 1)."""


def first_line(e: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none), for a
    message that must stay on one line."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
