"""What the CLI shows of a cluster's objects: tables of FineTuneJobs and GPUPools (`kubetune
get`, `pools`), one job in full (`describe`), and objects as JSON or YAML (`-o`); follow.py
has what `watch` and `logs` print while they follow a job.

Pure: objects in (as the API server returns them), text out. Tables are laid out by rich,
each column as wide as its widest cell, so no value runs into the next one.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from kubetune.api.units import about
from kubetune.api.v1alpha1 import GPUPool
from kubetune.api.vocabulary import Phase, PoolConditionType

NONE = "-"


def table(
    headers: Sequence[str], rows: Iterable[Sequence[str]], numeric: Iterable[str] = ()
) -> str:
    """Left-aligned text columns, right-aligned `numeric` ones, two spaces apart, laid out
    by rich as wide as their widest cell: never wrapped or cut to a terminal's width (the
    output is read by people and by scripts alike), no colour, no markup in cells."""
    right = set(numeric)
    grid = Table(box=None, pad_edge=False, padding=(0, 1), header_style="", show_edge=False)
    for header in headers:
        grid.add_column(header, justify="right" if header in right else "left", no_wrap=True)
    for row in rows:
        grid.add_row(*row)
    out = io.StringIO()
    Console(
        file=out, width=_UNBOUNDED, color_system=None, highlight=False, markup=False, emoji=False
    ).print(grid)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines())


_UNBOUNDED = 100_000
"""The console width tables are laid out in: wider than any row, so none is wrapped."""


def age(created: str | None, now: datetime) -> str:
    """`kubectl`'s short age: 45s, 12m, 3h, 5d."""
    if not created:
        return NONE
    seconds = (now - datetime.fromisoformat(created.replace("Z", "+00:00"))).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size * (2 if unit != "m" else 1):
            return f"{int(seconds // size)}{unit}"
    return f"{max(0, int(seconds))}s"


def usd(value: Any) -> str:
    """Dollars as the tables print them (`$1,234.50`), `-` for none."""
    return NONE if value is None else f"${float(value):,.2f}"


JOB_COLUMNS = ("NAME", "PHASE", "POOL", "GPUS", "PROGRESS", "ETA", "COST", "AGE")


def job_table(
    jobs: Iterable[Mapping[str, Any]], now: datetime | None = None, namespaces: bool = False
) -> str:
    """One row per FineTuneJob: phase, pool and GPUs of its plan, progress, ETA, cost spent
    of the estimate, age; with `namespaces`, a NAMESPACE column first."""
    now = now or datetime.now(UTC)
    rows = []
    for job in sorted(
        jobs, key=lambda j: (j["metadata"].get("namespace", ""), j["metadata"]["name"])
    ):
        meta, status = job["metadata"], job.get("status") or {}
        plan = status.get("plan") or {}
        progress = status.get("progress") or {}
        cost = status.get("cost") or {}
        total = progress.get("totalSteps") or 0
        done = (
            f"{progress.get('percent', 0)}% ({progress.get('step', 0)}/{total})" if total else NONE
        )
        spent = NONE
        if cost:
            spent = f"{usd(cost.get('accruedUSD'))} of {usd(cost.get('estimatedUSD'))}"
        row = [
            meta["name"],
            status.get("phase") or Phase.PENDING,
            plan.get("pool") or NONE,
            str(plan.get("totalGPUs") or NONE),
            done,
            progress.get("eta") or NONE,
            spent,
            age(meta.get("creationTimestamp"), now),
        ]
        rows.append([meta.get("namespace", ""), *row] if namespaces else row)
    headers = ["NAMESPACE", *JOB_COLUMNS] if namespaces else list(JOB_COLUMNS)
    return table(headers, rows, numeric=("GPUS",))


POOL_COLUMNS = (
    "NAME",
    "GPU",
    "MEM GiB",
    "GPUS/NODE",
    "NODES",
    "FREE GPUS",
    "$/GPU-H",
    "SPOT",
    "NAMESPACES",
    "STATE",
)


