"""Step time: compute at a stated efficiency, memory-bound kernels, the bubble, TP / PP / DP traffic.

Per block and micro batch on one tp rank (b micro batch, s sequence, t tp; docs/planner.md):

    matmuls     2 b s W / t FLOPs forward, twice that backward (W: the block's weights)
    attention   4 b s^2 q / t forward (halved with flash attention: causal tiles are skipped),
                backward 2x (2.5x with flash, which recomputes the scores)
    compute     FLOPs / (peak x efficiency)  +  bytes of the memory-bound kernels / (HBM x 0.8)
    recompute   full: one more forward (its TP collectives too); selective: the attention core

TP: two all-reduces of b s h c bytes forward and two backward per block (with sequence
parallelism the same bytes as all-gathers and reduce-scatters), ring time 2 (t-1)/t x bytes / link
for an all-reduce and (t-1)/t for the others, plus a latency per collective; the link is NVLink
while the group fits in a node. They are exposed (p3d's tp layers block), or with ``plan.overlap_tp`` each
pipelined with its GEMM, exposing what it outlasts (``_tp_exposed``).

PP: blocking sends of b s h c bytes per micro batch for every chunk boundary that crosses to another rank
(``p2p_hops``): 1f1b / gpipe 2 per middle stage, 1 on the first and last; interleaved 2 v (2 v - 1 on the
first and last rank): v times the traffic; V-shaped (zbv, dualpipev) 4 on middle ranks and 2 on the first and
the last, whose chunk p - 1 hands to chunk p on the same rank. ``plan.overlap_pp`` hides them behind the stage's
compute (asynchronous sends, as Megatron's schedules do); ``plan.p2p_scatter`` sends 1/t of the bytes (``p2p_bytes``,
Megatron's (s/t, b, h) tensors). Step = (m + fill) x the slowest stage's micro batch
time, where fill = m B / (1 - B) for the schedule's bubble B = ``p3d.layout.geometry.schedule_bubble`` (1f1b:
fill = p - 1; interleaved: (p - 1) / v; the I/W-split schedules: (p - 1) / (3 v), a chunk forward per stage in
three passes), so the bubble, the idle share of the step, is B.

DP: ZeRO 0 all-reduces the gradients once per step; a sharded optimizer reduce-scatters them and
all-gathers the updated parameters; ZeRO 2 and 3 (FSDP2, docs/zero.md) reduce-scatter once a step and gather
the weights once a step (ZeRO 2) or for every micro batch's forward and once for the backward (ZeRO 3, m + 1
gathers, under every schedule: counted in tests/workers/test_zero_fsdp.py). DeepSpeed's pipeline engine runs them after
the last backward (exposed); ``plan.overlap_dp`` leaves one layer chunk exposed and hides the rest behind one
micro batch's forward and backward (ZeRO 3: behind all compute of the step but the first block's gather;
``dp_exposed``). Tied embeddings add one all-reduce of the table's
gradient between the first and last stage. The optimizer step streams ~32 bytes per local
optimizer element through HBM.

Mixture of experts (p3d.planner.experts): an MoE block's matmuls are its active weights (attention, router, the k
routed and S shared experts a token goes through: ``geometry.mlp_params(active=True)``; under balanced routing
every rank computes the same rows). Its token dispatch adds 4 all-to-alls per micro batch (6 with full recompute)
of b s r h c bytes, (ep - 1)/ep of them leaving each rank (the "others" ring time, (n - 1)/n x bytes / link +
latency), over the link of its ep group's ep x t consecutive ranks; they are never hidden (``a2a``). Dense
gradients reduce over dp, the routed experts' over edp = (dp / ep) x cp (their Adam step over 1/edp of them).

Context parallelism (p3d.planner.context): a rank computes s / cp tokens of each sequence, so every b s above reads
b s / cp, and the attention FLOPs are 1/cp of the causal total (4 b s^2 q / t x 1/2 / cp: the head-tail chunks
balance them; the cp attention is flash-like whatever ``plan.flash_attention`` says). Each block's keys and values
cross the cp group per micro batch (``kv``, ``kv_traffic``): all-gathered (``context.kv_collectives``, b s 2 kv / t c
bytes each, the dK, dV reduce-scatter in fp32, (cp - 1) / cp of each leaving the rank, none hidden) or passed round a
ring (``context.ring_messages``, each hidden behind a step's attention as far as it lasts), over the link of its
tp x cp consecutive ranks.
Gradients reduce over the dp x cp holders of the parameters (the torch executor: cp > 1 never runs on DeepSpeed's).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from p3d.config.schema import Arch, Config, Recompute
from p3d.layout.geometry import (
    chunk_to_rank,
    head_dims,
    is_mla,
    moe_layers,
    padded_vocab,
    qk_head_dim,
)
from p3d.layout.hetero import mean_slowdown
from p3d.layout.schedule_rules import V_SHAPED
from p3d.planner import context, experts, float8, mla
from p3d.planner.gemms import Gemm, block_gemms, head_gemm
from p3d.planner.machine import (  # noqa: F401 - HBM_EFFICIENCY, COMM_EFFICIENCY, ...: importers read them here
    COMM_EFFICIENCY,
    HBM_EFFICIENCY,
    LATENCY_S,
    OPTIMIZER_BYTES_PER_ELEMENT,
    efficiency,
    gemm_device,
    hbm_bytes_per_s,
    intra_node,
    machine_of,
)
from p3d.planner.memory import dtype_bytes, optimizer_sharded
from p3d.planner.shapes import Layout, StageParams


def ring(cfg: Config, nbytes: float, n: int, span: int, op: str = "all_reduce") -> float:
    """Seconds of one ring collective over n ranks: all_reduce moves 2 (n-1)/n of the bytes, others (n-1)/n (an
    all_to_all too: each rank sends the (n-1)/n of its bytes meant for the others, and receives as much); the
    machine's link (p3d.planner.machine: the device table, or a calibration's fit of this op and n)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return machine_of(cfg).collective(op, nbytes, n, span)


