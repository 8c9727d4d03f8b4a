"""`python -m kubetune_trainer.launch <torchrun arguments>`: torchrun that keeps exit codes.

torchrun exits 1 whenever a worker fails, so the Job's podFailurePolicy would never see the
trainer's contract codes (42 preempted, 43 OOM, ...). This launcher runs torchrun's own `run()`
in-process with the same arguments and then exits with the workers' code:

- each worker writes its code to `$KUBETUNE_EXIT_CODE_DIR/rank-<r>` (a fresh temporary folder
  the launcher creates), which also covers a launcher stopped by SIGTERM, where torchrun
  reports no worker results at all;
- codes from torchrun's failure report fill in for workers that could not write (killed);
- several codes are reduced by priority: OOM (43) > config error (2) > preempted (42) >
  stopped (44) > any other failure > 0. OOM first because the operator must re-plan however
  the other ranks ended; preempted only when no rank failed in a way a restart cannot fix.

On SIGTERM torchrun forwards the signal to the workers and waits `--shutdown-timeout` seconds
before SIGKILL. Its default (30 s) is shorter than a large checkpoint takes, so this launcher
takes it from `KUBETUNE_SHUTDOWN_TIMEOUT`, which the operator sets to the pod's grace period
less 10 s (so torchrun's SIGKILL, and this launcher's exit with the workers' codes, come before
the kubelet's SIGKILL); without it, 110 s, inside the default 120 s grace period. An explicit
`--shutdown-timeout` wins.

One worker on one node (`--nnodes=1 --nproc-per-node=1 --max-restarts=0 -m kubetune_trainer`,
`--standalone` or not, nothing else), which is every single-GPU pod, skips torchrun: its agent
would import torch, start a second Python for the worker and watch it, which costs each such
pod about 5 s of a core and 6 s of its start and end. The trainer then runs in this process
with the environment torchrun gives a worker of a one-process group (a TCP store on a free
port), so it takes the same code paths; its exit code is the pod's, and SIGTERM reaches it
directly (there is no agent to forward it or to kill the worker before the kubelet does).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kubetune_trainer.contract import (
    EXIT_CONFIG_ERROR,
    EXIT_OK,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
)

DEFAULT_SHUTDOWN_TIMEOUT_S = 110
EXIT_SIGNALLED = 128 + 15  # what a shell reports for a launcher killed by SIGTERM
log = logging.getLogger("kubetune_trainer.launch")

_PRIORITY = (EXIT_OOM, EXIT_CONFIG_ERROR, EXIT_PREEMPTED, EXIT_STOPPED)


def combine_exit_codes(codes: Iterable[int | None]) -> int:
    """One exit code for the pod from the workers' codes (None: unknown, e.g. killed)."""
    seen = [c for c in codes if c is not None]
    for wanted in _PRIORITY:
        if wanted in seen:
            return wanted
    others = [c for c in seen if c != EXIT_OK]
    if others:
        code = others[0]
        return code if 0 < code < 256 else 1  # negative = killed by a signal
    return EXIT_OK


def _read_codes(folder: Path) -> dict[int, int]:
    codes: dict[int, int] = {}
    for f in folder.glob("rank-*"):
        try:
            codes[int(f.name.split("-", 1)[1])] = int(f.read_text().strip())
        except ValueError:
            continue
    return codes


_SINGLE_FLAGS = {
    "--nnodes": ("1", "1:1"),
    "--nproc-per-node": ("1",),
    "--max-restarts": ("0",),
}


def one_local_worker(argv: list[str]) -> list[str] | None:
    """The trainer's arguments when torchrun's would start exactly one worker of
    `kubetune_trainer` on this node and never restart it, else None (torchrun runs)."""
    args = list(argv)
    while args and args[0] != "-m":
        flag, _, value = args.pop(0).partition("=")
        flag = flag.replace("_", "-")
        if flag == "--standalone" and not value:
            continue
        if flag not in _SINGLE_FLAGS:
            return None
        if not value:
            if not args:
                return None
            value = args.pop(0)
        if value not in _SINGLE_FLAGS[flag]:
            return None
    if args[:2] != ["-m", "kubetune_trainer"]:
        return None
    return args[2:]


def run_in_process(trainer_args: list[str]) -> int:
    """Run the trainer here as the one worker of a one-process group, as torchrun would."""
    os.environ.update(
        {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "GROUP_RANK": "0",
            "ROLE_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "0",  # the store binds a free port; no other process joins it
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
        }
    )
    os.environ.pop("KUBETUNE_EXIT_CODE_DIR", None)  # the exit code is this process's own
    from kubetune_trainer import __main__ as trainer

    trainer.setup_logging()
    log.info("one worker on one node: the trainer runs in the launcher's process, no torchrun")
    return trainer.main(trainer_args)


def _exit_signalled(signum: int, _frame: object) -> None:
    log.warning("signal %d before the trainer took over: exiting %d", signum, EXIT_SIGNALLED)
    logging.shutdown()
    os._exit(EXIT_SIGNALLED)


def main(argv: list[str] | None = None) -> int:
    # The container's PID 1 ignores a signal it has no handler for, and the trainer (or
    # torchrun's agent) installs its own only once torch is imported, seconds from now: until
    # then SIGTERM ends the launcher at once (nothing to checkpoint yet) with the code it gave
    # when the signal ended its workers under torchrun, not at the kubelet's SIGKILL after the
    # grace period.
    signal.signal(signal.SIGTERM, _exit_signalled)
    argv = list(sys.argv[1:] if argv is None else argv)
    trainer_args = one_local_worker(argv)
    if trainer_args is not None:
        return run_in_process(trainer_args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return run_torchrun(argv)


def run_torchrun(argv: list[str]) -> int:
    """torchrun's `run()` with these arguments, then one exit code from the workers'."""
    import torch.distributed.run as torchrun_module
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    torchrun: Any = torchrun_module

    if not any(a.startswith(("--shutdown-timeout", "--shutdown_timeout")) for a in argv):
        os.environ.setdefault(
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
            os.environ.get("KUBETUNE_SHUTDOWN_TIMEOUT", str(DEFAULT_SHUTDOWN_TIMEOUT_S)),
        )
    codes_dir = Path(tempfile.mkdtemp(prefix="kubetune-exit-"))
    os.environ["KUBETUNE_EXIT_CODE_DIR"] = str(codes_dir)
    args = torchrun.parse_args(argv)
    reported: dict[int, int] = {}
    signalled = False
    try:
        torchrun.run(args)  # torchrun's main() minus the exit: same flags, same behaviour
    except ChildFailedError as e:
        reported = {rank: f.exitcode for rank, f in e.failures.items()}
    except SignalException as e:
        signalled = True
        log.warning("launcher got %s; workers were asked to checkpoint", e.sigval)
    try:
        written = _read_codes(codes_dir)
    finally:
        shutil.rmtree(codes_dir, ignore_errors=True)
    merged = {**reported, **written}  # what a worker wrote is more precise than torchrun's view
    code = combine_exit_codes(merged.values())
    if signalled and code == EXIT_OK and not merged:
        code = EXIT_SIGNALLED
    log.info("worker exit codes %s -> %d", dict(sorted(merged.items())), code)
    return code


if __name__ == "__main__":
    from kubetune_trainer.__main__ import exit_without_teardown

    exit_without_teardown(main())
