"""Every test fault of `TrainerConfig.faults` (`contract.FaultInjection`), in one module.

Each is off unless the config sets it, and each decides for itself whether it is due: the
loop calls `before_step`, `in_step` and `pace` around every step and `entering` at every
phase, whatever the config. The faults that end a process (a SIGKILL, the kernel's memory
limit) fire once per job: a marker on the checkpoint volume keeps the pod that replaces the
killed one from firing them again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path

import torch

from kubetune_trainer.checkpoint import Checkpointer
from kubetune_trainer.contract import FaultInjection
from kubetune_trainer.distributed import DistEnv

log = logging.getLogger(__name__)

CGROUP_MEMORY_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2: a number, or "max"
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # v1: a number near 2**63 if none
)


class Faults:
    """The faults of one run; `checkpoints` is the checkpoint folder (where markers go)."""

    def __init__(self, faults: FaultInjection, checkpoints: Path) -> None:
        self._f = faults
        self._checkpoints = checkpoints
        self._fired: set[str] = set()

    def entering(self, phase: str) -> None:
        """`faults.oom_in_phase`: out of GPU memory the first time the run enters `phase`."""
        if phase == self._f.oom_in_phase and phase not in self._fired:
            self._fired.add(phase)
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (simulated by faults.oom_in_phase={phase})"
            )

    def before_step(self, step: int, env: DistEnv) -> None:
        """Before step `step` (the one about to run): `faults.hang_at_step`,
        `faults.kill_at_step` (on `faults.kill_rank`) and `faults.host_memory_at_step` (on
        rank 0)."""
        f = self._f
        if f.hang_at_step is not None and step == f.hang_at_step:
            _hang(step)
        if step == f.kill_at_step and env.rank == f.kill_rank:
            _kill_once(self._checkpoints, step, env.rank)
        if step == f.host_memory_at_step and env.is_main:
            _exhaust_host_memory_once(self._checkpoints, step)

    def in_step(self, step: int) -> None:
        """`faults.oom_at_step`: out of GPU memory in step `step`, as the step starts."""
        at = self._f.oom_at_step
        if at is not None and step == at:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (simulated by faults.oom_at_step={at})"
            )

    def pace(self, started: float) -> None:
        """`faults.min_step_seconds`: wait until the step that began at `started`
        (`time.monotonic()`) took that long."""
        least = self._f.min_step_seconds
        if least is not None:
            time.sleep(max(0.0, least - (time.monotonic() - started)))

    def arm(self, checkpointer: Checkpointer) -> None:
        """`faults.disk_full_at_step`: the checkpointer finds the volume full at that step."""
        checkpointer.full_at_step = self._f.disk_full_at_step


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
