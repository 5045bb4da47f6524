"""Cross-group rules, checked once in the launcher, and the frozen run plan derived from them.

Every rule raises :class:`P3DConfigError` with one line naming the field, its value and an override
that fixes it. ``build_plan`` returns the numbers every worker needs (dp, micro batches, padded
vocab, stage boundaries, ...) so that no worker derives them again.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from p3d.config.bounds import BOUNDS, Bound
from p3d.config.errors import P3DConfigError
from p3d.config.schema import Arch, Config, DataSource, DType
from p3d.layout.context_rules import check_context, sequence_multiple
from p3d.layout.dims import ParallelDims, degrees_that_fill, largest_divisor_at_most, resolve_dp
from p3d.layout.elastic_rules import check_elastic
from p3d.layout.expert_rules import check_experts
from p3d.layout.fixes import Pins, settle
from p3d.layout.float8_rules import check_float8, recipe
from p3d.layout.geometry import (
    PIECES_RULE,
    active_params,
    layer_names,
    max_pieces,
    padded_vocab,
    stage_bounds,
    total_params,
)
from p3d.layout.hetero import check_group_ranks, fill_groups
from p3d.layout.mesh_fixes import fewer_stages, finer_cuts, suggest_mesh
from p3d.layout.model_rules import check_model
from p3d.layout.schedule_rules import V_SHAPED, check_schedule, chunks_per_rank

__all__ = ["P3DConfigError", "RunPlan", "build_plan"]  # P3DConfigError lives in p3d.config.errors


@dataclass(frozen=True)
class RunPlan:
    world_size: int
    tp: int
    pp: int
    dp: int
    micro_batches: int  # per optimizer step, per dp replica (the largest replica's: replica_micro_batches)
    padded_vocab_size: int  # vocab rounded up to a multiple of tp; padded logits are masked
    tokens_per_step: int
    layer_names: list[str] = field(default_factory=list)  # the flat pipeline layer list
    stage_bounds: list[int] = field(default_factory=list)  # stage s holds layers [b[s], b[s+1])
    procs_per_node: int = 1
    logging_rank: int = 0  # last stage, dp 0, tp 0: where the loss is known (ParallelDims.logging_rank)
    backend: str = "gloo"
    n_params: int = 0  # closed form, unpadded vocab, tied embedding counted once
    ep: int = 1  # expert parallelism, carved from dp (p3d.layout.dims)
    n_active_params: int = 0  # what one token goes through (MoE: the top-k experts); = n_params for a dense model
    cp: int = 1  # context parallelism: each sequence split over cp ranks (p3d.parallel.context)
    # micro batches of each dp replica (schedule.replica_micro_batches; [] in specs before them: micro_batches each)
    replica_micro_batches: list[int] = field(default_factory=list)

    def micro_batches_of(self, dp_rank: int) -> int:
        """The micro batches replica ``dp_rank`` runs per step (``micro_batches`` on an even split)."""
        return self.replica_micro_batches[dp_rank] if self.replica_micro_batches else self.micro_batches

    @property
    def mean_micro_batches(self) -> float:
        """m: the micro batches per replica, on average over the replicas (the global batch's micro batches / dp).
        Each micro batch's loss weighs 1 / m on its replica, and the replicas' gradients are averaged: every micro
        batch of the step weighs 1 / (m dp), the single process's mean over the global batch, whatever each replica
        runs (the even split's 1 / m exactly)."""
        if not self.replica_micro_batches:
            return float(self.micro_batches)
        return sum(self.replica_micro_batches) / self.dp

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(
            tp=self.tp, pp=self.pp, dp=self.dp, procs_per_node=self.procs_per_node, ep=self.ep, cp=self.cp
        )


def fill_derived(cfg: Config) -> Config:
    """The config with what follows from other fields filled in: the cluster numbers and dtype
    (:func:`fill_cluster`), ``schedule.virtual_stages`` from the pipeline and ``schedule.sequence_parallel`` from
    the mesh (:func:`sequence_parallel_default`) when unset."""
    from p3d.layout.schedule_rules import fewest_chunks_per_rank

    cfg = fill_cluster(cfg)
    s = cfg.schedule
    if s.virtual_stages is None:
        s = dataclasses.replace(s, virtual_stages=fewest_chunks_per_rank(str(s.pipeline.value)))
    if s.sequence_parallel is None and cfg.mesh.name != "auto":  # mesh=auto: per layout (p3d.planner apply_layout)
        s = dataclasses.replace(s, sequence_parallel=sequence_parallel_default(cfg, cfg.mesh.tp, cfg.mesh.cp))
    return dataclasses.replace(cfg, schedule=s)


def fill_cluster(cfg: Config) -> Config:
    """The config with every unset cluster number taken from the ``cluster.device`` preset, and
    ``train.dtype=auto`` made fp32 on cpu, bf16 on GPUs."""
    from p3d.config.devices import DEVICES

    c = fill_groups(cfg.cluster)  # a heterogeneous cluster: its groups' numbers, the nodes, the cluster-wide figures
    if c.device not in DEVICES:  # an Enum of DEVICES' keys: only a spec edited by hand gets here
        raise P3DConfigError(
            f"cluster.device={c.device} is not a known device; try one of: "
            + ", ".join(f"cluster.device={d}" for d in sorted(DEVICES))
        )
    preset = DEVICES[c.device]
    filled = {
        f: getattr(preset, f)
        for f in ("gpus_per_node", "peak_tflops", "memory_gb", "intra_node_gbps", "inter_node_gbps")
        if getattr(c, f) is None
    }
    train = cfg.train
    if train.dtype == DType.auto:  # float8 matmuls run inside a bf16 run, on cpu too (p3d.layout.float8_rules)
        fp32 = c.device == "cpu" and recipe(cfg) == "none"
        train = dataclasses.replace(train, dtype=DType.fp32 if fp32 else DType.bf16)
    return dataclasses.replace(cfg, cluster=dataclasses.replace(c, **filled), train=train)


def _world_size(cfg: Config, tp: int, pp: int) -> tuple[int, int]:
    """(world size, dp) from the cluster and mesh: the cluster's GPUs must be exactly tp cp pp dp."""
    cluster, cp = cfg.cluster, cfg.mesh.cp
    gpn = cluster.gpus_per_node
    world = None if gpn is None else cluster.nodes * gpn  # None on cpu: the mesh decides the world
    dp = resolve_dp(tp, pp, cfg.mesh.dp, cluster.nodes, gpn, cp)
    if gpn is not None and world is not None and tp * cp * pp * dp != world:
        names, values = (
            ("mesh.tp*mesh.cp*mesh.pp*mesh.dp", f"{tp}*{cp}*{pp}*{dp}")
            if cp > 1
            else (
                "mesh.tp*mesh.pp*mesh.dp",
                f"{tp}*{pp}*{dp}",
            )
        )
        nodes = math.ceil(tp * cp * pp * dp / gpn)
        raise P3DConfigError(
            f"{names}={values}={tp * cp * pp * dp} must equal the world size {world} "
            f"(cluster.nodes={cluster.nodes} x cluster.gpus_per_node={gpn})",
            [
                "mesh.dp=auto",
                *([f"cluster.nodes={nodes}"] if nodes * gpn == tp * cp * pp * dp else []),
                *degrees_that_fill(world, {"cp": cp, "pp": pp, "tp": tp}, dp),
            ],
        )
    return tp * cp * pp * dp, dp


def _describe(b: Bound) -> str:
    if b.low is not None and b.high is not None:
        return f"must lie in {'(' if b.open_low else '['}{b.low:g}, {b.high:g}{')' if b.open_high else ']'}"
    if b.low is None:
        return f"must be {'<' if b.open_high else '<='} {b.high:g}"
    if b.open_low:
        return "must be positive" if b.low == 0 else f"must be > {b.low:g}"
    return "must be >= 0" if b.low == 0 else f"must be at least {b.low:g}"


def _suggest(b: Bound, value: float, default) -> str:
    """The schema's default where it lies inside the bound (null: the preset's or the code's choice), else
    the nearest value inside it."""
    if default is None or _inside(b, default):
        return "null" if default is None else str(default)
    nearest = b.low if b.low is not None and value < b.low else b.high
    return str(type(value)(nearest if nearest is not None else value))


def _inside(b: Bound, value: float) -> bool:
    low_ok = b.low is None or (value > b.low if b.open_low else value >= b.low)
    return low_ok and (b.high is None or (value < b.high if b.open_high else value <= b.high))


def check_fields(cfg: Config) -> None:
    """Every int and float field against its bound (``p3d.config.bounds.BOUNDS``); NaN and inf are refused."""
    for key, b in BOUNDS.items():
        *path, name = key.split(".")
        owner: object = cfg
        for part in path:  # model.moe.top_k: no owner when model.moe is null (a dense model)
            owner = getattr(owner, part) if owner is not None else None
        if owner is None:
            continue
        value = getattr(owner, name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # null: the preset's or the code's default; a non-number: the field's own rule
        default = getattr(type(owner)(), name)
        if not math.isfinite(value):
            raise P3DConfigError(f"{key}={value} must be a finite number; try {key}={default}")
        if not _inside(b, value):
            raise P3DConfigError(f"{key}={value} {_describe(b)}; try {key}={_suggest(b, value, default)}")


LOGGER_CHOICES = {"name": ("none", "wandb")}  # logger.mode and logger.progress are Enums, checked at compose time


def check_logger(cfg: Config) -> None:
    for name, choices in LOGGER_CHOICES.items():
        value = getattr(cfg.logger, name)
        if value not in choices:
            raise P3DConfigError(
                f"logger.{name}={value} is not one of {', '.join(choices)}; "
                f"try logger.{name}={choices[0] if name != 'name' else 'wandb'}"
            )


def check_config(cfg: Config, pins: Pins | None = None) -> None:
    """What p3d-train and p3d-plan both refuse, whatever the layout: field bounds, the logger, the model's shape.
    A refusal suggests the fixes the same command accepts (``pins``: what it cannot move; p3d.layout.fixes)."""
    try:
        _check_config(cfg)
    except P3DConfigError as exc:
        raise settle(exc, cfg, pins, _config_rules) from None


def _check_config(cfg: Config) -> None:
    check_fields(cfg)
    check_float8(cfg)
    check_logger(cfg)
    check_model(cfg)
    check_faults(cfg)
    check_trace_steps(cfg)


def check_trace_steps(cfg: Config) -> None:
    """Every step of ``train.trace_steps`` is one the run trains: 1 .. train.steps."""
    steps, last = list(cfg.train.trace_steps), cfg.train.steps
    outside = [s for s in steps if not 1 <= s <= last]
    if outside:
        inside = sorted({s for s in steps if 1 <= s <= last}) or [min(2, last)]
        raise P3DConfigError(
            f"train.trace_steps={steps}: step {outside[0]} is not one of this run's steps 1..{last} "
            f"(train.steps={last}); try train.trace_steps=[{','.join(map(str, inside))}]"
        )


def _config_rules(cfg: Config) -> None:
    """check_config's rules and, with a layout given (not mesh=auto), the run plan's: what a fix must pass."""
    _check_config(cfg)
    if cfg.mesh.name != "auto":
        _derive_plan(cfg, None, for_training=False)


def check_faults(cfg: Config) -> None:
    f = cfg.train.spike_factor
    if 0 < f < 1:  # every loss near the median is above f times it: every step would be a spike
        raise P3DConfigError(
            f"train.spike_factor={f:g} flags every loss above {f:g} x the recent median, nearly every step; it is a "
            f"multiple of the median: try train.spike_factor={1 + f:g} ({1 + f:g} x the median), or 0 (off)"
        )


def check_mesh(cfg: Config, tp: int, pp: int) -> None:
    m, s = cfg.model, cfg.schedule
    for name, v in (("tp", tp), ("pp", pp)):
        if not isinstance(v, int) or v < 1:
            raise P3DConfigError(f"mesh.{name}={v!r} must be a positive integer")
    if m.n_heads % tp or m.n_kv_heads % tp:
        ok = largest_divisor_at_most(m.n_kv_heads, tp, m.n_heads)
        raise P3DConfigError(
            f"mesh.tp={tp} must divide model.n_heads={m.n_heads} and model.n_kv_heads={m.n_kv_heads} "
            f"(attention is split by heads); try {suggest_mesh(ok, pp, cfg.mesh.dp)}"
        )
    if m.ffn_hidden_size % tp:
        ok = largest_divisor_at_most(m.ffn_hidden_size, tp, m.n_kv_heads, m.n_heads)
        raise P3DConfigError(
            f"mesh.tp={tp} must divide model.ffn_hidden_size={m.ffn_hidden_size}; "
            f"try {suggest_mesh(ok, pp, cfg.mesh.dp)}"
        )
    pieces = max_pieces(m.n_layers, s.partition)
    if pieces < pp:
        raise P3DConfigError(
            f"mesh.pp={pp} exceeds model.n_layers={m.n_layers}: schedule.partition={s.partition.value} cuts it into at "
            f"most {pieces} stages ({PIECES_RULE[s.partition]})",
            lambda: _fewer_stages_or_finer_cuts(cfg, tp, pp, pieces),
        )
    gpn = cfg.cluster.gpus_per_node
    if gpn is not None and tp > gpn:
        raise P3DConfigError(
            f"mesh.tp={tp} exceeds cluster.gpus_per_node={gpn}: a TP group must stay inside one node",
            lambda: [suggest_mesh(gpn, pp * tp // gpn), suggest_mesh(gpn, pp), f"mesh.tp={gpn}"],
        )


def _fewer_stages_or_finer_cuts(cfg: Config, tp: int, pp: int, pieces: int) -> list[str]:
    """Fixes for more stages than pieces: fewer stages, a partition that cuts finer, more blocks (the model last)."""
    finer, more_blocks = finer_cuts(cfg, pp)
    return [*fewer_stages(cfg, tp, pieces), *finer, more_blocks]


def sequence_parallel_default(cfg: Config, tp: int, cp: int) -> bool:
    """``schedule.sequence_parallel`` when unset: on wherever tp > 1 and the sequence divides over it (and, with
    cp > 1, a rank's s / cp tokens over tp: ``sequence_multiple``), as Megatron-LM's and torchtitan's recipes pair it
    with tensor parallelism. It divides the activations outside the TP regions (norms, residual adds, a stage's
    input) by tp for the same bytes of TP traffic (two all-gathers and two reduce-scatters in place of two
    all-reduces); docs/schedules.md says what it costs on CPU."""
    seq = cfg.model.seq_len
    if not all(isinstance(n, int) and n >= 1 for n in (tp, cp, seq)):
        return False  # a degree the field bounds refuse (check_config), in one line of their own
    return tp > 1 and seq % tp == 0 and (cp == 1 or seq % sequence_multiple(cp, tp, True) == 0)


def check_sequence_parallel(cfg: Config, tp: int) -> None:
    """Sequence parallelism splits the sequence over the tp group: it needs one, and equal blocks."""
    if not cfg.schedule.sequence_parallel:
        return
    if tp == 1:
        raise P3DConfigError(
            "schedule.sequence_parallel=true needs mesh.tp > 1 (it splits the sequence over the tp group); "
            "try schedule.sequence_parallel=false or mesh=tp2"
        )
    seq = cfg.model.seq_len
    if seq % tp:
        raise P3DConfigError(
            f"model.seq_len={seq} must be divisible by mesh.tp={tp} with schedule.sequence_parallel=true; "
            f"try model.seq_len={max(tp, seq // tp * tp)}"
        )


def check_recompute_swiglu(cfg: Config) -> None:
    """The SwiGLU knob adds to selective recompute; full already recomputes whole blocks, none nothing."""
    recompute = cfg.schedule.recompute.value
    if cfg.schedule.recompute_swiglu and recompute != "selective":
        raise P3DConfigError(
            f"schedule.recompute_swiglu=true needs schedule.recompute=selective (it is {recompute}); "
            "try schedule.recompute=selective or schedule.recompute_swiglu=false"
        )


def check_zero(cfg: Config, pp: int, dp: int) -> None:
    """ZeRO-2/3 run FSDP2 on the torch executor's chunks (p3d.parallel.zero.fsdp): what that cannot do. They shard
    over every holder of the parameters, the dp x cp ranks."""
    stage, name, shard = cfg.zero.stage, cfg.schedule.pipeline.value, cfg.zero.shard_size
    degree = "the dp degree" if cfg.mesh.cp == 1 else "the dp x cp degree"
    dp *= cfg.mesh.cp
    if shard is not None and stage < 2:
        raise P3DConfigError(
            f"zero.shard_size={shard} with zero.stage={stage}: only ZeRO-2/3 shard over groups of dp ranks; "
            "try zero=stage3, or zero.shard_size=null"
        )
    if shard is not None and dp % shard:
        raise P3DConfigError(
            f"zero.shard_size={shard} must divide {degree} {dp} (groups of shard_size dp ranks, replicated "
            f"across); try zero.shard_size={max(d for d in range(1, dp + 1) if dp % d == 0 and d <= shard)}"
        )
    if stage < 2:
        return
    if name in V_SHAPED and cfg.model.tie_embeddings:
        raise P3DConfigError(
            f"zero.stage={stage} with schedule.pipeline={name} and model.tie_embeddings=true: the V placement puts "
            "both ends of the tied table in one module shared by two chunks, and FSDP2 shards a module for one "
            "chunk only; try schedule.pipeline=interleaved_1f1b, or model.tie_embeddings=false"
        )


def check_train(cfg: Config) -> None:
    t = cfg.train
    if t.eval_every > 0 and cfg.data.val_fraction <= 0 and cfg.data.source != DataSource.prepared:
        raise P3DConfigError(
            f"data.val_fraction={cfg.data.val_fraction} leaves no validation data for train.eval_every="
            f"{t.eval_every}; try data.val_fraction=0.005, or train.eval_every=0 for no validation"
        )


def check_data(cfg: Config, tokenizer_vocab: int | None) -> None:
    d, m = cfg.data, cfg.model
    if d.source == DataSource.files and not d.path:
        raise P3DConfigError("data.path is not set for data.source=files; try data.path=/path/to/*.jsonl")
    if d.source == DataSource.prepared and not d.path and not d.mix:
        raise P3DConfigError("data.path is not set for data=prepared; try data.path=<a store written by p3d-prepare>")
    if d.mix and d.source != DataSource.prepared:
        raise P3DConfigError(
            f"data.mix is set for data.source={d.source.value}; mixtures are of stores: try data=prepared"
        )
    if d.mix and d.path:
        raise P3DConfigError(
            f"data.path={d.path} is set beside data.mix, which names the stores of a mixture; drop data.path "
            "(data.path=null), or data.mix (data.mix=[]) to train from that one store"
        )
    if tokenizer_vocab is not None and m.vocab_size < tokenizer_vocab:
        raise P3DConfigError(
            f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's {tokenizer_vocab} tokens "
            f"(data.tokenizer={d.tokenizer}); try model.vocab_size={tokenizer_vocab}"
        )


def build_plan(
    cfg: Config, tokenizer_vocab: int | None = None, for_training: bool = True, pins: Pins | None = None
) -> RunPlan:
    """Check every cross-group rule and derive the run plan. Raises P3DConfigError, whose fix the same command
    accepts (``pins``: what it cannot move; p3d.layout.fixes). ``cfg``: typed and its fields checked
    (:func:`check_config`, which p3d.launch.check.typed_config runs once for every command)."""
    try:
        return _derive_plan(cfg, tokenizer_vocab, for_training)
    except P3DConfigError as exc:

        def rules(fixed: Config) -> None:
            _check_config(fixed)
            _derive_plan(fixed, tokenizer_vocab, for_training)

        raise settle(exc, cfg, pins, rules) from None


def _derive_plan(cfg: Config, tokenizer_vocab: int | None, for_training: bool) -> RunPlan:
    if cfg.model.arch != Arch.llama and for_training:
        raise P3DConfigError(
            f"model.arch={cfg.model.arch.value}: the trainer builds llama only "
            "(gpt shapes are for p3d-plan); try model.arch=llama"
        )
    tp, pp = cfg.mesh.tp, cfg.mesh.pp
    check_mesh(cfg, tp, pp)
    world, dp = _world_size(cfg, tp, pp)
    micro_batches = check_schedule(cfg, dp, pp)
    check_sequence_parallel(cfg, tp)
    check_recompute_swiglu(cfg)
    check_zero(cfg, pp, dp)
    check_experts(cfg, dp)
    check_context(cfg, tp)
    check_train(cfg)
    check_data(cfg, tokenizer_vocab)
    check_elastic(cfg, world)  # also: several (simulated) nodes on the local launcher are for elastic runs only
    check_group_ranks(cfg, world)
    backend = "gloo" if cfg.cluster.device == "cpu" else "nccl"
    dims = ParallelDims(tp, pp, dp, ep=cfg.mesh.ep, cp=cfg.mesh.cp)
    # cpu workers on several nodes: spread evenly (p3d.jobs.slurm.submit.job_shape refuses an uneven split)
    per_node = world // cfg.cluster.nodes if world % cfg.cluster.nodes == 0 else world
    blocks = cfg.schedule.stage_blocks if chunks_per_rank(cfg) == 1 else None  # one chunk per rank: pp stages
    return RunPlan(
        world_size=world,
        tp=tp,
        pp=pp,
        dp=dp,
        micro_batches=micro_batches,
        padded_vocab_size=padded_vocab(cfg.model.vocab_size, tp),
        tokens_per_step=cfg.schedule.global_batch_size * cfg.model.seq_len,
        layer_names=layer_names(cfg.model.n_layers),
        stage_bounds=stage_bounds(cfg.model.n_layers, pp, cfg.schedule.partition, cfg.model, blocks=blocks),
        procs_per_node=cfg.cluster.gpus_per_node or per_node,
        logging_rank=dims.logging_rank,
        backend=backend,
        n_params=total_params(cfg.model),
        ep=cfg.mesh.ep,
        n_active_params=active_params(cfg.model),
        cp=cfg.mesh.cp,
        replica_micro_batches=list(cfg.schedule.replica_micro_batches) or [micro_batches] * dp,
    )
