"""Accelerator catalogue: memory, peak throughput and interconnect of the devices a job can be planned for.

Figures are the vendors' dense (non-sparse) peaks. Memory is what the device reports as its total
(`nvidia-smi`/`rocm-smi`), in GiB. Bandwidths are per GPU and per direction: `intra_node_gb_s` over
NVLink/Infinity Fabric/PCIe, `inter_node_gb_s` over the node's network (one NIC per GPU, rail-optimised).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal


@dataclass(frozen=True)
class Accelerator:
    """One accelerator type."""

    name: str
    kind: Literal["gpu", "cpu"]
    memory_gib: float
    peak_tflops_bf16: float
    peak_tflops_fp16: float
    peak_tflops_fp32: float
    hbm_tb_s: float
    intra_node_gb_s: float
    inter_node_gb_s: float
    description: str = ""
    max_per_node: int | None = None
    """Most devices one node holds (8 on HGX/OAM boards); None = no fixed limit."""

    @property
    def memory_bytes(self) -> int:
        """Device memory in bytes."""
        return int(self.memory_gib * 2**30)

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for a compute dtype (fp32 means plain fp32 matmuls, no TF32)."""
        tflops = {"bf16": self.peak_tflops_bf16, "fp16": self.peak_tflops_fp16, "fp32": self.peak_tflops_fp32}[dtype]
        return tflops * 1e12


CATALOGUE: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator(
            "a100-40gb",
            "gpu",
            40.0,
            312,
            312,
            19.5,
            1.555,
            300,
            25,
            "A100 SXM4 40 GB, NVLink 3, HDR 200 Gb/s",
            max_per_node=8,
        ),
        Accelerator(
            "a100-80gb",
            "gpu",
            80.0,
            312,
            312,
            19.5,
            2.039,
            300,
            25,
            "A100 SXM4 80 GB, NVLink 3, HDR 200 Gb/s",
            max_per_node=8,
        ),
        Accelerator(
            "h100-sxm",
            "gpu",
            79.65,
            989,
            989,
            67,
            3.35,
            450,
            50,
            "H100 SXM5 80 GB, NVLink 4, NDR 400 Gb/s",
            max_per_node=8,
        ),
        Accelerator(
            "h100-pcie",
            "gpu",
            79.65,
            756,
            756,
            51,
            2.0,
            64,
            50,
            "H100 PCIe 80 GB, PCIe Gen5, NDR 400 Gb/s",
            max_per_node=8,
        ),
        Accelerator(
            "h200", "gpu", 140.4, 989, 989, 67, 4.8, 450, 50, "H200 SXM 141 GB, NVLink 4, NDR 400 Gb/s", max_per_node=8
        ),
        Accelerator(
            "l40s", "gpu", 44.99, 362, 362, 91.6, 0.864, 32, 25, "L40S 48 GB GDDR6, PCIe Gen4, 200 Gb/s", max_per_node=8
        ),
        Accelerator(
            "b200", "gpu", 179.1, 2250, 2250, 75, 8.0, 900, 50, "B200 180 GB, NVLink 5, NDR 400 Gb/s", max_per_node=8
        ),
        Accelerator(
            "mi300x",
            "gpu",
            192.0,
            1307,
            1307,
            163.4,
            5.3,
            448,
            50,
            "MI300X 192 GB, Infinity Fabric, 400 Gb/s",
            max_per_node=8,
        ),
        Accelerator(
            "cpu", "cpu", 16.0, 0.02, 0.02, 0.2, 0.02, 5, 1.25, "CPU process of a local run (gloo), 16 GiB per process"
        ),
    )
}


def accelerator_names(extra: dict[str, object] | None = None) -> list[str]:
    """Sorted names of the built-in catalogue plus any defined in a spec."""
    return sorted(set(CATALOGUE) | set(extra or {}))


def resolve_accelerator(name: str, overrides: dict[str, dict[str, object]] | None = None) -> Accelerator:
    """The catalogue entry `name` with the spec's overrides applied (or a wholly spec-defined entry)."""
    fields = dict((overrides or {}).get(name) or {})
    if name in CATALOGUE:
        return replace(CATALOGUE[name], **fields)
    if not fields:
        raise KeyError(f"unknown accelerator {name!r}; use one of {accelerator_names(overrides)}")
    return Accelerator(name=name, **fields)  # type: ignore[arg-type]