@dataclass
class StageTime:
    """Seconds per micro batch on one stage (compute = matmuls + attention + memory-bound kernels)."""

    compute: float
    recompute: float
    tp_comm: float  # exposed
    pp_comm: float
    backward_compute: float  # one micro batch's backward, what DP traffic may hide behind
    forward_compute: float
    a2a: float = 0.0  # the MoE blocks' all-to-alls (token dispatch), never hidden
    kv: float = 0.0  # context parallelism: the blocks' key/value traffic, what is not hidden of it

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.tp_comm + self.pp_comm + self.a2a + self.kv


@dataclass
class BlockWork:
    """One block's work per micro batch on one tp rank (``block_work``): its forward GEMMs (p3d.planner.gemms), the
    bytes of its memory-bound kernels, its TP collectives' seconds (one all-gather, one reduce-scatter, and ``tp``:
    all of one direction)."""

    gemms: dict[str, list[Gemm]]
    side_bytes: float  # norms, residual adds, rope, activation functions: read + written, forward
    core_bytes: float  # attention's input and output (and without flash its probabilities)
    ag: float
    rs: float
    tp: float
    cast_fwd: float = 0.0  # train.fp8: bytes of the float8 casts forward (the weights' a step spread over m)
    cast_bwd: float = 0.0  # ... and backward
    tp_saved: float = 0.0  # train.fp8=tensorwise with SP: the forward all-gathers' seconds float8 saves


