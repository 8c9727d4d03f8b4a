"""GGUF export of a merged model, with llama.cpp's own converter.

GGUF is what llama.cpp, Ollama and LM Studio load. The file is written by llama.cpp's
``convert_hf_to_gguf.py`` (with the ``conversion`` package and ``gguf-py`` of the same
llama.cpp commit) rather than by code of ours: the tensor names, the tokenizer metadata and the
chat template then follow whatever that llama.cpp version reads. The converter runs in a child
process, so its memory and logging stay out of the caller.

Types: the converter writes ``f32``, ``f16``, ``bf16`` and ``q8_0`` itself. Other types
(``q4_k_m``, ``q5_k_m``, ``q6_k``, ``q4_0``, ...) need llama.cpp's quantizer: first an
intermediate file is written (f16, or bf16 for a bf16 model), then ``llama-quantize`` (found
as ``$KUBETUNE_LLAMA_QUANTIZE`` or on ``PATH``) or, where llama-cpp-python is installed, its
``llama_model_quantize`` turns it into the asked type.

Where the converter lives: ``$KUBETUNE_LLAMA_CPP_DIR`` (default ``/opt/llama.cpp``, where the
trainer image puts it), a directory holding ``convert_hf_to_gguf.py``, ``conversion/`` and
``gguf-py/``. ::

    python -m kubetune_trainer.gguf --merged out/merged --out out/model-q8_0.gguf --type q8_0
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubetune_trainer.contract import GGUF_CONVERTER_TYPES, GGUF_QUANTIZER_TYPES, GGUF_TYPES
from kubetune_trainer.errors import ConfigError, TrainerExit

log = logging.getLogger(__name__)

#: Types convert_hf_to_gguf.py writes itself.
CONVERTER_TYPES: tuple[str, ...] = GGUF_CONVERTER_TYPES
#: Types that need llama.cpp's quantizer after the conversion (llama-quantize's names).
QUANTIZER_TYPES: tuple[str, ...] = GGUF_QUANTIZER_TYPES
SUPPORTED_TYPES: tuple[str, ...] = GGUF_TYPES

DEFAULT_CONVERTER_DIR = Path("/opt/llama.cpp")
CONVERTER_DIR_ENV = "KUBETUNE_LLAMA_CPP_DIR"
QUANTIZE_ENV = "KUBETUNE_LLAMA_QUANTIZE"

# Runs convert_hf_to_gguf.py as __main__ with the gguf-py of its own commit first on the path.
# With a pre-tokenizer name, a BPE tokenizer the converter does not recognise (a hash it has no
# entry for) is written with that name instead of failing; known tokenizers keep their own.
_BOOTSTRAP = """\
import runpy, sys
root, pre = sys.argv[1], sys.argv[2]
sys.path[0:0] = [root + "/gguf-py", root]
if pre:
    from conversion.base import TextModel
    known = TextModel.get_vocab_base_pre
    def get_vocab_base_pre(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            print("pre-tokenizer not recognised; written as " + repr(pre), file=sys.stderr)
            return pre
    TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

_TAIL_CHARS = 2000


class GGUFExportFailed(TrainerExit):
    """The converter or the quantizer failed for a reason the config does not explain (a crash,
    a full disk); the message carries the end of its output. Exit 1: a retry may succeed."""


@dataclass(frozen=True)
class GGUFResult:
    path: Path
    qtype: str
    size_bytes: int
    seconds: float
    #: "convert_hf_to_gguf" alone, or followed by "llama-quantize" / "llama_cpp".
    tool: str


def converter_dir(explicit: Path | None = None) -> Path:
    """The llama.cpp directory with the converter; a config error when it is not there."""
    root = explicit or Path(os.environ.get(CONVERTER_DIR_ENV) or DEFAULT_CONVERTER_DIR)
    if not (root / "convert_hf_to_gguf.py").is_file() or not (root / "conversion").is_dir():
        raise ConfigError(
            f"llama.cpp's GGUF converter is not in {root} (convert_hf_to_gguf.py and conversion/)."
            f" To fix: use the kubetune trainer image, which has it in {DEFAULT_CONVERTER_DIR},"
            f" or set {CONVERTER_DIR_ENV} to a llama.cpp source tree of the pinned version."
        )
    return root


def export_gguf(
    merged_dir: Path,
    out_file: Path,
    qtype: str,
    *,
    converter: Path | None = None,
    pre_tokenizer: str | None = None,
    quantize_bin: Path | None = None,
    threads: int | None = None,
) -> GGUFResult:
    """Write ``out_file`` (GGUF of type ``qtype``) from a merged Hugging Face model folder.

    The file appears only when complete (written under a temporary name, then renamed).
    ``pre_tokenizer`` names the llama.cpp pre-tokenizer for a BPE tokenizer the converter does
    not know (``gpt-2`` for a plain byte-level BPE); models it knows ignore it.
    """
    qtype = qtype.lower()
    if qtype not in SUPPORTED_TYPES:
        raise ConfigError(
            f"GGUF type {qtype!r} is not supported. To fix: choose one of"
            f" {', '.join(SUPPORTED_TYPES)} (f16, bf16 and q8_0 need no quantizer)."
        )
    merged_dir = Path(merged_dir)
    _check_model(merged_dir)
    root = converter_dir(converter)
    quantizer = None if qtype in CONVERTER_TYPES else _quantizer(quantize_bin)
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out_file.parent) as tmp:
        if quantizer is None:
            converted = Path(tmp) / "model.gguf"
            _convert(root, merged_dir, converted, qtype, pre_tokenizer)
            tool = "convert_hf_to_gguf"
        else:
            intermediate = Path(tmp) / "intermediate.gguf"
            _convert(root, merged_dir, intermediate, "auto", pre_tokenizer)
            converted = Path(tmp) / "model.gguf"
            tool = _quantize(quantizer, intermediate, converted, qtype, threads)
            tool = f"convert_hf_to_gguf+{tool}"
        os.replace(converted, out_file)
    seconds = time.monotonic() - start
    size = out_file.stat().st_size
    log.info("GGUF %s written to %s: %.1f MiB in %.1fs", qtype, out_file, size / 2**20, seconds)
    return GGUFResult(path=out_file, qtype=qtype, size_bytes=size, seconds=seconds, tool=tool)


