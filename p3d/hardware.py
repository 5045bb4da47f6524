"""Device presets: peak dense bf16 TFLOP/s, memory, GPUs per node and link bandwidths.

``cluster.device`` names one of these; every ``cluster.*`` number left unset (null) is filled from
it when the run spec is frozen, and any can be overridden (``cluster.peak_tflops=700``).
Bandwidths are GB/s per GPU, one direction: intra-node over NVLink, inter-node over the NICs.
Sources: NVIDIA A100, H100, H200 and DGX B200 datasheets (dense, no sparsity).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    peak_tflops: float
    memory_gb: float
    gpus_per_node: int | None
    intra_node_gbps: float
    inter_node_gbps: float


DEVICES: dict[str, Device] = {
    "a100_40gb": Device(
        peak_tflops=312.0, memory_gb=40.0, gpus_per_node=8, intra_node_gbps=300.0, inter_node_gbps=25.0
    ),
    "a100_80gb": Device(
        peak_tflops=312.0, memory_gb=80.0, gpus_per_node=8, intra_node_gbps=300.0, inter_node_gbps=25.0
    ),
    "h100_sxm": Device(peak_tflops=989.0, memory_gb=80.0, gpus_per_node=8, intra_node_gbps=450.0, inter_node_gbps=50.0),
    "h200": Device(peak_tflops=989.0, memory_gb=141.0, gpus_per_node=8, intra_node_gbps=450.0, inter_node_gbps=50.0),
    "b200": Device(peak_tflops=2250.0, memory_gb=180.0, gpus_per_node=8, intra_node_gbps=900.0, inter_node_gbps=50.0),
    # One CPU worker process: a nominal fp32 figure so MFU is defined on laptops; the world runs on one node.
    "cpu": Device(peak_tflops=0.1, memory_gb=24.0, gpus_per_node=None, intra_node_gbps=10.0, inter_node_gbps=1.0),
}


def device(name: str) -> Device:
    try:
        return DEVICES[name]
    except KeyError:
        raise KeyError(f"cluster.device={name} is not a known device; choose one of {sorted(DEVICES)}") from None
