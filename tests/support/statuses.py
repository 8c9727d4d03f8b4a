"""FineTuneJob status parts in wire form (camelCase), for tests that feed the operator's
metrics or models what a status patch holds."""

from __future__ import annotations

from typing import Any


def plan(**over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "revision": 1,
        "reason": "Initial",
        "method": "lora",
        "pool": "l40s",
        "gpuProduct": "NVIDIA-L40S",
        "gpuMemoryGiB": 48,
        "nodes": 1,
        "gpusPerNode": 2,
        "totalGPUs": 2,
        "spot": False,
        "sharding": "full",
        "precision": "bf16",
        "optimizer": "adamw",
        "microBatchSize": 1,
        "gradientAccumulation": 4,
        "gradientCheckpointing": True,
        "perGPUMemoryGiB": 20.5,
        "trainableParams": 1000,
        "modelParams": 100000,
        "totalSteps": 100,
        "totalTokens": 1000000,
        "estimatedTokensPerSecond": 1000.0,
        "estimatedDurationSeconds": 1000.0,
        "estimatedCostUSD": 0.5,
        "pricePerHourUSD": 1.58,
    }
    doc.update(over)
    return doc
