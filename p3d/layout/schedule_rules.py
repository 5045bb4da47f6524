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
from p3d.layout.geometry import PIECES_RULE, max_pieces
from p3d.layout.mesh_fixes import fewer_stages, finer_cuts

INTERLEAVED = ("interleaved_1f1b", "interleaved_zero_bubble")  # loop placement, v >= 2
V_SHAPED = ("zbv", "dualpipev")  # V placement, exactly 2 chunks per rank (schedules.py:3249, :3435)
IW_SPLIT = ("interleaved_zero_bubble", "zbv", "dualpipev")  # backward split into I (dx) and W (dw) passes
TORCH_PIPELINES = (*INTERLEAVED, *V_SHAPED, "gpipe")


def pipeline_name(cfg: Config) -> str:
    return str(cfg.schedule.pipeline.value)


def runs_on_deepspeed(cfg: Config) -> bool:
    """The executor follows from the config: DeepSpeed's engine runs ``1f1b`` with ZeRO 0-1; torch's pipelining
    runs every other schedule, and ``1f1b`` (its Schedule1F1B) with ZeRO-2/3, which DeepSpeed's pipeline engine
    refuses (FSDP2 shards over dp there: p3d.parallel.zero.fsdp), and with expert parallelism (mesh.ep > 1):
    DeepSpeed's engine reduces every gradient over the whole dp group and shards ZeRO-1 over it, and does it
    over expert groups only for its own MoE layer class and group registry (docs/moe.md); and with context
    parallelism (mesh.cp > 1), whose gradients reduce over dp x cp ranks that its topology has no axis for."""
    return pipeline_name(cfg) == "1f1b" and cfg.zero.stage < 2 and cfg.mesh.ep == 1 and cfg.mesh.cp == 1


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
    """Batch arithmetic and the pipeline schedule's rules. Returns the number of micro batches per step per replica."""
    s = cfg.schedule
    per_round = s.micro_batch_size * dp
    if s.global_batch_size < per_round or s.global_batch_size % per_round:
        ok = max(per_round * pp, math.ceil(s.global_batch_size / per_round) * per_round)
        raise P3DConfigError(
            f"schedule.global_batch_size={s.global_batch_size} must be a multiple of schedule.micro_batch_size x dp "
            f"= {s.micro_batch_size} x {dp} = {per_round}; try schedule.global_batch_size={ok}"
        )
    micro_batches = s.global_batch_size // per_round
    check_pipeline(cfg, pp, dp)
    name = pipeline_name(cfg)
    need = 2 * pp if name == "dualpipev" else pp
    if micro_batches < need:
        why = (
            "dualpipev needs at least 2 x mesh.pp micro batches, one per chunk (torch refuses fewer, schedules.py:3440)"
            if name == "dualpipev"
            else f"{'1F1B' if name == '1f1b' else name} needs at least pp to fill the pipeline"
        )
        raise P3DConfigError(
            f"schedule.global_batch_size={s.global_batch_size} gives {micro_batches} micro batches per replica, fewer "
            f"than {'2 x ' if name == 'dualpipev' else ''}mesh.pp={pp} stages: {why}; "
            f"try schedule.global_batch_size={per_round * need}"
        )
    if name in INTERLEAVED:
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            ok = math.ceil(micro_batches / pp) * pp * per_round
            raise P3DConfigError(
                f"schedule.global_batch_size={s.global_batch_size} gives {micro_batches} micro batches per replica: "
                f"{name} runs them in rounds of max(1, m // mesh.pp) = {rounds}, which must divide m "
                f"(torch's rule, schedules.py:2934); try schedule.global_batch_size={ok} (m a multiple of mesh.pp)"
            )
    return micro_batches


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
