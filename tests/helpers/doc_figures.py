"""The planner's figures the docs quote, each with the command that prints it (tests/unit/test_doc_figures.py reruns
every one and compares; issue 64, item 13).

A figure a page quotes from ``p3d-plan`` or a dry run is either in ``QUOTES`` (its page, the command, and how the
figure is written from the command's result) or in ``BLOCKS`` (an output block shown whole, line for line). When the
planner's model or a default moves a figure, the test names the page, the command and the figure it prints now: update
the page (and the entry, where its wording changes).

Commands are run in-process, as p3d-plan composes them: ``p3d-plan ...`` gives a ``Prediction`` (p3d.planner.predict);
``p3d-train ... dry_run=true`` the prediction the dry run prints (``predict(cfg, run_plan)``, its memory table and
verdict; the meta-device build is the dry run's own tests'); ``published <row> ...`` a row of
tests/helpers/published.py with more overrides, predicted as p3d-plan would.
"""

from __future__ import annotations

import functools
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GB = 1e9


@dataclass(frozen=True)
class Quote:
    page: str
    command: str
    figures: Callable[[Any, Any], list[str]]  # (cfg, result) -> the texts the page holds
    slow: bool = False  # a mesh=auto over many GPUs (seconds): the slow tier


@dataclass(frozen=True)
class Block:
    page: str
    command: str
    after: str  # the page's line that introduces the block (indented six spaces, as p3d-plan prints it)


@functools.cache
def run(command: str) -> tuple[Any, Any]:
    """(the command's config, its result)."""
    from p3d.planner import predict
    from tests.helpers.runs import compose_config, typed

    prog, *words = shlex.split(command)
    if prog == "published":
        from tests.helpers.published import ROWS

        cfg = compose_config(*ROWS[words[0]].overrides, *words[1:])
        return cfg, predict(cfg)
    words = [w for w in words if not w.startswith("format=")]
    if prog == "p3d-plan":
        cfg = compose_config(*words)
        return cfg, predict(cfg)
    assert prog == "p3d-train" and "dry_run=true" in words, command
    cfg, plan = typed(*words)
    return cfg, predict(cfg, plan)


def _layout(r) -> str:
    lay = r.layout
    cp = f" x cp {lay.cp}" if lay.cp > 1 else ""
    chunks = f" with {lay.virtual_stages} interleaved chunks" if lay.virtual_stages > 1 else ""
    return f"tp {lay.tp}{cp} x pp {lay.pp} x dp {lay.dp}{chunks}, micro batch {lay.micro_batch_size}"


def _throughput(r) -> list[str]:
    return [f"{r.step_time_s:.2f} s a step", f"{r.tflops_per_gpu:.1f} TFLOP/s per GPU (MFU {r.mfu:.1%})"]


def _most_loaded(r) -> str:
    return f"{r.worst.total / GB:.1f} GB"


def _error(r, published_tflops: float) -> str:
    return f"{r.tflops_per_gpu:.1f} TFLOP/s ({r.tflops_per_gpu / published_tflops - 1:+.0%})"


def _params(cfg, _r) -> list[str]:
    from p3d.layout.geometry import active_params, total_params

    return [f"{total_params(cfg.model) / 1e9:.2f}B / {active_params(cfg.model) / 1e9:.2f}B"]


def _param_cells(cfg, _r) -> list[str]:
    """The two cells of moe.md's table: total and active, each as ``| 46.70B |``."""
    from p3d.layout.geometry import active_params, total_params

    return [f"| {total_params(cfg.model) / 1e9:.2f}B |", f"| {active_params(cfg.model) / 1e9:.2f}B |"]


def _candidates(cfg, _r) -> list[str]:
    from collections import Counter

    from p3d.planner.search import candidates

    found = candidates(cfg)
    per_ep = Counter(lay.ep for lay in found)
    return [f"{len(found):,} at", " / ".join(f"{per_ep[ep]:,}" for ep in sorted(per_ep))]