def _check_model(merged_dir: Path) -> None:
    config = merged_dir / "config.json"
    if not config.is_file():
        raise ConfigError(
            f"{merged_dir} holds no config.json, so it is not a Hugging Face model folder."
            " To fix: point --merged at the merged model (output.merge_adapter: true writes"
            " out/merged) or a full fine-tune's out/model; an adapter alone cannot be exported."
        )
    if (merged_dir / "adapter_config.json").is_file():
        raise ConfigError(
            f"{merged_dir} is a PEFT adapter, not a merged model. To fix: export the merged"
            " folder (output.merge_adapter: true) instead."
        )
    arch = (json.loads(config.read_text()).get("architectures") or ["?"])[0]
    log.info("exporting %s (%s) to GGUF", merged_dir, arch)


def _convert(root: Path, model: Path, out: Path, outtype: str, pre_tokenizer: str | None) -> None:
    cmd = [
        sys.executable,
        "-c",
        _BOOTSTRAP,
        str(root),
        pre_tokenizer or "",
        str(model),
        "--outfile",
        str(out),
        "--outtype",
        outtype,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode == 0 and out.is_file():
        return
    output = proc.stdout + proc.stderr
    if "is not supported" in output or "not supported!" in output:
        arch = _architecture(model)
        raise ConfigError(
            f"llama.cpp's converter does not support the architecture {arch}."
            " To fix: leave GGUF out of the output (serve the merged safetensors with vLLM or"
            " TGI), or use a base model of an architecture llama.cpp converts (Llama, Mistral,"
            " Qwen2/3, Gemma, Phi-3, ...)."
        )
    if "BPE pre-tokenizer was not recognized" in output:
        raise ConfigError(
            "llama.cpp's converter does not recognise this model's BPE pre-tokenizer (its"
            " tokenizer is not one of the models llama.cpp lists). To fix: name the"
            " pre-tokenizer it uses (--pre-tokenizer, e.g. gpt-2 for a plain byte-level BPE,"
            " llama-bpe for Llama 3's), or leave GGUF out of the output."
        )
    raise GGUFExportFailed(
        f"convert_hf_to_gguf.py failed (exit {proc.returncode}): {output[-_TAIL_CHARS:]}"
    )


def _architecture(model: Path) -> str:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return str(json.loads((model / "config.json").read_text())["architectures"][0])
    return "of this model"


def _quantizer(explicit: Path | None) -> Path | str:
    """llama-quantize's path, or "llama_cpp" for the bindings' quantize function."""
    env = os.environ.get(QUANTIZE_ENV)
    for candidate in (explicit, Path(env) if env else None):
        if candidate is not None and candidate.is_file():
            return candidate
    found = shutil.which("llama-quantize")
    if found:
        return Path(found)
    with contextlib.suppress(ImportError, OSError):
        importlib.import_module("llama_cpp")
        return "llama_cpp"
    raise ConfigError(
        "this GGUF type needs llama.cpp's quantizer, and neither llama-quantize (on PATH or"
        f" ${QUANTIZE_ENV}) nor the llama_cpp Python bindings are here. To fix: choose f16,"
        " bf16 or q8_0, which the converter writes itself, or quantize the f16 file where"
        " llama.cpp is installed (llama-quantize model-f16.gguf model-q4_k_m.gguf Q4_K_M)."
    )


def _quantize(quantizer: Path | str, src: Path, dst: Path, qtype: str, threads: int | None) -> str:
    nthreads = threads or os.cpu_count() or 1
    if isinstance(quantizer, Path):
        cmd = [str(quantizer), str(src), str(dst), qtype.upper(), str(nthreads)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not dst.is_file():
            output = proc.stdout + proc.stderr
            raise GGUFExportFailed(
                f"llama-quantize failed (exit {proc.returncode}): {output[-_TAIL_CHARS:]}"
            )
        return "llama-quantize"
    llama_cpp: Any = importlib.import_module("llama_cpp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype.upper()}")
    params.nthread = nthreads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0 or not dst.is_file():
        raise GGUFExportFailed(f"llama_model_quantize({qtype}) failed with {rc}")
    return "llama_cpp"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kubetune_trainer.gguf", description="Export a merged model to GGUF."
    )
    parser.add_argument("--merged", type=Path, required=True, help="merged model folder")
    parser.add_argument("--out", type=Path, required=True, help="GGUF file to write")
    parser.add_argument("--type", default="q8_0", help=f"one of {', '.join(SUPPORTED_TYPES)}")
    parser.add_argument("--converter", type=Path, help=f"llama.cpp dir (${CONVERTER_DIR_ENV})")
    parser.add_argument("--pre-tokenizer", help="pre-tokenizer of a BPE llama.cpp does not know")
    parser.add_argument("--quantize-bin", type=Path, help=f"llama-quantize (${QUANTIZE_ENV})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        result = export_gguf(
            args.merged,
            args.out,
            args.type,
            converter=args.converter,
            pre_tokenizer=args.pre_tokenizer,
            quantize_bin=args.quantize_bin,
        )
    except TrainerExit as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    summary = {
        "path": str(result.path),
        "type": result.qtype,
        "size_bytes": result.size_bytes,
        "seconds": round(result.seconds, 2),
        "tool": result.tool,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
