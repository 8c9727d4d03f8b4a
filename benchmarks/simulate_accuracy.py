"""Error of the per-block extrapolation against a whole-model simulation (docs/simulate.md).

For each model of the built-in table and each setup, simulates one training step twice on fake
tensors: 1 and 2 decoder blocks extrapolated to the real depth, and every block. Prints a
Markdown table: peak GiB of both, the relative error of the peak and the largest error of any
phase, the wall time of each, and the analytical estimate of the same setup (the part of it an
allocated-bytes reading measures: `comparable_bytes(..., "allocated")`) against the whole-model
simulation. The table also goes to benchmarks/results/simulate-accuracy-<date>.md.

    .venv/bin/python benchmarks/simulate_accuracy.py [--seq-len 2048] [--models ID ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import warnings
from pathlib import Path

from kubetune.planning.estimator import TrainingSetup, comparable_bytes, estimate_vram
from kubetune.planning.models_table import MODELS
from kubetune.sources import load_arch
from kubetune_trainer.simulate import PHASES, SimulationSetup, simulate

RESULTS = Path(__file__).parent / "results"

GIB = 1024**3
DEFAULT_MODELS = ("meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-0.5B", "google/gemma-3-1b-pt")
SETUPS = {
    "lora": {"method": "lora"},
    "lora, chunked loss": {"method": "lora", "chunked_ce": True},
    "full": {"method": "full"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--models", nargs="*", default=list(DEFAULT_MODELS))
    parser.add_argument("--setups", nargs="*", default=list(SETUPS))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    fields = {m.hf_id: m.config for m in MODELS}

    lines = [
        f"# Simulated step memory: extrapolation and the analytical estimate, "
        f"{datetime.date.today()}",
        "",
        f"`python benchmarks/simulate_accuracy.py --seq-len {args.seq_len}`: micro-batch 1, "
        "bf16, AdamW, checkpointing on, LoRA rank 16 all-linear; the steady-state step "
        "(optimizer states allocated). Analytical: `comparable_bytes(estimate, 'allocated')`.",
        "",
        "| model | setup | extrapolated peak GiB | whole-model peak GiB | peak error "
        "| largest phase error | time extrapolated / whole | analytical GiB "
        "| analytical vs simulated |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for line in lines:
        print(line)
    for model in args.models:
        for name in args.setups:
            setup = SimulationSetup(seq_len=args.seq_len, **SETUPS[name])  # type: ignore[arg-type]
            fast = simulate(fields[model], setup, layers="extrapolate")
            whole = simulate(fields[model], setup, layers="all")
            errors = [
                abs(fast.phases[p] - whole.phases[p]) / whole.phases[p]
                for p in PHASES
                if whole.phases[p]
            ]
            peak_err = abs(fast.peak_bytes - whole.peak_bytes) / whole.peak_bytes
            names = {f.name for f in dataclasses.fields(TrainingSetup)}
            est_setup = TrainingSetup(
                **{k: v for k, v in dataclasses.asdict(setup).items() if k in names}
            )
            analytical = comparable_bytes(estimate_vram(load_arch(model), est_setup), "allocated")
            line = (
                f"| {model} ({whole.num_layers} blocks) | {name} "
                f"| {fast.peak_bytes / GIB:.3f} | {whole.peak_bytes / GIB:.3f} "
                f"| {100 * peak_err:.3f} % | {100 * max(errors):.3f} % "
                f"| {fast.seconds:.1f} s / {whole.seconds:.1f} s "
                f"| {analytical / GIB:.3f} | {100 * (analytical / whole.peak_bytes - 1):+.1f} % |"
            )
            lines.append(line)
            print(line, flush=True)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"simulate-accuracy-{datetime.date.today()}.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
