"""GPU throughput and peak memory of the kubetune trainer on real-size architectures.

No model hub is needed: each model is built from its published config (Llama-3.2-1B,
Qwen2.5-1.5B, Llama-3.1-8B) with random bf16 weights, saved with a tokenizer trained on the fly,
and loaded by the trainer through its normal path (`python -m kubetune_trainer --config ...`),
one fresh process per case. Data: synthetic alpaca records, packed into full sequences.

Two steps, because the GPU machine has no kubetune operator package:

    # on a GPU machine (writes one JSON line per case)
    python benchmarks/gpu_trainer.py run --out gpu-results.jsonl [--cases llama1b-lora,...]
    # anywhere with the project installed: the table, with `kubetune estimate` beside each case
    python benchmarks/gpu_trainer.py report gpu-results.jsonl [--out benchmarks/results/...md]

The GPU machine needs torch, transformers, peft, accelerate and tokenizers, plus what the
trainer imports that a CUDA image may lack: pydantic (the trainer's config contract, with
pydantic-core, annotated-types, typing-inspection), bitsandbytes (8-bit and paged optimizers,
QLoRA) and liger-kernel (the fused-loss cases). Without network access there, carry them as
wheels for its Python and install them with `pip install --no-index --no-deps --target DIR`.

Measured per case: trained (non-padding) tokens per second over the steps after `--warmup`,
the trainer's own MFU figure (model FLOPs per token x tokens/s over the GPU's dense bf16 peak),
the process's peak `torch.cuda.max_memory_allocated` / `max_memory_reserved`, which is what
decides an out-of-memory, and every step's loss. Cases come in "before" / "after" pairs: the
same setup without and with the memory savers and the variable-length attention path
(`Case`). Before the cases, `probe_varlen` checks the variable-length kernel against
per-document SDPA on the GPU; if it fails, the cases that would use it run on the mask;
`probe_fused` checks the fused loss's kernel (its soft-capped branch too) against the plain
loss before the cases that use it. `--time-budget` stops starting cases once a time-boxed GPU
lease is nearly spent.
`report` adds `kubetune estimate` and the simulated step (`--simulate`) beside each case.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "trainer_image" / "src"))
sys.path.insert(0, str(ROOT / "operator" / "src"))  # `report` only: the estimator

# Published configs (config.json fields the estimator reads too); weights are random.
ARCHS: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-3.2-1B": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen2.5-1.5B": {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    "meta-llama/Llama-3.1-8B": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
}

LLAMA1B, QWEN15B, LLAMA8B = ARCHS


@dataclass(frozen=True)
class Case:
    """One measured setup. The memory savers default to the 2026-11-22 run's setup (none, and
    packed rows through SDPA with a block-diagonal mask), so a case without them is the
    "before" of one with them."""

    model: str
    method: str
    micro_batch: int
    seq_len: int
    grad_ckpt: bool
    optimizer: str = "adamw"
    chunked_ce: bool = False
    activation_offload: bool = False
    packed_attention: str = "mask"
    fused_ce: bool = False
    optimizer_in_backward: bool = False

    def savers(self) -> str:
        """The savers and attention path in a few words, for the table."""
        words = [] if self.packed_attention == "mask" else [self.packed_attention]
        words += ["chunked CE"] if self.chunked_ce else []
        words += ["fused CE"] if self.fused_ce else []
        words += ["offload"] if self.activation_offload else []
        words += ["step in backward"] if self.optimizer_in_backward else []
        return ", ".join(words) or "-"


# Ordered by what a run cut short should have measured first: each "before" next to its
# "after", then the 8B models, then the savers' costs.
CASES: dict[str, Case] = {
    "llama1b-full": Case(LLAMA1B, "full", 4, 2048, False),
    "llama1b-full-varlen": Case(LLAMA1B, "full", 4, 2048, False, packed_attention="varlen"),
    "llama1b-full-savers": Case(
        LLAMA1B, "full", 4, 2048, False, chunked_ce=True, packed_attention="varlen"
    ),
    "llama1b-lora": Case(LLAMA1B, "lora", 8, 2048, False),
    "llama1b-lora-savers": Case(
        LLAMA1B, "lora", 8, 2048, False, chunked_ce=True, packed_attention="varlen"
    ),
    "llama8b-lora-ckpt-savers": Case(
        LLAMA8B, "lora", 4, 2048, True, chunked_ce=True, packed_attention="varlen"
    ),
    "llama8b-full-ckpt-8bit-savers": Case(
        LLAMA8B, "full", 2, 2048, True, "adamw-8bit", chunked_ce=True, packed_attention="varlen"
    ),
    "llama1b-lora-ckpt-offload": Case(
        LLAMA1B,
        "lora",
        8,
        2048,
        True,
        chunked_ce=True,
        activation_offload=True,
        packed_attention="varlen",
    ),
    "llama1b-full-ckpt-paged32": Case(
        LLAMA1B,
        "full",
        4,
        2048,
        True,
        "paged-adamw-32bit",
        chunked_ce=True,
        packed_attention="varlen",
    ),
    "llama1b-full-mb8-savers": Case(
        LLAMA1B, "full", 8, 2048, False, chunked_ce=True, packed_attention="varlen"
    ),
    # The 2026-11-22 cases not listed above.
    "llama1b-lora-mb2": Case(LLAMA1B, "lora", 2, 2048, False),
    "llama1b-lora-ckpt": Case(LLAMA1B, "lora", 8, 2048, True),
    "llama1b-qlora-ckpt": Case(LLAMA1B, "qlora", 8, 2048, True),
    "llama1b-full-ckpt": Case(LLAMA1B, "full", 4, 2048, True),
    "qwen1.5b-lora": Case(QWEN15B, "lora", 8, 2048, False),
    "qwen1.5b-lora-ckpt": Case(QWEN15B, "lora", 8, 2048, True),
    "qwen1.5b-full-ckpt": Case(QWEN15B, "full", 4, 2048, True),
    "llama8b-lora-ckpt": Case(LLAMA8B, "lora", 4, 2048, True),
    "llama8b-qlora-ckpt": Case(LLAMA8B, "qlora", 4, 2048, True),
    "llama8b-full-ckpt-8bit": Case(LLAMA8B, "full", 2, 2048, True, "adamw-8bit"),
    # The fused loss (Liger's kernel) and the optimizer step in backward, each beside the
    # chunked-loss case it replaces or adds to.
    "llama1b-full-fused": Case(
        LLAMA1B, "full", 4, 2048, False, fused_ce=True, packed_attention="varlen"
    ),
    "llama1b-lora-fused": Case(
        LLAMA1B, "lora", 8, 2048, False, fused_ce=True, packed_attention="varlen"
    ),
    "llama1b-lora-16k-savers": Case(
        LLAMA1B, "lora", 1, 16384, False, chunked_ce=True, packed_attention="varlen"
    ),
    "llama1b-lora-16k-fused": Case(
        LLAMA1B, "lora", 1, 16384, False, fused_ce=True, packed_attention="varlen"
    ),
    "llama1b-full-inbwd": Case(
        LLAMA1B,
        "full",
        4,
        2048,
        False,
        chunked_ce=True,
        packed_attention="varlen",
        optimizer_in_backward=True,
    ),
    "llama8b-full-ckpt-8bit-inbwd": Case(
        LLAMA8B,
        "full",
        2,
        2048,
        True,
        "adamw-8bit",
        chunked_ce=True,
        packed_attention="varlen",
        optimizer_in_backward=True,
    ),
}
DEFAULT_CASES = list(CASES)[:10]
LORA = {"rank": 16, "alpha": 32, "dropout": 0.05, "target_modules": ["all-linear"]}


# --------------------------------------------------------------------------- run (GPU)


def make_model(out: Path, model: str) -> Path:
    """Random bf16 weights for `model`'s config plus a small BPE tokenizer, in one folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kubetune_trainer.tiny import make_tokenizer

    if (out / "config.json").exists():
        return out
    fields = dict(ARCHS[model])
    tok = make_tokenizer(out, vocab_size=512, add_bos=fields["model_type"] == "llama")
    config = AutoConfig.for_model(
        fields.pop("model_type"),
        **fields,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        net = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    net.save_pretrained(str(out), safe_serialization=True)
    del net
    torch.cuda.empty_cache()
    return out


def trainer_config(work: Path, model_dir: Path, data: Path, case: str, steps: int) -> Path:
    from kubetune_trainer.contract import CONTRACT_VERSION

    c = CASES[case]
    method, micro = c.method, c.micro_batch
    cfg = {
        "contract_version": CONTRACT_VERSION,
        "job": {"name": case},
        "method": method,
        "model": {"source": str(model_dir)},
        "dataset": {"source": str(data), "format": "alpaca"},
        "lora": LORA if method != "full" else None,
        "training": {
            "epochs": 50,
            "total_steps": steps,
            "max_steps": steps,
            "micro_batch_size": micro,
            "gradient_accumulation": 1,
            "global_batch_size": micro,
            "sequence_length": c.seq_len,
            "learning_rate": 1e-4,
            "warmup_ratio": 0.1,
            "precision": "bf16",
            "gradient_checkpointing": c.grad_ckpt,
            "packing": True,
            "optimizer": c.optimizer,
            "chunked_cross_entropy": c.chunked_ce,
            "activation_offloading": c.activation_offload,
            "packed_attention": c.packed_attention,
            "fused_cross_entropy": c.fused_ce,
            "optimizer_in_backward": c.optimizer_in_backward,
        },
        "checkpoint": {"dir": str(work / "ckpt"), "interval_minutes": 0},
        "output": {"dir": str(work / "out")},
        "metrics": {"port": -1, "log_path": str(work / "metrics.jsonl")},
    }
    path = work / "config.json"
    path.write_text(json.dumps(cfg))
    return path


TIMED_OUT = -9
"""`exit_code` of a case stopped at `--case-timeout`."""


def run_case(
    case: str, models: Path, data: Path, steps: int, warmup: int, timeout: float
) -> dict[str, Any]:
    c = CASES[case]
    t0 = time.time()
    model_dir = make_model(models / c.model.replace("/", "--"), c.model)
    made = time.time() - t0
    work = Path(tempfile.mkdtemp(prefix=f"{case}-"))
    cfg = trainer_config(work, model_dir, data, case, steps)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT / "trainer_image" / "src"), os.environ.get("PYTHONPATH", "")])
        ),
    }
    started = time.time()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kubetune_trainer", "--config", str(cfg)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        code, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        code = TIMED_OUT
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else ""
    wall = time.time() - started
    log = work / "metrics.jsonl"
    events = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    # Each case's checkpoints (an 8B full fine-tune's are 33 GiB) would fill the disk for the
    # next ones.
    shutil.rmtree(work, ignore_errors=True)
    step_ev = [e for e in events if e.get("event") == "step"]
    start_ev = next((e for e in events if e.get("event") == "start"), {})
    result: dict[str, Any] = {
        "case": case,
        **asdict(c),
        "lora_rank": LORA["rank"] if c.method != "full" else None,
        "steps": len(step_ev),
        "exit_code": code,
        "varlen_attention": start_ev.get("varlen_attention"),
        "flops_per_token": start_ev.get("flops_per_token"),
        "params": start_ev.get("params"),
        "model_build_seconds": round(made, 1),
        "wall_seconds": round(wall, 1),
    }
    if step_ev:
        first, last = step_ev[0], step_ev[-1]
        result["startup_seconds"] = round(first["time"] - started, 1)
        timed = step_ev[warmup:] if len(step_ev) > warmup + 1 else step_ev
        prev = step_ev[warmup - 1] if len(step_ev) > warmup + 1 and warmup > 0 else None
        if prev is not None:
            tokens = timed[-1]["tokens_seen_total"] - prev["tokens_seen_total"]
            seconds = timed[-1]["time"] - prev["time"]
            result["tokens_per_second"] = round(tokens / seconds, 1)
        mfus = [e["mfu_ratio"] for e in timed if isinstance(e.get("mfu_ratio"), (int, float))]
        result["mfu_ratio"] = round(statistics.median(mfus), 4) if mfus else None
        result["peak_allocated_bytes"] = max(e["memory_allocated_peak_bytes"] for e in step_ev)
        result["peak_reserved_bytes"] = max(e["memory_reserved_peak_bytes"] for e in step_ev)
        result["loss_first"] = first.get("loss")
        result["loss_last"] = last.get("loss")
        result["losses"] = [e.get("loss") for e in step_ev]
    if code != 0:
        result["stderr_tail"] = stderr[-1500:]
        msg = Path("/dev/termination-log")
        if msg.exists():
            result["termination_message"] = msg.read_text()[-500:]
    return result


