"""A GPUPool without a nodeSelector selects the nodes GPU feature discovery labels with its
GPU product (`nvidia.com/gpu.product`); an explicit `nodeSelector: {}` still selects every
node. The default is the operator's, not the CRD's, and it reaches both the pool's capacity
and the trainer pods' nodeSelector."""

from __future__ import annotations

from typing import Any

import pytest

from kubetune.api.crdgen import gpupool_crd
from kubetune.api.gpus import KNOWN_GPUS
from kubetune.api.v1alpha1 import FineTuneJob, GPUPool, GPUPoolSpec, GPUSpec, PlanStatus
from kubetune.api.vocabulary import GPU_PRODUCT_LABEL
from kubetune.control.build.settings import BuildSettings
from kubetune.control.build.trainer import build_indexed_job
from kubetune.control.capacity import node_info
from kubetune.controller.cache import Caches, parse_pool

pytestmark = pytest.mark.unit

A10G = "NVIDIA-A10G"
MISSING = object()


def pool_body(node_selector: Any = MISSING, product: str = A10G) -> dict[str, Any]:
    """A GPUPool as the API server returns it."""
    spec: dict[str, Any] = {
        "gpu": {"product": product},
        "gpusPerNode": 4,
        "maxNodes": 2,
        "pricePerGPUHour": 1.0,
    }
    if node_selector is not MISSING:
        spec["nodeSelector"] = node_selector
    return {"metadata": {"name": "g5"}, "spec": spec}


def read(body: dict[str, Any]) -> GPUPool:
    pool = parse_pool(body)
    assert isinstance(pool, GPUPool), pool
    return pool


def test_an_omitted_selector_is_the_gfd_product_label() -> None:
    assert GPU_PRODUCT_LABEL == "nvidia.com/gpu.product"
    assert read(pool_body()).spec.node_selector == {GPU_PRODUCT_LABEL: A10G}
    # Any product, known or not, and Python construction by field name alike.
    spec = GPUPoolSpec(
        gpu=GPUSpec(product="ACME-X1", memory_gib=16, bf16_tflops=50),
        gpus_per_node=1,
        max_nodes=1,
        price_per_gpu_hour=0.1,
    )
    assert spec.node_selector == {GPU_PRODUCT_LABEL: "ACME-X1"}


def test_an_explicit_empty_selector_stays_empty() -> None:
    assert read(pool_body({})).spec.node_selector == {}
    snake = GPUPoolSpec.model_validate({**pool_body()["spec"], "node_selector": {}})
    assert snake.node_selector == {}


def test_an_explicit_selector_is_kept() -> None:
    selector = {"kubetune.io/pool": "g5-spot"}
    assert read(pool_body(selector)).spec.node_selector == selector
    both = {"kubetune.io/pool": "g5", GPU_PRODUCT_LABEL: "NVIDIA-L4"}
    assert read(pool_body(both)).spec.node_selector == both


def test_the_default_is_written_out_with_the_pool() -> None:
    """What the operator works with (and `to_wire` shows) names the label."""
    assert read(pool_body()).to_wire()["spec"]["nodeSelector"] == {GPU_PRODUCT_LABEL: A10G}


def test_the_crd_has_no_default_for_the_selector_and_says_what_it_is() -> None:
    """A schema default would be stored by the API server: the selector could no longer
    follow the pool's product, and an omitted key could not be told from `{}`."""
    spec = gpupool_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    selector = spec["properties"]["nodeSelector"]
    assert "default" not in selector
    assert "nodeSelector" not in spec.get("required", [])
    assert GPU_PRODUCT_LABEL in selector["description"]


# --------------------------------------------------------------------------- capacity


