"""Entry point: `python -m kubetune_trainer.stageout --config FILE` (or
`$KUBETUNE_STAGEOUT_CONFIG`).

On success the termination message is the `StageOutResult` as compact JSON; on failure it is
`config_error <message>` (exit 2), `transient <message>` (exit 1) or `crash <error>` (exit 1),
as the stage-in writes them (`stagein.__main__`). Progress goes to stdout, one JSON line per
file (uploaded or skipped); the log to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from kubetune_trainer.contract import (
    EXIT_OK,
    StageOutConfig,
    StageOutResult,
    parse_stage_out_config,
)
from kubetune_trainer.stagein.__main__ import (
    config_failure,
    setup_logging,
    step_failure,
    write_termination_message,
)

CONFIG_ENV = "KUBETUNE_STAGEOUT_CONFIG"
log = logging.getLogger("kubetune_trainer.stageout")


def compact(result: StageOutResult) -> str:
    return json.dumps(result.model_dump(mode="json"), separators=(",", ":"), sort_keys=True)


def load_config(path: str) -> StageOutConfig:
    return parse_stage_out_config(Path(path).read_text(), path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kubetune_trainer.stageout")
    parser.add_argument("--config", default=os.environ.get(CONFIG_ENV))
    args = parser.parse_args(argv)
    setup_logging("stageout")
    if not args.config:
        return config_failure(f"no config: pass --config FILE or set {CONFIG_ENV}", log)
    try:
        cfg = load_config(args.config)
    except (OSError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        return config_failure(f"config {args.config}: {e}", log)

    from kubetune_trainer.stageout.upload import stage_out

    try:
        result = stage_out(cfg)
    except Exception as e:
        return step_failure(e, log)
    write_termination_message(compact(result))
    log.info(
        "uploaded %d files to %s: %.1f MB sent, %.1f MB already there, in %.1fs",
        result.files,
        result.destination,
        result.uploaded_bytes / 1e6,
        result.skipped_bytes / 1e6,
        result.seconds,
    )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