def probe_varlen(device: str = "cuda") -> dict[str, Any]:
    """The variable-length kernel against the same attention one document at a time through
    SDPA, on this GPU in bf16 (forward and gradients): whether the `varlen` cases can run."""
    import torch

    from kubetune_trainer import attention

    out: dict[str, Any] = {"kernel_available": attention.kernel_available()}
    try:
        g = torch.Generator(device=device).manual_seed(0)
        batch, heads, kv_heads, seq, dim = 2, 8, 2, 512, 64
        pos = torch.cat([torch.arange(200), torch.arange(100), torch.arange(212)]).repeat(batch, 1)
        bounds = attention.document_bounds(pos.numpy()).to(torch.device(device))

        def qkv() -> list[torch.Tensor]:
            shapes = [(batch, heads, seq, dim), (batch, kv_heads, seq, dim)]
            return [
                torch.randn(
                    *shapes[min(i, 1)], device=device, generator=g, dtype=torch.bfloat16
                ).requires_grad_()
                for i in range(3)
            ]

        q, k, v = qkv()
        module = torch.nn.Module()
        got, _ = attention.packed_attention_forward(
            module, q, k, v, None, scaling=dim**-0.5, **bounds.model_kwargs()
        )
        got.float().square().sum().backward()
        got_grads = [t.grad.clone() for t in (q, k, v)]  # type: ignore[union-attr]
        for t in (q, k, v):
            t.grad = None
        flat = [t.transpose(1, 2).reshape(batch * seq, t.size(1), dim) for t in (q, k, v)]
        want = attention._per_document(*flat, bounds.cu_seqlens, dim**-0.5, heads // kv_heads)
        want.view(batch, seq, heads, dim).float().square().sum().backward()

        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            a, b = a.detach().float(), b.detach().float()
            return float((a - b).abs().max() / b.abs().max())

        out["output_rel_diff"] = rel(got.view_as(want), want)
        out["grad_rel_diff"] = max(
            rel(a, t.grad)  # type: ignore[arg-type]
            for a, t in zip(got_grads, (q, k, v), strict=True)
        )
        # bf16: the two round differently (~1e-2 of the largest value at most); attention
        # across a document boundary changes outputs by their own size.
        out["ok"] = out["output_rel_diff"] < 0.03 and out["grad_rel_diff"] < 0.05
    except Exception as e:  # recorded, and the varlen cases fall back to the mask
        out["ok"] = False
        out["error"] = f"{type(e).__name__}: {e}"[:800]
    return out


def probe_fused(
    device: str = "cuda", tokens: int = 4096, hidden: int = 2048, vocab: int = 32768
) -> dict[str, Any]:
    """Liger's fused linear cross-entropy, as the trainer calls it, against the plain loss
    computed in fp32 from the same inputs on this GPU: the loss and the gradients of the
    hidden states and of the weight, in fp32 and bf16, without and with a logit soft-cap
    (Gemma 2's 30.0; Triton's CPU interpreter cannot run that branch). Largest differences are
    relative to the largest value."""
    import torch
    import torch.nn.functional as F

    from kubetune_trainer.data import IGNORE_INDEX
    from kubetune_trainer.loss import fused_kernel

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.detach().float(), b.detach().float()
        return float((a - b).abs().max() / b.abs().max())

    def fused(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, cap: float | None) -> Any:
        return fused_kernel().apply(h, w, t, None, None, IGNORE_INDEX, 0.0, 0.0, "sum", cap)[0]

    def plain(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, cap: float | None) -> Any:
        logits = h.float() @ w.float().T
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return F.cross_entropy(logits, t, ignore_index=IGNORE_INDEX, reduction="sum")

    def loss_and_grads(
        loss_of: Callable[..., torch.Tensor], h: torch.Tensor, w: torch.Tensor, *rest: Any
    ) -> list[torch.Tensor]:
        h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
        loss = loss_of(h, w, *rest)
        loss.backward()  # type: ignore[no-untyped-call]
        assert h.grad is not None and w.grad is not None
        return [loss.detach(), h.grad, w.grad]

    out: dict[str, Any] = {}
    g = torch.Generator(device=device).manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        for softcap in (None, 30.0):
            name = f"{str(dtype).split('.')[-1]}{'' if softcap is None else ' softcap 30'}"
            h = torch.randn(tokens, hidden, device=device, generator=g).to(dtype)
            w = (torch.randn(vocab, hidden, device=device, generator=g) * hidden**-0.5).to(dtype)
            target = torch.randint(0, vocab, (tokens,), device=device, generator=g)
            target[::7] = IGNORE_INDEX
            try:  # each variant on its own: one failing kernel branch hides no other
                got = loss_and_grads(fused, h, w, target, softcap)
                want = loss_and_grads(plain, h, w, target, softcap)
            except Exception as e:
                out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:400]}
                continue
            diffs = [rel(a, b) for a, b in zip(got, want, strict=True)]
            out[name] = {
                "loss_rel_diff": diffs[0],
                "hidden_grad_rel_diff": diffs[1],
                "weight_grad_rel_diff": diffs[2],
                "ok": max(diffs) < tol,
            }
    out["ok"] = all(v["ok"] for v in out.values())
    return out