def block_work(cfg: Config, layout: Layout, moe: bool = False) -> BlockWork:
    """GEMMs and memory-bound bytes of one block's forward, and its TP collectives, per micro batch (``moe``: an
    MoE block, its active weights and its feed-forward's kernels). s: the rank's s / cp tokens; the attention's FLOPs
    are 1/cp of the whole sequence's causal total (the head-tail chunks give every cp rank the same share)."""
    m, sched = cfg.model, cfg.schedule
    b, s, t, c = layout.micro_batch_size, context.local_tokens(cfg, layout), layout.tp, dtype_bytes(cfg)
    h, a, f = m.hidden_size, m.n_heads, m.ffn_hidden_size
    q, kv = head_dims(m)
    sp = t if sched.sequence_parallel else 1
    flash = cfg.plan.flash_attention or layout.cp > 1
    core = (2 * q + 2 * kv) / t + (0 if flash else (2 if m.arch == Arch.llama else 4.5) * a * s / t)
    if is_mla(m):  # q, k, v padded and the output, d_qk wide each (p3d.planner.mla)
        core = 4 * a * qk_head_dim(m) / t
    if m.arch == Arch.llama and is_mla(m):  # 2 norms + 2 residual adds; MLA's latents' norms, rope, assembly
        ffn = experts.ffn_side_elements(cfg, layout) if moe else 5 * f / t
        side = 10 * h / sp + mla.side_elements(cfg, layout) + ffn
    elif m.arch == Arch.llama:  # 2 norms + 2 residual adds; rope; silu(gate) * up (MoE: the experts', the permutation)
        ffn = experts.ffn_side_elements(cfg, layout) if moe else 5 * f / t
        side = 10 * h / sp + 4 * (q + kv) / t + ffn
        # the families' pieces: the q|k|v bias add (read, write), the q and k heads' norms (as a block's norm)
        side += (2 * (q + 2 * kv) if m.qkv_bias else 0) / t + (5 * (q + kv) if m.qk_norm else 0) / t
    else:  # 2 layer norms + 2 bias-dropout-adds; qkv bias; bias-gelu
        side = 13 * h / sp + (2 * (q + 2 * kv) + 2 * f) / t
    act_bytes = b * s * h * c
    ag, rs = ring(cfg, act_bytes, t, t, "all_gather"), ring(cfg, act_bytes, t, t, "reduce_scatter")
    # 2 all-reduces per direction (or, with sequence parallelism, 2 all-gathers + 2 reduce-scatters)
    tp_dir = 2 * (ag + rs) if sched.sequence_parallel else 2 * ring(cfg, act_bytes, t, t)
    work = BlockWork(block_gemms(cfg, layout, moe), b * s * side * c, b * s * core * c, ag, rs, tp_dir)
    return _with_float8(cfg, layout, work)


def _with_float8(cfg: Config, layout: Layout, work: BlockWork) -> BlockWork:
    """``train.fp8`` (p3d.planner.float8): the casts' bytes of the block's float8 linears, and the forward
    all-gathers' halved bytes under tensorwise SP."""
    fwd_casts, bwd_casts, weight_casts = float8.casts_per_pass(cfg)
    linears = [g for name in ("qkv", "proj", "fc1", "fc2") for g in work.gemms[name] if g.fp8 and g.count == 1]
    if not linears:
        return work
    # a linear's input is m x k, its output gradient m x n; its weight k x n, cast once a step
    fwd = sum(g.m * g.k for g in linears) * fwd_casts * float8.CAST_BYTES
    fwd += sum(g.k * g.n for g in linears) * weight_casts * float8.WEIGHT_CAST_BYTES / layout.micro_batches
    bwd = sum(g.m * g.n for g in linears) * bwd_casts * float8.CAST_BYTES
    saved = work.ag if float8.sp_gathers_in_float8(cfg) and layout.tp > 1 else 0.0
    return dataclasses.replace(work, cast_fwd=fwd, cast_bwd=bwd, tp_saved=saved)


GemmTimer = Callable[[Gemm], float]


def _per_block(cfg: Config, k: BlockWork, gemm: GemmTimer, mem_s: float) -> dict[str, float]:
    """Seconds of one block per micro batch: forward, backward, recompute, exposed TP collectives (``gemm``: the
    machine's seconds of one GEMM)."""
    weights = [g for name in ("qkv", "proj", "fc1", "fc2") for g in k.gemms[name]]
    gemm_f = sum(gemm(g) for g in weights)
    gemm_b = sum(gemm(d) + gemm(w) for d, w in (g.grads() for g in weights))
    attn_f = sum(gemm(g) for g in k.gemms["attn"]) + k.core_bytes / mem_s
    side_f = k.side_bytes / mem_s
    fwd = gemm_f + attn_f + side_f + k.cast_fwd / mem_s
    bwd = gemm_b + sum(gemm(g) for g in k.gemms["attn_bwd"]) + (2 * (k.core_bytes + k.side_bytes) + k.cast_bwd) / mem_s
    rec = {Recompute.full: fwd, Recompute.selective: attn_f, Recompute.none: 0.0}[cfg.schedule.recompute]
    tp_layer = 2 * k.tp + (k.tp if cfg.schedule.recompute == Recompute.full else 0.0) - k.tp_saved
    if cfg.plan.overlap_tp:
        tp_layer = _tp_exposed(cfg, k, gemm)
    return {"fwd": fwd, "bwd": bwd, "both": fwd + bwd, "rec": rec, "tp": tp_layer}


