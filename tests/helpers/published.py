"""Published training runs (figures quoted from the sources below); tests/helpers/published_fit.py sets the
planner against them on step time.

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
  [N21 T2] the same paper, Sec. 5.2, Table 2: DeepSpeed ZeRO-3 without model parallelism against PTD-P (tp 8 with pp
         12 or 35) for GPT-3 175B (batch 1536 on 384 / 768 / 1536 GPUs: ZeRO-3 144 / 88 / 44 TFLOP/s with micro
         batch 4 / 2 / 1, PTD-P 153 / 149 / 141) and the 530B model (batch 2560 on 640 GPUs at micro batch 4: 138;
         batch 2240 on 1120 / 2240 at 2 / 1: 98 / 48; PTD-P on 560 / 1120 / 2240: 171 / 167 / 159).
  [MS]   Z. Jiang et al., "MegaScale: Scaling Large Language Model Training to More Than 10,000 GPUs", NSDI'24,
         arXiv:2402.15627. Table 1 (175B: 96 layers, h 12288, 128 heads, tp 8, pp 8), Sec. 6.1 (Megatron-LM commit
         285068c8, interleaved schedule with 6 chunks, s = 2048, V = 64000; Ampere GPUs, MFU against 312 TFLOP/s;
         Sec. 3.6: eight 200 Gb/s NICs per node), Table 2 (Megatron-LM rows: batch 768 on 256 / 512 / 768 / 1024
         GPUs, 40.0 / 21.2 / 15.2 / 11.9 s, MFU 53.0 / 49.9 / 46.7 / 44.7 %; batch 6144 on 3072 / 6144 / 8192 /
         12288, 29.02 / 14.78 / 12.24 / 8.57 s, MFU 48.7 / 47.8 / 43.3 / 41.2 %), Table 3 (the baseline at batch 256
         on 256 GPUs: 47.7 % MFU).
  [NEMO15] J. Parmar et al., "Nemotron-4 15B Technical Report", arXiv:2402.16819. Table 1 (32 layers, h 6144, 48
         heads, 8 kv heads, s = 4096, V = 256000), Sec. 2 (384 DGX H100 nodes, 8 x 400 Gb/s per node, 8-way tensor
         parallelism and data parallelism with the distributed optimizer), Table 2 (dp 96 / 192 / 288 on 768 / 1536 /
         2304 GPUs, batch 384 / 768 / 1152: 0.57 / 0.58 / 0.64 s per iteration, MFU 34.3 / 33.3 / 30.5 %).
  [DGXC GH] NVIDIA/dgxc-benchmarking on GitHub, the DGX Cloud benchmark tables of NeMo (Megatron-Core) workloads
         the NGC cards below do not cover: nemo_megatron/README_175b.md at 0b71cfda (GPT-3 175B BF16, TP 4 PP 8 VP 12
         MBS 1, seq 2048: 8.309 s on 128 H100 at GBS 256, 8.49 s on 2048 at GBS 4096; MFU 53.54 / 52.40 %) and
         llama3.1/README_70b.md at 143b90dd (Llama 3.1 70B 24.09 BF16, TP 4 PP 4 CP 2 VP 5 MBS 1: 14.72 s on 64 H100
         at GBS 128, MFU 54.10 %). The same repository's Nemotron4 tables add DGXC rows (nemotron/README_340b.md at
         143b90dd, 24.11 BF16: 4.84 s on 2048 H100 at GBS 512; nemotron/README_15b.md at 0b71cfda, BF16 TP 4 MBS 4:
         2.887 s on 2048 H100 at GBS 8192).
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

Not added: the Nemotron-4 340B technical report's Table 2 (arXiv:2406.11704; only a third party's quote of its
6144-GPU row was found); NeMo's and Megatron-Bridge's H100 performance summaries (their dense H100 rows are FP8, which
the planner does not model); torchtitan's docs/performance.md A100 rows (64 A100 80GB, FSDP2: the page does not say
the network, and at these sizes the network decides the step: at the a100_80gb preset's 25 GB/s per GPU the planner
puts Llama 2 13B +38 %, Llama 3 / Llama 2 70B +14 / +18 % slow, with every NIC of a node serving its 8 ranks -15 / -9
/ -7 %); the Zero Bubble paper's 1F1B rows (arXiv:2401.10241, Table 4: its vocabulary is not given).

The fit. Two constants per device generation (p3d/config/devices.py), e (the fraction of peak of a large GEMM) and k0
(a GEMM tile's fixed cost in k-steps) of the GEMM model (p3d/planner/gemms.py), are fitted on the ``FIT`` half of
the rows: the (e, k0) on a lattice of 0.001 x 8 that minimises the mean |ln(t_pred / t_pub)| over the generation's
fit rows (``fit``, ``fit_loss``). The ``HELD_OUT`` half is the check: the planner's error on rows it was not fitted
on (tests/unit/planner/test_published.py holds it to issue 50's bounds). The split alternates down ``ROWS`` and was
fixed before any new row was predicted.
"""

