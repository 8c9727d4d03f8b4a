"""Host memory and start-up time of the trainer's data setup, with and without the cache.

Two processes on the CPU (torchrun, gloo), as two ranks of one node, each run what the
recipe runs before it loads the model: `datacache.tokenized_data` around the recipe's own
`prepare` (read the records, template, tokenize, truncate, split, pack). Three starts per
dataset size:

- off: `KUBETUNE_DATA_CACHE=off`, the code path without the cache: every rank reads and
  tokenizes the whole dataset into lists of Python ints.
- cold: the cache on, its folder empty: local rank 0 tokenizes and writes the arrays, rank 1
  waits at the barrier; both then memory-map them.
- warm: the cache on, the folder filled by `cold` (a restart, a resume): nobody tokenizes.

After the data setup each rank touches every token of its rows (as an epoch would) and
reports, from /proc/self/status and /proc/self/smaps_rollup: RSS (anonymous + file pages
mapped), the anonymous part (private to the rank), the file part (shared libraries and
cache pages, shared through the page cache) and PSS (shared pages split between the
processes mapping them, the fair per-rank share), all in MiB after the setup, plus the peak
RSS (VmHWM) over the whole process. The interpreter's own memory is subtracted: the "data"
columns are the growth over each rank's own figures just before the data setup (torch and
transformers imported, tokenizer loaded), and "data peak" is VmHWM minus that RSS. Seconds
are the setup's wall time, the slower rank's.

Data: `kubetune_trainer.tiny.make_records("alpaca", N)` records with the tiny BPE tokenizer
(`tiny.make_tokenizer`, 512 tokens), sequence_length 512, packing on, validation_split 0.01.

Usage: python -m benchmarks.data_cache [--sizes 50000,200000] [--workdir DIR]
           [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.measure import proc_kib

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SEQ_LEN = 512
MODES = ("off", "cold", "warm")


def memory_mib() -> dict[str, float]:
    status = proc_kib("/proc/self/status", ("VmRSS", "RssAnon", "RssFile", "VmHWM"))
    rollup = proc_kib("/proc/self/smaps_rollup", ("Pss",))
    return {
        "rss": status["VmRSS"] / 1024,
        "anon": status["RssAnon"] / 1024,
        "file": status["RssFile"] / 1024,
        "pss": rollup["Pss"] / 1024,
        "peak": status["VmHWM"] / 1024,
    }


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from kubetune_trainer.contract import TrainerConfig
    from kubetune_trainer.data import PreparedData, Rows, prepare_data, read_records
    from kubetune_trainer.datacache import tokenized_data
    from kubetune_trainer.distributed import barrier, destroy_distributed, init_distributed

    torch.set_num_threads(1)
    cfg = TrainerConfig.model_validate(json.loads(Path(args.config).read_text()))
    env = init_distributed()
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.source)
    barrier()
    baseline = memory_mib()
    t0 = time.monotonic()

    def prepare() -> PreparedData:
        records = read_records(cfg.dataset.source, cfg.dataset.kind, cfg.dataset.revision)
        return prepare_data(
            records,
            fmt=cfg.dataset.format,
            tokenizer=tokenizer,
            sequence_length=cfg.training.sequence_length,
            packing=cfg.training.packing,
            validation_split=cfg.dataset.validation_split,
            seed=cfg.training.seed,
        )

    data, outcome = tokenized_data(cfg, env, tokenizer, prepare)
    seconds = time.monotonic() - t0
    rows = data.train
    assert isinstance(rows, Rows) and rows.position_ids is not None
    touched = 0
    for seqs in (rows.input_ids, rows.labels, rows.position_ids):
        flat = getattr(seqs, "flat", None)
        if flat is not None:  # every page of the mapped arrays read once
            touched += int(flat.sum(dtype=np.int64) != 0)
        else:
            touched += sum(len(r) for r in seqs)
    barrier()
    mem = memory_mib()
    result = {
        "rank": env.rank,
        "source": outcome.source,
        "seconds": seconds,
        "rows": len(rows),
        "tokens": int(data.stats.train_tokens),
        "baseline": baseline["rss"],
        "d_rss": mem["rss"] - baseline["rss"],
        "d_anon": mem["anon"] - baseline["anon"],
        "d_pss": mem["pss"] - baseline["pss"],
        "d_peak": mem["peak"] - baseline["rss"],
        **mem,
    }
    with open(args.out, "a") as fh:
        fh.write(json.dumps(result) + "\n")
    destroy_distributed()


def run_start(workdir: Path, config: Path, mode: str) -> list[dict[str, Any]]:
    out = workdir / f"ranks-{mode}.jsonl"
    out.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    if mode == "off":
        env["KUBETUNE_DATA_CACHE"] = "off"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",  # each rank runs this module, found as this process found it
        "benchmarks.data_cache",
        "--worker",
        "--config",
        str(config),
        "--out",
        str(out),
    ]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return [json.loads(line) for line in out.read_text().splitlines()]


def measure(workdir: Path, size: int, tokenizer_dir: Path) -> dict[str, list[dict[str, Any]]]:
    from kubetune_trainer.tiny import make_records, write_jsonl

    data = write_jsonl(workdir / f"alpaca-{size}.jsonl", make_records("alpaca", size))
    ckpt = workdir / f"ckpt-{size}"
    cfg = {
        "job": {"name": "bench", "namespace": "default", "uid": "u1"},
        "method": "lora",
        "model": {"source": str(tokenizer_dir), "kind": "path"},
        "dataset": {
            "source": str(data),
            "kind": "path",
            "format": "alpaca",
            "validation_split": 0.01,
        },
        "lora": {"rank": 4, "alpha": 8, "dropout": 0.0},
        "training": {
            "total_steps": 10,
            "micro_batch_size": 1,
            "gradient_accumulation": 1,
            "global_batch_size": 2,
            "sequence_length": SEQ_LEN,
            "packing": True,
            "seed": 7,
        },
        "checkpoint": {"dir": str(ckpt), "interval_steps": 10, "keep": 1},
        "output": {"dir": str(workdir / "out")},
        "metrics": {"port": -1},
    }
    config = workdir / f"config-{size}.json"
    config.write_text(json.dumps(cfg))
    results = {}
    for mode in MODES:
        results[mode] = sorted(run_start(workdir, config, mode), key=lambda r: r["rank"])
        print(f"{size} {mode}: {json.dumps(results[mode])}", flush=True)
    cache_bytes = sum(p.stat().st_size for p in (ckpt / ".data").rglob("*") if p.is_file())
    results["cache_mib"] = [{"mib": cache_bytes / 2**20}]
    return results


def table(all_results: dict[int, dict[str, list[dict[str, Any]]]]) -> str:
    head = (
        "| records | start | tokenized by | setup s (slower rank) | train rows / tokens | "
        "rank | RSS MiB | data RSS MiB | data anon MiB | file MiB | data PSS MiB | "
        "data peak MiB |\n"
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    lines = []
    for size, res in all_results.items():
        for mode in MODES:
            ranks = res[mode]
            secs = max(r["seconds"] for r in ranks)
            who = {"off": "both ranks", "cold": "rank 0", "warm": "nobody"}[mode]
            for r in ranks:
                lines.append(
                    f"| {size} | {mode} | {who} | {secs:.1f} | {r['rows']} / {r['tokens']} | "
                    f"{r['rank']} ({r['source']}) | {r['rss']:.0f} | {r['d_rss']:.0f} | "
                    f"{r['d_anon']:.0f} | {r['file']:.0f} | {r['d_pss']:.0f} | "
                    f"{r['d_peak']:.0f} |"
                )
    return head + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--config")
    parser.add_argument("--out")
    parser.add_argument("--sizes", default="50000,200000")
    parser.add_argument("--workdir")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from kubetune_trainer.tiny import make_tokenizer

    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        workdir = Path(tmp)
        tokenizer_dir = workdir / "tokenizer"
        make_tokenizer(tokenizer_dir)
        load0 = os.getloadavg()[0]
        all_results = {size: measure(workdir, size, tokenizer_dir) for size in sizes}
        load1 = os.getloadavg()[0]
    md = table(all_results)
    caches = ", ".join(f"{s}: {r['cache_mib'][0]['mib']:.1f} MiB" for s, r in all_results.items())
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    header = (
        f"Made by `python -m benchmarks.data_cache --sizes {args.sizes}` on {platform.node()}"
        f" ({os.cpu_count()} cores, Python {platform.python_version()}), code as of {commit}; "
        f"1-minute load average {load0:.1f} at the start, {load1:.1f} at the end.\n\n"
        f"Cache folder size on the volume: {caches}.\n\n"
    )
    print(header + md)
    if not args.no_write:
        out = HERE / "results" / f"data-cache-{time.strftime('%Y-%m-%d')}.md"
        out.write_text(header + md)
        print(f"written to {out}")


if __name__ == "__main__":
    main()
