"""The merged output as servers load it: plain transformers without peft, and GGUF through a
real llama.cpp runtime (llama-cpp-python built from its sdist into ~/.cache/kubetune on first
use, see kubetune_dev.llamacpp) choosing the same next tokens as transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="trainer tests need the trainer extra (torch)")
pytest.importorskip("peft", reason="trainer tests need the trainer extra")
pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports sentencepiece")

import torch

from kubetune_dev.llamacpp import LlamaCpp, ensure_llama_cpp
from kubetune_trainer.__main__ import main
from kubetune_trainer.contract import (
    EXIT_CONFIG_ERROR,
    EXIT_OK,
    ExportConfig,
    ExportResult,
    JobRef,
)
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.gguf import export_gguf
from kubetune_trainer.tiny import synthetic_sentences
from support.trainer import TINY_TIMEOUT_S, trainer_config, write_config

# The tiny tokenizer is a plain byte-level BPE (GPT-2's split regex) that llama.cpp's list of
# known tokenizers cannot hold; real base models are recognised by the converter itself.
PRE_TOKENIZER = "gpt-2"
PROMPTS = 10


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, alpaca_data: Path) -> Path:
    """A LoRA fine-tune of the tiny Llama, a few steps at a high rate, merged by the trainer."""
    tmp = tmp_path_factory.mktemp("gguf-run")
    cfg = trainer_config(
        tmp,
        tiny_llama,
        alpaca_data,
        "lora",
        output={"merge_adapter": True},
        training={"max_steps": 8, "learning_rate": 2e-2},
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KUBETUNE_TERMINATION_LOG", str(tmp / "termination-log"))
        assert main(["--config", str(write_config(tmp, cfg))]) == EXIT_OK
    return tmp / "out" / "merged"


@pytest.fixture(scope="session")
def llama_cpp() -> LlamaCpp:
    """Built when missing (about a quarter of an hour on 2 cores), reused afterwards."""
    return ensure_llama_cpp(progress=lambda msg: print(msg, file=sys.stderr))


def prompt_ids(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [tok(s).input_ids for s in synthetic_sentences(PROMPTS, seed=7)]


def hf_next_tokens(model_dir: Path, prompts: list[list[int]]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return [int(model(input_ids=torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]


# Runs in a child with only the cached llama_cpp added to the path: greedy next token of every
# prompt (fed as token ids, so the tokenizer is checked on its own), and llama.cpp's own
# tokenization of the texts.
_LLAMA_CPP_CHILD = """
import json, sys
import numpy as np
from llama_cpp import Llama
args = json.loads(sys.stdin.read())
llm = Llama(model_path=args["gguf"], n_ctx=256, n_threads=1, logits_all=True, verbose=False)
nxt = []
for ids in args["prompts"]:
    llm.reset()
    llm.eval(ids)
    nxt.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
toks = [llm.tokenize(t.encode(), add_bos=True, special=False) for t in args["texts"]]
template = llm.metadata.get("tokenizer.chat_template")
print(json.dumps({"next": nxt, "tokens": toks, "template": template}))
"""


def llama_cpp_run(
    lc: LlamaCpp, gguf: Path, prompts: list[list[int]], texts: list[str]
) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(lc.site_dir)}
    proc = subprocess.run(
        [sys.executable, "-c", _LLAMA_CPP_CHILD],
        input=json.dumps({"gguf": str(gguf), "prompts": prompts, "texts": texts}),
        env=env,
        capture_output=True,
        text=True,
        timeout=TINY_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# ------------------------------------------------------------------ the merged folder


def test_merged_folder_is_serving_ready(merged: Path) -> None:
    names = {p.name for p in merged.iterdir()}
    for needed in ("config.json", "generation_config.json", "tokenizer.json"):
        assert needed in names, f"{needed} missing from {sorted(names)}"
    assert any(n.endswith(".safetensors") for n in names), sorted(names)
    assert not {n for n in names if n.startswith("adapter_")}, sorted(names)
    config = json.loads((merged / "config.json").read_text())
    assert "quantization_config" not in config
    # TGI reads the chat template from tokenizer_config.json only, not chat_template.jinja.
    tok_config = json.loads((merged / "tokenizer_config.json").read_text())
    assert tok_config.get("chat_template"), "no chat template in tokenizer_config.json"
    # A serving pod running as another user reads the claim: safetensors writes 0600.
    umask = os.umask(0)
    os.umask(umask)
    for path in [merged.parent, *merged.parent.rglob("*")]:
        want = (0o777 if path.is_dir() else 0o666) & ~umask
        assert path.stat().st_mode & 0o777 == want, f"{path}: {oct(path.stat().st_mode)}"


_NO_PEFT_CHILD = """
import json, sys
sys.modules["peft"] = None  # import peft now raises ImportError
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path).eval()
ids = tok.apply_chat_template(
    [{"role": "user", "content": "repeat the words"}], add_generation_prompt=True,
    return_tensors="pt", return_dict=True,
)["input_ids"]
out = model.generate(ids, max_new_tokens=8, do_sample=False)
print(json.dumps({"prompt": ids.shape[1], "total": out.shape[1], "peft": "peft" in sys.modules
                  and sys.modules["peft"] is not None}))
