"""The planner's pipeline schedules: bubble, in-flight activations (against the action lists of DeepSpeed's and
torch's own schedules), p2p hops, and mesh=auto searching schedule x v, micro batch, recompute and ZeRO."""

from __future__ import annotations

import types

import pytest

from p3d.layout.geometry import schedule_bubble
from p3d.layout.run_plan import build_plan
from p3d.planner import apply_layout, predict, search
from p3d.planner.memory import in_flight, in_flight_chunks
from p3d.planner.shapes import Layout, layout_of
from p3d.planner.step_time import p2p_hops

TORCH_SCHEDULES = ("gpipe", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev")
SMALL_FP32 = ["model=small", "mesh.tp=1", "mesh.pp=2", "mesh.dp=1", "train.dtype=fp32", "schedule.micro_batch_size=1"]


# ---- counted peaks: the schedules' own action lists
def _torch_order(pipeline: str, p: int, m: int, v: int, rank: int = 0) -> dict:
    """torch's per-rank action list (``pipeline_order``) of ``pipeline``: the schedule class built for ``rank``
    with stage descriptors that carry what its constructor reads (no process group, no modules: the order is
    pure arithmetic on p, m and the stage indices)."""
    from torch.distributed.pipelining import schedules as S

    classes = {
        "gpipe": S.ScheduleGPipe,
        "interleaved_1f1b": S.ScheduleInterleaved1F1B,
        "interleaved_zero_bubble": S.ScheduleInterleavedZeroBubble,
        "zbv": S.ScheduleZBVZeroBubble,
        "dualpipev": S.ScheduleDualPipeV,
    }
    n = p * v
    ids = [rank] if v == 1 else [rank, n - 1 - rank] if pipeline in ("zbv", "dualpipev") else list(range(rank, n, p))
    stages = [
        types.SimpleNamespace(
            num_stages=n, group_size=p, group_rank=rank, stage_index=i, is_first=i == 0, is_last=i == n - 1, submod=None
        )
        for i in ids
    ]
    arg = stages[0] if v == 1 else stages
    return classes[pipeline](arg, m, loss_fn=lambda out, target: out).pipeline_order


def _torch_peak(actions: list) -> int:
    """Most chunks whose forward ran and whose backward (B, or W for the I/W split: torch's I keeps the graph) has
    not: the activations a rank holds at once."""
    live: set = set()
    peak = 0

    def flat(a):
        return [x for s in a.sub_actions for x in flat(s)] if a.sub_actions else [a]

    for action in actions:
        for a in flat(action) if action is not None else []:
            kind = a.computation_type.value
            if kind == "F":
                live.add((a.stage_index, a.microbatch_index))
                peak = max(peak, len(live))
            elif kind in ("B", "W"):
                live.discard((a.stage_index, a.microbatch_index))
    return peak


def _deepspeed_peak(p: int, m: int, stage: int) -> int:
    from deepspeed.runtime.pipe import schedule as D

    live = peak = 0
    for step in D.TrainSchedule(micro_batches=m, stages=p, stage_id=stage):
        for cmd in step:
            if isinstance(cmd, D.ForwardPass):
                live += 1
                peak = max(peak, live)
            elif isinstance(cmd, D.BackwardPass):
                live -= 1
    return peak


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (8, 16), (4, 2)])
def test_1f1b_in_flight_is_deepspeeds_counted_peak(p, m):
    """p3d's 1f1b is DeepSpeed's TrainSchedule: min(p - s, m) forwards without their backward."""
    for s in range(p):
        assert in_flight_chunks("1f1b", p, m, 1, s) == _deepspeed_peak(p, m, s)


CASES = [
    ("gpipe", 1, [(2, 4), (4, 8), (4, 16)]),
    ("interleaved_1f1b", 2, [(2, 4), (4, 4), (4, 8), (8, 16)]),
    ("interleaved_1f1b", 3, [(2, 4), (4, 8)]),
    ("interleaved_1f1b", 4, [(4, 8), (3, 6), (2, 2)]),
    ("interleaved_zero_bubble", 2, [(2, 4), (3, 6), (4, 8), (8, 24)]),
    ("interleaved_zero_bubble", 3, [(4, 4), (2, 6)]),
    ("zbv", 2, [(2, 2), (3, 4), (4, 4), (4, 5), (4, 8), (8, 10)]),
    ("dualpipev", 2, [(2, 4), (3, 7), (4, 8), (8, 20)]),
]


