"""The rules of ``schedule.*`` that depend on the pipeline schedule (docs/schedules.md, Refusals).

``schedule.pipeline=1f1b`` (the default) is DeepSpeed's PipelineEngine: one chunk per pp rank, m >= p micro
batches. The other schedules run ``torch.distributed.pipelining`` over mesh.pp x v chunks
(``p3d/train/executors/torch_pipeline.py``); each rule below says which line of torch (2.13,
``pipelining/schedules.py``) or which measurement it comes from. Every rule raises :class:`P3DConfigError` with
one line: field, value, fix.
"""

from __future__ import annotations

import math

from p3d.config.errors import P3DConfigError
from p3d.config.schema import Config, Recompute
from p3d.layout.dims import resolve_dp
from p3d.layout.float8_rules import recipe
from p3d.layout.geometry import PIECES_RULE, max_pieces
from p3d.layout.mesh_fixes import fewer_stages, finer_cuts

INTERLEAVED = ("interleaved_1f1b", "interleaved_zero_bubble")  # loop placement, v >= 2
V_SHAPED = ("zbv", "dualpipev")  # V placement, exactly 2 chunks per rank (schedules.py:3249, :3435)
IW_SPLIT = ("interleaved_zero_bubble", "zbv", "dualpipev")  # backward split into I (dx) and W (dw) passes
TORCH_PIPELINES = (*INTERLEAVED, *V_SHAPED, "gpipe")


def pipeline_name(cfg: Config) -> str:
    return str(cfg.schedule.pipeline.value)


def runs_on_deepspeed(cfg: Config) -> bool:
    """Whether DeepSpeed's pipeline engine runs ``cfg`` (else torch's pipelining): ``engine_runs`` of its schedule,
    ZeRO stage, ep, cp, micro batches per replica and float8, the one rule the launcher, the run spec's DeepSpeed
    JSON and the planner (``p3d.planner.shapes.Layout.torch_executor``) all follow."""
    fp8 = recipe(cfg) != "none"
    return engine_runs(pipeline_name(cfg), cfg.zero.stage, cfg.mesh.ep, cfg.mesh.cp, uneven_micro_batches(cfg), fp8)


def engine_runs(pipeline: str, zero: int, ep: int, cp: int, uneven: bool, fp8: bool) -> bool:
    """The executor follows from the config: DeepSpeed's engine runs ``1f1b`` with ZeRO 0-1; torch's pipelining
    runs every other schedule, and ``1f1b`` (its Schedule1F1B) with ZeRO-2/3, which DeepSpeed's pipeline engine
    refuses (FSDP2 shards over dp there: p3d.parallel.zero.fsdp), and with expert parallelism (mesh.ep > 1):
    DeepSpeed's engine reduces every gradient over the whole dp group and shards ZeRO-1 over it, and does it
    over expert groups only for its own MoE layer class and group registry (docs/moe.md); and with context
    parallelism (mesh.cp > 1), whose gradients reduce over dp x cp ranks that its topology has no axis for; and
    with uneven micro batches per replica (``uneven``: ``schedule.replica_micro_batches``): DeepSpeed's engine scales
    the loss by one accumulation count and averages the gradients over dp, which weighs a micro batch of a replica
    that runs fewer more heavily (torch's schedules take one count per replica, p3d weighs the loss itself); and with
    float8 matmuls (``fp8``: ``train.fp8``): DeepSpeed's bf16 engine keeps bf16 weights in its modules, the torch
    executor fp32 masters under autocast, which each float8 weight cast reads once a step (p3d.parallel.tp.float8)."""
    return not uneven and not fp8 and pipeline == "1f1b" and zero < 2 and ep == 1 and cp == 1


def executor_name(deepspeed: bool) -> str:
    """How messages name the executor (``runs_on_deepspeed``'s answer)."""
    return "DeepSpeed's engine" if deepspeed else "torch's executor"