def _tp_exposed(cfg: Config, k: BlockWork, gemm: GemmTimer) -> float:
    """``plan.overlap_tp``: a block's TP collectives per micro batch left exposed when each one is pipelined with its
    GEMM (Megatron-Core's tp_comm_overlap with TransformerEngine userbuffers; Wang et al., ASPLOS'23): forward, the
    all-gather with the qkv GEMM, the reduce-scatter with the out-projection, the all-gather with fc1, the
    reduce-scatter with fc2; backward the same four collectives with GEMMs of the same size (dgrad, or wgrad for the
    bulk overlaps); a full recompute's forward once more. Each pair exposes max(0, t_collective - t_GEMM). Without
    sequence parallelism an all-reduce is taken as its reduce-scatter and all-gather halves, paired the same way.
    The SMs the communication kernels take from the GEMMs are not modelled."""
    pairs = ((k.ag, "qkv"), (k.rs, "proj"), (k.ag, "fc1"), (k.rs, "fc2"))
    one_pass = sum(max(0.0, coll - sum(gemm(g) for g in k.gemms[name])) for coll, name in pairs)
    return (3 if cfg.schedule.recompute == Recompute.full else 2) * one_pass


def _probed(analytic: dict[str, float], probed: dict[str, float] | None) -> dict[str, float]:
    """A block's seconds with the probed fwd / bwd / recompute where the machine measured this shape. Its tp
    collectives stay the model's when the probe ran without them, and are the probe's (``tp`` 0) when it ran on tp
    real ranks."""
    if probed is None:
        return analytic
    out = dict(analytic, **probed)
    out["both"] = out["fwd"] + out["bwd"]
    return out


def block_sleep_seconds(cfg: Config) -> float:
    """``plan.block_seconds``: the seconds each block sleeps per piece under ``P3D_TEST_BLOCK_SECONDS``
    (p3d.train.block_seconds) on this cluster's devices: the fastest group's seconds stretched to the groups' mean
    device (``hetero.mean_slowdown``; a group's own config, p3d.planner.hetero, carries its own). 0: none."""
    return (cfg.plan.block_seconds or 0.0) * mean_slowdown(cfg.cluster)


def _slept(block: dict[str, float], cfg: Config, sleep: float) -> dict[str, float]:
    """A block's seconds with its sleep-timed pieces: the forward's, the backward's input- and weight-gradient pieces
    (B and W), and a full recompute's forward again (its pre-hook runs again under torch's and DeepSpeed's
    checkpoint)."""
    if sleep <= 0:
        return block
    out = dict(block, fwd=block["fwd"] + sleep, bwd=block["bwd"] + 2 * sleep)
    out["rec"] = block["rec"] + (sleep if cfg.schedule.recompute == Recompute.full else 0.0)
    out["both"] = out["fwd"] + out["bwd"]
    return out


def a2a_seconds(cfg: Config, layout: Layout) -> float:
    """Seconds of one MoE block's all-to-alls per micro batch on one rank (0 with ep = 1: every expert is local):
    ``experts.all_to_alls`` of the rows and of the row counts, over the ep group's link."""
    if cfg.model.moe is None or layout.ep == 1 or not moe_layers(cfg.model):
        return 0.0
    rows, counts = experts.all_to_alls(cfg.schedule.recompute)
    ep, span = layout.ep, experts.a2a_span(layout)
    one = ring(cfg, experts.dispatch_bytes(cfg, layout), ep, span, "all_to_all")
    return rows * one + counts * ring(cfg, 8.0 * cfg.model.moe.n_experts, ep, span, "all_to_all")


def a2a_link(cfg: Config, layout: Layout) -> str:
    """``intra`` when an ep group (ep x tp consecutive ranks) fits in a node, else ``inter``."""
    return "intra" if intra_node(cfg, experts.a2a_span(layout)) else "inter"


