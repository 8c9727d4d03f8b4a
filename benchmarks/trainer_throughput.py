"""CPU throughput: the kubetune trainer vs a plain Hugging Face `Trainer` + PEFT baseline.

Same random-init Llama-style model, same tokenized examples (alpaca format, prompt masked),
same LoRA settings, optimizer, schedule, batch and steps. Both run as fresh subprocesses with
the same thread count. Throughput is trained-on (non-padding) input tokens per second over the
steps after the first `--warmup` ones, measured the same way for both from per-step
timestamps, best of `--repeats` runs.

Two comparisons:

- `defaults`: each side as it is normally used. The trainer packs sequences (its default);
  the HF baseline pads each batch to its longest example (DataCollatorForSeq2Seq).
- `packing off`: both train on micro-batches padded to their longest example (drawn in a
  different random order); what is left is the training loop itself.

Usage: python benchmarks/trainer_throughput.py [--steps 30] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

MODEL = {
    "hidden": 256,
    "layers": 4,
    "heads": 8,
    "kv_heads": 4,
    "intermediate": 688,
    "vocab_size": 1024,
}
TRAIN = {
    "micro_batch_size": 8,
    "gradient_accumulation": 2,
    "sequence_length": 256,
    "learning_rate": 2e-4,
    "warmup_ratio": 0.05,
    "lora_rank": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.05,
    "records": 1200,
}


# --------------------------------------------------------------------------- our trainer


def trainer_config(work: Path, model: Path, data: Path, steps: int, packing: bool) -> Path:
    from kubetune_trainer.contract import CONTRACT_VERSION

    cfg = {
        "contract_version": CONTRACT_VERSION,
        "job": {"name": "bench"},
        "method": "lora",
        "model": {"source": str(model)},
        "dataset": {"source": str(data), "format": "alpaca"},
        "lora": {
            "rank": TRAIN["lora_rank"],
            "alpha": TRAIN["lora_alpha"],
            "dropout": TRAIN["lora_dropout"],
            "target_modules": ["all-linear"],
        },
        "training": {
            "total_steps": steps,
            "max_steps": steps,
            "micro_batch_size": TRAIN["micro_batch_size"],
            "gradient_accumulation": TRAIN["gradient_accumulation"],
            "global_batch_size": TRAIN["micro_batch_size"] * TRAIN["gradient_accumulation"],
            "sequence_length": TRAIN["sequence_length"],
            "learning_rate": TRAIN["learning_rate"],
            "warmup_ratio": TRAIN["warmup_ratio"],
            "precision": "fp32",
            "gradient_checkpointing": False,
            "packing": packing,
            "optimizer": "adamw",
        },
        "checkpoint": {"dir": str(work / "ckpt"), "interval_minutes": 0},
        "output": {"dir": str(work / "out")},
        "metrics": {"port": -1, "log_path": str(work / "metrics.jsonl")},
    }
    path = work / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def run_ours(
    work: Path, model: Path, data: Path, steps: int, packing: bool, env: dict[str, str]
) -> list[tuple[float, float]]:
    """(end time, tokens) per step from the trainer's JSON-lines log."""
    work.mkdir(parents=True, exist_ok=True)
    cfg = trainer_config(work, model, data, steps, packing)
    subprocess.run(
        [sys.executable, "-m", "kubetune_trainer", "--config", str(cfg)],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    events = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    steps_ev = [e for e in events if e["event"] == "step"]
    out, seen = [], 0.0
    for e in steps_ev:
        out.append((e["time"], e["tokens_seen_total"] - seen))
        seen = e["tokens_seen_total"]
    return out


# --------------------------------------------------------------------------- HF baseline


def hf_baseline(model_dir: str, data: str, steps: int, out_json: str) -> None:
    """Plain transformers Trainer + PEFT LoRA, as its docs set it up."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from kubetune_trainer.data import Record, read_records, record_to_example

    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = []
    for rec in read_records(data):
        ex = record_to_example(Record(rec.where, rec.value), "alpaca", tok)
        ids, labels = (
            ex.input_ids[: TRAIN["sequence_length"]],
            ex.labels[: TRAIN["sequence_length"]],
        )
        examples.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels})

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    model = get_peft_model(
        model,
        LoraConfig(
            r=TRAIN["lora_rank"],
            lora_alpha=TRAIN["lora_alpha"],
            lora_dropout=TRAIN["lora_dropout"],
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        ),
    )
    collator = DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100)
    counted = {"tokens": 0.0}

    def count_tokens(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        # Counted at forward time: the data loader may fetch a batch ahead of the step.
        if model.training and kwargs.get("attention_mask") is not None:
            counted["tokens"] += float(kwargs["attention_mask"].sum())

    model.register_forward_pre_hook(count_tokens, with_kwargs=True)

    marks: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            marks.append((time.time(), counted["tokens"]))

    args = TrainingArguments(
        output_dir=str(Path(out_json).parent / "hf-out"),
        per_device_train_batch_size=TRAIN["micro_batch_size"],
        gradient_accumulation_steps=TRAIN["gradient_accumulation"],
        max_steps=steps,
        learning_rate=TRAIN["learning_rate"],
        warmup_steps=math.ceil(TRAIN["warmup_ratio"] * steps),  # as the trainer rounds it
        lr_scheduler_type="cosine",
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=42,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=examples, data_collator=collator, callbacks=[Clock()]
    )
    trainer.train()
    per_step, prev = [], 0.0
    for t, total in marks:
        per_step.append((t, total - prev))
        prev = total
    Path(out_json).write_text(json.dumps(per_step))


def run_hf(
    work: Path, model: Path, data: Path, steps: int, env: dict[str, str]
) -> list[tuple[float, float]]:
    work.mkdir(parents=True, exist_ok=True)
    out = work / "steps.json"
    subprocess.run(
        [sys.executable, __file__, "--hf-baseline", str(model), str(data), str(steps), str(out)],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return [(float(t), float(n)) for t, n in json.loads(out.read_text())]


# --------------------------------------------------------------------------- measure


def tokens_per_second(marks: list[tuple[float, float]], warmup: int) -> float:
    """Tokens of steps warmup+1..N over the time from the end of step `warmup` to the end."""
    if len(marks) <= warmup + 1:
        raise ValueError("not enough steps")
    t0 = marks[warmup - 1][0] if warmup else marks[0][0]
    tokens = sum(n for _, n in marks[warmup:])
    return tokens / (marks[-1][0] - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument(
        "--out", type=Path, default=HERE / "results" / f"trainer_throughput-{dt.date.today()}.md"
    )
    args = p.parse_args()

    from kubetune_trainer.tiny import make_model, make_records, write_jsonl

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    env.pop("WORLD_SIZE", None)
    with tempfile.TemporaryDirectory(prefix="kt-bench-") as tmp_s:
        tmp = Path(tmp_s)
        model = make_model(
            tmp / "model",
            arch="llama",
            hidden=MODEL["hidden"],
            layers=MODEL["layers"],
            heads=MODEL["heads"],
            kv_heads=MODEL["kv_heads"],
            intermediate=MODEL["intermediate"],
            vocab_size=MODEL["vocab_size"],
        )
        data = write_jsonl(
            tmp / "data.jsonl", make_records("alpaca", TRAIN["records"], seed=1, long_tail=True)
        )
        results: dict[str, list[float]] = {"ours-packed": [], "ours-padded": [], "hf": []}
        for r in range(args.repeats):  # interleaved, so drift in machine load hits all sides
            for name in results:
                work = tmp / f"{name}-{r}"
                if name == "hf":
                    marks = run_hf(work, model, data, args.steps, env)
                else:
                    marks = run_ours(work, model, data, args.steps, name == "ours-packed", env)
                tps = tokens_per_second(marks, args.warmup)
                results[name].append(tps)
                print(f"run {r + 1} {name:12s} {tps:9.0f} tok/s", flush=True)

    best = {k: max(v) for k, v in results.items()}
    spread = {k: (min(v), statistics.median(v), max(v)) for k, v in results.items()}
    ratio_default = best["ours-packed"] / best["hf"]
    ratio_same = best["ours-padded"] / best["hf"]
    print(f"\nHF Trainer + PEFT        {best['hf']:9.0f} tok/s")
    print(f"kubetune (packing)       {best['ours-packed']:9.0f} tok/s  ratio {ratio_default:.2f}x")
    print(f"kubetune (same batches)  {best['ours-padded']:9.0f} tok/s  ratio {ratio_same:.2f}x")
    write_report(args, best, spread, ratio_default, ratio_same)


def write_report(
    args: argparse.Namespace,
    best: dict[str, float],
    spread: dict[str, tuple[float, float, float]],
    ratio_default: float,
    ratio_same: float,
) -> None:
    import peft
    import torch
    import transformers

    n_params = MODEL["vocab_size"] * MODEL["hidden"] * 2 + MODEL["layers"] * (
        MODEL["hidden"] * MODEL["hidden"] * 2
        + 2 * MODEL["hidden"] * (MODEL["hidden"] // MODEL["heads"]) * MODEL["kv_heads"]
        + 3 * MODEL["hidden"] * MODEL["intermediate"]
    )
    rows = [
        ("HF `Trainer` + PEFT (pads each batch)", "hf", "1.00×"),
        ("kubetune trainer, packing (its default)", "ours-packed", f"{ratio_default:.2f}×"),
        (
            "kubetune trainer, packing off (padded batches, as HF)",
            "ours-padded",
            f"{ratio_same:.2f}×",
        ),
    ]
    m, t = MODEL, TRAIN
    command = (
        f"python benchmarks/trainer_throughput.py --steps {args.steps} --warmup {args.warmup} "
        f"--repeats {args.repeats} --threads {args.threads}"
    )
    lines = [
        f"# Trainer throughput on CPU — {dt.date.today()}",
        "",
        f"Made by `{command}`.",
        "",
        f"- Machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"{args.threads} thread(s) per run, no GPU",
        f"- torch {torch.__version__}, transformers {transformers.__version__}, "
        f"peft {peft.__version__}",
        f"- Model: random-init Llama, hidden {m['hidden']}, {m['layers']} layers, "
        f"{m['heads']} heads ({m['kv_heads']} KV), MLP {m['intermediate']}, "
        f"vocab {m['vocab_size']} (~{n_params / 1e6:.1f}M parameters), fp32",
        f"- LoRA r={t['lora_rank']} α={t['lora_alpha']} dropout {t['lora_dropout']} on all "
        f"linear layers; AdamW lr {t['learning_rate']}, warmup + cosine; micro-batch "
        f"{t['micro_batch_size']} × accumulation {t['gradient_accumulation']}; "
        f"sequence {t['sequence_length']}; no activation checkpointing",
        f"- Data: {t['records']} synthetic alpaca records (a copy task, prompt masked) whose "
        "lengths follow a long-tailed (log-normal) distribution like real instruction data; "
        "tokenized identically for both sides",
        f"- {args.steps} optimizer steps per run; throughput = non-padding tokens per second "
        f"after the first {args.warmup} steps; best of {args.repeats} interleaved runs",
        "",
        "| setup | tokens/s (best) | min / median / max | vs HF |",
        "| --- | ---: | --- | ---: |",
    ]
    for label, key, ratio in rows:
        lo, med, hi = spread[key]
        lines.append(f"| {label} | {best[key]:.0f} | {lo:.0f} / {med:.0f} / {hi:.0f} | {ratio} |")
    lines += [
        "",
        "Reading it: with packing off both loops train on micro-batches padded to their longest",
        "example, so they do about the same arithmetic and the difference is the loop itself.",
        "Packing removes the padding, so more of every matmul is real tokens; that is where the",
        "trainer's default setup gains.",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--hf-baseline":
        hf_baseline(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        main()