def pool_table(pools: Iterable[Mapping[str, Any]]) -> str:
    """One row per GPUPool: its GPU (with the memory the planner uses), nodes ready of the
    most a job may use, free GPUs, price, spot, the namespaces whose jobs may use it (its
    namespaceSelector, `all` without one), and whether the operator reads it."""
    rows = []
    for obj in sorted(pools, key=lambda p: p["metadata"]["name"]):
        status = obj.get("status") or {}
        try:
            spec = GPUPool.model_validate(
                {"metadata": obj["metadata"], "spec": obj.get("spec") or {}}
            ).spec
        except ValidationError as exc:
            rows.append([obj["metadata"]["name"], NONE, NONE, NONE, NONE, NONE, NONE, NONE, NONE,
                         f"unreadable: {exc.errors()[0]['msg']}"])  # fmt: skip
            continue
        conditions = status.get("conditions") or []
        valid = next((c for c in conditions if c.get("type") == PoolConditionType.VALID), None)
        state = (
            "not seen by the operator"
            if valid is None
            else ("ok" if valid.get("status") == "True" else f"invalid: {valid.get('reason')}")
        )
        seen = status.get("updatedAt") is not None
        rows.append(
            [
                obj["metadata"]["name"],
                spec.gpu.product,
                f"{spec.gpu.memory_gib:g}",
                str(spec.gpus_per_node),
                f"{status.get('nodes', 0)}/{spec.max_nodes}" if seen else f"?/{spec.max_nodes}",
                str(status.get("freeGPUs", 0)) if seen else NONE,
                f"{spec.price_per_gpu_hour:,.2f}",
                "yes" if spec.spot else "no",
                (spec.namespace_selector.describe() if spec.namespace_selector else "") or "all",
                state,
            ]
        )
    return table(
        POOL_COLUMNS, rows, numeric=("MEM GiB", "GPUS/NODE", "NODES", "FREE GPUS", "$/GPU-H")
    )


def hours(seconds: float | None) -> str:
    """A duration as minutes under an hour (`54m`), else hours (`2.9h`)."""
    return NONE if seconds is None else about(seconds)


def describe_job(
    job: Mapping[str, Any], events: Iterable[Mapping[str, Any]], now: datetime | None = None
) -> str:
    """`kubetune describe`: the plan with its alternatives and memory breakdown, progress,
    cost, checkpoint, recoveries, conditions and the job's recent Events."""
    now = now or datetime.now(UTC)
    meta, spec, status = job["metadata"], job.get("spec") or {}, job.get("status") or {}
    lines = [
        f"Name:        {meta['name']}",
        f"Namespace:   {meta.get('namespace', '')}",
        f"Model:       {(spec.get('model') or {}).get('uri', NONE)} ({spec.get('method', NONE)})",
        f"Phase:       {status.get('phase') or Phase.PENDING}"
        + (f", attempt {status['attempt']}" if status.get("attempt") else "")
        + (f": {status['message']}" if status.get("message") else ""),
    ]
    plan = status.get("plan")
    if plan:
        lines += _plan_lines(plan)
    lines += _run_lines(spec, status, now)
    conditions = status.get("conditions") or []
    if conditions:
        lines += ["", "Conditions:"]
        rows = [[c["type"], c["status"], c.get("reason", ""), age(c.get("lastTransitionTime"), now),
                 c.get("message", "")] for c in conditions]  # fmt: skip
        lines += [
            "  " + ln
            for ln in table(["TYPE", "STATUS", "REASON", "AGE", "MESSAGE"], rows).splitlines()
        ]
    recent = sorted(events, key=event_order)[-10:]
    lines += ["", "Events:" if recent else "Events:      none"]
    if recent:
        rows = [[age(_event_time(e) or None, now), e.get("type", ""), e.get("reason", ""),
                 e.get("message", "")] for e in recent]  # fmt: skip
        lines += [
            "  " + ln for ln in table(["AGE", "TYPE", "REASON", "MESSAGE"], rows).splitlines()
        ]
    return "\n".join(lines)


def _plan_lines(plan: Mapping[str, Any]) -> list[str]:
    """`describe`'s plan: the chosen layout and its memory, then each alternative and each
    rejected pool."""
    lines = [
        f"Plan:        r{plan.get('revision', 1)} ({plan.get('reason', NONE)}): "
        f"{plan['method']} "
        f"on {plan['nodes']}×{plan['gpusPerNode']} {plan['gpuProduct']} (pool {plan['pool']}"
        f"{', spot' if plan.get('spot') else ''}), "
        f"~{hours(plan.get('estimatedDurationSeconds'))}, "
        f"~{usd(plan.get('estimatedCostUSD'))}",
        f"  layout:    micro-batch {plan['microBatchSize']} × accumulation "
        f"{plan['gradientAccumulation']}, sharding {plan['sharding']}, {plan['precision']}, "
        f"{plan['optimizer']}, "
        f"checkpointing {'on' if plan['gradientCheckpointing'] else 'off'}"
        + (", chunked loss" if plan.get("chunkedCrossEntropy") else "")
        + (", fused loss" if plan.get("fusedCrossEntropy") else "")
        + (", activations offloaded" if plan.get("activationOffloading") else "")
        + (", optimizer in backward" if plan.get("optimizerInBackward") else ""),
        f"  memory:    {plan['perGPUMemoryGiB']:.1f} of {plan['gpuMemoryGiB']:g} GiB per GPU: "
        + ", ".join(f"{k} {v:.2f}" for k, v in (plan.get("memoryBreakdownGiB") or {}).items()),
    ]
    for alt in plan.get("alternatives") or []:
        lines.append(
            f"  instead:   {alt['pool']}: {alt['method']} on {alt['totalGPUs']} GPU(s), "
            f"{alt['perGPUMemoryGiB']:.1f} GiB/GPU, "
            f"~{hours(alt['estimatedDurationSeconds'])}, "
            f"~{usd(alt['estimatedCostUSD'])}"
        )
    for rejected in plan.get("rejected") or []:
        lines.append(f"  not:       {rejected['pool']}: {rejected['reason']}")
    return lines


