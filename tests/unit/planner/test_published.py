"""The planner against published training runs (figures quoted from the sources below), on step time.

Each row carries what its source gives (TFLOP/s per GPU, an MFU as TFLOP/s, or seconds per step) and the FLOP
convention the source counts with (p3d.layout.geometry.FLOP_CONVENTIONS; docs/planner.md, "FLOP conventions"). A
TFLOP/s figure is turned back into seconds with the source's own count, t_pub = FLOPs per step / (TFLOP/s x GPUs),
and the error is t_pred / t_pub - 1:
  eq3       Narayanan et al. (2021) Eq. 3, F = 96 B s l h^2 (1 + s/6h + V/16lh): counts the recomputed
            forward of full recompute. Megatron-LM (2021), Megatron-DeepSpeed (BLOOM) and GPT-NeoX
            (megatron/logging.py get_flops, ckpt factor 4) report this.
  p3d       model FLOPs only (Korthikanti et al. 2022; Llama 3; MosaicML).
  nemo_mha  NeMo's formula with query_groups = heads, the DGX Cloud cards' MFU (the rows give step times, so
            the convention only shows in the MFU column of bench/planner_published.py).

Sources
  [N21]  D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
         Megatron-LM", SC'21, arXiv:2104.04473. Table 1 (A100-80GB, DGX A100 nodes with 8 x 200 Gb/s
         HDR; full recompute; s = 2048, V = 51200); Sec. 5.4.1 / Fig. 13 (tensor vs pipeline degree);
         Fig. 12 (interleaved schedule).
  [K22]  V. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
         arXiv:2205.05198 (MLSys'23). Table 2 (activation memory), Table 3 (configs: dp 1, micro
         batch 1), Table 5 (iteration time full recompute vs selective + sequence parallel; MFU).
  [L3]   Llama Team, "The Llama 3 Herd of Models", arXiv:2407.21783, Table 4 (405B on H100).
  [NEOX] S. Black et al., "GPT-NeoX-20B", arXiv:2204.06745, Sec. 3 (96 A100-SXM4-40GB, 12 nodes,
         four 200 Gb/s HCAs per node, tp 2 pp 4, ZeRO-1, 117 TFLOP/s per GPU).
  [BLOOM] BigScience, "BLOOM: A 176B-Parameter Open-Access Multilingual Language Model",
         arXiv:2211.05100, Sec. 3.4 (384 A100-80GB, tp 4 pp 12 dp 8, 156 TFLOP/s in the fastest
         configuration; 4 x 100 Gb/s Omni-Path per node).
  [MTNLG] S. Smith et al., "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B",
         arXiv:2201.11990, Sec. 2 (batch 1920 on 2240 / 2800 / 3360 A100: 126 / 121 / 113 TFLOP/s).
  [MPT]  MosaicML llm-foundry, scripts/train/benchmarking/README.md (MPT, FSDP FULL_SHARD; 8 GPUs per
         node; A100 section: 1600 Gb/s per node).
  [ZERO] S. Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
         Models", SC'20, arXiv:1910.02054, Table 1.
  [DGXC] NVIDIA DGX Cloud Benchmarking recipes on NGC (catalog.ngc.nvidia.com, team dgxc-benchmarking):
         "Nemotron4 340B 24.11" (nemotron340b-dgxc-benchmarking-a: BF16, 128 H100, TP 8 PP 8 VP 12 MBS 1 GA 16,
         GBS 32, "training step time = 4.77 s", 1.01e16 FLOPs per sequence, MFU 53.52%) and "Nemotron 15B 24.11.1"
         (nemotron15b-dgxc-benchmarking-a: BF16, 64 H100, TP 4 PP 1 MBS 4 GA 4, GBS 256, "training step time =
         2.86 s", 434.5e12 FLOPs per sequence, MFU 61%). Options of NeMo's recipes (NVIDIA/NeMo
         nemo/collections/llm/recipes/nemotron4_340b.py performance mode: tp_comm_overlap; megatron_comm_overlap.py:
         overlap_grad_reduce and overlap_param_gather when dp > 1, overlap_p2p_comm when pp > 1 and vp > 1;
         sequence parallelism and the distributed optimizer).

Cross-checks of the transcribed figures where a source gives two linked numbers: [N21] Table 1's
aggregate PFLOP/s = GPUs x per-GPU TFLOP/s on every row; [K22] Table 5's MFU = Korthikanti's model
FLOPs / iteration time / GPUs / 312 TFLOP/s; [MTNLG] 126 / 121 / 113 TFLOP/s = Eq. 3 FLOPs of a
1920 x 2048-token batch over 60.1 / 50.2 / 44.4 s iterations; [MPT] rows copied from the README;
[DGXC] each card's MFU = its FLOPs per sequence x GBS / step time / GPUs / 989 TFLOP/s
(tests/unit/layout/test_flop_conventions.py).

Not added, for want of a source read here: the Nemotron-4 340B technical report's Table 2 (arXiv:2406.11704;
only a third party's quote of its 6144-GPU row was found), DGXC's 256..2048-GPU 340B rows (the cards found give
one worked example each) and NeMo's GPT-3 175B performance summaries (FP8, which the planner does not model).

Calibration: the matmul efficiency of each device generation is the one fitted constant of the
time model (p3d/config/devices.py matmul_efficiency). It was set from the MPT-70B rows on 64 A100 and 64
H100 (test_calibration_rows); every other row here is a prediction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import pytest

from p3d.layout.geometry import flops_per_token
from p3d.planner import evaluate


def gpt(layers, hidden, heads, vocab=51200, seq=2048, tied=True, kv_heads=None):
    return [
        "model.arch=gpt",
        "model.name=gpt",
        f"model.n_layers={layers}",
        f"model.hidden_size={hidden}",
        f"model.n_heads={heads}",
        f"model.n_kv_heads={kv_heads or heads}",
        f"model.ffn_hidden_size={4 * hidden}",
        f"model.vocab_size={vocab}",
        f"model.seq_len={seq}",
        f"model.tie_embeddings={tied}",
    ]


def run(
    tp,
    pp,
    dp,
    mbs,
    gbs,
    device,
    recompute="full",
    sp=False,
    v=1,
    zero=0,
    flash=False,
    megatron=True,
    overlap_dp=False,
    *extra,
):
    """A layout on ``device`` nodes of 8; megatron: asynchronous pipeline sends (Megatron's schedules)."""
    return [
        f"mesh.tp={tp}",
        f"mesh.pp={pp}",
        f"mesh.dp={dp}",
        f"schedule.micro_batch_size={mbs}",
        f"schedule.global_batch_size={gbs}",
        f"schedule.recompute={recompute}",
        f"schedule.sequence_parallel={sp}",
        f"schedule.virtual_stages={v}",
        f"schedule.pipeline={'interleaved_1f1b' if v > 1 else '1f1b'}",  # Megatron's virtual stages are interleaved
        f"zero.stage={zero}",
        "train.dtype=bf16",
        f"cluster.device={device}",
        "cluster.launcher=slurm",
        f"cluster.nodes={max(1, tp * pp * dp // 8)}",
        f"plan.flash_attention={flash}",
        f"plan.overlap_pp={megatron}",
        f"plan.overlap_dp={overlap_dp}",
        *extra,
    ]


def mpt(layers, hidden, heads, gpus, mbs, gbs, device, ckpt):
    """MosaicML MPT: FSDP FULL_SHARD (ZeRO 3, prefetching: overlapped), flash attention, vocab 50368."""
    return gpt(layers, hidden, heads, vocab=50368) + run(
        1, 1, gpus, mbs, gbs, device, "full" if ckpt else "none", zero=3, flash=True, overlap_dp=True
    )


def nemotron4(layers, hidden, heads):
    """Nemotron-4 (NeMo's Nemotron4Config): GQA with 8 kv heads, a squared-ReLU MLP of 4h (two matrices, as gpt's),
    vocab 256000, untied, 4096 tokens (gpt's learned positions and biases add under 0.1 %)."""
    return gpt(layers, hidden, heads, vocab=256000, seq=4096, tied=False, kv_heads=8)


class Published(NamedTuple):
    overrides: list[str]
    value: float  # what the source gives: TFLOP/s per GPU (an MFU as its share of the peak), or seconds per step
    unit: str  # "tflops" | "step_s"
    convention: str  # how the source counts FLOPs: a key of p3d.layout.geometry.FLOP_CONVENTIONS
    source: str


N21 = "N21 Table 1"
ROWS = {
    "N21-1.7B": Published(gpt(24, 2304, 24) + run(1, 1, 32, 1, 512, "a100_80gb"), 137, "tflops", "eq3", N21),
    "N21-3.6B": Published(gpt(30, 3072, 32) + run(2, 1, 32, 1, 512, "a100_80gb"), 138, "tflops", "eq3", N21),
    "N21-7.5B": Published(gpt(36, 4096, 32) + run(4, 1, 32, 1, 512, "a100_80gb"), 142, "tflops", "eq3", N21),
    "N21-18.4B": Published(gpt(40, 6144, 48) + run(8, 1, 32, 1, 1024, "a100_80gb"), 135, "tflops", "eq3", N21),
    "N21-39.1B": Published(gpt(48, 8192, 64) + run(8, 2, 32, 1, 1536, "a100_80gb"), 138, "tflops", "eq3", N21),
    "N21-76.1B": Published(gpt(60, 10240, 80) + run(8, 4, 32, 1, 1792, "a100_80gb"), 140, "tflops", "eq3", N21),
    "N21-145.6B": Published(gpt(80, 12288, 96) + run(8, 8, 24, 1, 2304, "a100_80gb"), 148, "tflops", "eq3", N21),
    "N21-310.1B": Published(gpt(96, 16384, 128) + run(8, 16, 15, 1, 2160, "a100_80gb"), 155, "tflops", "eq3", N21),
    "N21-529.6B": Published(gpt(105, 20480, 128) + run(8, 35, 9, 1, 2520, "a100_80gb"), 163, "tflops", "eq3", N21),
    "N21-1008B": Published(gpt(128, 25600, 160) + run(8, 64, 6, 1, 3072, "a100_80gb"), 163, "tflops", "eq3", N21),
    # MFU 41.5 / 51.4 / 56.0 / 56.3 % of 312 TFLOP/s, selective recompute + sequence parallelism
    "K22-22B": Published(
        gpt(48, 6144, 64) + run(8, 1, 1, 1, 4, "a100_80gb", "selective", True), 0.415 * 312, "tflops", "p3d", "K22 T5"
    ),
    "K22-175B": Published(
        gpt(96, 12288, 96) + run(8, 8, 1, 1, 64, "a100_80gb", "selective", True),
        0.514 * 312,
        "tflops",
        "p3d",
        "K22 T5",
    ),
    "K22-530B": Published(
        gpt(105, 20480, 128) + run(8, 35, 1, 1, 280, "a100_80gb", "selective", True),
        0.560 * 312,
        "tflops",
        "p3d",
        "K22 T5",
    ),
    "K22-1T": Published(
        gpt(128, 25600, 160) + run(8, 64, 1, 1, 512, "a100_80gb", "selective", True),
        0.563 * 312,
        "tflops",
        "p3d",
        "K22 T5",
    ),
    # Llama 3: 16M-token batches of 8192 tokens, sequence parallel; assumed: micro batch 1, 8 virtual
    # stages (one layer per chunk), no recompute, FSDP-style overlapped dp traffic
    "L3-405B-8192": Published(
        ["model=llama3_405b"] + run(8, 16, 64, 1, 2048, "h100_sxm", "none", True, 8, 1, True, True, True),
        430,
        "tflops",
        "p3d",
        "L3 Table 4",
    ),
    "L3-405B-16384": Published(
        ["model=llama3_405b"] + run(8, 16, 128, 1, 2048, "h100_sxm", "none", True, 8, 1, True, True, True),
        400,
        "tflops",
        "p3d",
        "L3 Table 4",
    ),
    # BLOOM: Megatron-DeepSpeed (DeepSpeed's pipeline engine: blocking sends, dp after the flush)
    "BLOOM-176B": Published(
        ["model=gpt_bloom_176b"]
        + run(4, 12, 8, 2, 2048, "a100_80gb", zero=1, megatron=False)
        + ["cluster.inter_node_gbps=6.25"],
        156,
        "tflops",
        "eq3",
        "BLOOM 3.4",
    ),
    "MPT-30B-a100": Published(mpt(48, 7168, 56, 8, 3, 504, "a100_80gb", True), 0.553 * 312, "tflops", "p3d", "MPT"),
    "MPT-7B-a100": Published(mpt(32, 4096, 32, 8, 6, 96, "a100_80gb", False), 0.6423 * 312, "tflops", "p3d", "MPT"),
    "MPT-30B-h100": Published(mpt(48, 7168, 56, 8, 3, 504, "h100_sxm", True), 0.3811 * 989, "tflops", "p3d", "MPT"),
    # DGX Cloud cards (NeMo 24.11, BF16): the step time itself. NeMo's performance recipe: TP communication overlap,
    # DP overlap (distributed optimizer: ZeRO 1), sequence parallelism, and overlap_p2p_comm with virtual stages;
    # assumed: flash attention, no recompute (the recipes set none)
    "DGXC-NEMOTRON4-340B-128": Published(
        nemotron4(96, 18432, 96)
        + run(8, 8, 2, 1, 32, "h100_sxm", "none", True, 12, 1, True, True, True, "plan.overlap_tp=true"),
        4.77,
        "step_s",
        "nemo_mha",
        "DGXC 340B 24.11",
    ),
    "DGXC-NEMOTRON4-15B-64": Published(
        nemotron4(32, 6144, 48)
        + run(4, 1, 16, 4, 256, "h100_sxm", "none", True, 1, 1, True, True, True, "plan.overlap_tp=true"),
        2.86,
        "step_s",
        "nemo_mha",
        "DGXC 15B 24.11.1",
    ),
}
# Runs the planner is known to over-predict by more than 15 % (kept, strict, so a change shows)
MISSES = {
    # DeepSpeed pipeline engine at tp 2, fp16, 12.5 GB/s per GPU between nodes: the planner says ~147
    "NEOX-20B": Published(
        ["model=gpt_neox_20b"]
        + run(2, 4, 12, 4, 1536, "a100_40gb", zero=1, megatron=False)
        + ["cluster.inter_node_gbps=12.5"],
        117,
        "tflops",
        "eq3",
        "NEOX 3",
    ),
    # the same DeepSpeed engine for MT-NLG 530B on 2240 GPUs (Eq. 3: 126 TFLOP/s = its 60.1 s
    # iterations): the planner says ~156
    "MTNLG-530B-2240": Published(
        ["model=gpt_530b"] + run(8, 35, 8, 1, 1920, "a100_80gb", zero=1, megatron=False),
        126,
        "tflops",
        "eq3",
        "MTNLG 2",
    ),
    # small-model FSDP runs on H100 (2023 software): the planner is 15-35 % optimistic there
    "MPT-7B-h100": Published(mpt(32, 4096, 32, 8, 6, 48, "h100_sxm", False), 0.4644 * 989, "tflops", "p3d", "MPT"),
    "MPT-13B-h100": Published(mpt(40, 5120, 40, 8, 2, 16, "h100_sxm", False), 0.3979 * 989, "tflops", "p3d", "MPT"),
}
CALIBRATION = {
    "MPT-70B-a100": Published(mpt(80, 8192, 64, 64, 8, 2048, "a100_80gb", True), 0.5333 * 312, "tflops", "p3d", "MPT"),
    "MPT-70B-h100": Published(mpt(80, 8192, 64, 64, 8, 2048, "h100_sxm", True), 0.4257 * 989, "tflops", "p3d", "MPT"),
}


@dataclass(frozen=True)
class Compared:
    """One published run against the planner, on step time; FLOPs and MFU in the source's own convention."""

    step_pub: float  # seconds: the source's, or its TFLOP/s turned back with its FLOPs
    step_pred: float
    flops: float  # FLOPs of one step as the source counts them
    gpus: int
    peak_tflops: float

    @property
    def error(self) -> float:
        return self.step_pred / self.step_pub - 1

    def mfu(self, step: float) -> float:
        return self.flops / step / self.gpus / (self.peak_tflops * 1e12)


def compare(make_cfg, row: Published) -> Compared:
    cfg = make_cfg(*row.overrides)
    pred = evaluate(cfg, check=False)
    flops = flops_per_token(cfg.model, row.convention, cfg.schedule.recompute.value) * pred.tokens_per_step
    gpus = pred.layout.world_size
    step_pub = row.value if row.unit == "step_s" else flops / (row.value * 1e12 * gpus)
    return Compared(step_pub, pred.step_time_s, flops, gpus, float(cfg.cluster.peak_tflops))


def predicted(make_cfg, overrides, convention) -> float:
    """TFLOP/s per GPU as ``convention`` counts FLOPs (eq3: the HFU of Eq. 3; p3d: model FLOPs)."""
    cfg = make_cfg(*overrides)
    r = evaluate(cfg, check=False)
    flops = flops_per_token(cfg.model, convention, cfg.schedule.recompute.value)
    return flops * r.tokens_per_s / r.layout.world_size / 1e12


# Step time within 13 %: inside the former +-15 % on TFLOP/s per GPU on both sides (which is -13.0 % .. +17.6 % on
# step time), so no row passes that did not before; the calibration rows' 3 % on TFLOP/s becomes 2.9 %
WITHIN = 0.13


@pytest.mark.parametrize("name", list(ROWS))
def test_step_time_within_13_percent(make_cfg, name):
    row = ROWS[name]
    got = compare(make_cfg, row)
    assert abs(got.error) <= WITHIN, (
        f"{name} ({row.source}): predicted {got.step_pred:.2f} s, published {got.step_pub:.2f} s "
        f"({row.value} {row.unit}, {row.convention}): {got.error:+.1%}"
    )


@pytest.mark.parametrize("name", list(MISSES))
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="known miss > 13%; see docs/planner.md, Known limits")
def test_known_misses(make_cfg, name):
    assert abs(compare(make_cfg, MISSES[name]).error) <= WITHIN