def kv_seconds(cfg: Config, layout: Layout) -> float:
    """Exposed seconds of one block's key/value traffic per micro batch on one rank (0 with cp = 1): ``kv_traffic``."""
    return kv_traffic(cfg, layout)[0]


def kv_traffic(cfg: Config, layout: Layout) -> tuple[float, float]:
    """(exposed, all) seconds of one block's key/value traffic per micro batch on one rank, over the cp group's link:
    allgather, the all-gathers and reduce-scatters of ``context.kv_collectives`` (blocking: all exposed); ring, its
    p2p messages less what hides behind each step's attention (``context.ring_exposed``)."""
    if layout.cp == 1:
        return 0.0, 0.0
    cp, span = layout.cp, context.kv_span(layout)
    if context.variant(cfg) == "ring":
        mach = machine_of(cfg)
        kv_s = mach.collective("send_recv", context.kv_bytes(cfg, layout) / cp, 2, span)
        grad_s = mach.collective("send_recv", context.kv_grad_bytes(cfg, layout) / cp, 2, span)
        attention_s = sum(mach.gemm(g, layout) for g in block_gemms(cfg, layout)["attn"])
        return context.ring_exposed(layout, kv_s, grad_s, attention_s)
    gathers, scatters = context.kv_collectives(Recompute(layout.recompute))
    gather = ring(cfg, context.kv_bytes(cfg, layout), cp, span, "all_gather")
    scatter = ring(cfg, context.kv_grad_bytes(cfg, layout), cp, span, "all_gather")  # a reduce-scatter: as a gather
    blocking = gathers * gather + scatters * scatter
    return blocking, blocking


def kv_link(cfg: Config, layout: Layout) -> str:
    """``intra`` when a cp group (tp x cp consecutive ranks) fits in a node, else ``inter``."""
    return "intra" if intra_node(cfg, context.kv_span(layout)) else "inter"


def stage_times(cfg: Config, layout: Layout, stages: list[StageParams]) -> list[StageTime]:
    m, mach = cfg.model, machine_of(cfg)
    mem_s = mach.mem_s(layout)

    def gemm(g: Gemm) -> float:
        return mach.gemm(g, layout)

    sleep = block_sleep_seconds(cfg)

    def timed(moe: bool) -> dict[str, float]:
        block = _probed(_per_block(cfg, block_work(cfg, layout, moe=moe), gemm, mem_s), mach.block(layout, moe))
        return _slept(block, cfg, sleep)

    dense = timed(False)
    moe = timed(True) if moe_layers(m) else dense
    probed_head, probed_embed = mach.head(layout), mach.embedding(layout)
    a2a, kv = a2a_seconds(cfg, layout), kv_seconds(cfg, layout)
    b, s, t, c = layout.micro_batch_size, context.local_tokens(cfg, layout), layout.tp, dtype_bytes(cfg)
    vpad = padded_vocab(m.vocab_size, t)
    act_bytes = b * s * m.hidden_size * c
    head = head_gemm(cfg, layout)
    head_fwd, head_bwd = gemm(head), sum(gemm(g) for g in head.grads())
    loss_mem = b * s * vpad / t * (c + 16) / mem_s  # logits written, fp32 copy, shift, exp, softmax
    # pipeline neighbours are tp * dp ranks apart: some boundary leaves the node unless the whole world fits in one
    p2p = mach.collective("send_recv", p2p_bytes(cfg, layout, act_bytes), 2, layout.world_size)
    if cfg.plan.p2p_scatter and not cfg.schedule.sequence_parallel:
        p2p += ring(cfg, act_bytes, t, t, "all_gather")  # the receiving tp group gathers the pieces (NVLink)
    out = []
    for rank, st in enumerate(stages):
        n, e = st.blocks - st.moe_blocks, st.moe_blocks  # dense and MoE blocks

        def blocks(key: str) -> float:
            return n * dense[key] + (e * moe[key] if e else 0.0)  # noqa: B023 - called within this iteration

        comp, back, forw = blocks("both"), blocks("bwd"), blocks("fwd")
        tp = blocks("tp")
        if "embed" in st.layers:
            tp += ring(cfg, act_bytes, t, t)  # the vocab-parallel lookup's all-reduce
            if probed_embed is not None:  # measured: the lookup and its dense gradient
                comp += probed_embed[0] + probed_embed[1]
                back += probed_embed[1]
        if "head" in st.layers:
            if probed_head is not None:  # measured: final norm, head and loss, fwd and bwd
                comp += probed_head[0] + probed_head[1]
                back += probed_head[1]
            else:
                comp += head_fwd + head_bwd + 2 * loss_mem
                back += head_bwd + loss_mem
            tp += ring(cfg, act_bytes, t, t) + 3 * ring(cfg, b * s * 4, t, t)  # head input grad; loss max/sum/target
        pp = 0.0
        if layout.pp > 1:
            pp = p2p * p2p_hops(layout, rank)
            if cfg.plan.overlap_pp:
                pp = max(0.0, pp - comp)
        out.append(StageTime(comp, blocks("rec"), tp, pp, back, forw, e * a2a, st.blocks * kv))
    return out


