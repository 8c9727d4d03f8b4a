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

Measured per case: trained (non-padding) tokens per second over the steps after `--warmup`,
the trainer's own MFU figure (model FLOPs per token x tokens/s over the GPU's dense bf16 peak),
and the process's peak `torch.cuda.max_memory_allocated` / `max_memory_reserved`, which is
what decides an out-of-memory.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
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

# name -> (model, method, micro-batch, sequence length, activation checkpointing, optimizer)
CASES: dict[str, tuple[str, str, int, int, bool, str]] = {
    "llama1b-lora": (LLAMA1B, "lora", 8, 2048, False, "adamw"),
    "llama1b-lora-mb2": (LLAMA1B, "lora", 2, 2048, False, "adamw"),
    "llama1b-lora-ckpt": (LLAMA1B, "lora", 8, 2048, True, "adamw"),
    "llama1b-qlora-ckpt": (LLAMA1B, "qlora", 8, 2048, True, "adamw"),
    "llama1b-full": (LLAMA1B, "full", 4, 2048, False, "adamw"),
    "llama1b-full-ckpt": (LLAMA1B, "full", 4, 2048, True, "adamw"),
    "qwen1.5b-lora": (QWEN15B, "lora", 8, 2048, False, "adamw"),
    "qwen1.5b-lora-ckpt": (QWEN15B, "lora", 8, 2048, True, "adamw"),
    "qwen1.5b-full-ckpt": (QWEN15B, "full", 4, 2048, True, "adamw"),
    "llama8b-lora-ckpt": (LLAMA8B, "lora", 4, 2048, True, "adamw"),
    "llama8b-qlora-ckpt": (LLAMA8B, "qlora", 4, 2048, True, "adamw"),
    "llama8b-full-ckpt-8bit": (LLAMA8B, "full", 2, 2048, True, "adamw-8bit"),
}
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
    _, method, micro, seq, ckpt, optimizer = CASES[case]
    cfg = {
        "contract_version": 1,
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
            "sequence_length": seq,
            "learning_rate": 1e-4,
            "warmup_ratio": 0.1,
            "precision": "bf16",
            "gradient_checkpointing": ckpt,
            "packing": True,
            "optimizer": optimizer,
        },
        "checkpoint": {"dir": str(work / "ckpt"), "interval_minutes": 0},
        "output": {"dir": str(work / "out")},
        "metrics": {"port": -1, "log_path": str(work / "metrics.jsonl")},
    }
    path = work / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def run_case(case: str, models: Path, data: Path, steps: int, warmup: int) -> dict[str, Any]:
    model, method, micro, seq, ckpt, optimizer = CASES[case]
    t0 = time.time()
    model_dir = make_model(models / model.replace("/", "--"), model)
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
    proc = subprocess.run(
        [sys.executable, "-m", "kubetune_trainer", "--config", str(cfg)],
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.time() - started
    log = work / "metrics.jsonl"
    events = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    step_ev = [e for e in events if e.get("event") == "step"]
    result: dict[str, Any] = {
        "case": case,
        "model": model,
        "method": method,
        "micro_batch": micro,
        "seq_len": seq,
        "grad_ckpt": ckpt,
        "optimizer": optimizer,
        "lora_rank": LORA["rank"] if method != "full" else None,
        "steps": len(step_ev),
        "exit_code": proc.returncode,
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
    if proc.returncode != 0:
        result["stderr_tail"] = proc.stderr[-1500:]
        msg = Path("/dev/termination-log")
        if msg.exists():
            result["termination_message"] = msg.read_text()[-500:]
    return result


def cmd_run(args: argparse.Namespace) -> int:
    import peft
    import torch
    import transformers

    from kubetune_trainer.tiny import make_records, write_jsonl

    cases = args.cases.split(",") if args.cases else list(CASES)
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        print(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures GPU runs", file=sys.stderr)
        return 2
    models = Path(args.models)
    models.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(models / "alpaca.jsonl", make_records("alpaca", 20000, long_tail=True))
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
    out = Path(args.out)
    with out.open("a") as fh:
        for case in cases:
            result = {**host, **run_case(case, models, data, args.steps, args.warmup)}
            fh.write(json.dumps(result) + "\n")
            fh.flush()
            print(json.dumps({k: v for k, v in result.items() if k != "stderr_tail"}), flush=True)
            if result["exit_code"] != 0:
                print(result.get("stderr_tail", ""), flush=True)
    return 0


# --------------------------------------------------------------------------- report


def estimate_for(row: dict[str, Any]) -> tuple[float, float, float]:
    """(allocated-comparable, reserved-comparable, whole per-GPU) estimate in GiB."""
    from kubetune.planning.arch import arch_from_hf_config
    from kubetune.planning.estimator import TrainingSetup, comparable_bytes, estimate_vram

    arch = arch_from_hf_config(ARCHS[row["model"]], name=row["model"])
    setup = TrainingSetup(
        method=row["method"],
        micro_batch=row["micro_batch"],
        seq_len=row["seq_len"],
        gpus=1,
        sharding="none",
        precision="bf16",
        optimizer=row["optimizer"],
        grad_ckpt=row["grad_ckpt"],
        lora_rank=row["lora_rank"] or 16,
    )
    est = estimate_vram(arch, setup)
    gib = 2**30
    return (
        comparable_bytes(est, "allocated") / gib,
        comparable_bytes(est, "reserved") / gib,
        est.per_gpu_bytes / gib,
    )


def render(rows: list[dict[str, Any]], command: str) -> str:
    gib = 2**30
    host = rows[0]
    lines = [
        f"# Trainer on one GPU — {host['date']}",
        "",
        f"Made by `{command}` on one {host['gpu']} ({host['gpu_memory_bytes'] / gib:.0f} GiB).",
        "",
        f"- torch {host['torch']}, transformers {host['transformers']}, peft {host['peft']}, "
        f"bitsandbytes {host.get('bitsandbytes') or '-'}; SDPA attention (transformers' default)",
        "- Random bf16 weights from the published configs; a 512-token BPE tokenizer trained on "
        "the fly; synthetic alpaca records packed into full sequences; one process, no FSDP",
        "- LoRA r16 α32 dropout 0.05 on all linear layers of the blocks; AdamW (8-bit where "
        "named); bf16 weights; gradient accumulation 1",
        "- tokens/s: trained tokens per second after the warm-up steps; MFU: the trainer's "
        "own figure (6·N·tokens/s + attention, over 989 TFLOP/s dense bf16); peaks: "
        "`torch.cuda.max_memory_allocated` / `max_memory_reserved` of the trainer process",
        "- estimate: `kubetune estimate` for the same setup, the part comparable to each "
        "measured metric, and the whole per-GPU figure the planner uses (adds CUDA context, "
        "allocator headroom); error = (estimate − measured) / measured",
        "",
        "| case | model | method | micro-batch × seq | ckpt | steps | tokens/s | MFU "
        "| allocated GiB | estimate | error | reserved GiB | estimate | error "
        "| planner per-GPU GiB | loss first → last |",
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | --- |",
    ]
    for r in rows:
        name = r["case"] + (f" ({r['optimizer']})" if r["optimizer"] != "adamw" else "")
        setup = f"{r['micro_batch']} × {r['seq_len']}"
        ckpt = "on" if r["grad_ckpt"] else "off"
        if r["exit_code"] != 0 or "peak_allocated_bytes" not in r:
            why = "out of memory" if r["exit_code"] == 43 else f"exit {r['exit_code']}"
            lines.append(
                f"| {name} | {r['model']} | {r['method']} | {setup} | {ckpt} | {r['steps']} "
                f"| {why} | | | | | | | | | |"
            )
            continue
        e_alloc, e_res, e_full = estimate_for(r)
        alloc = r["peak_allocated_bytes"] / gib
        res = r["peak_reserved_bytes"] / gib
        mfu = f"{100 * r['mfu_ratio']:.1f}%" if r.get("mfu_ratio") is not None else "-"
        loss = f"{r['loss_first']:.2f} → {r['loss_last']:.2f}" if r.get("loss_last") else "-"
        lines.append(
            f"| {name} | {r['model']} | {r['method']} | {setup} | {ckpt} | {r['steps']} "
            f"| {r.get('tokens_per_second', 0):,.0f} | {mfu} "
            f"| {alloc:.2f} | {e_alloc:.2f} | {100 * (e_alloc - alloc) / alloc:+.1f}% "
            f"| {res:.2f} | {e_res:.2f} | {100 * (e_res - res) / res:+.1f}% "
            f"| {e_full:.2f} | {loss} |"
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
    text = render(rows, command)
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
    run.add_argument("--warmup", type=int, default=4)
    run.add_argument("--models", default=str(Path(tempfile.gettempdir()) / "kubetune-gpu-models"))
    rep = sub.add_parser("report", help="markdown table of results, estimates beside them")
    rep.add_argument("results")
    rep.add_argument("--out", default="")
    rep.add_argument("--steps", type=int, default=16, help="as given to run (for the header)")
    rep.add_argument("--warmup", type=int, default=4, help="as given to run (for the header)")
    args = parser.parse_args(argv)
    return cmd_run(args) if args.command == "run" else cmd_report(args)


if __name__ == "__main__":
    raise SystemExit(main())
