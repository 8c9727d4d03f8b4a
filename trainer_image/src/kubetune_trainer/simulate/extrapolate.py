"""`simulate`: one step per block count, extrapolated to the whole model, and the result.

Memory is affine in the number of decoder blocks for every phase, so the step runs with 1 and
2 blocks (3 and 4 sharded) and each window's peak is extrapolated on its own; the overall peak
is the largest of them (the package's docstring says why).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Literal

from kubetune_trainer.simulate.spec import (
    MEASURED_COMPONENTS,
    PHASES,
    SimulationResult,
    SimulationSetup,
    _refuse_unsupported,
    hf_config,
)
from kubetune_trainer.simulate.step import _run_once, _sharded


def _has_process_group() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def _in_subprocess(
    fields: Mapping[str, Any], setup: SimulationSetup, layers: Literal["extrapolate", "all"] | int
) -> SimulationResult:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(simulate, dict(fields), setup, layers=layers).result()


def _finish(
    phases: dict[str, dict[str, int]],
    *,
    total: int,
    trainable: int,
    layers: int,
    simulated: tuple[int, ...],
    seconds: float,
    method: str,
) -> SimulationResult:
    def size(name: str) -> int:
        return sum(phases[name].values())

    windows = [k for k in phases if k.startswith("peak:")]
    best: dict[str, str] = {}  # phase peak → its highest window
    for phase, stage in (("forward_peak", "forward"), ("backward_peak", "backward")):
        best[phase] = max((w for w in windows if w.startswith(f"peak:{stage}:")), key=size)
    best["optimizer_peak"] = "peak:step"
    peak_phase = max(best, key=lambda k: size(best[k]))
    breakdown = dict(phases[best[peak_phase]])
    points = {k: size(k) for k in ("weights", "forward", "optimizer")}
    points["backward_peak"] = size(best["backward_peak"])
    points["peak"] = sum(breakdown.values())
    kept = {k: dict(v) for k, v in phases.items() if not k.startswith("peak:")}
    kept.update({k: dict(phases[w]) for k, w in best.items()})
    return SimulationResult(
        breakdown=breakdown,
        phases={k: points[k] for k in PHASES},
        phase_breakdowns=kept,
        peak_phase=peak_phase,
        total_params=total,
        trainable_params=trainable,
        num_layers=layers,
        simulated_layers=simulated,
        seconds=seconds,
        method=method,
    )


def simulate(
    fields: Mapping[str, Any],
    setup: SimulationSetup,
    *,
    layers: Literal["extrapolate", "all"] | int = "extrapolate",
) -> SimulationResult:
    """Simulate one training step of the model whose `config.json` fields are `fields`.

    `layers="extrapolate"` simulates 1 and 2 decoder blocks (2 and 3 when sharded) and
    extrapolates to the model's `num_hidden_layers`; `"all"` (or a number) simulates that many
    blocks as they are."""
    _refuse_unsupported(setup)
    if _sharded(setup) and _has_process_group():
        # The fake group must be this process's default group: simulate in a fresh process.
        return _in_subprocess(fields, setup, layers)
    start = time.monotonic()
    num_layers = int(hf_config(fields).num_hidden_layers)
    # Under FSDP2 the first and last blocks differ from the others (no block to prefetch
    # after the last, no reduce-scatter pending before the first): a sharded model is
    # simulated with 3 and 4 blocks, so that both runs have a middle block.
    low = 3 if _sharded(setup) else 1
    if layers == "extrapolate" and num_layers > low + 1:
        one = _run_once(setup, fields, low)
        two = _run_once(setup, fields, low + 1)

        def affine(a: int, b: int) -> int:
            return a + (num_layers - low) * (b - a)

        phases = {
            name: {
                key: affine(one.phases[name][key], two.phases[name][key])
                for key in MEASURED_COMPONENTS
            }
            for name in one.phases
            if name in two.phases
        }
        return _finish(
            phases,
            total=affine(one.total_params, two.total_params),
            trainable=affine(one.trainable_params, two.trainable_params),
            layers=num_layers,
            simulated=(low, low + 1),
            seconds=time.monotonic() - start,
            method=(
                f"{low} and {low + 1} of {num_layers} decoder blocks simulated, "
                "extrapolated linearly"
            ),
        )
    count = num_layers if layers in ("all", "extrapolate") else int(layers)
    run = _run_once(setup, fields, count)
    return _finish(
        run.phases,
        total=run.total_params,
        trainable=run.trainable_params,
        layers=count,
        simulated=(count,),
        seconds=time.monotonic() - start,
        method=f"all {count} decoder blocks simulated",
    )
