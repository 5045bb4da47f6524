"""What the planner counts exactly: the layout, parameters per rank and stage, and FLOPs per token.

Notation (docs/planner.md uses the same): L layers, h hidden, a = n_heads, hd = h / a, q = a * hd,
kv = n_kv_heads * hd, f = ffn_hidden_size, V vocab (V_pad: padded to a multiple of tp, as p3d
builds it), s sequence, b micro batch, t = tp, p = pp, d = dp, m micro batches per replica per
step, v virtual stages (chunks per pp rank), cp the context-parallel degree (each sequence split over cp ranks, s / cp
tokens each: p3d.planner.context).

A layout also names the pipeline schedule, recompute and ZeRO stage it runs with, the knobs ``mesh=auto``
searches (p3d.planner.search); ``layout_of`` reads them from the config and ``apply_layout`` writes them back.

Parameters per tensor-parallel rank mirror the modules p3d builds (p3d/model/llama.py, pipe.py):

    llama block:  matrices  h (q + 2 kv) / t  (q|k|v)  +  h q / t  (o)  +  3 h f / t  (gate|up, down)
                  vectors   2 h  (two RMSNorm weights, replicated on every tp rank)
    gpt block:    matrices  h (q + 2 kv) / t  +  h q / t  +  2 h f / t  (fc1, fc2)
                  vectors   (q + 2 kv) / t + f / t  (column-parallel biases)  +  2 h  (row-parallel
                            biases, replicated)  +  4 h  (two LayerNorms, weight and bias)
    embedding:    V_pad h / t  (+ gpt: learned positions s h, replicated)
    final norm:   h (llama RMSNorm) or 2 h (gpt LayerNorm)
    head:         V_pad h / t; with tied embeddings and pp > 1 the last stage holds a copy of the
                  embedding (DeepSpeed's TiedLayerSpec), with pp = 1 the one table serves both.

Layers are placed on stages by ``p3d.layout.geometry.stage_bounds``, the function p3d-train uses; with a torch
schedule of v chunks per rank the layer list is cut into p v chunks and rank r holds the chunks
``geometry.rank_chunks`` gives it (loop placement for the interleaved schedules, V placement for zbv and
dualpipev, where rank 0 holds both the embedding and the head), as p3d/train/executors/torch_pipeline.py builds them.
The per-block counts and FLOPs per token are ``p3d.layout.geometry``'s too.

Mixture of experts (``model.moe``): a block i >= first_dense_layers holds, besides its attention and norms, the
router h E (replicated over tp), S shared experts and E / ep routed experts, each expert 3 h f_e / t
(``geometry.mlp_params``); a layout's ep (``mesh.ep``, carved from dp) is 1 for a dense model. ``StageParams``
keeps the routed experts' share apart: they reduce and shard over edp = (dp / ep) x cp ranks, the rest over dp x cp.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from p3d.config.schema import Arch, Config, DType, ModelConfig, Pipeline, Recompute
from p3d.layout.dims import resolve_dp
from p3d.layout.expert_rules import check_expert_degree
from p3d.layout.float8_rules import recipe
from p3d.layout.geometry import (
    attention_params,
    block_vector_params,
    expert_params,
    is_moe_layer,
    layer_names,
    max_pieces,
    mlp_params,
    padded_vocab,
    rank_chunks,
    stage_bounds,
)
from p3d.layout.run_plan import P3DConfigError, sequence_parallel_default
from p3d.layout.schedule_rules import INTERLEAVED, V_SHAPED, engine_runs, uneven_micro_batches, virtual_stages


@dataclass(frozen=True)
class Layout:
    """One parallel layout: degrees, micro batch, the derived micro batches per replica, the pipeline schedule
    with its chunks per rank, recompute, the ZeRO stage (the values of ``schedule.pipeline``,
    ``schedule.recompute``, ``zero.stage``), the expert-parallel degree ep (``mesh.ep``, carved from dp) and the
    context-parallel degree cp (``mesh.cp``: the cp ranks of a dp replica split its sequences)."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    micro_batches: int
    virtual_stages: int = 1
    pipeline: str = "1f1b"
    recompute: str = "none"
    zero: int = 0
    ep: int = 1
    cp: int = 1
    fp8: bool = False  # train.fp8 set: the torch executor runs it (schedule_rules.runs_on_deepspeed)
    uneven: bool = False  # the dp replicas run different micro batch counts (schedule.replica_micro_batches)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dp_cp(self) -> int:
        """The ranks holding the same parameters, which reduce their gradients and share ZeRO's shards: dp x cp."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """The expert-data-parallel degree: the dp / ep ranks of a dp group that hold the same experts, times cp."""
        return max(1, self.dp // self.ep) * self.cp

    @property
    def torch_executor(self) -> bool:
        """Whether torch's pipelining runs it: ``schedule_rules.engine_runs``, the launcher's rule, for its schedule,
        ZeRO stage, ep, cp, micro batches per replica and float8."""
        return not engine_runs(self.pipeline, self.zero, self.ep, self.cp, self.uneven, self.fp8)

    def describe(self, seq_len: int) -> str:
        """``tp=8 pp=8 dp=1 (64 ranks), 1024 micro batches of 1 x 8192 per replica, 1f1b``: the micro batches
        counted, then batch x sequence length, as ``p3d-train`` prints them at start (``cp=16`` after tp, ``ep=8``
        after dp, when > 1)."""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return (
            f"tp={self.tp}{cp} pp={self.pp} dp={self.dp}{ep} ({self.world_size} ranks), {self.micro_batches} micro "
            f"batches of {self.micro_batch_size} x {seq_len} per replica, {self.schedule_name}"
        )

    @property
    def schedule_name(self) -> str:
        """The pipeline schedule with its chunks per rank: ``1f1b``, ``interleaved_1f1b v=4``, ``zbv v=2``."""
        return self.pipeline + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")


def dtype_bytes(cfg: Config) -> int:
    """c: bytes of an activation (and of a weight on DeepSpeed's engine): 4 in fp32, 2 in bf16."""
    return 4 if cfg.train.dtype == DType.fp32 else 2


def world_size(cfg: Config) -> int | None:
    """GPUs of the cluster: nodes x gpus_per_node; None on cpu, where the mesh decides the world."""
    gpn = cfg.cluster.gpus_per_node
    return None if gpn is None else cfg.cluster.nodes * gpn


def layout_of(cfg: Config) -> Layout:
    """The layout the config asks for, modelled even where p3d-train would refuse it.

    dp=auto takes world / (tp cp pp); an explicit dp that disagrees with the cluster is modelled as
    given (tp cp pp dp GPUs). Micro batches m = global_batch / (micro_batch dp), at least 1. The schedule is
    ``schedule.pipeline``; v is ``schedule.virtual_stages``, 2 for zbv and dualpipev. v > 1 with 1f1b or gpipe
    (which p3d-train refuses: they run one chunk per rank) is planned as interleaved_1f1b, and the report's
    notes say so (PlanReport._verdict), as a published Megatron run with virtual stages is. ep is ``mesh.ep`` for
    an MoE model (P3DConfigError where it does not divide dp and the experts: no rank's experts are defined) and 1
    for a dense one (``mesh.ep`` > 1 there is refused by p3d-train, which the report's warnings say). cp is
    ``mesh.cp``; the cp ranks of a replica read its sequences, so m does not depend on cp.
    """
    tp, pp, cp, s = cfg.mesh.tp, cfg.mesh.pp, cfg.mesh.cp, cfg.schedule
    for name, val in (
        ("mesh.tp", tp),
        ("mesh.pp", pp),
        ("mesh.cp", cp),
        ("schedule.micro_batch_size", s.micro_batch_size),
        ("schedule.global_batch_size", s.global_batch_size),
        ("schedule.virtual_stages", virtual_stages(cfg)),
    ):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise P3DConfigError(f"{name}={val!r} must be a positive integer")
    dp = resolve_dp(tp, pp, cfg.mesh.dp, cfg.cluster.nodes, cfg.cluster.gpus_per_node, cp)
    m = max(1, s.global_batch_size // (s.micro_batch_size * dp))
    pipeline, v = str(s.pipeline.value), virtual_stages(cfg)
    if pipeline in V_SHAPED:
        v = 2
    elif pipeline in ("1f1b", "gpipe") and v > 1:
        pipeline = "interleaved_1f1b"
    ep = 1
    if cfg.model.moe is not None:
        check_expert_degree(cfg, dp)
        ep = cfg.mesh.ep
    uneven = uneven_micro_batches(cfg)
    return Layout(
        tp,
        pp,
        dp,
        s.micro_batch_size,
        m,
        v,
        pipeline,
        s.recompute.value,
        cfg.zero.stage,
        ep,
        cp,
        float8_on(cfg),
        uneven,
    )


def apply_layout(cfg: Config, layout: Layout) -> Config:
    """``cfg`` with the mesh (ep and cp too), micro batch, pipeline schedule and chunks, recompute and ZeRO stage of
    ``layout`` (what p3d-train runs for mesh=auto), and sequence parallelism where unset: the layout's default."""
    name = (
        f"tp{layout.tp}_pp{layout.pp}_dp{layout.dp}"
        + (f"_ep{layout.ep}" if layout.ep > 1 else "")
        + (f"_cp{layout.cp}" if layout.cp > 1 else "")
    )
    mesh = dataclasses.replace(
        cfg.mesh, name=name, tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=layout.ep, cp=layout.cp
    )
    sp = cfg.schedule.sequence_parallel
    sched = dataclasses.replace(
        cfg.schedule,
        micro_batch_size=layout.micro_batch_size,
        pipeline=Pipeline[layout.pipeline],
        virtual_stages=layout.virtual_stages,
        recompute=Recompute(layout.recompute),
        sequence_parallel=sequence_parallel_default(cfg, layout.tp, layout.cp) if sp is None else sp,
    )
    zero = cfg.zero
    if zero.stage != layout.zero:
        zero = dataclasses.replace(zero, name=f"stage{layout.zero}", stage=layout.zero)
    return dataclasses.replace(cfg, mesh=mesh, schedule=sched, zero=zero)


def layout_of_run_plan(cfg: Config, run_plan) -> Layout:
    """The layout of a run p3d-train has accepted: tp, pp, dp, cp and the micro batches as its run plan derived
    them (p3d.layout.run_plan.RunPlan), the rest from the config, so that the pre-flight planner models the
    very run that will start and derives nothing again."""
    s = cfg.schedule
    pipeline, v = str(s.pipeline.value), virtual_stages(cfg)
    return Layout(
        run_plan.tp,
        run_plan.pp,
        run_plan.dp,
        s.micro_batch_size,
        run_plan.micro_batches,
        2 if pipeline in V_SHAPED else v,
        pipeline,
        s.recompute.value,
        cfg.zero.stage,
        run_plan.ep if cfg.model.moe is not None else 1,
        run_plan.cp,
        float8_on(cfg),
        len(set(run_plan.replica_micro_batches)) > 1,
    )


def float8_on(cfg: Config) -> bool:
    return recipe(cfg) != "none"


def rank_layers(cfg: Config, layout: Layout) -> list[list[str]]:
    """Per pp rank, the names of the layers it holds: its stage (1f1b, gpipe) or its v chunks (torch schedules).

    Where the p v chunks would outnumber the layers (p3d-train refuses that), the rank's stage is modelled."""
    m, p, v = cfg.model, layout.pp, layout.virtual_stages
    names = layer_names(m.n_layers)
    given = cfg.schedule.stage_blocks  # an uneven split (cluster.groups): the blocks of each piece, as p3d-train cuts
    if given and len(given) == p * v and (v == 1 or layout.pipeline in (*INTERLEAVED, *V_SHAPED)):
        style = "v" if layout.pipeline in V_SHAPED else "loop"
        bounds = stage_bounds(m.n_layers, p, cfg.schedule.partition, m, v, style, blocks=list(given))
        return [[n for c in rank_chunks(p, v, style, r) for n in names[bounds[c] : bounds[c + 1]]] for r in range(p)]
    if (
        v > 1
        and p * v <= max_pieces(m.n_layers, cfg.schedule.partition)
        and layout.pipeline in (*INTERLEAVED, *V_SHAPED)
    ):
        style = "v" if layout.pipeline in V_SHAPED else "loop"
        bounds = stage_bounds(m.n_layers, p, cfg.schedule.partition, m, v, style)
        return [[n for c in rank_chunks(p, v, style, r) for n in names[bounds[c] : bounds[c + 1]]] for r in range(p)]
    bounds = stage_bounds(m.n_layers, p, cfg.schedule.partition, m)
    return [names[bounds[r] : bounds[r + 1]] for r in range(p)]


@dataclass(frozen=True)
class StageParams:
    """Parameters on one rank of a stage, split as p3d's optimizer groups them."""

    matrices: int  # ndim >= 2: weight-decayed group (the routed experts among them)
    vectors: int  # norms, biases: no-decay group
    blocks: int  # transformer blocks on this stage
    layers: tuple[str, ...] = ()
    experts: int = 0  # the routed experts' weights (E / ep per MoE block): reduced and sharded over edp
    moe_blocks: int = 0  # MoE blocks among ``blocks``

    @property
    def total(self) -> int:
        return self.matrices + self.vectors

    @property
    def dense(self) -> int:
        """Every parameter but the routed experts' (attention, norms, router, shared experts, embeddings): over dp."""
        return self.total - self.experts


def block_index(name: str) -> int | None:
    """``block7`` -> 7; None for the embedding, the final norm and the head."""
    return int(name[5:]) if name.startswith("block") else None


def _layer_params(m: ModelConfig, name: str, tp: int, vpad: int) -> tuple[int, int, int]:
    """(matrices, vectors, routed experts among them) of the embedding, the final norm or the head on one tp rank."""
    h = m.hidden_size
    if name == "embed":
        return vpad * h // tp + (m.seq_len * h if m.arch == Arch.gpt else 0), 0, 0
    if name == "head":
        return vpad * h // tp, 0, 0
    assert name == "final_norm", name
    return 0, (h if m.arch == Arch.llama else 2 * h), 0


def _block_params(m: ModelConfig, layer: int, tp: int, ep: int) -> tuple[int, int, int]:
    """(matrices, vectors, routed experts among the matrices) of block ``layer`` on one tp rank of ep rank."""
    routed = m.moe.n_experts // ep * expert_params(m, tp) if m.moe is not None and is_moe_layer(m, layer) else 0
    return attention_params(m, tp) + mlp_params(m, layer, tp, ep=ep), block_vector_params(m, tp), routed


def stage_params(cfg: Config, layout: Layout) -> list[StageParams]:
    """Per stage, the parameters of one tp rank (identical on every tp rank and dp replica; the routed experts of
    each ep rank are others, as many)."""
    m = cfg.model
    vpad = padded_vocab(m.vocab_size, layout.tp)
    kinds: dict[bool, tuple[int, int, int]] = {}  # dense and MoE blocks: each kind counted once
    out = []
    for here in rank_layers(cfg, layout):
        mat = vec = routed = moe = blocks = 0
        for name in here:
            i = block_index(name)
            if i is not None:
                kind = is_moe_layer(m, i)
                if kind not in kinds:
                    kinds[kind] = _block_params(m, i, layout.tp, layout.ep)
                dm, dv, de = kinds[kind]
                blocks, moe = blocks + 1, moe + kind
            elif name == "head" and m.tie_embeddings and "embed" in here:
                continue  # pp=1 (or embed and head on one stage): one tied table
            elif name == "head" and m.tie_embeddings:
                dm, dv, de = vpad * m.hidden_size // layout.tp, 0, 0  # DeepSpeed's tied copy: the embedding table only
            else:
                dm, dv, de = _layer_params(m, name, layout.tp, vpad)
            mat, vec, routed = mat + dm, vec + dv, routed + de
        out.append(StageParams(mat, vec, blocks, tuple(here), routed, moe))
    return out


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
