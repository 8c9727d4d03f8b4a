"""What kubetune knows of common GPU products, by the name GPU feature discovery gives them
(the `nvidia.com/gpu.product` node label): memory, dense bf16 tensor-core TFLOPS, memory
bandwidth and the GPU-to-GPU link, from NVIDIA's datasheets. A GPUPool that names one of these
products may leave the numbers out.

The TFLOPS come from the trainer's contract (`kubetune_trainer.contract.PEAK_BF16_TFLOPS`),
the one table the trainer's MFU reads too; the built-in pool catalog, examples/gpupools.yaml and
the chart's commented catalog are held to these figures by tests/unit/test_gpu_products.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kubetune_trainer.contract import peak_bf16_tflops


@dataclass(frozen=True)
class GPUFacts:
    memory_gib: float
    bf16_tflops: float
    memory_bandwidth_gbps: float
    interconnect: Literal["nvlink", "pcie"]
    interconnect_gbps: float

    def spec_fields(self) -> dict[str, object]:
        """The GPUPool `spec.gpu` fields (camelCase) these facts fill in."""
        return {
            "memoryGiB": self.memory_gib,
            "bf16TFLOPS": self.bf16_tflops,
            "memoryBandwidthGBps": self.memory_bandwidth_gbps,
            "interconnect": self.interconnect,
            "interconnectGBps": self.interconnect_gbps,
        }


def _datasheet(
    product: str,
    memory_gib: float,
    memory_bandwidth_gbps: float,
    interconnect: Literal["nvlink", "pcie"],
    interconnect_gbps: float,
) -> GPUFacts:
    tflops = peak_bf16_tflops(product)
    if tflops is None:  # pragma: no cover - a table bug, caught at import by every test
        raise ValueError(f"{product}: no bf16 peak in kubetune_trainer.contract.PEAK_BF16_TFLOPS")
    return GPUFacts(memory_gib, tflops, memory_bandwidth_gbps, interconnect, interconnect_gbps)


_DATASHEETS: tuple[tuple[str, float, float, Literal["nvlink", "pcie"], float], ...] = (
    # product, memory GiB, memory bandwidth GB/s, interconnect, its GB/s
    ("NVIDIA-H200", 141, 4800, "nvlink", 450),
    ("NVIDIA-H100-80GB-HBM3", 80, 3456, "nvlink", 450),
    ("NVIDIA-H100-PCIe", 80, 2000, "pcie", 64),
    ("NVIDIA-A100-SXM4-80GB", 80, 2039, "nvlink", 300),
    ("NVIDIA-A100-SXM4-40GB", 40, 1555, "nvlink", 300),
    # The PCIe A100 80GB has less bandwidth than the SXM4 one (datasheet: 1,935 GB/s).
    ("NVIDIA-A100-80GB-PCIe", 80, 1935, "pcie", 32),
    ("NVIDIA-A100-PCIE-40GB", 40, 1555, "pcie", 32),
    ("NVIDIA-L40S", 48, 864, "pcie", 32),
    ("NVIDIA-A40", 48, 696, "pcie", 32),
    ("NVIDIA-A10", 24, 600, "pcie", 32),
    # AWS g5: the A10's memory and bandwidth, not its tensor-core rate.
    ("NVIDIA-A10G", 24, 600, "pcie", 32),
    ("NVIDIA-L4", 24, 300, "pcie", 32),
    ("NVIDIA-GeForce-RTX-4090", 24, 1008, "pcie", 32),
)

KNOWN_GPUS: dict[str, GPUFacts] = {row[0]: _datasheet(*row) for row in _DATASHEETS}
