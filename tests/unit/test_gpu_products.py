"""GPUPools that name a known GPU product may leave its numbers out (api/gpus.py), and every
table of GPU figures says what the one table says."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from kubetune.api.crdgen import gpupool_crd
from kubetune.api.gpus import KNOWN_GPUS
from kubetune.api.v1alpha1 import GPUPool, GPUSpec
from kubetune.planning.catalog import default_pools
from kubetune_trainer.contract import PEAK_BF16_TFLOPS, peak_bf16_tflops

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

# What `torch.cuda.get_device_name()` says on each known product (GPU feature discovery's
# label is this name with hyphens for its spaces).
DEVICE_NAMES = {
    "NVIDIA-H200": "NVIDIA H200",
    "NVIDIA-H100-80GB-HBM3": "NVIDIA H100 80GB HBM3",
    "NVIDIA-H100-PCIe": "NVIDIA H100 PCIe",
    "NVIDIA-A100-SXM4-80GB": "NVIDIA A100-SXM4-80GB",
    "NVIDIA-A100-SXM4-40GB": "NVIDIA A100-SXM4-40GB",
    "NVIDIA-A100-80GB-PCIe": "NVIDIA A100 80GB PCIe",
    "NVIDIA-A100-PCIE-40GB": "NVIDIA A100-PCIE-40GB",
    "NVIDIA-L40S": "NVIDIA L40S",
    "NVIDIA-A40": "NVIDIA A40",
    "NVIDIA-A10": "NVIDIA A10",
    "NVIDIA-A10G": "NVIDIA A10G",
    "NVIDIA-L4": "NVIDIA L4",
    "NVIDIA-GeForce-RTX-4090": "NVIDIA GeForce RTX 4090",
}


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


def test_the_trainer_divides_by_the_peak_the_planner_plans_with() -> None:
    """The trainer's MFU and the operator's known products read one table: on each known GPU
    the trainer finds the figure the pool defaults to."""
    assert set(DEVICE_NAMES) == set(KNOWN_GPUS)
    for product, device in DEVICE_NAMES.items():
        assert device.replace(" ", "-") == product
        assert peak_bf16_tflops(device) == KNOWN_GPUS[product].bf16_tflops, product
        assert peak_bf16_tflops(product) == KNOWN_GPUS[product].bf16_tflops, product


@pytest.mark.parametrize(
    ("device", "tflops"),
    [
        ("NVIDIA H100 NVL", 989),
        ("NVIDIA GH200 480GB", 989),
        ("NVIDIA A800-SXM4-80GB", 312),
        ("Tesla T4", 65),
        ("Tesla V100-SXM2-16GB", 125),
        ("NVIDIA RTX A4000", None),  # not an A40
        ("NVIDIA GeForce RTX 3090", None),
    ],
)
def test_the_peak_is_the_first_part_of_the_name_the_table_knows(
    device: str, tflops: float | None
) -> None:
    assert peak_bf16_tflops(device) == tflops


def test_a_longer_name_part_comes_before_the_parts_it_contains() -> None:
    parts = [part for part, _ in PEAK_BF16_TFLOPS]
    for i, part in enumerate(parts):
        assert not any(earlier in part and earlier != part for earlier in parts[:i]), part


def _chart_catalog() -> list[dict[str, object]]:
    """The pools commented out under the chart's `gpuPools: []`, uncommented."""
    lines = (ROOT / "charts/kubetune/values.yaml").read_text().splitlines()
    block = []
    for line in lines[lines.index("gpuPools: []") + 1 :]:
        if not line.startswith("  #"):
            break
        block.append(line.removeprefix("  #").removeprefix(" "))
    return [pool for pool in yaml.safe_load("\n".join(block)) if "spec" in pool]


def test_the_charts_commented_catalog_is_the_example_catalog() -> None:
    """values.yaml shows examples/gpupools.yaml (itself the built-in catalog, test_api_crds)."""
    examples = yaml.safe_load_all((ROOT / "examples/gpupools.yaml").read_text())
    expected = [{"name": d["metadata"]["name"], "spec": d["spec"]} for d in examples if d]
    assert _chart_catalog() == expected