def _a2a(_cfg, r) -> list[str]:
    e = r.to_json()["experts"]
    ep = e["ep"]
    rows = e["a2a_bytes_sent"] * ep / (ep - 1)
    one = e["a2a_s_per_layer_per_micro_batch"] / e["a2a_per_layer_per_micro_batch"]
    share = r.breakdown["a2a_comm"] / r.step_time_s
    return [f"{rows / 1e6:.1f} MB of rows per all-to-all", f"{one * 1e3:.2f} ms on the", f"{share:.0%} of the step"]


def _kv(_cfg, r) -> list[str]:
    c = r.to_json()["context"]
    share = r.breakdown["kv_comm"] / r.step_time_s
    return [
        f"{c['kv_bytes_per_collective'] / 2**20:.0f} MiB per collective",
        f"{c['kv_bytes_sent_per_layer_per_micro_batch'] / 1e6:.1f} MB sent per GPU per layer and micro batch",
        f"{c['kv_s_per_layer_per_micro_batch'] * 1e3:.2f} ms on the NICs",
        f"{share:.0%} of the step",
    ]


def _split(_cfg, r) -> list[str]:
    p = r.hetero
    lay = p.layout
    return [
        f"tp{lay.tp} pp{lay.pp} dp{lay.dp} ZeRO-{lay.zero}",
        f"`schedule.replica_micro_batches=[{','.join(map(str, p.replica_micro_batches))}]`",
        f"{p.step_s:.2f} s a step against {p.uniform_step_s:.2f} s for the uniform split "
        f"({p.uniform_step_s / p.step_s:.2f}x)",
        f"{max(u for _, u, _ in p.group_memory) / GB:.1f} GB of 80",
        f"{p.gap:+.1%} from the ideal ({p.ideal_step_s:.2f} s)",
    ]


def _cpu_split(_cfg, r) -> list[str]:
    p = r.hetero
    lay = p.layout
    blocks = " + ".join(map(str, p.stage_blocks))
    return [f"pp{lay.pp} dp{lay.dp} with {blocks} blocks, {p.step_s:.3f} s, {p.gap:+.1%}"]


def _hetero_steps(_cfg, r) -> list[str]:
    return [f"{r.hetero.step_s:.3f} s", f"{r.hetero.uniform_step_s:.3f} s"]


def _dry_405b(_cfg, r) -> list[str]:
    w = r.worst
    return [
        f"{w.total / GB:.2f} GB of the 80 GB",
        f"{w.activation_bytes / GB:.2f} GB of activations per micro batch",
        f"{w.attention_bytes / GB:.2f} GB of the attention's working set",
    ]


def _dry_405b_ring(_cfg, r) -> list[str]:
    w = r.worst
    return [f"{w.total / GB:.2f} GB with `context.attention=ring` ({w.attention_bytes / GB:.2f} GB of working set)"]


def _dry_405b_bare(_cfg, r) -> list[str]:
    w = r.worst
    one = r.stages[1]
    return [
        f"{w.total / GB:.1f} GB ({w.activation_bytes / GB:.1f} GB of activations per micro batch, "
        f"{one.in_flight:g} in flight on stage 1)"
    ]