@pytest.mark.parametrize("name", list(CALIBRATION))
def test_calibration_rows(make_cfg, name):
    assert abs(compare(make_cfg, CALIBRATION[name]).error) <= 0.029


# ---- orderings of layouts of one model


def test_mtnlg_throughput_falls_with_more_replicas_at_fixed_batch(make_cfg):
    """[MTNLG]: 530B, tp 8 pp 35, batch 1920: 126 > 121 > 113 TFLOP/s on 8 / 10 / 12 replicas (fewer
    micro batches each, a larger bubble). Same order, and each ratio to the first within 5 %."""
    published = [126, 121, 113]
    got = [
        predicted(make_cfg, ["model=gpt_530b"] + run(8, 35, dp, 1, 1920, "a100_80gb", zero=1, megatron=False), "eq3")
        for dp in (8, 10, 12)
    ]
    assert got == sorted(got, reverse=True)
    for g, p in zip(got[1:], published[1:]):
        assert g / got[0] == pytest.approx(p / published[0], rel=0.05)


def test_llama3_8k_gpus_beat_16k_gpus_per_gpu(make_cfg):
    """[L3] Table 4: 430 TFLOP/s on 8192 GPUs > 400 on 16384 (same 16M-token batch); ratio within 5 %."""
    a, b = (predicted(make_cfg, ROWS[k].overrides, "p3d") for k in ("L3-405B-8192", "L3-405B-16384"))
    assert a > b
    assert b / a == pytest.approx(400 / 430, rel=0.05)