"""


def test_merged_folder_loads_and_generates_without_peft(merged: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _NO_PEFT_CHILD, str(merged)],
        capture_output=True,
        text=True,
        timeout=TINY_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["total"] > result["prompt"]
    assert result["peft"] is False


# ------------------------------------------------------------------ GGUF


@pytest.mark.parametrize(("qtype", "at_least"), [("f16", 10), ("q8_0", 9)])
def test_gguf_next_tokens_match_transformers(
    merged: Path, llama_cpp: LlamaCpp, tmp_path: Path, qtype: str, at_least: int
) -> None:
    result = export_gguf(
        merged,
        tmp_path / f"model-{qtype}.gguf",
        qtype,
        converter=llama_cpp.converter_dir,
        pre_tokenizer=PRE_TOKENIZER,
    )
    assert result.path.is_file() and result.size_bytes > 0
    assert [p.name for p in tmp_path.iterdir()] == [result.path.name]  # no temporary left over
    prompts = prompt_ids(merged)
    texts = synthetic_sentences(PROMPTS, seed=7)
    want = hf_next_tokens(merged, prompts)
    got = llama_cpp_run(llama_cpp, result.path, prompts, texts)
    agree = sum(a == b for a, b in zip(got["next"], want, strict=True))
    print(
        f"{qtype}: {agree}/{PROMPTS} next tokens agree, {result.size_bytes} bytes,"
        f" {result.seconds:.1f}s"
    )
    assert agree >= at_least, (got["next"], want)
    assert got["tokens"] == prompts  # llama.cpp tokenizes the texts as transformers does
    tok_config = json.loads((merged / "tokenizer_config.json").read_text())
    assert got["template"] == tok_config["chat_template"]  # what Ollama and llama-server use


def test_gguf_k_quant_through_the_bindings(
    merged: Path, llama_cpp: LlamaCpp, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q4_k_m needs llama.cpp's quantizer: here the bindings' llama_model_quantize."""
    monkeypatch.syspath_prepend(str(llama_cpp.site_dir))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no llama-quantize: the bindings are used
    result = export_gguf(
        merged,
        tmp_path / "model-q4_k_m.gguf",
        "q4_k_m",
        converter=llama_cpp.converter_dir,
        pre_tokenizer=PRE_TOKENIZER,
    )
    assert result.tool == "convert_hf_to_gguf+llama_cpp"
    prompts = prompt_ids(merged)
    got = llama_cpp_run(llama_cpp, result.path, prompts, [])
    want = hf_next_tokens(merged, prompts)
    agree = sum(a == b for a, b in zip(got["next"], want, strict=True))
    print(f"q4_k_m: {agree}/{PROMPTS} next tokens agree, {result.size_bytes} bytes")
    assert len(got["next"]) == PROMPTS


