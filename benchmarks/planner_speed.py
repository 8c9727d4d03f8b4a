"""Planner speed: how long one `plan_job` call takes, in process, on realistic jobs.

The operator plans every pending or queued FineTuneJob, so the planner's latency times the
number of jobs is CPU the operator spends each pass. This benchmark plans a varied, fixed set
of jobs against two catalogs and reports p50 / p95 / p99 / max milliseconds per plan and plans
per second:

- `example`: the 8 pools of examples/gpupools.yaml (the built-in catalog);
- `doubled`: those 8 plus a copy of each under a new name, at a different price and with live
  capacity in its status (some nodes busy), so layouts that do not fit the free GPUs are
  planned as queued: 16 pools.

Jobs: every FineTuneJob in examples/ plus variants generated from a fixed seed that differ in
model (0.5B to 405B, dense and MoE), method (full, lora, qlora, auto), sequence length, dataset
size, GPU count (auto or fixed), checkpointing, objective, spot policy, deadline and budget.
Each plan's full `status.plan` (chosen, alternatives, rejected pools; or the infeasibility
message) goes into a digest, so two runs of different code that print the same digest chose
exactly the same plans.

Usage: python -m benchmarks.planner_speed [--quick] [--rounds N] [--jobs N]
           [--save-json FILE] [--before FILE] [--out FILE | --no-write]

`--save-json` keeps this run's numbers; `--before` adds a saved run (e.g. made with an older
planner on PYTHONPATH) to the results table as the "before" column.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import hashlib
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.measure import nearest_rank
from kubetune.api.errors import InfeasibleError
from kubetune.api.v1alpha1 import FineTuneJob, FineTuneJobSpec, GPUPool
from kubetune.planning.estimator import EstimatorError
from kubetune.planning.planner import Plan, PlannerSettings, plan_job
from kubetune.sources import load_arch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EXAMPLES = ROOT / "examples"
SEED = 20261124

MODELS = [
    "Qwen/Qwen2.5-0.5B",
    "meta-llama/Llama-3.2-1B",
    "microsoft/Phi-3-mini-4k-instruct",
    "Qwen/Qwen2.5-7B",
    "mistralai/Mistral-7B-v0.3",
    "meta-llama/Llama-3.1-8B",
    "google/gemma-2-9b",
    "Qwen/Qwen2.5-14B",
    "Qwen/Qwen3-30B-A3B",
    "Qwen/Qwen2.5-32B",
    "mistralai/Mixtral-8x7B-v0.1",
    "meta-llama/Llama-3.1-70B",
    "meta-llama/Llama-3.1-405B",
]


# --------------------------------------------------------------------------- inputs


def example_pools() -> list[GPUPool]:
    text = (EXAMPLES / "gpupools.yaml").read_text()
    return [GPUPool.model_validate(doc) for doc in yaml.safe_load_all(text) if doc]


def doubled_pools(pools: list[GPUPool]) -> list[GPUPool]:
    """Each pool, plus a copy under a new name at another price with some GPUs in use."""
    out = list(pools)
    for i, pool in enumerate(pools):
        doc = pool.to_wire()
        name = f"{pool.name}-b"
        doc["metadata"] = {"name": name}
        doc["spec"]["nodeSelector"] = {"kubetune.io/pool": name}
        doc["spec"]["pricePerGPUHour"] = round(
            pool.spec.price_per_gpu_hour * (0.85 if i % 2 else 1.2), 4
        )
        nodes = pool.spec.max_nodes
        gpn = pool.spec.gpus_per_node
        # First node half busy, second node full, the rest free.
        free = [gpn // 2, 0, *[gpn] * (nodes - 2)][:nodes]
        doc["status"] = {
            "nodes": nodes,
            "allocatableGPUs": nodes * gpn,
            "freeGPUs": sum(free),
            "freeGPUsPerNode": free,
            "updatedAt": "2026-01-01T00:00:00Z",
        }
        out.append(GPUPool.model_validate(doc))
    return out


def example_jobs() -> list[tuple[str, FineTuneJobSpec]]:
    jobs = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        if path.name == "gpupools.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "FineTuneJob":
                jobs.append((f"examples/{path.name}", FineTuneJob.model_validate(doc).spec))
    return jobs


def generated_jobs(count: int, seed: int = SEED) -> list[tuple[str, FineTuneJobSpec]]:
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        model = rng.choice(MODELS)
        method = rng.choice(["full", "lora", "lora", "qlora", "qlora", "auto"])
        seq = rng.choice([512, 1024, 2048, 4096, 8192])
        training: dict[str, Any] = {
            "sequenceLength": seq,
            "globalBatchSize": rng.choice([8, 16, 32, 64, 128, 256]),
            "epochs": rng.choice([1, 2, 3]),
        }
        ckpt = rng.choice([None, None, True, False])
        if ckpt is not None:
            training["gradientCheckpointing"] = ckpt
        if rng.random() < 0.15:
            training["microBatchSize"] = rng.choice([1, 2, 4])
        if rng.random() < 0.3:
            training["packing"] = True
        resources: dict[str, Any] = {
            "gpus": rng.choice(["auto", "auto", "auto", 1, 2, 4, 8, 16]),
            "spot": rng.choice(["never", "allowed", "preferred"]),
        }
        if rng.random() < 0.8:
            resources["objective"] = rng.choice(["cost", "time"])
        if rng.random() < 0.3:
            resources["deadline"] = rng.choice(["2h", "12h", "48h", "168h"])
        if rng.random() < 0.3:
            resources["maxCostUSD"] = rng.choice([20, 200, 2000])
        body: dict[str, Any] = {
            "model": {"uri": model},
            "dataset": {
                "uri": "pvc://datasets/train.jsonl",
                "numExamples": rng.choice([1_000, 20_000, 100_000, 1_000_000]),
                "avgTokensPerExample": rng.choice([200, 600, 1500]),
            },
            "method": method,
            "training": training,
            "resources": resources,
        }
        if method != "full":
            body["lora"] = {"rank": rng.choice([8, 16, 64])}
        jobs.append((f"generated-{i:03d}", FineTuneJobSpec.model_validate(body)))
    return jobs


# --------------------------------------------------------------------------- measuring


def run_catalog(
    jobs: list[tuple[str, FineTuneJobSpec]], pools: list[GPUPool], rounds: int
) -> dict[str, Any]:
    settings = PlannerSettings()  # as the operator plans: live capacity on
    archs = {name: load_arch(s.model.architecture or s.model.uri) for name, s in jobs}
    digest = hashlib.sha256()
    times_ms: list[float] = []
    cpu_ms: list[float] = []
    per_job: dict[str, list[float]] = {name: [] for name, _ in jobs}
    infeasible = queued = 0
    for round_ in range(rounds):
        for name, spec in jobs:
            plan: Plan | None = None
            cpu_start = time.thread_time()
            start = time.perf_counter()
            try:
                plan = plan_job(spec, pools, archs[name], settings)
            except (InfeasibleError, EstimatorError) as exc:  # the operator's two refusals
                error = str(exc)
            elapsed = time.perf_counter() - start
            cpu_ms.append((time.thread_time() - cpu_start) * 1000)
            times_ms.append(elapsed * 1000)
            per_job[name].append(elapsed * 1000)
            if round_ == 0:
                if plan is None:
                    infeasible += 1
                    text = error
                else:
                    queued += plan.queued
                    text = json.dumps(plan.to_status(pools).to_wire(), sort_keys=True)
                digest.update(f"{name}\n{text}\n".encode())
    ordered = sorted(times_ms)
    total_s = sum(times_ms) / 1000
    return {
        "pools": len(pools),
        "jobs": len(jobs),
        "plans": len(times_ms),
        "infeasible": infeasible,
        "queued": queued,
        "p50_ms": nearest_rank(ordered, 50),
        "p95_ms": nearest_rank(ordered, 95),
        "p99_ms": nearest_rank(ordered, 99),
        "max_ms": ordered[-1],
        "mean_ms": statistics.fmean(ordered),
        "plans_per_s": len(times_ms) / total_s,
        "cpu_p50_ms": nearest_rank(sorted(cpu_ms), 50),
        "cpu_p99_ms": nearest_rank(sorted(cpu_ms), 99),
        "digest": digest.hexdigest()[:16],
        "job_median_ms": {name: statistics.median(ms) for name, ms in per_job.items()},
    }


def measure(quick: bool, rounds: int | None, count: int | None) -> dict[str, Any]:
    jobs = example_jobs() + generated_jobs(count if count is not None else (40 if quick else 196))
    rounds = rounds if rounds is not None else (1 if quick else 3)
    base = example_pools()
    catalogs = {"example": base, "doubled": doubled_pools(base)}
    # Warm-up: imports, the model table, first-call costs; not counted.
    run_catalog(jobs[:5], base, 1)
    gc.collect()
    load_before = os.getloadavg()[0]
    results = {name: run_catalog(jobs, pools, rounds) for name, pools in catalogs.items()}
    return {
        "load": f"{load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end",
        "date": dt.date.today().isoformat(),
        "quick": quick,
        "rounds": rounds,
        "machine": f"{platform.machine()}, Python {platform.python_version()}",
        "catalogs": results,
    }


# --------------------------------------------------------------------------- report


def fmt(x: float) -> str:
    return f"{x:.1f}" if x < 100 else f"{x:.0f}"


def row(name: str, label: str, x: dict[str, Any]) -> str:
    return (
        f"| {name} | {x['pools']} | {label} | {fmt(x['p50_ms'])} | {fmt(x['p95_ms'])} | "
        f"{fmt(x['p99_ms'])} | {fmt(x['max_ms'])} | {x['plans_per_s']:.0f} | "
        f"{fmt(x['cpu_p50_ms'])} / {fmt(x['cpu_p99_ms'])} | `{x['digest']}` |"
    )


def table(run: dict[str, Any], before: dict[str, Any] | None) -> list[str]:
    lines = [
        "| catalog | pools | code | p50 ms | p95 ms | p99 ms | max ms | plans/s "
        "| CPU p50 / p99 ms | digest |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, r in run["catalogs"].items():
        if before is None:
            lines.append(row(name, "this", r))
            continue
        b = before["catalogs"][name]
        lines += [row(name, "before", b), row(name, "after", r)]
        lines.append(
            f"| {name} | | speed-up | {b['p50_ms'] / r['p50_ms']:.0f}× | "
            f"{b['p95_ms'] / r['p95_ms']:.0f}× | {b['p99_ms'] / r['p99_ms']:.0f}× | "
            f"{b['max_ms'] / r['max_ms']:.0f}× | {r['plans_per_s'] / b['plans_per_s']:.0f}× | "
            f"{b['cpu_p50_ms'] / r['cpu_p50_ms']:.0f}× / "
            f"{b['cpu_p99_ms'] / r['cpu_p99_ms']:.0f}× | "
            f"{'same plans' if b['digest'] == r['digest'] else 'PLANS DIFFER'} |"
        )
    return lines


def job_table(run: dict[str, Any], before: dict[str, Any] | None) -> list[str]:
    """The example jobs and the slowest generated ones, median ms per plan."""
    reference = before or run
    cols = list(run["catalogs"])
    slowest = sorted(
        (n for n in reference["catalogs"][cols[0]]["job_median_ms"] if n.startswith("gen")),
        key=lambda n: -reference["catalogs"][cols[0]]["job_median_ms"][n],
    )[:3]
    names = [n for n in run["catalogs"][cols[0]]["job_median_ms"] if n.startswith("ex")]
    head = " | ".join(f"{c} before | {c} after" if before else f"{c} ms" for c in cols)
    lines = [
        f"| job (median ms per plan) | {head} |",
        "| --- |" + " ---: |" * (len(cols) * (2 if before else 1)),
    ]
    for name in names + slowest:
        cells = []
        for c in cols:
            if before:
                cells.append(fmt(before["catalogs"][c]["job_median_ms"][name]))
            cells.append(fmt(run["catalogs"][c]["job_median_ms"][name]))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def report(run: dict[str, Any], before: dict[str, Any] | None, command: str) -> str:
    any_catalog = next(iter(run["catalogs"].values()))
    lines = [
        f"# Planner speed — {run['date']}",
        "",
        f"Made by `{command}`.",
        "",
        f"- Machine: {run['machine']}, one process; 1-minute load average "
        f"{run['load']}" + (f" (before: {before['load']})" if before else ""),
        f"- {any_catalog['jobs']} jobs (the FineTuneJobs in examples/ and generated variants), "
        f"each planned {run['rounds']}× per catalog; time of one `plan_job` call, "
        "architecture already loaded",
        "- `example`: examples/gpupools.yaml (8 pools); `doubled`: those plus a copy of each "
        "at another price with some GPUs busy (16 pools)",
        "- digest: hash of every plan's `status.plan` (or infeasibility message); equal "
        "digests mean the same plans",
        "",
        *table(run, before),
        "",
        "The jobs of examples/ and the slowest generated ones"
        + (" (slowest before)" if before else "")
        + ":",
        "",
        *job_table(run, before),
        "",
    ]
    for name, r in run["catalogs"].items():
        lines.append(
            f"- {name}: {r['infeasible']} of {r['jobs']} jobs infeasible (planning them "
            f"ends in the error with advice), {r['queued']} planned as queued"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="40 generated jobs, one round; prints only"
    )
    parser.add_argument("--rounds", type=int, help="times each job is planned (default 3)")
    parser.add_argument("--jobs", type=int, help="generated jobs (default 196)")
    parser.add_argument("--save-json", type=Path, help="write this run's numbers as JSON")
    parser.add_argument("--before", type=Path, help="a saved run to compare against")
    parser.add_argument("--out", type=Path, help="results file (default: dated, in results/)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()

    run = measure(args.quick, args.rounds, args.jobs)
    before = json.loads(args.before.read_text()) if args.before else None
    command = "python -m benchmarks.planner_speed " + " ".join(sys.argv[1:])
    text = report(run, before, command.strip())
    print(text)
    if args.save_json:
        args.save_json.write_text(json.dumps(run, indent=2) + "\n")
    if not (args.no_write or args.quick):
        out = args.out or HERE / "results" / f"planner-speed-{run['date']}.md"
        out.write_text(text)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