@pytest.mark.parametrize("pipeline,v,pms", CASES, ids=[f"{c[0]}-v{c[1]}" for c in CASES])
def test_in_flight_is_torchs_counted_peak(pipeline, v, pms):
    """Every torch schedule's formula (p3d.planner.memory) equals the peak counted on every rank of torch's own
    action list; in_flight() is that count over v (units of the rank's whole layers)."""
    for p, m in pms:
        order = _torch_order(pipeline, p, m, v)
        for s in range(p):
            counted = _torch_peak(order[s])
            assert in_flight_chunks(pipeline, p, m, v, s) == counted, (pipeline, p, m, v, s)
            assert in_flight(Layout(1, p, 1, 1, m, v, pipeline), s) == pytest.approx(counted / v)


# ---- bubble: the idle share of a simulated run of each schedule's own action order
def _deepspeed_actions(p: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    """Per stage, DeepSpeed's TrainSchedule as (kind, chunk, micro batch): F and a full backward B, in order
    (1F1B runs micro batches first in, first out, so the i-th forward and the i-th backward are micro batch i)."""
    from deepspeed.runtime.pipe import schedule as D

    out: dict[int, list[tuple[str, int, int]]] = {}
    for stage in range(p):
        seen = {"F": 0, "B": 0}
        out[stage] = []
        for step in D.TrainSchedule(micro_batches=m, stages=p, stage_id=stage):
            for cmd in step:
                kind = "F" if isinstance(cmd, D.ForwardPass) else "B" if isinstance(cmd, D.BackwardPass) else None
                if kind:
                    out[stage].append((kind, stage, seen[kind]))
                    seen[kind] += 1
    return out


def _torch_actions(pipeline: str, p: int, m: int, v: int) -> dict[int, list[tuple[str, int, int]]]:
    """Per rank, torch's own order as (kind, chunk, micro batch): F, B (full backward), I and W; DualPipeV's
    overlapped F+B pairs in their order; communication and grad-reduce actions left out."""

    def flat(a):
        return [x for sub in a.sub_actions for x in flat(sub)] if a.sub_actions else [a]

    out = {}
    for rank in range(p):
        order = _torch_order(pipeline, p, m, v, rank)[rank]
        out[rank] = [
            (a.computation_type.value, a.stage_index, a.microbatch_index)
            for action in order
            if action is not None
            for a in flat(action)
            if a.computation_type.value in ("F", "B", "I", "W")
        ]
    return out


def _simulated_bubble(actions: dict[int, list[tuple[str, int, int]]], n_chunks: int) -> float:
    """Every rank runs its actions in order, each as soon as the rank is free and its input exists (F of chunk c
    needs F of c - 1; I or B of c needs I or B of c + 1; W needs this chunk's I), with F, I and W one time unit
    and a full backward B two. Returns the mean over ranks of the idle share up to the step's end (the last
    rank's last action), the share the theory and the measured ``bubble`` count."""
    cost = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
    done: dict[tuple[str, int, int], float] = {}
    clock = dict.fromkeys(actions, 0.0)
    busy = dict.fromkeys(actions, 0.0)
    nxt = dict.fromkeys(actions, 0)
    progressed = True
    while progressed:
        progressed = False
        for rank, todo in actions.items():
            while nxt[rank] < len(todo):
                kind, c, mb = todo[nxt[rank]]
                need = {"F": ("F", c - 1, mb) if c > 0 else None, "W": ("dx", c, mb)}.get(
                    kind, ("dx", c + 1, mb) if c < n_chunks - 1 else None
                )
                if need is not None and need not in done:
                    break
                start = max(clock[rank], done[need] if need else 0.0)
                clock[rank] = start + cost[kind]
                busy[rank] += cost[kind]
                done[("F" if kind == "F" else "W" if kind == "W" else "dx", c, mb)] = clock[rank]
                nxt[rank] += 1
                progressed = True
    assert all(nxt[r] == len(todo) for r, todo in actions.items()), "the order deadlocks"
    end = max(clock.values())
    return sum(1 - busy[r] / end for r in actions) / len(actions)


BUBBLE_CASES = [
    ("1f1b", 1, [(2, 2), (2, 8), (4, 4), (4, 8), (6, 13)]),
    ("gpipe", 1, [(2, 4), (4, 8), (5, 7)]),
    ("interleaved_1f1b", 2, [(2, 4), (2, 8), (4, 8), (4, 12), (6, 12)]),
    ("interleaved_1f1b", 3, [(2, 4), (4, 8)]),
    ("interleaved_zero_bubble", 2, [(2, 4), (2, 8), (3, 6), (4, 8), (6, 18)]),
    ("interleaved_zero_bubble", 3, [(4, 4), (2, 6)]),
    ("zbv", 2, [(2, 2), (2, 8), (4, 4), (4, 5), (4, 6), (4, 8), (6, 8), (6, 20)]),
    ("dualpipev", 2, [(2, 4), (2, 8), (3, 7), (4, 8), (6, 12)]),
]


@pytest.mark.parametrize("pipeline,v,pms", BUBBLE_CASES, ids=[f"{c[0]}-v{c[1]}" for c in BUBBLE_CASES])
def test_schedule_bubble_is_the_idle_share_of_the_schedules_own_order(pipeline, v, pms):
    """geometry.schedule_bubble (the metrics' bubble_theory and the planner's bubble) against a run of the
    action order the executor really follows: DeepSpeed's TrainSchedule for 1f1b, torch's pipeline_order for
    the rest, with equal F, I, W (and B = I + W) chunk times."""
    for p, m in pms:
        actions = _deepspeed_actions(p, m) if pipeline == "1f1b" else _torch_actions(pipeline, p, m, v)
        simulated = _simulated_bubble(actions, p * v)
        assert schedule_bubble(pipeline, p, m, v) == pytest.approx(simulated, abs=1e-12), (pipeline, p, m, v)


# ---- bubble, step time and p2p through a config
@pytest.mark.parametrize(
    "pipeline,v", [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("interleaved_zero_bubble", 2), ("zbv", 2)]
)
def test_bubble_is_schedule_bubble_and_is_the_idle_share(make_cfg, pipeline, v):
    cfg = make_cfg(
        *SMALL_FP32, "schedule.global_batch_size=4", f"schedule.pipeline={pipeline}", f"schedule.virtual_stages={v}"
    )
    r = predict(cfg)
    assert (r.layout.pipeline, r.layout.virtual_stages, r.layout.micro_batches) == (pipeline, v, 4)
    assert r.bubble == schedule_bubble(pipeline, 2, 4, v)
    slow = max(t.total for t in r.stage_times)
    assert r.breakdown["pipeline_idle"] / (4 * slow + r.breakdown["pipeline_idle"]) == pytest.approx(r.bubble)
    assert not [w for w in r.warnings if "refuse" in w]  # p3d-train accepts each of these configs
    assert pipeline in r.render()


def test_p2p_hops_interleaving_multiplies_and_a_v_keeps_one_local():
    p = 4
    assert [p2p_hops(Layout(1, p, 1, 1, 8), s) for s in range(p)] == [1, 2, 2, 1]
    assert [p2p_hops(Layout(1, p, 1, 1, 8, 3, "interleaved_1f1b"), s) for s in range(p)] == [5, 6, 6, 5]
    assert [p2p_hops(Layout(1, p, 1, 1, 8, 2, "zbv"), s) for s in range(p)] == [2, 4, 4, 2]
    # all hops counted from both ends: 2 x the crossing boundaries (p v - 1 looped; 2 p - 2 in a V)
    assert sum(p2p_hops(Layout(1, p, 1, 1, 8, 2, "dualpipev"), s) for s in range(p)) == 2 * (2 * p - 2)


def test_v_placement_puts_embedding_and_head_on_rank_0(make_cfg):
    zbv = ("schedule.pipeline=zbv", "schedule.virtual_stages=2")
    r = predict(make_cfg(*SMALL_FP32, "schedule.global_batch_size=4", *zbv))
    assert {"embed", "head"} <= set(r.stages[0].params.layers)
    assert not {"embed", "head"} & set(r.stages[1].params.layers)
    assert r.stages[0].loss_bytes > 0 and r.stages[1].loss_bytes == 0
    tied = predict(make_cfg(*SMALL_FP32, "schedule.global_batch_size=4", *zbv, "model.tie_embeddings=true"))
    assert tied.breakdown["tied_embedding"] == 0.0  # one module serves both ends on rank 0: no all-reduce
    looped = predict(make_cfg(*SMALL_FP32, "schedule.global_batch_size=4", "model.tie_embeddings=true"))
    assert looped.breakdown["tied_embedding"] > 0.0


def test_virtual_stages_with_1f1b_is_planned_as_interleaved_with_a_note(make_cfg):
    cfg = make_cfg(*SMALL_FP32, "schedule.global_batch_size=4", "schedule.virtual_stages=2")
    assert layout_of(cfg).pipeline == "interleaved_1f1b"
    r = predict(cfg)
    assert any("planned as interleaved_1f1b" in n for n in r.notes)
    assert any("p3d-train would refuse" in w for w in r.warnings)  # and p3d-train's verdict is kept


# ---- mesh=auto
H100_64 = ["model=llama70b", "mesh=auto", "cluster=h100_64"]


def test_mesh_auto_finds_a_llama70b_layout_on_h100_64_that_p3d_train_accepts(make_cfg):
    """The issue's example: before, every layout at zero=stage0 recompute=none overflowed 80 GB."""
    cfg = make_cfg(*H100_64)
    assert (cfg.zero.stage, cfg.schedule.recompute.value) == (0, "none")
    ranked = search(cfg)
    assert ranked and all(r.fits for r in ranked)
    for r in ranked:
        chosen = apply_layout(cfg, r.layout)
        run_plan = build_plan(chosen, None)
        assert (run_plan.tp, run_plan.pp, run_plan.dp, run_plan.micro_batches) == (
            r.layout.tp,
            r.layout.pp,
            r.layout.dp,
            r.layout.micro_batches,
        )
    best = predict(cfg)
    text = best.render()
    lay = best.layout
    assert f"zero.stage={lay.zero}, recompute={lay.recompute}" in text and lay.schedule_name in text


def test_mesh_auto_in_fp32_searches_the_torch_schedules_and_each_is_trainable(make_cfg):
    cfg = make_cfg(*H100_64, "train.dtype=fp32")
    ranked = search(cfg)
    chosen = {r.layout.pipeline for r in ranked}
    assert chosen - {"1f1b"}, chosen  # some torch schedule fits
    for r in ranked:
        build_plan(apply_layout(cfg, r.layout), None)
    assert ranked[0].tokens_per_s >= max(r.tokens_per_s for r in ranked)


def test_apply_layout_round_trips(make_cfg):
    cfg = make_cfg(*SMALL_FP32, "schedule.global_batch_size=8")
    for layout in (
        Layout(1, 2, 1, 1, 8, 1, "1f1b", "none", 0),
        Layout(1, 2, 1, 2, 4, 1, "gpipe", "selective", 1),
        Layout(1, 2, 1, 1, 8, 2, "interleaved_1f1b", "full", 1),
        Layout(1, 2, 1, 1, 8, 2, "interleaved_zero_bubble", "selective", 0),
        Layout(1, 2, 1, 1, 8, 2, "zbv", "none", 1),
        Layout(1, 2, 1, 1, 8, 2, "dualpipev", "selective", 1),
    ):
        applied = apply_layout(cfg, layout)
        assert layout_of(applied) == layout
        assert applied.zero.name == f"stage{layout.zero}"
        build_plan(applied, None)  # each is a config p3d-train accepts