def p2p_bytes(cfg: Config, layout: Layout, act_bytes: float) -> float:
    """Bytes one rank sends per pipeline hop and micro batch: the whole (b, s, h) activation, as DeepSpeed's engine
    and p3d's executors send it from every tp rank; with ``plan.p2p_scatter`` 1/tp of it, as Megatron sends under
    sequence parallelism (its (s/t, b, h) tensors) and with its scatter-gather optimization before that (Narayanan
    et al. 2021, Sec. 4.1, where the receivers all-gather the pieces over NVLink)."""
    return act_bytes / layout.tp if cfg.plan.p2p_scatter else act_bytes


def p2p_hops(layout: Layout, rank: int) -> int:
    """Point-to-point transfers per micro batch and direction on pp rank ``rank``: the boundaries between
    consecutive chunks that touch this rank and cross to another one (a V keeps chunk p-1 -> p on one rank)."""
    return _hops(layout.pp, layout.virtual_stages, "v" if layout.pipeline in V_SHAPED else "loop", rank)


@functools.lru_cache(maxsize=4096)  # mesh=auto asks for the same few placements of every candidate
def _hops(p: int, v: int, style: str, rank: int) -> int:
    n = p * v
    where = chunk_to_rank(p, n, style)
    hops = 0
    for c in range(n - 1):
        if where[c] != where[c + 1] and rank in (where[c], where[c + 1]):
            hops += 1
    return hops


def _reduced_groups(layout: Layout, st: StageParams) -> list[tuple[int, int]]:
    """(parameters, ranks) of each reduction: all of them over the dp x cp holders, or with ep > 1 the dense ones
    over dp and the routed experts over their edp group (whose dp / ep ranks, ep apart, span the dp group's tp d
    ranks too)."""
    if layout.ep == 1:
        return [(st.total, layout.dp_cp)]
    return [(st.dense, layout.dp_cp), (st.experts, layout.edp)]


