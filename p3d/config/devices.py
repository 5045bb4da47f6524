"""Device presets: peak dense bf16 TFLOP/s, memory, GPUs per node and link bandwidths.

``cluster.device`` names one of these; every ``cluster.*`` number left unset (null) is filled from
it when the run spec is frozen, and any can be overridden (``cluster.peak_tflops=700``).
Bandwidths are GB/s per GPU, one direction: intra-node over NVLink, inter-node over the NICs.
Sources: NVIDIA A100, H100, H200 and DGX B200 datasheets (dense, no sparsity; float8: H100 SXM and H200 1,979
TFLOP/s, B200 4,500, half the datasheets' "with sparsity" figures). SMs: A100 108 (NVIDIA A100 Tensor Core
GPU Architecture whitepaper), H100 SXM5 and H200 132 (NVIDIA H100 Tensor Core GPU Architecture whitepaper; H200 is the
same GH100 die with HBM3e), B200 148 (the device query quoted in pytorch/ao pull request 4002, "update b200 peak memory
bandwidth": "Number of SMs: 148").
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
    # GPUs: the fraction of peak_tflops a large, well-shaped GEMM reaches, e of the planner's GEMM model
    # (p3d/planner/gemms.py: each GEMM's time from its tiles, waves and bytes); cpu: the flat fraction of its nominal
    # peak in every matmul. One of the two constants per device generation fitted on half the published runs of
    # tests/helpers/published.py (the other half is the held-out check, docs/planner.md). H200 / B200: H100's, no
    # reference run.
    matmul_efficiency: float
    # GPUs: the streaming multiprocessors a GEMM's tiles are spread over (its waves); None: no shape model (cpu)
    sms: int | None = None
    # GPUs: k0 of the GEMM model, a tile's fixed cost (prologue, epilogue) in k-steps of work: the other fitted constant
    gemm_k_overhead: float = 0.0
    # GPUs: dense float8 peak (e4m3 / e5m2 tensor cores; B200's MXFP8 runs at the same rate), None where the device
    # has no float8 tensor cores (A100) or emulates float8 (cpu): the planner then times float8 GEMMs at peak_tflops
    float8_tflops: float | None = None
    # GPUs: CUDA compute capability (major, minor): float8 needs (8, 9), MXFP8 (10, 0) (p3d.layout.float8_rules)
    capability: tuple[int, int] | None = None


def _gpu(
    peak: float,
    memory: float,
    nvlink: float,
    nic: float,
    hbm: float,
    sms: int,
    fit: tuple[float, float],
    float8: float | None,
    capability: tuple[int, int],
) -> Device:
    efficiency, k_overhead = fit
    return Device(
        peak_tflops=peak,
        memory_gb=memory,
        gpus_per_node=8,
        intra_node_gbps=nvlink,
        inter_node_gbps=nic,
        hbm_gbps=hbm,
        matmul_efficiency=efficiency,
        sms=sms,
        gemm_k_overhead=k_overhead,
        float8_tflops=float8,
        capability=capability,
    )


# (e, k0) of each generation's GEMMs, fitted on the fit half of tests/helpers/published.py (test_published checks they
# are the fit's optimum); H200 and B200 take H100's
A100_GEMMS = (0.735, 0.0)
H100_GEMMS = (0.542, 0.0)


DEVICES: dict[str, Device] = {
    "a100_40gb": _gpu(312.0, 40.0, 300.0, 25.0, 1555.0, 108, A100_GEMMS, float8=None, capability=(8, 0)),
    "a100_80gb": _gpu(312.0, 80.0, 300.0, 25.0, 2039.0, 108, A100_GEMMS, float8=None, capability=(8, 0)),
    "h100_sxm": _gpu(989.0, 80.0, 450.0, 50.0, 3350.0, 132, H100_GEMMS, float8=1979.0, capability=(9, 0)),
    "h200": _gpu(989.0, 141.0, 450.0, 50.0, 4800.0, 132, H100_GEMMS, float8=1979.0, capability=(9, 0)),
    "b200": _gpu(2250.0, 180.0, 900.0, 50.0, 8000.0, 148, H100_GEMMS, float8=4500.0, capability=(10, 0)),
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