PLAN_70B = "p3d-plan mesh=tp8_pp8 model=llama70b cluster=h100_sxm cluster.nodes=8 schedule=large"
DRY_405B = (  # docs/context.md's line
    "p3d-train model=llama3_1_405b model.seq_len=131072 mesh.tp=8 mesh.cp=16 mesh.pp=16 mesh.dp=8 cluster=h100_sxm "
    "cluster.nodes=2048 schedule.micro_batch_size=1 schedule.global_batch_size=128 schedule.sequence_parallel=true "
    "zero=stage1 schedule.recompute=full dry_run=true"
)
DP_LINE = (
    "p3d-plan model=llama3_8b cluster=h100_sxm mesh.tp=2 mesh.pp=2 mesh.dp=2 schedule.pipeline=interleaved_1f1b "
    "zero=stage1"
)
PLAN_405B_131K = (
    "p3d-plan model=llama3_1_405b model.seq_len=131072 mesh.tp=8 mesh.cp=16 mesh.pp=16 mesh.dp=8 cluster=h100_sxm "
    "cluster.nodes=2048 schedule.micro_batch_size=1 schedule.global_batch_size=128 schedule.pipeline=interleaved_1f1b "
    "schedule.virtual_stages=8 zero=stage1 plan.overlap_pp=true plan.overlap_dp=true"
)
GROUPS_CPU = (
    "'cluster.groups=[{device: cpu, nodes: 1}, {device: cpu, nodes: 1, peak_tflops: 0.035}]' mesh=auto "
    "cluster.gpus_per_node=2 model=tiny model.n_layers=4 schedule.global_batch_size=8 plan.block_seconds=0.01"
)
BENCH_GROUPS = "'cluster.groups=[{device: cpu, nodes: 1}, {device: cpu, nodes: 1, peak_tflops: 0.05}]'"
TIMING_GROUPS = (
    "'cluster.groups=[{device: cpu, nodes: 1}, {device: cpu, nodes: 1, peak_tflops: 0.025}]' cluster.gpus_per_node=1 "
    "mesh=auto model=tiny model.n_layers=4 schedule.global_batch_size=8 plan.block_seconds=0.05"
)

BLOCKS = [Block("docs/planner.md", PLAN_70B, "The first prints")]

