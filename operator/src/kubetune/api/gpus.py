"""What kubetune knows of common GPU products, by the name GPU feature discovery gives them
(the `nvidia.com/gpu.product` node label): memory, dense bf16 tensor-core TFLOPS, memory
bandwidth and the GPU-to-GPU link, from NVIDIA's datasheets (the same figures as the
built-in pool catalog). A GPUPool that names one of these products may leave the numbers out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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


KNOWN_GPUS: dict[str, GPUFacts] = {
    "NVIDIA-H200": GPUFacts(141, 989, 4800, "nvlink", 450),
    "NVIDIA-H100-80GB-HBM3": GPUFacts(80, 989, 3456, "nvlink", 450),
    "NVIDIA-H100-PCIe": GPUFacts(80, 756, 2000, "pcie", 64),
    "NVIDIA-A100-SXM4-80GB": GPUFacts(80, 312, 2039, "nvlink", 300),
    "NVIDIA-A100-SXM4-40GB": GPUFacts(40, 312, 1555, "nvlink", 300),
    # The PCIe A100 80GB has less bandwidth than the SXM4 one (datasheet: 1,935 GB/s).
    "NVIDIA-A100-80GB-PCIe": GPUFacts(80, 312, 1935, "pcie", 32),
    "NVIDIA-A100-PCIE-40GB": GPUFacts(40, 312, 1555, "pcie", 32),
    "NVIDIA-L40S": GPUFacts(48, 362, 864, "pcie", 32),
    "NVIDIA-A40": GPUFacts(48, 149.7, 696, "pcie", 32),
    "NVIDIA-A10": GPUFacts(24, 125, 600, "pcie", 32),
    # AWS g5. The A10's memory and bandwidth, but not its tensor-core rate: NVIDIA publishes
    # no A10G datasheet, and published A10-vs-A10G comparisons give 70 dense bf16 TFLOPS
    # (125 is the A10's datasheet figure).
    "NVIDIA-A10G": GPUFacts(24, 70, 600, "pcie", 32),
    "NVIDIA-L4": GPUFacts(24, 121, 300, "pcie", 32),
    "NVIDIA-GeForce-RTX-4090": GPUFacts(24, 165, 1008, "pcie", 32),
}
