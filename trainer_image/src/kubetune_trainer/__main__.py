"""Entry point: `python -m kubetune_trainer --config FILE` (or `$KUBETUNE_CONFIG`).

Exit codes (`contract.EXIT_*`): 0 done; 2 bad config or data; 42 preempted, checkpoint
written; 43 out of memory; 44 stop requested, checkpoint written; 45 a checkpoint could not be
written or none can be loaded, `checkpoint_failed <message>` in the termination message;
anything else is a crash. On exit 0 rank 0, and on exit 43 each rank that ran out of memory,
leaves the run's `contract.TrainerResult` in the termination message, one line of JSON.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import sys
import traceback
import warnings
from pathlib import Path

from kubetune_trainer.contract import EXIT_CONFIG_ERROR, EXIT_OK, TrainerResult

TERMINATION_LOG = "/dev/termination-log"
TERMINATION_LINE_CHARS = 1000
"""A line written to the termination message is cut to this (the kubelet keeps 4096 bytes
of the file, every rank of the pod writes to it)."""
CRASH_MESSAGE_CHARS = 300
"""A crash's message is cut to this in the termination message: the file holds every rank's
line, and the operator shows its last 500 characters."""
log = logging.getLogger("kubetune_trainer")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def termination_log() -> Path | None:
    """The Kubernetes termination message file (`$KUBETUNE_TERMINATION_LOG`, else
    /dev/termination-log), or None where there is none."""
    explicit = os.environ.get("KUBETUNE_TERMINATION_LOG")
    path = Path(explicit or TERMINATION_LOG)
    # The kubelet creates /dev/termination-log in every container; outside a pod there is
    # none, and the trainer must not create files in the host's /dev.
    if not (explicit and path.parent.is_dir()) and not path.exists():
        return None
    return path


def write_termination_message(message: str) -> None:
    """Append one line to the Kubernetes termination message file, if there is one."""
    path = termination_log()
    if path is None:
        return
    with contextlib.suppress(OSError), path.open("a") as fh:
        fh.write(message.strip()[:TERMINATION_LINE_CHARS] + "\n")


def result_line(result: TrainerResult) -> str:
    """`result` as one line of JSON short enough to be written whole: an out-of-memory
    error's message is cut to the longest start that fits."""
    line = result.model_dump_json()
    oom = result.out_of_memory
    if len(line) <= TERMINATION_LINE_CHARS or oom is None:
        return line

    def cut(keep: int) -> str:
        short = oom.model_copy(update={"message": oom.message[:keep]})
        return result.model_copy(update={"out_of_memory": short}).model_dump_json()

    fits, too_long = 0, len(oom.message)
    while too_long - fits > 1:
        keep = (fits + too_long) // 2
        if len(cut(keep)) <= TERMINATION_LINE_CHARS:
            fits = keep
        else:
            too_long = keep
    return cut(fits)


def record_exit_code(code: int) -> None:
    """Tell `kubetune_trainer.launch` this worker's contract code (torchrun would hide it)."""
    folder = os.environ.get("KUBETUNE_EXIT_CODE_DIR")
    if not folder:
        return
    with contextlib.suppress(OSError):
        (Path(folder) / f"rank-{_rank()}").write_text(str(code))


def setup_logging() -> None:
    """Log to stderr with the rank in each line (local rank 0's INFO, the other ranks' warnings)."""
    level = logging.INFO if int(os.environ.get("LOCAL_RANK", "0")) == 0 else logging.WARNING
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s rank{_rank()} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Known-harmless warnings that would otherwise repeat in every pod log.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    warnings.filterwarnings(
        "ignore", message=".*assuming the intent is to save in a single process.*"
    )
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def crash_message(e: BaseException) -> str:
    """One line for an unexpected error: its type and the start of its message."""
    text = " ".join(str(e).split())
    if len(text) > CRASH_MESSAGE_CHARS:
        text = text[: CRASH_MESSAGE_CHARS - 3] + "..."
    return f"crash rank={_rank()} {type(e).__name__}: {text or '(no message)'}"


def _report_exit(e: BaseException) -> None:
    """The termination message of a contract exit other than OOM and config errors: a stop
    or preemption once per pod (rank 0's), anything else from every rank it hit."""
    from kubetune_trainer.contract import EXIT_PREEMPTED, EXIT_STOPPED

    code = getattr(e, "exit_code", 1)
    if code in (EXIT_PREEMPTED, EXIT_STOPPED):
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            write_termination_message(str(e))
        return
    write_termination_message(f"rank={_rank()} {e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kubetune_trainer")
    parser.add_argument("--config", default=os.environ.get("KUBETUNE_CONFIG"))
    args = parser.parse_args(argv)
    setup_logging()
    code = _run(args.config)
    record_exit_code(code)
    return code


def _run(config_path: str | None) -> int:
    from pydantic import ValidationError

    from kubetune_trainer.contract import ContractError, parse_config

    if not config_path:
        log.error("no config: pass --config FILE or set KUBETUNE_CONFIG")
        write_termination_message(
            "config_error no config: pass --config FILE or set KUBETUNE_CONFIG"
        )
        return EXIT_CONFIG_ERROR
    try:
        cfg = parse_config(Path(config_path).read_text(), config_path)
    except (OSError, ValueError, ContractError, ValidationError) as e:
        message = f"config {config_path}: {e}"
        log.error("%s", message)
        write_termination_message(f"config_error {message}")
        return EXIT_CONFIG_ERROR

    from kubetune_trainer.errors import CheckpointFailed, ConfigError, OutOfMemory, TrainerExit
    from kubetune_trainer.recipe import run

    try:
        result = run(cfg)
    except OutOfMemory as e:
        log.error("%s", e)
        write_termination_message(result_line(e.result))
        return e.exit_code
    except ConfigError as e:
        log.error("%s", e)
        if _rank() == 0:
            write_termination_message(f"config_error {e}")
        return e.exit_code
    except CheckpointFailed as e:
        log.error("%s", e)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one line per pod
            write_termination_message(f"checkpoint_failed {e}")
        return e.exit_code
    except TrainerExit as e:
        log.warning("%s", e)
        _report_exit(e)
        return e.exit_code
    except Exception as e:
        traceback.print_exc()
        write_termination_message(crash_message(e))
        return 1
    if _rank() == 0:
        # The operator reads it from the pod: the final numbers, and EarlyStopped instead of
        # Completed when early stopping ended the run.
        write_termination_message(result_line(result.result()))
    log.info(
        "done: step %d/%d loss %.4f, %d tokens in %.1fs; output in %s",
        result.step,
        result.total_steps,
        result.loss,
        result.tokens_seen,
        result.seconds,
        result.output_dir,
    )
    return EXIT_OK


def exit_without_teardown(code: int) -> None:
    """Exit with `code` once the exit handlers have run and the output is flushed, skipping
    the interpreter's teardown of its modules: with torch, transformers and peft loaded that
    takes 2.5 s of a core and holds the pod (and a relaunch after preemption) for nothing.
    Every file the trainer writes is closed before `main` returns, and no thread is left."""
    atexit._run_exitfuncs()  # logging's flush among them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_without_teardown(main())
