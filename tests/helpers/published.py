"""Published training runs (figures quoted from the sources below), and the planner against them on step time.

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

The fit: the matmul efficiency of each device generation is the one fitted constant of the time model
(p3d/config/devices.py matmul_efficiency). Every run here implies one, the efficiency at which the planner
reproduces its step time (``implied_efficiency``); the constant is the median of them over the generation's runs
(``fitted``: 20 A100 runs, 8 H100). A row's prediction with the constant fitted on the others (``leave_one_out``)
is the honest error, the one tests/unit/planner/test_published.py holds to the issue's bounds.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from dataclasses import dataclass
from typing import NamedTuple

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


def llama(layers, hidden, heads, kv_heads, ffn, vocab, seq):
    """A Llama block stack (SwiGLU, RMSNorm, untied)."""
    return [
        "model.arch=llama",
        "model.name=llama",
        f"model.n_layers={layers}",
        f"model.hidden_size={hidden}",
        f"model.n_heads={heads}",
        f"model.n_kv_heads={kv_heads}",
        f"model.ffn_hidden_size={ffn}",
        f"model.vocab_size={vocab}",
        f"model.seq_len={seq}",
        "model.tie_embeddings=false",
    ]


def nemo(tp, pp, dp, mbs, gbs, v, cp=1):
    """NeMo's performance recipes on H100 (the DGX Cloud cards): sequence parallelism, flash attention, no
    recompute, the distributed optimizer (ZeRO 1) with its DP overlap, TP communication overlap, and with virtual
    stages overlapped pipeline sends."""
    return run(tp, pp, dp, mbs, gbs, "h100_sxm", "none", True, v, 1, True, True, True, "plan.overlap_tp=true") + (
        [f"mesh.cp={cp}", f"cluster.nodes={tp * pp * dp * cp // 8}"] if cp > 1 else []
    )


def megascale(gpus, gbs):
    """MegaScale's Megatron-LM baseline for the 175B model (Table 1: 96 layers, h 12288, 128 heads, tp 8, pp 8)."""
    return gpt(96, 12288, 128, vocab=64000) + run(
        8, 8, gpus // 64, 1, gbs, "a100_80gb", "selective", True, 6, 1, False, False, False, "plan.p2p_scatter=true"
    )


def titan(mbs, recompute):
    """torchtitan on 64 A100 80GB: FSDP2 (p3d's ZeRO 3: weights gathered in bf16, gradients reduce-scattered in
    fp32 once a step) with prefetching, flash attention (SDPA), one micro batch of ``mbs`` sequences per GPU."""
    return run(1, 1, 64, mbs, 64 * mbs, "a100_80gb", recompute, zero=3, flash=True, overlap_dp=True)


class Published(NamedTuple):
    overrides: list[str]
    value: float  # what the source gives: TFLOP/s per GPU (an MFU as its share of the peak), seconds per step, or
    # tokens per second per GPU
    unit: str  # "tflops" | "step_s" | "tokens_s"
    convention: str  # how the source counts FLOPs: a key of p3d.layout.geometry.FLOP_CONVENTIONS
    source: str


N21 = "N21 Table 1"
N21_T2 = "N21 Table 2"
MS = "MegaScale T2"
NEMO15 = "Nemotron-4 15B T2"
TT = "torchtitan A100"