QUOTES = [
    # docs/planner.md
    Quote(
        "docs/planner.md",
        "p3d-plan model=llama3_1_405b mesh=auto cluster=h100_sxm cluster.nodes=1024 schedule=large format=json",
        lambda _c, r: [_layout(r), *_throughput(r), f"{_most_loaded(r)} on the most loaded GPU"],
        slow=True,
    ),
    Quote(
        "docs/planner.md",
        f"{PLAN_70B} plan.efficiency=0.55",
        lambda _c, r: [f"{r.step_time_s:.1f} s, {r.tflops_per_gpu:.1f} TFLOP/s"],
    ),
    Quote(
        "docs/planner.md",
        "p3d-plan model=mixtral_8x7b cluster=h100_64 mesh=auto schedule.global_batch_size=512",
        _candidates,
        slow=True,
    ),
    Quote(
        "docs/planner.md",
        "p3d-plan model=mixtral_8x7b cluster=h100_64 mesh.tp=8 mesh.pp=1 mesh.dp=auto mesh.ep=8",
        _a2a,
    ),
    Quote(
        "docs/planner.md",
        "p3d-plan model=mixtral_8x7b cluster=h100_64 mesh.tp=8 mesh.pp=1 mesh.dp=auto mesh.ep=8",
        _params,
    ),
    Quote(
        "docs/planner.md", "p3d-plan model=deepseek_moe_16b cluster=h100_64 mesh.tp=2 mesh.pp=4 mesh.dp=auto", _params
    ),
    Quote("docs/planner.md", DRY_405B.replace("p3d-train", "p3d-plan").replace(" dry_run=true", ""), _kv),
    Quote("docs/planner.md", PLAN_405B_131K, lambda _c, r: [_error(r, 380), f"{_most_loaded(r)} on a GPU"]),
    Quote(
        "docs/planner.md",
        f"{PLAN_405B_131K} schedule.recompute=full",
        lambda _c, r: [f"with full recompute {_error(r, 380)} in {_most_loaded(r)}"],
    ),
    Quote(
        "docs/planner.md",
        "p3d-plan model=llama3_8b model.seq_len=131072 cluster=h100_sxm cluster.nodes=1 mesh=auto",
        lambda _c, r: [f"proposes cp {r.layout.cp} x tp {r.layout.tp}"],
    ),
    Quote("docs/planner.md", "published L3-405B-8192", lambda _c, r: [f"({_most_loaded(r)} on the most loaded stage)"]),
    Quote(
        "docs/planner.md",
        "published L3-405B-8192 schedule.recompute=full",
        lambda _c, r: [f"with full recompute the planner predicts {_error(r, 430)}"],
    ),
    Quote(
        "docs/planner.md",
        "published DGXC-NEMOTRON4-340B-128",
        lambda _c, r: [f"predicted at {_most_loaded(r)} on stage {r.worst.stage}"],
    ),
    Quote(
        "docs/planner.md",
        "published DGXC-NEMOTRON4-340B-128",
        lambda _c, r: [f"{r.step_time_s:.2f} s against 4.77 s at 128 GPUs: {r.breakdown['compute']:.2f} s of compute"],
    ),
    Quote(
        "docs/planner.md",
        "published DGXC-NEMOTRON4-340B-128 plan.overlap_tp=false",
        lambda _c, r: [f"without `overlap_tp` it would be {r.step_time_s:.2f} s, {r.step_time_s / 4.77 - 1:+.1%}"],
    ),
    Quote(
        "docs/planner.md",
        "published DGXC-NEMOTRON4-15B-64 plan.overlap_tp=false",
        lambda _c, r: [f"{r.step_time_s / 2.86 - 1:+.1%} without `overlap_tp`"],
    ),
    # docs/context.md: the 131K dry run, as written and two variants
    Quote("docs/context.md", DRY_405B, _dry_405b),
    Quote("docs/context.md", DRY_405B.replace(" dry_run=true", " context.attention=ring dry_run=true"), _dry_405b_ring),
    Quote(
        "docs/context.md",
        DRY_405B.replace("sequence_parallel=true zero=stage1 schedule.recompute=full", "sequence_parallel=false"),
        _dry_405b_bare,
    ),
    # docs/overlap.md
    Quote(
        "docs/overlap.md",
        DP_LINE,
        lambda _c, r: [next(x.strip() for x in r.render().splitlines() if x.strip().startswith("dp_comm"))],
    ),
    # docs/moe.md
    Quote(
        "docs/moe.md",
        "p3d-train model=mixtral_8x7b mesh.tp=4 mesh.pp=4 mesh.dp=4 mesh.ep=4 schedule.global_batch_size=64 "
        "cluster=h100_sxm cluster.nodes=8 dry_run=true",
        _param_cells,
    ),
    Quote(
        "docs/moe.md", "p3d-plan model=deepseek_moe_16b cluster=h100_64 mesh.tp=2 mesh.pp=4 mesh.dp=auto", _param_cells
    ),
    # docs/clusters.md
    Quote("docs/clusters.md", "p3d-plan cluster=mixed_h100_a100 model=llama3_8b mesh=auto", _split),
    Quote("docs/clusters.md", f"p3d-plan {GROUPS_CPU}", _cpu_split),
    # docs/benchmarks.md: p3d-plan's columns of bench/hetero.py, and tests/e2e/test_hetero_timing.py's mesh=auto run
    Quote(
        "docs/benchmarks.md",
        f"p3d-plan {BENCH_GROUPS} mesh=pp2 model.n_layers=6 schedule.micro_batch_size=2 schedule.global_batch_size=16 "
        "plan.block_seconds=0.03",
        lambda _c, r: [f"3.505 s  {r.hetero.step_s:.3f} s   4.790 s  {r.hetero.uniform_step_s:.3f} s"],
    ),
    Quote(
        "docs/benchmarks.md",
        f"p3d-plan {BENCH_GROUPS} mesh=dp2 model.n_layers=4 schedule.micro_batch_size=2 schedule.global_batch_size=24 "
        "plan.block_seconds=0.03",
        lambda _c, r: [f"3.080 s  {r.hetero.step_s:.3f} s   4.486 s  {r.hetero.uniform_step_s:.3f} s"],
    ),
    Quote(
        "docs/benchmarks.md",
        f"p3d-plan {TIMING_GROUPS}",
        lambda _c, r: [f"p3d-plan predicts {r.hetero.step_s:.3f} s (uniform split {r.hetero.uniform_step_s:.3f} s)"],
    ),
]
