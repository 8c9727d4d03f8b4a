"""Entry point: `python -m kubetune_trainer.stagein --config FILE` (or
`$KUBETUNE_STAGEIN_CONFIG`).

On success the termination message is the `StageInResult` as compact JSON (without
`model_config_json` when the whole would pass Kubernetes' 4096 bytes); on failure it is
`config_error <message>` (exit 2), `transient <message>` (exit 1) or `crash <error>` (exit 1).
The file is the trainer's (`$KUBETUNE_TERMINATION_LOG`, else /dev/termination-log).
Progress goes to stdout, one JSON line per file fetched; the log to stderr.

The stage-out and export steps' entry points run the same way (`run_step`): the same
termination message, log and failure mapping.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from kubetune_trainer.__main__ import crash_message, termination_log
from kubetune_trainer.contract import (
    EXIT_CONFIG_ERROR,
    EXIT_OK,
    StageInConfig,
    StageInResult,
    parse_stage_in_config,
)

CONFIG_ENV = "KUBETUNE_STAGEIN_CONFIG"
TERMINATION_BYTES = 4096
"""What Kubernetes keeps of a termination message."""
log = logging.getLogger("kubetune_trainer.stagein")


def write_termination_message(text: str) -> None:
    """Replace the termination message, if there is a file for it (as the trainer decides)."""
    path = termination_log()
    if path is None:
        return
    data = text.strip().encode()[:TERMINATION_BYTES].decode(errors="ignore")
    with contextlib.suppress(OSError):
        path.write_text(data)


def compact(result: StageInResult) -> str:
    """The result as one line of JSON under TERMINATION_BYTES: model_config_json goes first."""
    text = compact_json(result)
    if len(text.encode()) <= TERMINATION_BYTES:
        return text
    return compact_json(result.model_copy(update={"model_config_json": {}}))


def config_failure(message: str, logger: logging.Logger = log) -> int:
    """Log a config that cannot be read and say so in the termination message: exit 2."""
    logger.error("%s", message)
    write_termination_message(f"config_error {message}")
    return EXIT_CONFIG_ERROR


def step_failure(e: Exception, logger: logging.Logger = log) -> int:
    """Log a step's failure, put it in the termination message and return its exit code: a
    `ConfigError` is `config_error` (exit 2), another `TrainerExit` `transient` (its code,
    1), anything else a crash (exit 1, with the traceback in the log)."""
    from kubetune_trainer.errors import ConfigError, TrainerExit

    if isinstance(e, ConfigError):
        logger.error("%s", e)
        write_termination_message(f"config_error {e}")
        return e.exit_code
    if isinstance(e, TrainerExit):
        logger.warning("%s", e)
        write_termination_message(f"transient {e}")
        return e.exit_code
    traceback.print_exception(e)
    write_termination_message(crash_message(e))
    return 1


def setup_logging(step: str) -> None:
    """The log of a CPU-only step (`stagein`, `stageout`) to stderr, the clients' chatter
    quieted."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {step} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("httpx", "httpx2", "urllib3", "filelock", "botocore", "s3transfer", "boto3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


Config = TypeVar("Config")
Result = TypeVar("Result", bound=BaseModel)


def compact_json(result: BaseModel) -> str:
    """A step's result as one line of JSON, for its termination message."""
    return json.dumps(result.model_dump(mode="json"), separators=(",", ":"), sort_keys=True)


def run_step(
    argv: Sequence[str] | None,
    *,
    step: str,
    config_env: str,
    parse: Callable[[str, str], Config],
    run: Callable[[Config], Result],
    message: Callable[[Result], str] = compact_json,
    summary: Callable[[Result], str],
    logger: logging.Logger,
) -> int:
    """A CPU-only step's entry point (`python -m kubetune_trainer.<step> --config FILE`, or
    `$<config_env>`): parse its config, run it, leave its result (`message`) or its failure in
    the termination message, log `summary`, return the exit code."""
    parser = argparse.ArgumentParser(prog=f"python -m kubetune_trainer.{step}")
    parser.add_argument("--config", default=os.environ.get(config_env))
    args = parser.parse_args(argv)
    setup_logging(step)
    if not args.config:
        return config_failure(f"no config: pass --config FILE or set {config_env}", logger)
    try:
        cfg = parse(Path(args.config).read_text(), args.config)
    except (OSError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        return config_failure(f"config {args.config}: {e}", logger)
    try:
        result = run(cfg)
    except Exception as e:
        return step_failure(e, logger)
    write_termination_message(message(result))
    logger.info("%s", summary(result))
    return EXIT_OK


def _stage_in(cfg: StageInConfig) -> StageInResult:
    from kubetune_trainer.stagein.stage import stage_in

    result = stage_in(cfg)
    path = Path(cfg.result_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(result.model_dump_json(indent=2) + "\n")
    return result


def _summary(result: StageInResult) -> str:
    return (
        f"staged: {result.examples} examples, {result.tokens} tokens, "
        f"{result.packed_sequences} sequences; {result.downloaded_bytes / 1e6:.1f} MB "
        f"downloaded, {result.reused_bytes / 1e6:.1f} MB reused, in {result.seconds:.1f}s"
    )


def main(argv: list[str] | None = None) -> int:
    return run_step(
        argv,
        step="stagein",
        config_env=CONFIG_ENV,
        parse=parse_stage_in_config,
        run=_stage_in,
        message=compact,
        summary=_summary,
        logger=log,
    )


if __name__ == "__main__":
    sys.exit(main())