# The rows, grouped by source in this order. The split (``FIT``, ``HELD_OUT``) alternates down this listing: the
# first row fits, the second is held out, and so on across the sources, fixed before any new row was predicted.
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
    # DeepSpeed ZeRO-3 without model parallelism (full recompute, as Table 1's FLOPs; one micro batch per step),
    # against PTD-P (tp 8 x pp 12 and tp 8 x pp 35) at the same batch
    **{
        f"N21T2-Z3-{size}-{gpus}": Published(
            shape + run(1, 1, gpus, mbs, gbs, "a100_80gb", zero=3, overlap_dp=True), tflops, "tflops", "eq3", N21_T2
        )
        for size, shape, gpus, mbs, gbs, tflops in (
            ("175B", gpt(96, 12288, 96), 384, 4, 1536, 144),
            ("175B", gpt(96, 12288, 96), 768, 2, 1536, 88),
            ("175B", gpt(96, 12288, 96), 1536, 1, 1536, 44),
            ("530B", gpt(105, 20480, 128), 640, 4, 2560, 138),
            ("530B", gpt(105, 20480, 128), 1120, 2, 2240, 98),
            ("530B", gpt(105, 20480, 128), 2240, 1, 2240, 48),
        )
    },
    **{
        f"N21T2-PTD-{size}-{gpus}": Published(
            shape + run(8, pp, gpus // (8 * pp), 1, gbs, "a100_80gb"), tflops, "tflops", "eq3", N21_T2
        )
        for size, shape, pp, gpus, gbs, tflops in (
            ("175B", gpt(96, 12288, 96), 12, 384, 1536, 153),
            ("175B", gpt(96, 12288, 96), 12, 768, 1536, 149),
            ("175B", gpt(96, 12288, 96), 12, 1536, 1536, 141),
            ("530B", gpt(105, 20480, 128), 35, 560, 2240, 171),
            ("530B", gpt(105, 20480, 128), 35, 1120, 2240, 167),
            ("530B", gpt(105, 20480, 128), 35, 2240, 2240, 159),
        )
    },
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
    # DeepSpeed pipeline engine at tp 2, fp16, 12.5 GB/s per GPU between nodes
    "NEOX-20B": Published(
        ["model=gpt_neox_20b"]
        + run(2, 4, 12, 4, 1536, "a100_40gb", zero=1, megatron=False)
        + ["cluster.inter_node_gbps=12.5"],
        117,
        "tflops",
        "eq3",
        "NEOX 3",
    ),
    # the same DeepSpeed engine for MT-NLG 530B on 2240 GPUs (Eq. 3: 126 TFLOP/s = its 60.1 s iterations)
    "MTNLG-530B-2240": Published(
        ["model=gpt_530b"] + run(8, 35, 8, 1, 1920, "a100_80gb", zero=1, megatron=False),
        126,
        "tflops",
        "eq3",
        "MTNLG 2",
    ),
    # MosaicML's FSDP runs (2023 software): with checkpointing (30B, 70B) and without (7B, 13B)
    "MPT-30B-a100": Published(mpt(48, 7168, 56, 8, 3, 504, "a100_80gb", True), 0.553 * 312, "tflops", "p3d", "MPT"),
    "MPT-7B-a100": Published(mpt(32, 4096, 32, 8, 6, 96, "a100_80gb", False), 0.6423 * 312, "tflops", "p3d", "MPT"),
    "MPT-70B-a100": Published(mpt(80, 8192, 64, 64, 8, 2048, "a100_80gb", True), 0.5333 * 312, "tflops", "p3d", "MPT"),
    "MPT-30B-h100": Published(mpt(48, 7168, 56, 8, 3, 504, "h100_sxm", True), 0.3811 * 989, "tflops", "p3d", "MPT"),
    "MPT-7B-h100": Published(mpt(32, 4096, 32, 8, 6, 48, "h100_sxm", False), 0.4644 * 989, "tflops", "p3d", "MPT"),
    "MPT-13B-h100": Published(mpt(40, 5120, 40, 8, 2, 16, "h100_sxm", False), 0.3979 * 989, "tflops", "p3d", "MPT"),
    "MPT-70B-h100": Published(mpt(80, 8192, 64, 64, 8, 2048, "h100_sxm", True), 0.4257 * 989, "tflops", "p3d", "MPT"),
    # DGX Cloud cards (NeMo, BF16): the step time itself. NeMo's performance recipes: TP communication overlap,
    # DP overlap (distributed optimizer: ZeRO 1), sequence parallelism, and overlap_p2p_comm with virtual stages;
    # assumed: flash attention, no recompute (the recipes set none)
    "DGXC-NEMOTRON4-340B-128": Published(
        nemotron4(96, 18432, 96) + nemo(8, 8, 2, 1, 32, 12), 4.77, "step_s", "nemo_mha", "DGXC 340B 24.11"
    ),
    "DGXC-NEMOTRON4-15B-64": Published(
        nemotron4(32, 6144, 48) + nemo(4, 1, 16, 4, 256, 1), 2.86, "step_s", "nemo_mha", "DGXC 15B 24.11.1"
    ),
    "DGXC-NEMOTRON4-340B-2048": Published(
        nemotron4(96, 18432, 96) + nemo(8, 8, 32, 1, 512, 12), 4.84, "step_s", "nemo_mha", "DGXC 340B 24.11"
    ),
    "DGXC-NEMOTRON4-15B-2048": Published(
        nemotron4(32, 6144, 48) + nemo(4, 1, 512, 4, 8192, 1), 2.887, "step_s", "nemo_mha", "DGXC 15B"
    ),
    "DGXC-GPT3-175B-128": Published(
        ["model=gpt_175b"] + nemo(4, 8, 4, 1, 256, 12), 8.309, "step_s", "nemo_mha", "DGXC GPT3 175B"
    ),
    "DGXC-GPT3-175B-2048": Published(
        ["model=gpt_175b"] + nemo(4, 8, 64, 1, 4096, 12), 8.49, "step_s", "nemo_mha", "DGXC GPT3 175B"
    ),
    "DGXC-LLAMA31-70B-64": Published(
        ["model=llama70b"] + nemo(4, 4, 2, 1, 128, 5, cp=2), 14.72, "step_s", "p3d", "DGXC Llama 3.1 70B 24.09"
    ),
    # MegaScale's Megatron-LM baseline (commit 285068c8, 2023): the standard 175B GPT of 128 heads, tp 8 pp 8,
    # 6 interleaved stages, 2048 tokens, vocabulary 64000; batch 768 on 256..1024 GPUs and 6144 on 3072..12288; the
    # iteration time itself. Assumed: micro batch 1, selective recompute with sequence parallelism (Megatron's
    # recommended setting since Korthikanti'22), the distributed optimizer, nothing overlapped (the paper adds the
    # TP, PP and DP overlaps as its own), Megatron's scattered pipeline sends
    **{
        f"MS-175B-{gpus}": Published(megascale(gpus, gbs), step, "step_s", "p3d", MS)
        for gpus, gbs, step in (
            (256, 768, 40.0),
            (512, 768, 21.2),
            (768, 768, 15.2),
            (1024, 768, 11.9),
            (3072, 6144, 29.02),
            (6144, 6144, 14.78),
            (8192, 6144, 12.24),
            (12288, 6144, 8.57),
        )
    },
    # Table 3's baseline: the same Megatron-LM at batch 256 on 256 GPUs, 47.7 % MFU
    "MS-175B-256-b256": Published(megascale(256, 256), 0.477 * 312, "tflops", "p3d", "MegaScale T3"),
    # Nemotron-4 15B's pre-training: tp 8 and data parallelism with the distributed optimizer on DGX H100 (8 x 400
    # Gb/s per node), batch ramped 384 / 768 / 1152 of 4096 tokens; the iteration time itself. Assumed as the DGX
    # Cloud recipes: micro batch 1, sequence parallelism, flash attention, no recompute, TP and DP overlap
    **{
        f"NEMO4-15B-{gpus}": Published(
            nemotron4(32, 6144, 48) + nemo(8, 1, gpus // 8, 1, gbs, 1), step, "step_s", "p3d", NEMO15
        )
        for gpus, gbs, step in ((768, 384, 0.57), (1536, 768, 0.58), (2304, 1152, 0.64))
    },
    # torchtitan's FSDP2 (ZeRO 3 with prefetching) on 64 A100 80GB, one sequence (or two) per GPU, flash attention
    # (SDPA): tokens per second per GPU. Assumed: the a100_80gb preset's links (the page does not give the network)
    "TT-L2-13B-b2": Published(
        llama(40, 5120, 40, 40, 13824, 32000, 4096) + titan(2, "none"), 2162, "tokens_s", "p3d", TT
    ),
    "TT-L3-70B-b1": Published(
        llama(80, 8192, 64, 8, 28672, 128256, 8192) + titan(1, "full"), 331, "tokens_s", "p3d", TT
    ),
    "TT-L2-70B-b2": Published(
        llama(80, 8192, 64, 8, 28672, 32000, 4096) + titan(2, "full"), 353, "tokens_s", "p3d", TT
    ),
}


def split(names) -> tuple[list[str], list[str]]:
    """(fit, held out): every other row of the listing, the first one fitting."""
    names = list(names)
    return names[0::2], names[1::2]


FIT, HELD_OUT = split(ROWS)


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
    step_pub = {
        "step_s": row.value,
        "tflops": flops / (row.value * 1e12 * gpus) if row.value else 0.0,
        "tokens_s": pred.tokens_per_step / (row.value * gpus) if row.value else 0.0,
    }[row.unit]
    return Compared(step_pub, pred.step_time_s, flops, gpus, float(cfg.cluster.peak_tflops))


def predicted(make_cfg, overrides, convention) -> float:
    """TFLOP/s per GPU as ``convention`` counts FLOPs (eq3: the HFU of Eq. 3; p3d: model FLOPs)."""
    cfg = make_cfg(*overrides)
    r = evaluate(cfg, check=False)
    flops = flops_per_token(cfg.model, convention, cfg.schedule.recompute.value)
    return flops * r.tokens_per_s / r.layout.world_size / 1e12


# Runs the planner, at the fitted efficiency, puts more than 13 % off (test_published keeps them as strict
# expected failures, so that a change shows): two DeepSpeed-engine runs with recompute, slower than predicted; the
# H100 runs furthest either side of the generation's median, MPT-13B without checkpointing (slower) and MPT-70B
MISSES = frozenset({"NEOX-20B", "MTNLG-530B-2240", "MPT-13B-h100", "MPT-70B-h100"})


def generation(device: str) -> str:
    """The device generation whose runs fit one efficiency: A100 (40 and 80 GB) or H100 (H200 and B200 take it)."""
    return "a100" if device.startswith("a100") else "h100"


@functools.cache
def config(name: str):
    """The composed config of a run (Hydra takes ~0.2 s a row; the fit evaluates each row ~40 times)."""
    from tests.helpers.runs import compose_config

    return compose_config(*ROWS[name].overrides)


def compared(name: str) -> Compared:
    """A run against the planner at the device preset's stored efficiency."""
    return compare(lambda *_: config(name), ROWS[name])


def step_at(name: str, efficiency: float) -> float:
    """The planner's step time for a run at this matmul efficiency (``plan.efficiency``)."""
    cfg = config(name)
    cfg = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, efficiency=efficiency))
    return evaluate(cfg, check=False).step_time_s


@functools.cache
def implied_efficiency(name: str) -> float:
    """The matmul efficiency at which the planner reproduces the run's published step time (bisection: the step
    time falls as the efficiency grows)."""
    target = compared(name).step_pub
    low, high = 0.01, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if step_at(name, mid) > target else (low, mid)
    return (low + high) / 2


def fitted(exclude: str | None = None) -> dict[str, float]:
    """generation -> the median implied efficiency of its runs (``exclude``: fitted without that run)."""
    by_gen: dict[str, list[float]] = {}
    for name in ROWS:
        if name != exclude:
            by_gen.setdefault(generation(str(config(name).cluster.device)), []).append(implied_efficiency(name))
    return {gen: statistics.median(effs) for gen, effs in by_gen.items()}


def leave_one_out(name: str) -> float:
    """The run's step-time error with the efficiency fitted on the other runs of its generation."""
    eff = fitted(exclude=name)[generation(str(config(name).cluster.device))]
    return step_at(name, eff) / compared(name).step_pub - 1
