"""Throughput, step count and cost model."""

from __future__ import annotations

import pytest

from kubetune.api.v1alpha1 import DatasetSource, GPUSpec, TrainingSettings
from kubetune.planning.throughput import (
    DEFAULT_EXAMPLES,
    cost_usd,
    dataset_size,
    flops_per_token,
    micro_batch_efficiency,
    step_time,
    total_steps,
)

pytestmark = pytest.mark.unit

H100 = GPUSpec.model_validate(
    {
        "product": "H100",
        "memoryGiB": 80,
        "bf16TFLOPS": 989,
        "interconnect": "nvlink",
        "interconnectGBps": 450,
    }
)


def test_flops_per_token_by_method() -> None:
    p = 8_000_000_000
    assert flops_per_token(p, 0, 0, 2048, "full", False) == 6 * p
    assert flops_per_token(p, 0, 0, 2048, "lora", False) == 4 * p
    assert flops_per_token(p, 0, 0, 2048, "full", True) == 8 * p
    with_attention = flops_per_token(p, 32, 4096, 2048, "full", False)
    assert with_attention == 6 * p + 12 * 32 * 4096 * 2048


def test_packing_counts_tokens_and_padding_counts_sequences() -> None:
    ds = DatasetSource.model_validate(
        {"uri": "x/y", "numExamples": 1000, "avgTokensPerExample": 256}
    )
    packed = dataset_size(ds, TrainingSettings(sequence_length=1024, packing=True))
    padded = dataset_size(ds, TrainingSettings(sequence_length=1024, packing=False))
    assert packed.sequences_per_epoch == 250
    assert padded.sequences_per_epoch == 1000
    assert padded.tokens_per_epoch == 1000 * 1024
    assert not packed.assumed
    assumed = dataset_size(DatasetSource(uri="x/y"), TrainingSettings())
    assert assumed.assumed and assumed.sequences_per_epoch > 0
    assert DEFAULT_EXAMPLES > 0


def test_total_steps_rounds_up_and_max_steps_wins() -> None:
    ds = DatasetSource.model_validate({"uri": "x/y", "totalTokens": 10_000_000})
    tr = TrainingSettings(sequence_length=2048, global_batch_size=32, epochs=2)
    size = dataset_size(ds, tr)
    assert total_steps(size, tr) == -(-size.sequences_per_epoch * 2 // 32)
    assert total_steps(size, TrainingSettings(max_steps=7)) == 7


def test_single_gpu_has_no_communication_and_scaling_is_sublinear() -> None:
    kw = dict(
        gpu=H100,
        network_gbps=400,
        method="full",
        flops_token=6 * 8e9,
        tokens_per_step=32 * 2048,
        micro_batch_tokens=2048,
        weight_bytes=16e9,
        grad_bytes=16e9,
    )
    one = step_time(nodes=1, gpus_per_node=1, sharding="none", **kw)  # type: ignore[arg-type]
    eight = step_time(nodes=1, gpus_per_node=8, sharding="full", **kw)  # type: ignore[arg-type]
    sixteen = step_time(nodes=2, gpus_per_node=8, sharding="full", **kw)  # type: ignore[arg-type]
    assert one.comm_s == 0
    assert eight.comm_s > 0
    assert one.tokens_per_s * 8 >= eight.tokens_per_s > one.tokens_per_s
    # Crossing nodes on a slower network costs more than staying on NVLink.
    assert sixteen.comm_s > eight.comm_s
    assert 0 < eight.mfu <= 0.40


def test_micro_batch_efficiency_saturates() -> None:
    assert micro_batch_efficiency(1024) == pytest.approx(0.5)
    assert micro_batch_efficiency(16384) > 0.9


def test_cost() -> None:
    assert cost_usd(3600, 8, 2.5) == pytest.approx(20.0)