@pytest.mark.parametrize(
    "shape,pp,gbs,full_s,present_s",
    [
        ((48, 6144, 64), 1, 4, 1.42, 1.10),
        ((96, 12288, 96), 8, 64, 18.13, 13.75),
        ((105, 20480, 128), 35, 280, 49.05, 37.83),
        ((128, 25600, 160), 64, 512, 94.42, 71.49),
    ],
)
def test_selective_with_sequence_parallel_beats_full_recompute(make_cfg, shape, pp, gbs, full_s, present_s):
    """[K22] Table 5: iteration time with full recompute vs selective recompute + sequence parallelism
    (dp 1, tp 8): faster in every case, speedup 1.29-1.32x; predicted speedup within 10 %."""
    full = evaluate(make_cfg(*gpt(*shape), *run(8, pp, 1, 1, gbs, "a100_80gb")), check=False).step_time_s
    present = evaluate(
        make_cfg(*gpt(*shape), *run(8, pp, 1, 1, gbs, "a100_80gb", "selective", True)), check=False
    ).step_time_s
    assert present < full
    assert full / present == pytest.approx(full_s / present_s, rel=0.10)


@pytest.mark.parametrize("gbs", [32, 128])
def test_tensor_parallel_peaks_at_gpus_per_node(make_cfg, gbs):
    """[N21] Sec. 5.4.1, Fig. 13: a ~162B GPT on 64 A100, (t, p) from (2, 32) to (32, 2), dp 1: throughput
    peaks at t = 8, the GPUs of one node, and falls sharply once tensor parallelism crosses nodes.
    (The shape is not given in the text; 88 layers of h = 12288 make 160 B.)"""
    tput = {
        t: predicted(make_cfg, gpt(88, 12288, 96) + run(t, 64 // t, 1, 1, gbs, "a100_80gb"), "eq3")
        for t in (2, 4, 8, 16, 32)
    }
    assert max(tput, key=tput.get) == 8
    assert tput[8] > tput[16] > tput[32]


def test_interleaving_helps_most_at_small_batch(make_cfg):
    """[N21] Fig. 12: GPT-3 175B on 96 A100 (t 8, p 12): the interleaved schedule is faster than 1F1B,
    and its advantage shrinks as the batch (micro batches per pipeline) grows."""
    gains = []
    for gbs in (24, 48, 96):
        plain, inter = (
            predicted(make_cfg, ["model=gpt_175b"] + run(8, 12, 1, 1, gbs, "a100_80gb", v=v), "eq3") for v in (1, 2)
        )
        gains.append(inter / plain)
    assert all(g > 1 for g in gains)
    assert gains == sorted(gains, reverse=True)


# ---- memory tables


def test_zero_stages_through_a_config(make_cfg):
    """[ZERO] Table 1, the 7.5 B model on 64 GPUs, mixed-precision Adam (K = 12), model states per GPU:
    31.4 GB with P_os, 16.6 GB with P_os+g, 1.88 GB with P_os+g+p. Through the planner's own path: a
    GPT of 36 x 4096 on 64 GPUs (pp 1, tp 1), bf16 with the ZeRO stage's sharding. Its bytes per
    parameter are Psi (2 + 2 + 12/64) and Psi 16/64 exactly, and at the paper's Psi = 7.5e9 they give the table.

    p3d's stage 2 is not the paper's P_os+g: FSDP2 (docs/zero.md) keeps the parameters sharded between steps too, so
    its resident states are stage 3's, 16/64 per parameter, and a step gathers 2 + 4 bytes per parameter on top (bf16
    weights, fp32 gradients accumulated over the micro batches)."""
    from p3d.layout.geometry import total_params
    from p3d.planner.memory import stage_memory
    from p3d.planner.shapes import layout_of

    cases = ((1, 2 + 2 + 12 / 64, 31.4), (2, 16 / 64, 1.88), (3, 16 / 64, 1.88))
    for stage, factor, published_gb in cases:
        cfg = make_cfg(*gpt(36, 4096, 32), *run(1, 1, 64, 1, 64, "a100_80gb", zero=stage))
        (mem,) = stage_memory(cfg, layout_of(cfg))
        states = mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes
        per_param = states / total_params(cfg.model)
        assert per_param == pytest.approx(factor, rel=1e-6)
        assert 7.5e9 * per_param / 1e9 == pytest.approx(published_gb, abs=0.05)
        assert mem.step_buffers == pytest.approx((6.0 if stage >= 2 else 0.0) * total_params(cfg.model), rel=1e-6)
