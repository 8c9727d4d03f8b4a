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
"""

from __future__ import annotations

import logging
import os
import shutil
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


def main(argv: list[str] | None = None) -> int:
    import torch.distributed.run as torchrun_module
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    torchrun: Any = torchrun_module

    argv = list(sys.argv[1:] if argv is None else argv)
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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sys.exit(main())
