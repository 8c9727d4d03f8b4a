"""Entry point: `python -m kubetune_trainer.stageout --config FILE` (or
`$KUBETUNE_STAGEOUT_CONFIG`).

On success the termination message is the `StageOutResult` as compact JSON; on failure it is
`config_error <message>` (exit 2), `transient <message>` (exit 1) or `crash <error>` (exit 1),
as the stage-in writes them (`stagein.__main__`). Progress goes to stdout, one JSON line per
file (uploaded or skipped); the log to stderr.
"""

from __future__ import annotations

import logging
import sys

from kubetune_trainer.contract import StageOutConfig, StageOutResult, parse_stage_out_config
from kubetune_trainer.stagein.__main__ import run_step

CONFIG_ENV = "KUBETUNE_STAGEOUT_CONFIG"
log = logging.getLogger("kubetune_trainer.stageout")


def _stage_out(cfg: StageOutConfig) -> StageOutResult:
    from kubetune_trainer.stageout.upload import stage_out

    return stage_out(cfg)


def _summary(result: StageOutResult) -> str:
    return (
        f"uploaded {result.files} files to {result.destination}: "
        f"{result.uploaded_bytes / 1e6:.1f} MB sent, {result.skipped_bytes / 1e6:.1f} MB "
        f"already there, in {result.seconds:.1f}s"
    )


def main(argv: list[str] | None = None) -> int:
    return run_step(
        argv,
        step="stageout",
        config_env=CONFIG_ENV,
        parse=parse_stage_out_config,
        run=_stage_out,
        summary=_summary,
        logger=log,
    )


if __name__ == "__main__":
    sys.exit(main())
