"""Device presets: peak dense bf16 TFLOP/s, memory, GPUs per node and link bandwidths.

``cluster.device`` names one of these; every ``cluster.*`` number left unset (null) is filled from
it when the run spec is frozen, and any can be overridden (``cluster.peak_tflops=700``).
Bandwidths are GB/s per GPU, one direction: intra-node over NVLink, inter-node over the NICs.
Sources: NVIDIA A100, H100, H200 and DGX B200 datasheets (dense, no sparsity).
"""

from __future__ import annotations

from dataclasses import dataclass

from p3d.config.choice import Choice


@dataclass(frozen=True)
class Device:
    peak_tflops: float  # dense bf16 (GPUs)
    memory_gb: float
    gpus_per_node: int | None
    intra_node_gbps: float
    inter_node_gbps: float
    hbm_gbps: float  # device memory bandwidth, datasheet (cpu: a DDR4/5 socket)
    # Achieved fraction of peak_tflops in a transformer block's matmuls: the planner's one fitted constant
    # per device generation, the median of the efficiencies at which the planner reproduces each published run
    # of that generation (tests/helpers/published.py: 20 A100 runs, 8 H100; a test recomputes it).
    # docs/planner.md quotes each run's error with the constant fitted on the others. H200 / B200: H100's figure,
    # no reference run.
    matmul_efficiency: float


def _gpu(peak: float, memory: float, nvlink: float, nic: float, hbm: float, efficiency: float) -> Device:
    return Device(
        peak_tflops=peak,
        memory_gb=memory,
        gpus_per_node=8,
        intra_node_gbps=nvlink,
        inter_node_gbps=nic,
        hbm_gbps=hbm,
        matmul_efficiency=efficiency,
    )


DEVICES: dict[str, Device] = {
    "a100_40gb": _gpu(312.0, 40.0, nvlink=300.0, nic=25.0, hbm=1555.0, efficiency=0.721),
    "a100_80gb": _gpu(312.0, 80.0, nvlink=300.0, nic=25.0, hbm=2039.0, efficiency=0.721),
    "h100_sxm": _gpu(989.0, 80.0, nvlink=450.0, nic=50.0, hbm=3350.0, efficiency=0.522),
    "h200": _gpu(989.0, 141.0, nvlink=450.0, nic=50.0, hbm=4800.0, efficiency=0.522),
    "b200": _gpu(2250.0, 180.0, nvlink=900.0, nic=50.0, hbm=8000.0, efficiency=0.522),
    # One CPU worker process: a nominal fp32 figure so MFU is defined on laptops; the world runs on one node.
    "cpu": Device(
        peak_tflops=0.1,
        memory_gb=24.0,
        gpus_per_node=None,
        intra_node_gbps=10.0,
        inter_node_gbps=1.0,
        hbm_gbps=40.0,
        matmul_efficiency=0.5,
    ),
}

# The values cluster.device accepts: the keys of DEVICES (compose-time checked by OmegaConf).
DeviceName = Choice("DeviceName", {name: name for name in DEVICES})  # type: ignore[call-overload]  # functional API
