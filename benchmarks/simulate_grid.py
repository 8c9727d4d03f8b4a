"""The analytical estimator against the simulated step over a grid (docs/simulate-grid.md).

One model per architecture family of the built-in table (the smallest) × full / LoRA / QLoRA ×
sequence length {512, 2048, 8192} × micro-batch {1, 4, 8} × checkpointing on/off, one GPU, bf16,
AdamW, LoRA rank 16 on all linears (QLoRA: NF4 with double quantization, as the trainer loads).
For each cell: the simulated peak (`kubetune_trainer.simulate`, 1 and 2 blocks extrapolated, the
steady-state step) and the part of the analytical estimate an allocated-bytes reading measures
(`comparable_bytes(estimate, "allocated")`), and their relative difference. `--methods` runs
some methods only, `--merge FILE` adds the cells of an earlier run (results .jsonl) for the
(method, GPU count) pairs not run, so that one method's cells, or one method's sharded
cells, can be redone without the others.

`--gpus 1 2 8` adds cells on several GPUs: rank 0 of N under FSDP2 (`--sharding full`, the
default, or `grad-op`) over sequence length {512, 2048} × micro-batch {1, 4} × checkpointing
on/off (a smaller grid: a sharded cell simulates 3 and 4 blocks).

`--objective dpo` runs the trainer's DPO step instead (a micro-batch of preference pairs, two
rows each; the LoRA reference forward with the adapters off) over sequence length {512, 2048}
× micro-batch {1, 4} pairs, against the estimate the planner makes for it (the rows of the
pairs), and writes docs/simulate-grid-dpo.md, its results and its own sample.

Writes docs/simulate-grid.md (summary and every cell), the cells as JSON lines under
benchmarks/results/, and every seventh cell to tests/unit/data/simulate_grid_sample.json, which
a unit test holds the estimator to, so that a change of the estimator that moves it away from
(or towards) the simulation shows up in CI until this script is run again.

    .venv/bin/python benchmarks/simulate_grid.py [--families llama qwen2 ...] [--objective dpo]
        [--gpus 1 2 8] [--sharding full|grad-op] [--methods qlora] [--merge RESULTS.jsonl]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from kubetune.planning.estimator import (
    GIB,
    TRAINER_QLORA_MATMUL_KEEPS_INPUT,
    TrainingSetup,
    comparable_bytes,
    estimate_vram,
    trainer_attention,
)
from kubetune.planning.models_table import MODELS
from kubetune.planning.throughput import ROWS_PER_PAIR
from kubetune.sources import load_arch
from kubetune_trainer.simulate import SimulationError, SimulationSetup, simulate

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "simulate-grid.md"
SAMPLE = ROOT / "tests" / "unit" / "data" / "simulate_grid_sample.json"
SAMPLE_EVERY = 7  # odd: the grid alternates checkpointing on and off
# LoRA dropout 0 in every cell: PEFT refuses dropout on MoE experts' stacked parameters, and
# the grid's cells stay comparable with its earlier runs. (The simulation runs dropout as
# CUDA's fused kernel does, with a 1-byte mask: docs/simulate.md.)
LORA_DROPOUT = 0.0

METHODS = ("full", "lora", "qlora")
SEQ_LENS = (512, 2048, 8192)
MICRO_BATCHES = (1, 4, 8)
CHECKPOINTING = (True, False)
SHARDED_SEQ_LENS = (512, 2048)
SHARDED_MICRO_BATCHES = (1, 4)
DPO_SEQ_LENS = (512, 2048)
DPO_MICRO_BATCHES = (1, 4)  # pairs


def outputs(objective: str) -> tuple[Path, Path]:
    """The doc and the unit test's sample for `objective`'s grid."""
    if objective == "dpo":
        return DOC.with_name("simulate-grid-dpo.md"), SAMPLE.with_name(
            "simulate_grid_dpo_sample.json"
        )
    return DOC, SAMPLE


def smallest_per_family() -> dict[str, str]:
    best: dict[str, tuple[str, int]] = {}
    for model in MODELS:
        family = str(model.config.get("model_type"))
        params = load_arch(model.hf_id).total_params
        if family not in best or params < best[family][1]:
            best[family] = (model.hf_id, params)
    return {family: hf_id for family, (hf_id, _) in sorted(best.items())}


def analytical(row: dict[str, Any]) -> int:
    """The estimator's allocated bytes for a grid row, with the attention the trainer runs."""
    arch = load_arch(row["model"])
    names = {f.name for f in dataclasses.fields(TrainingSetup)} - {"attention"}
    fields = {k: v for k, v in row.items() if k in names}
    fields["lora_targets"] = tuple(fields["lora_targets"])
    # The planner's estimate for the trainer, whose bitsandbytes the simulation runs.
    fields["qlora_matmul_keeps_input"] = TRAINER_QLORA_MATMUL_KEEPS_INPUT
    if row.get("objective") == "dpo":  # the planner's estimate: the rows of the pairs
        fields["micro_batch"] = row["micro_batch"] * ROWS_PER_PAIR
    setup = TrainingSetup(**fields, attention=trainer_attention(arch))
    return comparable_bytes(estimate_vram(arch, setup), "allocated")