from __future__ import annotations

from typing import NamedTuple


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


class Published(NamedTuple):
    overrides: list[str]
    value: float  # what the source gives: TFLOP/s per GPU (an MFU as its share of the peak), or seconds per step
    unit: str  # "tflops" | "step_s"
    convention: str  # how the source counts FLOPs: a key of p3d.layout.geometry.FLOP_CONVENTIONS
    source: str


N21 = "N21 Table 1"
N21_T2 = "N21 Table 2"
MS = "MegaScale T2"
NEMO15 = "Nemotron-4 15B T2"
DGXC_GH = "DGXC GH"

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
        ["model=llama3_1_405b"] + run(8, 16, 64, 1, 2048, "h100_sxm", "none", True, 8, 1, True, True, True),
        430,
        "tflops",
        "p3d",
        "L3 Table 4",
    ),
    "L3-405B-16384": Published(
        ["model=llama3_1_405b"] + run(8, 16, 128, 1, 2048, "h100_sxm", "none", True, 8, 1, True, True, True),
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
        nemotron4(96, 18432, 96) + nemo(8, 8, 32, 1, 512, 12), 4.84, "step_s", "nemo_mha", "DGXC 340B GH"
    ),
    "DGXC-NEMOTRON4-15B-2048": Published(
        nemotron4(32, 6144, 48) + nemo(4, 1, 512, 4, 8192, 1), 2.887, "step_s", "nemo_mha", "DGXC 15B GH"
    ),
    "DGXC-GPT3-175B-128": Published(
        ["model=gpt_175b"] + nemo(4, 8, 4, 1, 256, 12), 8.309, "step_s", "nemo_mha", DGXC_GH
    ),
    "DGXC-GPT3-175B-2048": Published(
        ["model=gpt_175b"] + nemo(4, 8, 64, 1, 4096, 12), 8.49, "step_s", "nemo_mha", DGXC_GH
    ),
    "DGXC-LLAMA31-70B-64": Published(
        ["model=llama70b"] + nemo(4, 4, 2, 1, 128, 5, cp=2), 14.72, "step_s", "p3d", DGXC_GH
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
}


# The sources new to the table since issue 50 (its held-out rows must come from at least three of them)
NEW_SOURCES = {
    "MegaScale (NSDI'24)": (MS, "MegaScale T3"),
    "Nemotron-4 15B report": (NEMO15,),
    "NVIDIA/dgxc-benchmarking on GitHub": (DGXC_GH, "DGXC 340B GH", "DGXC 15B GH"),
    "N21 Table 2 (ZeRO-3 comparison)": (N21_T2,),
}


def split(names) -> tuple[list[str], list[str]]:
    """(fit, held out): every other row of the listing, the first one fitting."""
    names = list(names)
    return names[0::2], names[1::2]


FIT, HELD_OUT = split(ROWS)