def fewest_chunks_per_rank(pipeline: str) -> int:
    """``schedule.virtual_stages`` when the config leaves it unset: the fewest chunks the schedule runs per rank."""
    return 2 if pipeline in (*INTERLEAVED, *V_SHAPED) else 1


def virtual_stages(cfg: Config) -> int:
    """``schedule.virtual_stages`` as given, or derived from the pipeline when unset."""
    given = cfg.schedule.virtual_stages
    return given if given is not None else fewest_chunks_per_rank(pipeline_name(cfg))


def chunks_per_rank(cfg: Config) -> int:
    """v: the chunks each pp rank runs (1 for 1f1b and gpipe, 2 for the V schedules)."""
    name = pipeline_name(cfg)
    return virtual_stages(cfg) if name in INTERLEAVED else 2 if name in V_SHAPED else 1


def uneven_micro_batches(cfg: Config) -> bool:
    """Whether ``schedule.replica_micro_batches`` gives the dp replicas different micro batch counts."""
    return len(set(cfg.schedule.replica_micro_batches)) > 1


def check_replica_micro_batches(cfg: Config, dp: int) -> list[int]:
    """``schedule.replica_micro_batches``: one count per dp replica, each at least 1, that together make the global
    batch. Returns the counts."""
    s = cfg.schedule
    counts, field = list(s.replica_micro_batches), "schedule.replica_micro_batches"
    total = s.global_batch_size // s.micro_batch_size
    even = [total // dp + (1 if d < total % dp else 0) for d in range(dp)] if total >= dp else [1] * dp
    fix = f"try {field}=[{','.join(map(str, even))}]"
    if len(counts) != dp:
        named = f"{len(counts)} replica" + ("" if len(counts) == 1 else "s")
        raise P3DConfigError(f"{field}={counts} names {named}, mesh.dp={dp} has {dp}; {fix}")
    if min(counts) < 1:
        raise P3DConfigError(f"{field}={counts}: every replica needs at least one micro batch; {fix}")
    if sum(counts) * s.micro_batch_size != s.global_batch_size:
        raise P3DConfigError(
            f"{field}={counts} x schedule.micro_batch_size={s.micro_batch_size} = "
            f"{sum(counts) * s.micro_batch_size} sequences, not schedule.global_batch_size={s.global_batch_size}; "
            + (fix if s.global_batch_size % s.micro_batch_size == 0 else "the global batch must be whole micro batches")
        )
    if len(set(counts)) > 1 and cfg.mesh.ep > 1:
        raise P3DConfigError(
            f"{field}={counts} with mesh.ep={cfg.mesh.ep}: the ranks of an expert group exchange tokens at every micro "
            "batch, so they must run as many; try mesh.ep=1 or an even split"
        )
    if len(set(counts)) > 1 and cfg.zero.stage >= 3:  # measured: gloo paired the mismatched calls, step 1 was wrong
        raise P3DConfigError(
            f"{field}={counts} with zero.stage={cfg.zero.stage}: FSDP2 gathers the parameters over dp in every micro "
            "batch's forward, so the replicas must run as many; try zero.stage=2 or an even split"
        )
    return counts


def check_stage_blocks(cfg: Config, pp: int) -> None:
    """``schedule.stage_blocks``: the blocks of each of the mesh.pp x v pipeline pieces, in chunk order; they add up to
    the model's blocks, and every piece but the first and the last (which hold the embedding and the head) has one."""
    blocks, n_layers = list(cfg.schedule.stage_blocks), cfg.model.n_layers
    if not blocks:
        return
    pieces, field = pp * chunks_per_rank(cfg), "schedule.stage_blocks"
    base, extra = divmod(n_layers, pieces)
    even = ",".join(str(base + (1 if i < extra else 0)) for i in range(pieces))
    fix = f"try {field}=[{even}]" if base >= 1 else f"try {field}=[] ({pieces} pieces exceed the model's blocks)"
    if len(blocks) != pieces:
        what = "mesh.pp" if pieces == pp else f"mesh.pp x {chunks_per_rank(cfg)} chunks per rank"
        raise P3DConfigError(f"{field}={blocks} names {len(blocks)} pipeline pieces, {what} = {pieces}; {fix}")
    if sum(blocks) != n_layers:
        raise P3DConfigError(f"{field}={blocks} holds {sum(blocks)} blocks, model.n_layers={n_layers}; {fix}")
    if min(blocks) < 0:
        raise P3DConfigError(f"{field}={blocks}: a piece cannot hold {min(blocks)} blocks; {fix}")
    if (pieces > 2 and min(blocks[1:-1]) < 1) or (pieces == 1 and blocks[0] < 1):
        raise P3DConfigError(
            f"{field}={blocks}: every piece but the first and the last (the embedding's and the head's) needs a block; "
            f"{fix}"
        )


def fewer_chunks(cfg: Config, pp: int, per_rank: int) -> list[str]:
    """Fixes for more chunks than the layer list has pieces (pp ranks x ``per_rank`` chunks): fewer chunks per rank
    (interleaved schedules), a partition that cuts finer, fewer stages, or more blocks; p3d.layout.fixes keeps
    those the command accepts."""
    pieces, fixes = max_pieces(cfg.model.n_layers, cfg.schedule.partition), []
    if pipeline_name(cfg) in INTERLEAVED:
        fixes += [f"schedule.virtual_stages={k}" for k in range(min(pieces // pp, per_rank - 1), 1, -1)]
    finer, more_blocks = finer_cuts(cfg, pp * per_rank)
    fixes += [*finer, *fewer_stages(cfg, cfg.mesh.tp, pieces // per_rank)]
    return [*fixes, more_blocks]  # the model's shape last: a resume may not change it


def check_schedule(cfg: Config, dp: int, pp: int) -> int:
    """Batch arithmetic and the pipeline schedule's rules. Returns the number of micro batches per step per replica
    (with ``schedule.replica_micro_batches``: the largest)."""
    s = cfg.schedule
    per_round = s.micro_batch_size * dp
    if s.replica_micro_batches:
        counts = check_replica_micro_batches(cfg, dp)
    elif s.global_batch_size < per_round or s.global_batch_size % per_round:
        ok = max(per_round * pp, math.ceil(s.global_batch_size / per_round) * per_round)
        raise P3DConfigError(
            f"schedule.global_batch_size={s.global_batch_size} must be a multiple of schedule.micro_batch_size x dp "
            f"= {s.micro_batch_size} x {dp} = {per_round}; try schedule.global_batch_size={ok}"
        )
    else:
        counts = [s.global_batch_size // per_round]
    check_pipeline(cfg, pp, dp)
    check_stage_blocks(cfg, pp)
    for micro_batches in sorted(set(counts)):
        _check_micro_batches(cfg, micro_batches, pp, per_round, uneven=len(set(counts)) > 1)
    return max(counts)


def _check_micro_batches(cfg: Config, micro_batches: int, pp: int, per_round: int, uneven: bool) -> None:
    """One replica's micro batch count against the schedule's needs (``uneven``: the counts are the replicas' own)."""
    s, name = cfg.schedule, pipeline_name(cfg)
    where = (
        f"schedule.replica_micro_batches={list(s.replica_micro_batches)} gives a replica {micro_batches} micro batches"
        if uneven
        else f"schedule.global_batch_size={s.global_batch_size} gives {micro_batches} micro batches per replica"
    )
    need = 2 * pp if name == "dualpipev" else pp
    if micro_batches < need:
        why = (
            "dualpipev needs at least 2 x mesh.pp micro batches, one per chunk (torch refuses fewer, schedules.py:3440)"
            if name == "dualpipev"
            else f"{'1F1B' if name == '1f1b' else name} needs at least pp to fill the pipeline"
        )
        fix = f"give every replica at least {need}" if uneven else f"try schedule.global_batch_size={per_round * need}"
        raise P3DConfigError(
            f"{where}, fewer than {'2 x ' if name == 'dualpipev' else ''}mesh.pp={pp} stages: {why}; {fix}"
        )
    if name in INTERLEAVED:
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            ok = math.ceil(micro_batches / pp) * pp * per_round
            fix = (
                "give every replica a multiple of mesh.pp"
                if uneven
                else f"try schedule.global_batch_size={ok} (m a multiple of mesh.pp)"
            )
            raise P3DConfigError(
                f"{where}: {name} runs them in rounds of max(1, m // mesh.pp) = {rounds}, which must divide m "
                f"(torch's rule, schedules.py:2934); {fix}"
            )


def check_pipeline(cfg: Config, pp: int, dp: int) -> None:
    """schedule.pipeline against mesh.pp, virtual_stages, the model's blocks, ZeRO, recompute, compile, dtype."""
    s, name = cfg.schedule, pipeline_name(cfg)
    v = virtual_stages(cfg)
    if name in ("1f1b", "gpipe"):
        if v != 1:
            runs = "DeepSpeed's 1F1B runs" if name == "1f1b" else "gpipe runs"
            raise P3DConfigError(
                f"schedule.virtual_stages={v} with schedule.pipeline={name}: {runs} one chunk per pp rank; "
                "try schedule.pipeline=interleaved_1f1b or schedule.virtual_stages=1"
            )
        if name == "1f1b":
            return
    if pp < 2:
        raise P3DConfigError(
            f"schedule.pipeline={name} needs mesh.pp >= 2 (it schedules pipeline stages; mesh.pp={pp}); "
            "try schedule.pipeline=1f1b or mesh=pp2"
        )
    if name in INTERLEAVED and v < 2:
        raise P3DConfigError(
            f"schedule.virtual_stages={v} with schedule.pipeline={name}: interleaving needs at least 2 chunks per "
            "pp rank; try schedule.virtual_stages=2"
        )
    if name in V_SHAPED and v != 2:
        raise P3DConfigError(
            f"schedule.virtual_stages={v} with schedule.pipeline={name}: V schedules place exactly two chunks per "
            "rank (torch schedules.py:3249); try schedule.virtual_stages=2"
        )
    chunks = pp * (2 if name in V_SHAPED else v)
    pieces, n_layers = max_pieces(cfg.model.n_layers, s.partition), cfg.model.n_layers
    if pieces < chunks:
        raise P3DConfigError(
            f"mesh.pp x chunks per rank = {chunks} chunks of schedule.pipeline={name} exceed the {pieces} pieces "
            f"schedule.partition={s.partition.value} can cut model.n_layers={n_layers} into "
            f"({PIECES_RULE[s.partition]})",
            lambda: fewer_chunks(cfg, pp, chunks // pp),
        )
    if name in IW_SPLIT and s.recompute == Recompute.full:
        raise P3DConfigError(
            f"schedule.recompute=full with schedule.pipeline={name}: its split W pass reruns every checkpointed "
            "block once per weight (measured: 8 block forwards a micro batch, not 2); "
            "try schedule.recompute=selective or schedule.pipeline=interleaved_1f1b"
        )
    if name in IW_SPLIT and cfg.model.compile:
        raise P3DConfigError(
            f"model.compile=true with schedule.pipeline={name}: torch refuses compiled stage modules under the "
            "I/W-split schedules (schedules.py:3816); try model.compile=false or schedule.pipeline=interleaved_1f1b"
        )


def check_split(cfg: Config) -> None:
    """The uneven split a config names (``schedule.stage_blocks``, ``schedule.replica_micro_batches``), checked as
    p3d-train checks it: p3d-plan models the layout as given and cannot model a split that does not add up, where
    it only warns of the other rules p3d-train would refuse by."""
    c, m = cfg.cluster, cfg.mesh
    if cfg.schedule.replica_micro_batches:
        check_replica_micro_batches(cfg, resolve_dp(m.tp, m.pp, m.dp, c.nodes, c.gpus_per_node, m.cp))
    check_stage_blocks(cfg, m.pp)