def cmd_run(args: argparse.Namespace) -> int:
    import peft
    import torch
    import transformers

    from kubetune_trainer.tiny import make_records, write_jsonl

    cases = args.cases.split(",") if args.cases else DEFAULT_CASES
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        print(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures GPU runs", file=sys.stderr)
        return 2
    models = Path(args.models)
    models.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(
        models / "alpaca.jsonl", make_records("alpaca", args.records, long_tail=True)
    )
    host = {
        "gpu": torch.cuda.get_device_name(0),
        "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "date": dt.date.today().isoformat(),
    }
    try:
        import bitsandbytes

        host["bitsandbytes"] = bitsandbytes.__version__
    except ImportError:
        host["bitsandbytes"] = None
    try:
        from importlib.metadata import version

        host["liger_kernel"] = version("liger-kernel")
    except ImportError:
        host["liger_kernel"] = None
    probe = probe_varlen()
    host["varlen_probe"] = probe
    print(json.dumps({"varlen_probe": probe}), flush=True)
    if any(CASES[c].fused_ce for c in cases):
        host["fused_probe"] = probe_fused()
        print(json.dumps({"fused_probe": host["fused_probe"]}), flush=True)
    if not probe["ok"]:
        for case in cases:  # measure the other savers on the mask path rather than nothing
            if CASES[case].packed_attention == "varlen":
                CASES[case] = replace(CASES[case], packed_attention="mask")
    out = Path(args.out)
    began = time.time()
    with out.open("a") as fh:
        for case in cases:
            if args.time_budget and time.time() - began > args.time_budget:
                print(f"time budget of {args.time_budget:.0f} s spent; not run: {case}", flush=True)
                continue
            result = {
                **host,
                **run_case(case, models, data, args.steps, args.warmup, args.case_timeout),
            }
            fh.write(json.dumps(result) + "\n")
            fh.flush()
            print(json.dumps({k: v for k, v in result.items() if k != "stderr_tail"}), flush=True)
            if result["exit_code"] != 0:
                print(result.get("stderr_tail", ""), flush=True)
    return 0


# --------------------------------------------------------------------------- report

GIB = 2**30

# "Before" → "after" pairs of the report's second table.
COMPARISONS = [
    ("llama1b-full", "llama1b-full-varlen"),
    ("llama1b-full", "llama1b-full-savers"),
    ("llama1b-full", "llama1b-full-mb8-savers"),
    ("llama1b-lora", "llama1b-lora-savers"),
    ("llama1b-full-savers", "llama1b-full-fused"),
    ("llama1b-lora-savers", "llama1b-lora-fused"),
    ("llama1b-lora-16k-savers", "llama1b-lora-16k-fused"),
    ("llama1b-full-savers", "llama1b-full-inbwd"),
    ("llama8b-full-ckpt-8bit-savers", "llama8b-full-ckpt-8bit-inbwd"),
]


def _setup_fields(row: dict[str, Any]) -> dict[str, Any]:
    """The row's setup as the estimator's and the simulation's field names."""
    return {
        "method": row["method"],
        "micro_batch": row["micro_batch"],
        "seq_len": row["seq_len"],
        "gpus": 1,
        "sharding": "none",
        "precision": "bf16",
        "optimizer": row["optimizer"],
        "grad_ckpt": row["grad_ckpt"],
        "lora_rank": row["lora_rank"] or 16,
        "chunked_ce": bool(row.get("chunked_ce")),
        "activation_offload": bool(row.get("activation_offload")),
        "fused_ce": bool(row.get("fused_ce")),
        "optimizer_in_backward": bool(row.get("optimizer_in_backward")),
    }


def estimate_for(row: dict[str, Any]) -> tuple[float, float, float]:
    """(allocated-comparable, reserved-comparable, whole per-GPU) estimate in GiB."""
    from kubetune.planning.arch import arch_from_hf_config
    from kubetune.planning.estimator import TrainingSetup, comparable_bytes, estimate_vram

    arch = arch_from_hf_config(ARCHS[row["model"]], name=row["model"])
    # Packed rows through the variable-length kernel build no attention mask.
    attention = "varlen" if row.get("varlen_attention") else "sdpa"
    est = estimate_vram(arch, TrainingSetup(**_setup_fields(row), attention=attention))
    return (
        comparable_bytes(est, "allocated") / GIB,
        comparable_bytes(est, "reserved") / GIB,
        est.per_gpu_bytes / GIB,
    )


def simulated_for(row: dict[str, Any]) -> tuple[float | None, str]:
    """The simulated step's peak in GiB (`kubetune estimate --simulate`), or None and why
    the simulation does not run that setup."""
    from kubetune_trainer.simulate import SimulationError, SimulationSetup, simulate

    try:
        result = simulate(ARCHS[row["model"]], SimulationSetup(**_setup_fields(row)))
    except SimulationError as e:
        return None, str(e).split(":")[0].split(";")[0]
    return result.phases["peak"] / GIB, ""


def _pct(got: float, want: float) -> str:
    return f"{100 * (got - want) / want:+.1f}%"


def render(rows: list[dict[str, Any]], command: str, simulate: bool = True) -> str:
    host = rows[0]
    lines = [
        f"# Trainer on one GPU — {host['date']}",
        "",
        f"Made by `{command}` on one {host['gpu']} ({host['gpu_memory_bytes'] / GIB:.0f} GiB).",
        "",
        f"- torch {host['torch']}, transformers {host['transformers']}, peft {host['peft']}, "
        f"bitsandbytes {host.get('bitsandbytes') or '-'}",
        "- Random bf16 weights from the published configs; a 512-token BPE tokenizer trained on "
        "the fly; synthetic alpaca records packed into full sequences; one process, no FSDP",
        "- LoRA r16 α32 dropout 0.05 on all linear layers of the blocks; AdamW (8-bit or paged "
        "where named); bf16 weights; gradient accumulation 1",
        "- savers: `varlen`: packed rows by document bounds through PyTorch's variable-length "
        "flash attention instead of SDPA with a block-diagonal mask (`training.packed_attention`"
        "); `chunked CE`: the chunked cross-entropy; `fused CE`: Liger's fused linear "
        "cross-entropy (`training.fused_cross_entropy`); `offload`: activations offloaded to host "
        "memory; `step in backward`: the optimizer step inside backward "
        "(`training.optimizer_in_backward`, no gradient clipping)",
        "- tokens/s: trained tokens per second after the warm-up steps; MFU: the trainer's own "
        "figure (6·N·tokens/s for full fine-tuning, 4·N for adapters, N the weights that take "
        "part in a matmul — a tied output projection included — plus attention; over 989 "
        "TFLOP/s dense bf16); peaks: `torch.cuda.max_memory_allocated` / `max_memory_reserved` "
        "of the trainer process (paged optimizer states are CUDA managed memory, outside both)",
        "- estimate: `kubetune estimate` for the same setup (`--attention varlen` where the run "
        "used the variable-length kernel), the part comparable to each measured "
        "metric; simulated: the trainer's step on fake tensors (`kubetune estimate --simulate`), "
        "on the machine that made the table; error = (figure − measured) / measured",
    ]
    probe = host.get("varlen_probe")
    if probe:
        lines.append(
            f"- variable-length kernel against per-document SDPA on this GPU (bf16, "
            f"forward and gradients): largest difference {probe.get('output_rel_diff', 0):.1e} "
            f"/ {probe.get('grad_rel_diff', 0):.1e} of the largest value "
            f"({'passed' if probe.get('ok') else 'failed: ' + str(probe.get('error'))})"
        )
    fused = next((r["fused_probe"] for r in rows if r.get("fused_probe")), None)
    if fused:
        parts = [
            f"{name}: {v['loss_rel_diff']:.1e} / {v['hidden_grad_rel_diff']:.1e} / "
            f"{v['weight_grad_rel_diff']:.1e}"
            if "error" not in v
            else f"{name}: failed ({v['error']})"
            for name, v in fused.items()
            if isinstance(v, dict)
        ]
        lines.append(
            "- fused loss kernel against the plain loss computed in fp32 from the same inputs "
            "(loss / hidden-state gradient / weight gradient, largest difference over the largest "
            f"value): {'; '.join(parts)} ({'passed' if fused.get('ok') else 'failed'})"
        )
    lines += [
        "",
        "| case | model | method | micro-batch × seq | ckpt | optimizer | savers | steps "
        "| tokens/s | MFU | allocated GiB | estimate | error | simulated | error "
        "| reserved GiB | loss first → last |",
        "| --- | --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: | --- |",
    ]
    by_case = {r["case"]: r for r in rows}
    not_simulated: list[str] = []
    for r in rows:
        c = Case(**{k: r[k] for k in Case.__dataclass_fields__ if k in r})
        head = (
            f"| {r['case']} | {r['model']} | {r['method']} | {r['micro_batch']} × {r['seq_len']} "
            f"| {'on' if r['grad_ckpt'] else 'off'} | {r['optimizer']} | {c.savers()} "
            f"| {r['steps']} "
        )
        if "peak_allocated_bytes" not in r:
            why = "out of memory" if r["exit_code"] == 43 else f"exit {r['exit_code']}"
            lines.append(head + f"| {why} | | | | | | | | |")
            continue
        alloc = r["peak_allocated_bytes"] / GIB
        e_alloc, _, _ = estimate_for(r)
        sim, why = simulated_for(r) if simulate else (None, "not run")
        sim_cells = f"{sim:.2f} | {_pct(sim, alloc)}" if sim is not None else "- | -"
        if sim is None:
            not_simulated.append(f"{r['case']}: {why}")
        mfu = f"{100 * r['mfu_ratio']:.1f}%" if r.get("mfu_ratio") is not None else "-"
        loss = f"{r['loss_first']:.3f} → {r['loss_last']:.3f}" if r.get("loss_last") else "-"
        lines.append(
            head + f"| {r.get('tokens_per_second', 0):,.0f} | {mfu} | {alloc:.2f} "
            f"| {e_alloc:.2f} | {_pct(e_alloc, alloc)} | {sim_cells} "
            f"| {r['peak_reserved_bytes'] / GIB:.2f} | {loss} |"
        )
    if not_simulated:
        lines += ["", "Not simulated: " + "; ".join(not_simulated) + "."]
    pairs = [(a, b) for a, b in COMPARISONS if a in by_case and b in by_case]
    if pairs:
        lines += [
            "",
            "Before → after (same run, same machine):",
            "",
            "| before | after | tokens/s | MFU | allocated GiB | largest step-loss difference |",
            "| --- | --- | ---: | ---: | ---: | ---: |",
        ]
        for a, b in pairs:
            ra, rb = by_case[a], by_case[b]
            if "peak_allocated_bytes" not in ra or "peak_allocated_bytes" not in rb:
                continue
            same_batch = ra["micro_batch"] == rb["micro_batch"]
            diff = (
                f"{max(abs(x - y) for x, y in zip(ra['losses'], rb['losses'], strict=True)):.1e}"
                if same_batch and len(ra["losses"]) == len(rb["losses"])
                else "- (other batches)"
            )
            lines.append(
                f"| {a} | {b} | {ra['tokens_per_second']:,.0f} → {rb['tokens_per_second']:,.0f} "
                f"({_pct(rb['tokens_per_second'], ra['tokens_per_second'])}) "
                f"| {100 * ra['mfu_ratio']:.1f}% → {100 * rb['mfu_ratio']:.1f}% "
                f"| {ra['peak_allocated_bytes'] / GIB:.2f} → "
                f"{rb['peak_allocated_bytes'] / GIB:.2f} "
                f"| {diff} |"
            )
    return "\n".join(lines) + "\n"


def cmd_report(args: argparse.Namespace) -> int:
    rows = [json.loads(x) for x in Path(args.results).read_text().splitlines() if x.strip()]
    if not rows:
        print(f"{args.results}: no results", file=sys.stderr)
        return 2
    command = "python benchmarks/gpu_trainer.py run --steps {} --warmup {} --cases {}".format(
        args.steps, args.warmup, ",".join(r["case"] for r in rows)
    )
    text = render(rows, command, simulate=not args.no_simulate)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="measure on this machine's GPU; one JSON line per case")
    run.add_argument("--out", required=True, help="JSON-lines file to append results to")
    run.add_argument("--cases", default="", help=f"comma-separated subset of: {', '.join(CASES)}")
    run.add_argument("--steps", type=int, default=16)
    run.add_argument("--records", type=int, default=20000, help="synthetic alpaca records")
    run.add_argument(
        "--case-timeout", type=float, default=600, help="seconds before a case is stopped"
    )
    run.add_argument("--warmup", type=int, default=4)
    run.add_argument(
        "--time-budget",
        type=float,
        default=0,
        help="seconds after which no further case starts (0: none); a lent GPU is time-boxed",
    )
    run.add_argument("--models", default=str(Path(tempfile.gettempdir()) / "kubetune-gpu-models"))
    rep = sub.add_parser("report", help="markdown table of results, estimates beside them")
    rep.add_argument("results")
    rep.add_argument("--out", default="")
    rep.add_argument("--steps", type=int, default=16, help="as given to run (for the header)")
    rep.add_argument("--warmup", type=int, default=4, help="as given to run (for the header)")
    rep.add_argument("--no-simulate", action="store_true", help="leave the simulated column out")
    args = parser.parse_args(argv)
    return cmd_run(args) if args.command == "run" else cmd_report(args)


if __name__ == "__main__":
    raise SystemExit(main())
