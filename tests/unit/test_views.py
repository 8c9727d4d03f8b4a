"""The CLI's tables of jobs and pools (kubetune/views.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from kubetune.views import age, job_table, pool_table

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)


def job(name: str, namespace: str = "team-a", **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": namespace,
                     "creationTimestamp": "2026-11-24T10:30:00Z"},
        "status": status,
    }  # fmt: skip


def test_jobs_show_plan_progress_eta_and_cost() -> None:
    running = job(
        "llama-8b-support-bot-with-a-long-name",
        phase="Running",
        plan={"pool": "h100-spot", "totalGPUs": 8},
        progress={"step": 40, "totalSteps": 100, "percent": 40, "eta": "1h20m"},
        cost={"accruedUSD": 3.5, "estimatedUSD": 9.1},
    )
    queued = job("waits", phase="Queued", plan={"pool": "l40s", "totalGPUs": 2})
    text = job_table([queued, running, job("new")], now=NOW)
    header, *rows = text.splitlines()
    assert header.split() == ["NAME", "PHASE", "POOL", "GPUS", "PROGRESS", "ETA", "COST", "AGE"]
    assert rows[0].split() == [
        "llama-8b-support-bot-with-a-long-name", "Running", "h100-spot", "8",
        "40%", "(40/100)", "1h20m", "$3.50", "of", "$9.10", "90m",
    ]  # fmt: skip
    assert rows[1].split() == ["new", "Pending", "-", "-", "-", "-", "-", "90m"]
    assert rows[2].split()[:4] == ["waits", "Queued", "l40s", "2"]
    # Every column starts where its header does, however long the name.
    start = header.index("PHASE")
    assert all(row[start - 2 : start] == "  " for row in rows)


def test_all_namespaces_adds_the_namespace_first() -> None:
    text = job_table([job("b", "z"), job("a", "y")], now=NOW, namespaces=True)
    assert [ln.split()[:2] for ln in text.splitlines()] == [
        ["NAMESPACE", "NAME"], ["y", "a"], ["z", "b"],
    ]  # fmt: skip


def test_ages_read_like_kubectls() -> None:
    assert [age(t, NOW) for t in (
        "2026-11-24T11:59:15Z", "2026-11-24T11:48:00Z", "2026-11-24T09:00:00Z",
        "2026-11-20T12:00:00Z", None,
    )] == ["45s", "12m", "3h", "4d", "-"]  # fmt: skip


def pool(name: str, gpu: dict[str, Any], status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {"gpu": gpu, "gpusPerNode": 8, "maxNodes": 4, "pricePerGPUHour": 2.5},
        "status": status or {},
    }


def test_pools_show_capacity_price_and_whether_the_operator_reads_them() -> None:
    valid = {"type": "Valid", "status": "True", "reason": "Accepted"}
    seen = {"updatedAt": "2026-11-24T11:00:00Z", "nodes": 2, "freeGPUs": 9, "conditions": [valid]}
    text = pool_table([
        pool("h200-reserved", {"product": "NVIDIA-H200"}, seen),
        pool("b200", {"product": "NVIDIA-B200"}),
        pool("fresh", {"product": "NVIDIA-L4"}),
    ])  # fmt: skip
    header, *rows = text.splitlines()
    assert "FREE GPUS" in header and "STATE" in header
    b200, fresh, h200 = rows
    assert h200.split() == [
        "h200-reserved",
        "NVIDIA-H200",
        "141",
        "8",
        "2/4",
        "9",
        "2.50",
        "no",
        "ok",
    ]
    assert fresh.split()[2] == "24" and fresh.endswith("not seen by the operator")
    assert "unreadable:" in b200 and "bf16TFLOPS" in b200