def _run_lines(spec: Mapping[str, Any], status: Mapping[str, Any], now: datetime) -> list[str]:
    """`describe`'s lines of the training itself: progress, DPO rewards, cost, the latest
    checkpoint and each recovery."""
    lines = []
    progress = status.get("progress") or {}
    if progress.get("totalSteps"):
        speed = progress.get("tokensPerSecond")
        extra = [
            f"loss {progress['loss']:.3f}" if progress.get("loss") is not None else "",
            f"{speed:,.0f} tok/s" if speed else "",
            f"ETA {progress['eta']}" if progress.get("eta") else "",
        ]
        lines.append(
            f"Progress:    {progress.get('percent', 0)}% ({progress.get('step', 0)}/"
            f"{progress['totalSteps']} steps)" + "".join(f", {e}" for e in extra if e)
        )
    rewards = dpo_rewards(progress)
    if rewards:
        lines.append(f"DPO rewards: {rewards}")
    cost = status.get("cost") or {}
    if cost:
        budget = (spec.get("resources") or {}).get("maxCostUSD")
        lines.append(
            f"Cost:        {usd(cost.get('accruedUSD'))} spent "
            f"of ~{usd(cost.get('estimatedUSD'))}"
            + (f" at {usd(cost['rateUSDPerHour'])}/h" if cost.get("rateUSDPerHour") else "")
            + (f"; budget {usd(budget)}" if budget is not None else "")
        )
    checkpoint = status.get("checkpoint")
    if checkpoint:
        lines.append(
            f"Checkpoint:  step {checkpoint['latestStep']}, {age(checkpoint.get('time'), now)} ago"
        )
    for recovery in status.get("recoveries") or []:
        lines.append(
            f"Recovered:   {recovery['reason']} {age(recovery.get('time'), now)} ago"
            + (
                f", resumed from step {recovery['step']}"
                if recovery.get("step") is not None
                else ""
            )
            + (f": {recovery['message']}" if recovery.get("message") else "")
        )
    return lines


def _event_time(event: Mapping[str, Any]) -> str:
    return str(
        event.get("lastTimestamp")
        or event.get("eventTime")
        or event.get("firstTimestamp")
        or (event.get("metadata") or {}).get("creationTimestamp")
        or ""
    )


def event_order(event: Mapping[str, Any]) -> tuple[str, int]:
    """By time, then (same second) by when the API server stored it."""
    version = str((event.get("metadata") or {}).get("resourceVersion") or "")
    return _event_time(event), int(version) if version.isdigit() else 0


def dpo_rewards(progress: Mapping[str, Any]) -> str:
    """A DPO job's implicit rewards in words, e.g. `accuracy 0.88 (eval 0.92), margin 0.41
    (eval 0.38), chosen 0.21, rejected -0.20`; empty for an SFT job or before the first step."""

    def pair(name: str, train: str, held_out: str) -> str:
        value, at_eval = progress.get(train), progress.get(held_out)
        if value is None and at_eval is None:
            return ""
        text = f"{name} {value:.2f}" if value is not None else f"{name} -"
        return text + (f" (eval {at_eval:.2f})" if at_eval is not None else "")

    parts = [
        pair("accuracy", "dpoRewardAccuracy", "evalDpoRewardAccuracy"),
        pair("margin", "dpoRewardMargin", "evalDpoRewardMargin"),
        *(
            f"{name} {progress[key]:.2f}"
            for name, key in (("chosen", "dpoRewardsChosen"), ("rejected", "dpoRewardsRejected"))
            if progress.get(key) is not None
        ),
    ]
    return ", ".join(p for p in parts if p)


def dump(value: Mapping[str, Any], output: str) -> str:
    """`value` as JSON or YAML (`output`), as kubectl prints objects."""
    if output == "json":
        return json.dumps(value, indent=2)
    return yaml.safe_dump(dict(value), sort_keys=False).rstrip("\n")
