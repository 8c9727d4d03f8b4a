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

import logging
import sys
from pathlib import Path

from kubetune_trainer.contract import ExportConfig, ExportResult, parse_export_config
from kubetune_trainer.stagein.__main__ import run_step

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


def _summary(result: ExportResult) -> str:
    return (
        f"wrote {result.file} ({result.quantization}, {result.bytes / 1e6:.1f} MB) in "
        f"{result.seconds:.1f}s"
    )


def main(argv: list[str] | None = None) -> int:
    return run_step(
        argv,
        step="export",
        config_env=CONFIG_ENV,
        parse=parse_export_config,
        run=export,
        summary=_summary,
        logger=log,
    )


if __name__ == "__main__":
    sys.exit(main())