def test_gguf_refusals_say_how_to_fix(merged: Path, llama_cpp: LlamaCpp, tmp_path: Path) -> None:
    conv = llama_cpp.converter_dir
    with pytest.raises(ConfigError, match="To fix:"):
        export_gguf(merged, tmp_path / "x.gguf", "q3_xyz", converter=conv)
    adapter = merged.parent / "adapter"
    with pytest.raises(ConfigError, match=r"To fix:.*merged"):
        export_gguf(adapter, tmp_path / "x.gguf", "f16", converter=conv)
    with pytest.raises(ConfigError, match="pre-tokenizer"):
        export_gguf(merged, tmp_path / "x.gguf", "f16", converter=conv)
    odd = tmp_path / "odd"
    odd.mkdir()
    config = json.loads((merged / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="does not support the architecture NoSuch"):
        export_gguf(odd, tmp_path / "x.gguf", "f16", converter=conv)
    with pytest.raises(ConfigError, match="converter is not in"):
        export_gguf(merged, tmp_path / "x.gguf", "f16", converter=tmp_path)
    assert not (tmp_path / "x.gguf").exists()


def test_gguf_cli_exits_with_the_config_error_code(merged: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.gguf"
    cli = [sys.executable, "-m", "kubetune_trainer.gguf", "--merged", str(merged)]
    proc = subprocess.run(
        [*cli, "--out", str(out), "--type", "q4_k_m"],
        env={**os.environ, "PATH": "/usr/bin:/bin", "KUBETUNE_LLAMA_CPP_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=TINY_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr
    assert "To fix:" in proc.stderr


# ------------------------------------------------------------------ the export step


def test_the_export_step_writes_a_gguf_llama_cpp_loads(
    merged: Path, llama_cpp: LlamaCpp, tmp_path: Path
) -> None:
    """`python -m kubetune_trainer.export` as the operator's export pod runs it: the config
    file in, the GGUF file and the ExportResult (termination message) out; a refusal is
    `config_error` with exit 2 and no file."""
    out = tmp_path / "output"
    config = ExportConfig(
        job=JobRef(name="demo", namespace="ns", uid="u1"),
        model_dir=str(merged),
        out_file=str(out / "gguf" / "demo-q8_0.gguf"),
        quantization="q8_0",
        pre_tokenizer=PRE_TOKENIZER,
    )

    def run_step(cfg: ExportConfig, extra_env: dict[str, str]) -> tuple[int, str]:
        path = tmp_path / "step.json"
        path.write_text(cfg.model_dump_json())
        term = tmp_path / "termination-log"
        term.write_text("")
        proc = subprocess.run(
            [sys.executable, "-m", "kubetune_trainer.export", "--config", str(path)],
            env={**os.environ, "KUBETUNE_TERMINATION_LOG": str(term), **extra_env},
            capture_output=True,
            text=True,
            timeout=TINY_TIMEOUT_S,
            check=False,
        )
        return proc.returncode, term.read_text()

    code, message = run_step(config, {"KUBETUNE_LLAMA_CPP_DIR": str(llama_cpp.converter_dir)})
    assert code == EXIT_OK, message
    result = ExportResult.model_validate_json(message)
    gguf = Path(result.file)
    assert gguf == out / "gguf" / "demo-q8_0.gguf" and result.quantization == "q8_0"
    assert result.bytes == gguf.stat().st_size > 0 and result.seconds > 0
    assert sorted(p.name for p in gguf.parent.iterdir()) == [gguf.name]  # nothing half-written
    prompts = prompt_ids(merged)
    got = llama_cpp_run(llama_cpp, gguf, prompts, [])
    want = hf_next_tokens(merged, prompts)
    agree = sum(a == b for a, b in zip(got["next"], want, strict=True))
    print(f"export step q8_0: {agree}/{PROMPTS} agree, {result.bytes} bytes, {result.seconds}s")
    assert agree >= 9, (got["next"], want)

    # No quantizer here (no llama-quantize on PATH, no bindings importable): a k-quant is a
    # permanent failure that says what to do.
    k_quant = config.model_copy(
        update={"quantization": "q4_k_m", "out_file": str(out / "gguf" / "demo-q4_k_m.gguf")}
    )
    env = {"KUBETUNE_LLAMA_CPP_DIR": str(llama_cpp.converter_dir), "PATH": "/usr/bin:/bin"}
    code, message = run_step(k_quant, env)
    assert code == EXIT_CONFIG_ERROR, message
    assert message.startswith("config_error ") and "To fix:" in message
    assert not Path(k_quant.out_file).exists()


def test_the_export_step_tells_permanent_from_transient_failures(tmp_path: Path) -> None:
    """Exit 2 (`config_error`, the batch Job fails at once) for what a retry cannot fix; exit
    1 (`transient`, retried) when the converter itself crashes."""
    model = tmp_path / "merged"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    crashing = tmp_path / "llama.cpp"
    (crashing / "conversion").mkdir(parents=True)
    (crashing / "convert_hf_to_gguf.py").write_text("import sys; sys.exit('disk full')\n")

    def run_step(model_dir: Path) -> tuple[int, str]:
        cfg = ExportConfig(
            job=JobRef(name="demo", namespace="ns", uid="u1"),
            model_dir=str(model_dir),
            out_file=str(tmp_path / "out" / "demo-q8_0.gguf"),
        )
        (tmp_path / "step.json").write_text(cfg.model_dump_json())
        term = tmp_path / "termination-log"
        term.write_text("")
        env = {
            **os.environ,
            "KUBETUNE_TERMINATION_LOG": str(term),
            "KUBETUNE_LLAMA_CPP_DIR": str(crashing),
        }
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "kubetune_trainer.export",
                "--config",
                str(tmp_path / "step.json"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=TINY_TIMEOUT_S,
            check=False,
        )
        return proc.returncode, term.read_text()

    code, message = run_step(model.parent / "adapter-only")
    assert code == EXIT_CONFIG_ERROR and message.startswith("config_error "), message
    assert "no config.json" in message and "To fix:" in message
    code, message = run_step(model)
    assert code == 1 and message.startswith("transient "), message
    assert "convert_hf_to_gguf.py failed" in message and "disk full" in message
    assert not (tmp_path / "out" / "demo-q8_0.gguf").exists()