def fsdp_seconds(cfg: Config, layout: Layout, st: StageParams) -> tuple[float, float]:
    """ZeRO 2 and 3 (FSDP2, docs/zero.md): seconds of one all-gather of the stage's weights (c bytes) and of one
    reduction of its gradients (fp32, reduce-scattered; under HSDP within shard groups, the pieces then all-reduced
    across the replicas), over the dp x cp holders (the routed experts' over edp)."""
    d, span = layout.dp_cp, layout.tp * layout.dp_cp
    gather = reduce = 0.0
    in_float8_all = float8.gathered_in_float8(cfg, layout.tp, st.blocks, st.moe_blocks)  # tensorwise: 1 byte each
    for n, g in _reduced_groups(layout, st):
        s = cfg.zero.shard_size or g
        shard_span = layout.tp * s if g == d else span  # a shard group: s adjacent dp x cp ranks; edp's: ep apart
        reduce += ring(cfg, n * 4.0, s, shard_span, "reduce_scatter")
        if s < g:
            reduce += ring(cfg, n * 4.0 / s, g // s, span)
        in_float8 = in_float8_all if g == d else 0  # of the dense group
        gather += ring(cfg, (n - in_float8) * dtype_bytes(cfg) + in_float8, s, shard_span, "all_gather")
    return gather, reduce


def fsdp_gathers(layout: Layout) -> int:
    """The weights' all-gathers of a step: ZeRO 2 once; ZeRO 3 for every micro batch's forward and once for the
    backward (p3d's FSDP2 keeps a unit gathered from its first backward until the step's one reduction; counted in
    tests/workers/test_zero_fsdp.py)."""
    return 1 if layout.zero == 2 else layout.micro_batches + 1


def dp_seconds(cfg: Config, layout: Layout, st: StageParams) -> float:
    """Per-step seconds of one rank's data-parallel traffic (all of it, before any overlap), over the dp x cp ranks
    holding its parameters (tp x cp x dp consecutive ranks)."""
    d, zero = layout.dp_cp, cfg.zero.stage
    if d <= 1:
        return 0.0
    if zero >= 2:
        gather, reduce = fsdp_seconds(cfg, layout, st)
        return fsdp_gathers(layout) * gather + reduce
    span = layout.tp * d
    total = 0.0
    for n, g in _reduced_groups(layout, st):
        nbytes = n * dtype_bytes(cfg)
        whole = None if optimizer_sharded(cfg) else machine_of(cfg).engine_reduce(layout, nbytes, g)
        if whole is not None:  # DeepSpeed's reduce probed whole on real ranks: its copies are in it
            return whole
        if optimizer_sharded(cfg) and zero == 1:
            grads = ring(cfg, nbytes, g, span, "reduce_scatter")
        else:
            grads = ring(cfg, nbytes, g, span)
        params = ring(cfg, nbytes, g, span, "all_gather") if optimizer_sharded(cfg) else 0.0
        total += grads + params
    return total + machine_of(cfg).engine_copies(layout, st.total)  # a calibrated machine: DeepSpeed's copies


def dp_exposed(cfg: Config, layout: Layout, st: StageParams, total: float, t: StageTime) -> float:
    """Seconds of a stage's dp traffic (``dp_seconds``: ``total``) left on the critical path. Without
    ``plan.overlap_dp`` all of it (DeepSpeed's pipeline engine reduces after the last backward). With it, as
    Megatron's distributed optimizer with overlap_grad_reduce and overlap_param_gather: the traffic is chunked by
    layers (by the layers of a virtual stage when pp > 1) and one chunk stays exposed, the last gradients' reduction
    and the first weights' gather (Megatron-Bridge docs, "Communication Overlap"), and what exceeds one micro batch's
    forward + backward is exposed too: max(total / chunks, total - hide). ZeRO 2 and 3: ``fsdp_exposed``.

    ``plan.overlap_dp`` null (the default) models p3d's executors (docs/overlap.md): DeepSpeed's 1F1B exposes it all;
    the torch executor's ZeRO 0/1 all-reduce buckets of ``zero.bucket_mb`` fp32 gradients, each issued during the
    step's last backward as soon as its gradients are final (p3d.train.executors.grad_buckets), so the last bucket
    stays exposed and what outlasts that backward (its recompute included): max(total / buckets, total - hide);
    FSDP2 reduce-scatters each unit in the last backward and prefetches its gathers (``fsdp_exposed``)."""
    stated = cfg.plan.overlap_dp  # None: as p3d runs it
    if total <= 0.0 or not (stated or (stated is None and layout.torch_executor)):
        return total
    if layout.zero >= 2:
        return fsdp_exposed(layout, st, fsdp_seconds(cfg, layout, st), t)
    if stated is None:  # the torch executor's buckets
        buckets = max(1, math.ceil(4.0 * st.total / (cfg.zero.bucket_mb * 2**20)))
        return max(total / buckets, total - (t.backward_compute + t.recompute))
    chunks = max(1, st.blocks if layout.pp == 1 else layout.virtual_stages)
    return max(total / chunks, total - (t.forward_compute + t.backward_compute))


def fsdp_exposed(layout: Layout, st: StageParams, traffic: tuple[float, float], t: StageTime) -> float:
    """ZeRO 2 and 3 with prefetching (FSDP2's, DeepSpeed's): each block's collective runs behind its neighbour's
    compute, one block at a time, in the pass that needs it. A pass of L blocks with x seconds of traffic and y of
    compute per block exposes the first block's (the first gather, or the last reduction) and, where the traffic
    outlasts the compute it hides behind, the excess: x + (L - 1) max(0, x - y). The forwards that gather (ZeRO 3:
    every micro batch's; ZeRO 2: the first) have x = the gather per block; the backwards: the first gathers (ZeRO 3)
    and the last reduce-scatters its gradients, each hidden behind a backward (its recompute included)."""
    gather, reduce = (seconds / max(1, st.blocks) for seconds in traffic)
    blocks, m = max(1, st.blocks), layout.micro_batches
    fwd = t.forward_compute / blocks
    bwd = (t.backward_compute + t.recompute) / blocks

    def exposed(x: float, y: float) -> float:
        return x + (blocks - 1) * max(0.0, x - y) if x > 0 else 0.0

    forwards = (m if layout.zero >= 3 else 1) * exposed(gather, fwd)
    if layout.zero >= 3 and m > 1:  # the first backward gathers, the last reduces
        return forwards + exposed(gather, bwd) + exposed(reduce, bwd)
    return forwards + exposed(reduce + (gather if layout.zero >= 3 else 0.0), bwd)


def tied_seconds(cfg: Config, layout: Layout) -> float:
    """All-reduce of the tied embedding's gradient between the first and the last stage (none in a V: rank 0
    holds both ends, one module, as p3d/train/executors/torch_pipeline.py builds it)."""
    if not cfg.model.tie_embeddings or layout.pp == 1 or layout.pipeline in V_SHAPED:
        return 0.0
    vpad = padded_vocab(cfg.model.vocab_size, layout.tp)
    nbytes = vpad * cfg.model.hidden_size / layout.tp * dtype_bytes(cfg)
    return ring(cfg, nbytes, 2, layout.world_size)


def optimizer_seconds(cfg: Config, layout: Layout, st: StageParams) -> float:
    n = sum(p / (g if optimizer_sharded(cfg) else 1) for p, g in _reduced_groups(layout, st))
    return machine_of(cfg).optimizer_seconds(layout, n)


def gemm_efficiency(cfg: Config, layout: Layout) -> float:
    """The fraction of peak one dense block's GEMMs reach together on this machine (forward and backward, attention's
    included): what the GEMM model makes of the asymptotic efficiency at this layout's shapes."""
    mach, work = machine_of(cfg), block_gemms(cfg, layout)
    names = ("qkv", "proj", "fc1", "fc2")
    every = [g for n in names for g in work[n]] + [d for n in names for g in work[n] for d in g.grads()]
    every += work["attn"] + work["attn_bwd"]
    seconds = sum(mach.gemm(g, layout) for g in every)
    return sum(g.flops for g in every) / seconds / (cast(float, cfg.cluster.peak_tflops) * 1e12) if seconds else 0.0


def assumptions(cfg: Config, layout: Layout | None = None) -> dict[str, Any]:
    """The planner's fixed assumptions for this config (printed and in format=json); with ``layout``, also what its
    block's GEMMs reach (``gemm_efficiency``)."""
    gemm = gemm_device(cfg) if cfg.calibration is None else None
    return {
        "efficiency": efficiency(cfg),
        "gemm_model": gemm is not None,  # each GEMM timed from its shape (p3d.planner.gemms)
        "gemm_k_overhead": gemm.k_overhead if gemm else None,
        "gemm_efficiency": gemm_efficiency(cfg, layout) if layout is not None else None,
        "hbm_gbps": hbm_bytes_per_s(cfg) / HBM_EFFICIENCY / 1e9,
        "peak_tflops": cfg.cluster.peak_tflops,
        "intra_node_gbps": cfg.cluster.intra_node_gbps,
        "inter_node_gbps": cfg.cluster.inter_node_gbps,
        "comm_efficiency": COMM_EFFICIENCY,
        "flash_attention": cfg.plan.flash_attention,
        "overlap_dp": cfg.plan.overlap_dp,
        "overlap_tp": cfg.plan.overlap_tp,
        "overlap_pp": cfg.plan.overlap_pp,
        "p2p_scatter": cfg.plan.p2p_scatter,
        "calibration": cfg.calibration,
    }