def score(row: dict[str, Any]) -> None:
    row["analytical_bytes"] = analytical(row)
    if "simulated_bytes" in row:
        row["error"] = row["analytical_bytes"] / row["simulated_bytes"] - 1


def cell(model: str, fields: Any, setup: SimulationSetup) -> dict[str, Any]:
    row: dict[str, Any] = {"model": model, **dataclasses.asdict(setup)}
    row["lora_targets"] = list(setup.lora_targets)
    start = time.monotonic()
    try:
        result = simulate(fields, setup)
    except (SimulationError, ValueError, RuntimeError, NotImplementedError) as e:
        row["not_simulated"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return row
    row["simulated_bytes"] = result.peak_bytes
    row["peak_phase"] = result.peak_phase
    row["seconds"] = round(time.monotonic() - start, 2)
    return row


def label(row: dict[str, Any]) -> str:
    pairs = " pairs" if row.get("objective") == "dpo" else ""
    gpus = row.get("gpus", 1)
    sharded = f" {gpus} GPUs {row['sharding']}" if gpus > 1 else ""
    return (
        f"{row['method']} b{row['micro_batch']}{pairs}×{row['seq_len']} "
        f"{'ckpt' if row['grad_ckpt'] else 'no-ckpt'}{sharded}"
    )


def summary(rows: list[dict[str, Any]], total: int) -> list[str]:
    """The summary line of a set of scored cells."""
    errors = [r["error"] for r in rows]
    below = [e for e in errors if e < -0.03]
    return [
        f"| {total} | {len(rows)} | {statistics.median(errors):+.1%} "
        f"| {statistics.median(abs(e) for e in errors):.1%} | {min(errors):+.1%} "
        f"| {max(errors):+.1%} | {len(below)} |",
    ]


def write_doc(
    rows: list[dict[str, Any]], families: dict[str, str], elapsed: float, objective: str
) -> None:
    done = [r for r in rows if "error" in r]
    gpu_counts = sorted({int(r.get("gpus", 1)) for r in rows})
    one_gpu = [r for r in done if r.get("gpus", 1) == 1]
    errors = [r["error"] for r in one_gpu]
    dpo = objective == "dpo"
    lines = [
        "# The analytical estimator against the simulated " + ("DPO step" if dpo else "step"),
        "",
    ]
    if dpo:
        lines += [
            "The trainer's DPO step (docs/dpo.md) simulated for micro-batches of preference "
            "pairs, each a chosen and a rejected row of the sequence length; the LoRA cells run "
            "the reference forward with the adapters off and without gradients, the full cells "
            "use precomputed reference log-probabilities (zeros here). The estimate is the one "
            "the planner makes for a DPO job: the estimator's step for twice the rows. The SFT "
            "grid is docs/simulate-grid.md.",
            "",
        ]
    lines += [
        f"Made by `python benchmarks/simulate_grid.py{' --objective dpo' if dpo else ''}` on "
        f"{datetime.date.today()} in "
        f"{elapsed / 60:.0f} minutes (2-core machine); docs/simulate.md says what the simulation "
        "runs. "
        + (
            "One GPU"
            if gpu_counts == [1]
            else "One GPU, and rank 0 of several GPUs sharded by FSDP2 (the trainer's "
            "`fully_shard` per block and root on a fake process group)"
        )
        + ", bf16, AdamW, LoRA rank 16 on all linears without dropout (the "
        "simulation's CPU dropout keeps a 4-byte noise tensor where CUDA keeps a 1-byte mask), "
        "the smallest model of each "
        "family; estimate = `comparable_bytes(estimate, 'allocated')` (what "
        "`torch.cuda.max_memory_allocated` would read: no CUDA context, NCCL or allocator "
        "slack); error = estimate / simulated − 1. QLoRA: NF4, double quantization, as the "
        "trainer loads; sharded, every rank keeps the whole quantization state.",
        "",
    ]
    if errors:
        lines += [
            "| cells | simulated | median error | median abs error | smallest | largest | "
            "below the simulation by > 3 % |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *summary(one_gpu, len([r for r in rows if r.get("gpus", 1) == 1])),
            "",
        ]
    if gpu_counts != [1]:
        lines += [
            "Several GPUs (rank 0's peak; sequence length {512, 2048} × micro-batch {1, 4} × "
            "checkpointing on/off):",
            "",
            "| GPUs | sharding | method | cells | simulated | median error | median abs error "
            "| smallest | largest | below the simulation by > 3 % |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for gpus in gpu_counts[1:] if gpu_counts[0] == 1 else gpu_counts:
            for method in METHODS:
                these = [r for r in rows if r.get("gpus", 1) == gpus and r["method"] == method]
                scored = [r for r in these if "error" in r]
                if scored:
                    sharding = these[0]["sharding"]
                    lines.append(
                        f"| {gpus} | {sharding} | {method} " + summary(scored, len(these))[0]
                    )
        lines.append("")
    if errors:
        lines += [
            "By family and method, one GPU (median error, smallest, largest):",
            "",
            f"| family | model | {' | '.join(METHODS)} |",
            "| --- | --- |" + " --- |" * len(METHODS),
        ]
        for family, model in families.items():
            cells = []
            for method in METHODS:
                errs = [
                    r["error"] for r in one_gpu if r["model"] == model and r["method"] == method
                ]
                cells.append(
                    f"{statistics.median(errs):+.1%} ({min(errs):+.1%} … {max(errs):+.1%})"
                    if errs
                    else "not simulated"
                )
            lines.append(f"| {family} | {model} | {' | '.join(cells)} |")
    lines += [
        "",
        "## Every cell",
        "",
        "| model | setup | simulated GiB | estimate GiB | error | peak |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['model']} | {label(r)} | {r['simulated_bytes'] / GIB:.2f} "
                f"| {r['analytical_bytes'] / GIB:.2f} | {r['error']:+.1%} | {r['peak_phase']} |"
            )
        else:
            lines.append(
                f"| {r['model']} | {label(r)} | – | {r['analytical_bytes'] / GIB:.2f} "
                f"| {r['not_simulated']} | |"
            )
    outputs(objective)[0].write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", help="model types (default: every one)")
    parser.add_argument(
        "--rescore",
        type=Path,
        help="a results .jsonl: keep its simulations, recompute the estimate (after an estimator "
        "change), rewrite the doc and the sample",
    )
    parser.add_argument("--objective", choices=("sft", "dpo"), default="sft")
    parser.add_argument("--gpus", nargs="+", type=int, default=[1], help="GPU counts (default: 1)")
    parser.add_argument("--sharding", choices=("full", "grad-op"), default="full")
    parser.add_argument(
        "--methods", nargs="+", choices=METHODS, default=list(METHODS), help="default: all"
    )
    parser.add_argument(
        "--merge",
        type=Path,
        help="an earlier results .jsonl whose cells of the (method, GPU count) pairs not run "
        "join this run's",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    families = smallest_per_family()
    if args.families:
        families = {f: m for f, m in families.items() if f in args.families}
    if args.rescore:
        rows = [json.loads(line) for line in args.rescore.read_text().splitlines() if line]
        for row in rows:
            score(row)
        args.rescore.write_text("".join(json.dumps(row) + "\n" for row in rows))
        elapsed = sum(float(row.get("seconds", 0)) for row in rows)
        write_outputs(rows, families, elapsed, args.rescore, args.objective)
        return 0
    fields = {m.hf_id: m.config for m in MODELS}
    dpo = args.objective == "dpo"
    name = f"simulate-grid{'-dpo' if dpo else ''}-{datetime.date.today()}.jsonl"
    results = ROOT / "benchmarks" / "results" / name
    rows: list[dict[str, Any]] = []
    grid = [
        (gpus, *cell)
        for gpus in args.gpus
        for cell in itertools.product(
            families.items(),
            args.methods,
            DPO_SEQ_LENS if dpo else SEQ_LENS if gpus == 1 else SHARDED_SEQ_LENS,
            DPO_MICRO_BATCHES if dpo else MICRO_BATCHES if gpus == 1 else SHARDED_MICRO_BATCHES,
            CHECKPOINTING,
        )
    ]
    if args.merge:
        earlier = [json.loads(line) for line in args.merge.read_text().splitlines() if line]
        rows = [
            r
            for r in earlier
            if r["method"] not in args.methods or r.get("gpus", 1) not in args.gpus
        ]
    with results.open("w") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
        for i, (gpus, (_family, model), method, seq, micro, ckpt) in enumerate(grid, 1):
            setup = SimulationSetup(
                method=method,  # type: ignore[arg-type]
                seq_len=seq,
                micro_batch=micro,
                grad_ckpt=ckpt,
                lora_dropout=LORA_DROPOUT,
                objective=args.objective,
                gpus=gpus,
                sharding=args.sharding,
            )
            row = cell(model, fields[model], setup)
            score(row)
            rows.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
            shown = f"{row['error']:+.1%}" if "error" in row else row["not_simulated"]
            print(f"[{i}/{len(grid)}] {model} {label(row)}: {shown}", flush=True)
    # The simulations' own time (with --merge, the earlier run's cells count theirs).
    elapsed = sum(float(row.get("seconds", 0)) for row in rows)
    write_outputs(rows, families, elapsed, results, args.objective)
    return 0


def write_outputs(
    rows: list[dict[str, Any]],
    families: dict[str, str],
    elapsed: float,
    results: Path,
    objective: str,
) -> None:
    write_doc(rows, families, elapsed, objective)
    doc, sample_path = outputs(objective)
    keys = ("model", "method", "seq_len", "micro_batch", "grad_ckpt", "lora_dropout")
    extra = {"objective": objective} if objective == "dpo" else {}

    def sharded(r: dict[str, Any]) -> dict[str, Any]:
        return {"gpus": r["gpus"], "sharding": r["sharding"]} if r.get("gpus", 1) > 1 else {}

    sample = [
        {
            **{k: r[k] for k in keys},
            **extra,
            **sharded(r),
            "simulated_bytes": r["simulated_bytes"],
            "error": r["error"],
        }
        for r in rows[::SAMPLE_EVERY]
        if "error" in r
    ]
    sample_path.parent.mkdir(parents=True, exist_ok=True)
    sample_path.write_text(json.dumps(sample, indent=1) + "\n")
    print(f"wrote {doc}, {results} and {sample_path} ({len(sample)} cells)")


if __name__ == "__main__":
    sys.exit(main())
