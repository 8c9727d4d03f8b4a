"""The export step: GGUF from a finished run's whole model, as a CPU-only pod.

    python -m kubetune_trainer.export --config /etc/kubetune/step.json

runs once training succeeded, with the volume that holds the output mounted read-write. It
converts `ExportConfig.model_dir` (the merged model of a LoRA/QLoRA run, or a full
fine-tune's model) into `ExportConfig.out_file` with `kubetune_trainer.gguf` (llama.cpp's own
converter, and its quantizer for k-quants). The file appears only when complete, so a pod
killed half-way leaves nothing a server could mistake for the model, and a retry starts over.

The termination message is the `ExportResult` as compact JSON; on failure it is
`config_error <message>` (exit 2: no model there, an architecture or type llama.cpp cannot
write, no quantizer in the image), `transient <message>` (exit 1: the converter or quantizer
crashed, the disk filled) or `crash <error>` (exit 1), as the stage-in and stage-out write
them.
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
    ExportConfig,
    ExportResult,
    parse_export_config,
)
from kubetune_trainer.stagein.__main__ import (
    config_failure,
    setup_logging,
    step_failure,
    write_termination_message,
)

CONFIG_ENV = "KUBETUNE_EXPORT_CONFIG"
log = logging.getLogger("kubetune_trainer.export")


def export(cfg: ExportConfig) -> ExportResult:
    """Write the GGUF file the config names; `kubetune_trainer.gguf`'s errors pass through."""
    from kubetune_trainer.gguf import export_gguf

    result = export_gguf(
        Path(cfg.model_dir),
        Path(cfg.out_file),
        cfg.quantization,
        pre_tokenizer=cfg.pre_tokenizer,
    )
    return ExportResult(
        file=str(result.path),
        quantization=result.qtype,
        bytes=result.size_bytes,
        seconds=round(result.seconds, 2),
        tool=result.tool,
    )


def compact(result: ExportResult) -> str:
    return json.dumps(result.model_dump(mode="json"), separators=(",", ":"), sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kubetune_trainer.export")
    parser.add_argument("--config", default=os.environ.get(CONFIG_ENV))
    args = parser.parse_args(argv)
    setup_logging("export")
    if not args.config:
        return config_failure(f"no config: pass --config FILE or set {CONFIG_ENV}", log)
    try:
        cfg = parse_export_config(Path(args.config).read_text(), args.config)
    except (OSError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        return config_failure(f"config {args.config}: {e}", log)
    try:
        result = export(cfg)
    except Exception as e:
        return step_failure(e, log)
    write_termination_message(compact(result))
    log.info(
        "wrote %s (%s, %.1f MB) in %.1fs",
        result.file,
        result.quantization,
        result.bytes / 1e6,
        result.seconds,
    )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