def node(
    name: str, labels: dict[str, str], gpus: int, *, ready: bool = True, memory: str = ""
) -> dict[str, Any]:
    allocatable = {"nvidia.com/gpu": str(gpus)} if gpus else {}
    if memory:
        allocatable["memory"] = memory
    return {
        "metadata": {"name": name, "labels": labels},
        "status": {
            "allocatable": allocatable,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


NODES = [
    node("g5-a", {GPU_PRODUCT_LABEL: A10G, "kubetune.io/pool": "g5-spot"}, 4),
    node("g5-b", {GPU_PRODUCT_LABEL: A10G}, 4),
    node("g5-down", {GPU_PRODUCT_LABEL: A10G}, 4, ready=False, memory="1Ti"),
    node("l4-a", {GPU_PRODUCT_LABEL: "NVIDIA-L4"}, 8, memory="195998420Ki"),
    node("l4-b", {GPU_PRODUCT_LABEL: "NVIDIA-L4"}, 8, memory="64Gi"),
    node("cpu-a", {}, 0),
]


def capacity(pool: GPUPool, used: dict[str, int] | None = None) -> dict[str, Any]:
    infos = {n["metadata"]["name"]: [node_info(n)] for n in NODES}
    caches = Caches(
        pods={},
        batch_jobs={},
        nodes=infos,
        gpu_pods={name: [gpus] for name, gpus in (used or {}).items()},
        pools={},
    )
    return caches.capacities([pool])[pool.name]


def test_a_default_pool_counts_the_ready_nodes_of_its_product() -> None:
    got = capacity(read(pool_body()), used={"g5-a": 3, "l4-a": 2})
    assert got == {
        "nodes": 2,
        "allocatableGPUs": 8,
        "freeGPUs": 5,
        "freeGPUsPerNode": [1, 4],
        "nodeMemoryGiB": None,  # these nodes do not say
    }


def test_an_empty_selector_still_counts_every_ready_node() -> None:
    got = capacity(read(pool_body({})))
    assert got["nodes"] == 5 and got["allocatableGPUs"] == 24


def test_an_explicit_selector_counts_only_its_nodes() -> None:
    got = capacity(read(pool_body({"kubetune.io/pool": "g5-spot"})))
    assert got == {
        "nodes": 1,
        "allocatableGPUs": 4,
        "freeGPUs": 4,
        "freeGPUsPerNode": [4],
        "nodeMemoryGiB": None,
    }


def test_a_pool_shows_the_memory_of_its_largest_ready_node() -> None:
    # What a trainer pod may ask for at most; a node that is not Ready does not count.
    got = capacity(read(pool_body({GPU_PRODUCT_LABEL: "NVIDIA-L4"})))
    assert got["nodes"] == 2 and got["nodeMemoryGiB"] == 186.92
    assert capacity(read(pool_body({GPU_PRODUCT_LABEL: A10G})))["nodeMemoryGiB"] is None


# --------------------------------------------------------------------------- trainer pods


def job() -> FineTuneJob:
    return FineTuneJob.model_validate(
        {
            "metadata": {"name": "tiny-lora", "namespace": "team-a", "uid": "uid-tiny"},
            "spec": {
                "model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M"},
                "dataset": {"uri": "tatsu-lab/alpaca", "format": "alpaca"},
                "method": "lora",
                "training": {"maxSteps": 50, "sequenceLength": 512, "globalBatchSize": 8},
            },
        }
    )


def plan() -> PlanStatus:
    facts = KNOWN_GPUS[A10G]
    return PlanStatus(
        method="lora",
        pool="g5",
        gpu_product=A10G,
        gpu_memory_gib=facts.memory_gib,
        nodes=1,
        gpus_per_node=1,
        total_gpus=1,
        sharding="none",
        precision="bf16",
        optimizer="adamw",
        micro_batch_size=4,
        gradient_accumulation=2,
        gradient_checkpointing=False,
        per_gpu_memory_gib=3.2,
        trainable_params=921_600,
        model_params=134_515_008,
        total_steps=50,
        total_tokens=204_800,
        estimated_tokens_per_second=9000.0,
        estimated_duration_seconds=60.0,
        estimated_cost_usd=0.01,
        price_per_hour_usd=1.0,
    )


def pod_spec(pool: GPUPool) -> dict[str, Any]:
    batch = build_indexed_job(job(), plan(), pool, BuildSettings(), 1)
    spec: dict[str, Any] = batch["spec"]["template"]["spec"]
    return spec


def test_trainer_pods_of_a_default_pool_go_to_nodes_of_its_product() -> None:
    assert pod_spec(read(pool_body()))["nodeSelector"] == {GPU_PRODUCT_LABEL: A10G}


def test_trainer_pods_of_an_empty_selector_pool_have_no_node_selector() -> None:
    assert "nodeSelector" not in pod_spec(read(pool_body({})))


def test_trainer_pods_keep_an_explicit_selector() -> None:
    selector = {"kubetune.io/pool": "g5-spot"}
    assert pod_spec(read(pool_body(selector)))["nodeSelector"] == selector


# --------------------------------------------------------------------------- products


@pytest.mark.parametrize(
    ("product", "memory_gib", "bf16_tflops", "bandwidth"),
    [
        ("NVIDIA-A10G", 24, 70, 600),
        ("NVIDIA-A10", 24, 125, 600),
        ("NVIDIA-A40", 48, 149.7, 696),
        ("NVIDIA-A100-80GB-PCIe", 80, 312, 1935),
        ("NVIDIA-A100-PCIE-40GB", 40, 312, 1555),
    ],
)
def test_pcie_ampere_products_are_known_by_their_gfd_names(
    product: str, memory_gib: float, bf16_tflops: float, bandwidth: float
) -> None:
    gpu = read(pool_body(product=product)).spec.gpu
    assert (gpu.memory_gib, gpu.bf16_tflops, gpu.memory_bandwidth_gbps) == (
        memory_gib,
        bf16_tflops,
        bandwidth,
    )
    assert (gpu.interconnect, gpu.interconnect_gbps) == ("pcie", 32)
