"""GPUPools that name a known GPU product may leave its numbers out (api/gpus.py)."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from kubetune.api.crdgen import gpupool_crd
from kubetune.api.gpus import KNOWN_GPUS
from kubetune.api.v1alpha1 import GPUPool, GPUSpec
from kubetune.planning.catalog import default_pools

pytestmark = pytest.mark.unit


def pool(gpu: dict[str, object]) -> GPUPool:
    return GPUPool.model_validate(
        {
            "metadata": {"name": "p"},
            "spec": {"gpu": gpu, "gpusPerNode": 8, "maxNodes": 2, "pricePerGPUHour": 2.0},
        }
    )


def test_the_catalogs_figures_are_the_tables() -> None:
    """One set of datasheet figures: the built-in catalog's pools say what the table says."""
    for catalog_pool in default_pools():
        gpu = catalog_pool.spec.gpu
        assert GPUSpec.model_validate({"product": gpu.product}) == gpu, gpu.product


def test_a_product_alone_gets_its_datasheet_and_any_number_given_wins() -> None:
    h100 = pool({"product": "NVIDIA-H100-80GB-HBM3"}).spec.gpu
    assert (h100.memory_gib, h100.bf16_tflops, h100.interconnect) == (80, 989, "nvlink")
    assert h100.memory_bandwidth_gbps == KNOWN_GPUS["NVIDIA-H100-80GB-HBM3"].memory_bandwidth_gbps
    capped = pool({"product": "NVIDIA-H100-80GB-HBM3", "memoryGiB": 72, "interconnect": "pcie"})
    assert capped.spec.gpu.memory_gib == 72 and capped.spec.gpu.interconnect == "pcie"
    assert capped.spec.gpu.bf16_tflops == 989


def test_an_unknown_product_needs_its_numbers_and_the_error_says_so() -> None:
    with pytest.raises(ValidationError) as err:
        pool({"product": "NVIDIA-B200", "memoryGiB": 180})
    message = str(err.value)
    assert "gpu.bf16TFLOPS required: kubetune does not know GPU product 'NVIDIA-B200'" in message
    assert "To fix:" in message and "NVIDIA-H200" in message
    given = pool({"product": "NVIDIA-B200", "memoryGiB": 180, "bf16TFLOPS": 2250}).spec.gpu
    # Unknown products keep the old defaults for what is not given.
    assert (given.memory_bandwidth_gbps, given.interconnect, given.interconnect_gbps) == (
        0,
        "pcie",
        64,
    )


def test_the_crd_lets_known_products_leave_the_numbers_out() -> None:
    gpu = gpupool_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]["gpu"]
    assert gpu["required"] == ["product"]
    (rule,) = gpu["x-kubernetes-validations"]
    assert all(f"'{product}'" in rule["rule"] for product in KNOWN_GPUS)
    # No schema default the apiserver would store in place of the product's figure.
    assert not [k for k, v in gpu["properties"].items() if "default" in v]
    text = yaml.safe_dump(gpupool_crd())
    assert "memoryGiB and spec.gpu.bf16TFLOPS are required" in text
