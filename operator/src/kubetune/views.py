"""Tables of FineTuneJobs and GPUPools for the CLI (`kubetune get`, `kubetune pools`).

Pure: objects in (as the API server returns them), text out. Columns are as wide as their
widest cell, so no value runs into the next one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from kubetune.api.v1alpha1 import GPUPool

NONE = "-"


def table(
    headers: Sequence[str], rows: Iterable[Sequence[str]], numeric: Iterable[str] = ()
) -> str:
    """Left-aligned text columns, right-aligned `numeric` ones, two spaces apart."""
    body = [list(r) for r in rows]
    right = {i for i, h in enumerate(headers) if h in set(numeric)}
    widths = [max([len(h), *(len(r[i]) for r in body)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), *(line(r) for r in body)])


def age(created: str | None, now: datetime) -> str:
    """`kubectl`'s short age: 45s, 12m, 3h, 5d."""
    if not created:
        return NONE
    seconds = (now - datetime.fromisoformat(created.replace("Z", "+00:00"))).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size * (2 if unit != "m" else 1):
            return f"{int(seconds // size)}{unit}"
    return f"{max(0, int(seconds))}s"


def _usd(value: Any) -> str:
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
            spent = f"{_usd(cost.get('accruedUSD'))} of {_usd(cost.get('estimatedUSD'))}"
        row = [
            meta["name"],
            status.get("phase") or "Pending",
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
    "STATE",
)


def pool_table(pools: Iterable[Mapping[str, Any]]) -> str:
    """One row per GPUPool: its GPU (with the memory the planner uses), nodes ready of the
    most a job may use, free GPUs, price, spot, and whether the operator reads it."""
    rows = []
    for obj in sorted(pools, key=lambda p: p["metadata"]["name"]):
        status = obj.get("status") or {}
        try:
            spec = GPUPool.model_validate(
                {"metadata": obj["metadata"], "spec": obj.get("spec") or {}}
            ).spec
        except ValidationError as exc:
            rows.append([obj["metadata"]["name"], NONE, NONE, NONE, NONE, NONE, NONE, NONE,
                         f"unreadable: {exc.errors()[0]['msg']}"])  # fmt: skip
            continue
        valid = next((c for c in status.get("conditions") or [] if c.get("type") == "Valid"), None)
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
                state,
            ]
        )
    return table(
        POOL_COLUMNS, rows, numeric=("MEM GiB", "GPUS/NODE", "NODES", "FREE GPUS", "$/GPU-H")
    )
