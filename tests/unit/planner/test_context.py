"""Issues 35 and 52: the planner models context parallelism (mesh.cp): a rank's activations and compute are for s / cp
tokens, beside one layer's cp attention working set; its model states shard over the dp x cp holders of its
parameters; the key/value traffic of every block costs its bytes on the cp group's link (all-gathers: none hidden;
a ring: what outlasts each step's attention); mesh=auto splits a long sequence over cp ranks, and the dry run of
Llama 3 405B at 131,072 tokens on 16,384 ranks prints each stage's memory per rank."""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from p3d.layout.run_plan import P3DConfigError, build_plan
from p3d.planner import apply_layout, predict, search
from p3d.planner.gemms import block_gemms
from p3d.planner.machine import machine_of
from p3d.planner.memory import stage_memory, state_bytes, step_buffer_bytes
from p3d.planner.shapes import layout_of, stage_params
from p3d.planner.step_time import dp_seconds, stage_times
from tests.helpers.runs import typed

# Llama 3 405B's long-context layout (The Llama 3 Herd of Models, Table 4): tp 8 x cp 16 x pp 16 x dp 8 on 16,384
# H100, sequences of 131,072 tokens, 16 per dp replica
LLAMA3_131K = (
    "model=llama3_1_405b",
    "model.seq_len=131072",
    "mesh.tp=8",
    "mesh.cp=16",
    "mesh.pp=16",
    "mesh.dp=8",
    "cluster=h100_sxm",
    "cluster.nodes=2048",
    "schedule.micro_batch_size=1",
    "schedule.global_batch_size=128",
)
ONE_NODE_8B = (
    "model=llama3_8b",
    "cluster=h100_sxm",
    "cluster.nodes=1",
    "schedule.micro_batch_size=1",
    "schedule.global_batch_size=8",
)


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("schedule.recompute=selective",),
        ("schedule.recompute=full",),
        ("schedule.sequence_parallel=true", "schedule.recompute=selective", "schedule.recompute_swiglu=true"),
        ("plan.flash_attention=false",),
    ],
    ids=["none", "selective", "full", "sp-selective-swiglu", "math-attention"],
)
def test_activation_bytes_at_cp2_are_half_of_cp1s(make_cfg, extra):
    """Every per-token tensor of a rank, the rope tables, the first and last stages' and the loss buffer are for
    s / 2 tokens: exactly half of cp = 1's flash inventory per rank (the cp attention keeps the log-sum-exp whatever
    plan.flash_attention says), and so are the FLOPs of a micro batch's GEMMs (attention: 1/cp of the causal total);
    their time halves up to the GEMM model's tiles (half the rows fill the SMs' waves a little differently)."""
    base = ("model=llama3_8b", "cluster=h100_sxm", "mesh.tp=2", "mesh.pp=2", "mesh.dp=auto", *extra)  # seq 8192, 8 GPUs
    one = make_cfg(*base, "plan.flash_attention=true")
    two = make_cfg(*base, "mesh.cp=2")
    lay1, lay2 = layout_of(one), layout_of(two)
    assert (lay1.cp, lay1.dp, lay2.cp, lay2.dp) == (1, 2, 2, 1) and lay2.world_size == 8
    for a, b in zip(stage_memory(one, lay1), stage_memory(two, lay2), strict=True):
        assert b.in_flight == a.in_flight
        assert b.activation_bytes == a.activation_bytes / 2
        assert (b.loss_bytes, b.recompute_bytes) == (a.loss_bytes / 2, a.recompute_bytes / 2)
        assert a.attention_bytes == 0 and b.attention_bytes > 0  # one layer's working set, at cp > 1 only
        assert b.activations_total - b.attention_bytes == a.activations_total / 2
    for name, gemms in block_gemms(one, lay1).items():
        half = sum(g.flops for g in block_gemms(two, lay2)[name])
        assert half == pytest.approx(sum(g.flops for g in gemms) / 2, rel=1e-12), name
    params = [s.params for s in stage_memory(one, lay1)]
    for a, b in zip(stage_times(one, lay1, params), stage_times(two, lay2, params), strict=True):
        assert b.compute == pytest.approx(a.compute / 2, rel=0.02)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_states_shard_over_dp_times_cp(make_cfg, zero):
    """dp 2 x cp 2 holds what dp 4 holds on the torch executor (which every cp > 1 runs on; gpipe puts cp = 1 there
    too): the Adam moments over 4 ranks under ZeRO-1, FSDP2's shards over 4 under ZeRO-2/3, and the gradients reduce
    over the same 4 holders (tp x 4 = 8 consecutive ranks: one node)."""
    cfg = make_cfg(
        "model=llama3_8b", "cluster=h100_sxm", "cluster.nodes=2", "mesh.tp=2", "mesh.pp=2", "mesh.dp=auto", "mesh.cp=2"
    )
    cfg = dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, stage=zero))
    cp = layout_of(cfg)
    flat = dataclasses.replace(cp, dp=4, cp=1, pipeline="gpipe")  # the same micro batches: the same ZeRO-3 gathers
    assert (cp.dp, cp.dp_cp, cp.torch_executor, flat.torch_executor) == (2, 4, True, True)
    for sp in stage_params(cfg, cp):
        states = state_bytes(cfg, cp, sp)
        assert states == state_bytes(cfg, flat, sp) and step_buffer_bytes(cfg, cp, sp) == step_buffer_bytes(
            cfg, flat, sp
        )
        assert dp_seconds(cfg, cp, sp) == dp_seconds(cfg, flat, sp) > 0
        n = sp.total
        expected = {0: (4 * n, 4 * n, 8 * n), 1: (4 * n, 4 * n, 8 * n / 4)}.get(zero, (4 * n / 4, 4 * n / 4, 8 * n / 4))
        assert states == pytest.approx(expected, rel=1e-12)


def test_key_value_traffic_by_hand(make_cfg):
    """Llama 3's layout: per block and micro batch, 2 all-gathers of k and v, each of b s 2 kv / t c bytes
    (1 x 131072 x 2 x 1024 / 8 x 2 = 64 MiB), and 1 reduce-scatter of the fp32 dk, dv (twice that), 15/16 of each
    leaving a rank, over the 50 GB/s NICs at 0.8 + 25 us (a cp group is tp x cp = 128 consecutive ranks: 16 nodes);
    none hidden."""
    r = predict(make_cfg(*LLAMA3_131K, "train.dtype=bf16"))
    kv = 1 * 131072 * 2 * 1024 / 8 * 2
    one = 15 / 16 * kv / (50e9 * 0.8) + 25e-6
    scatter = 15 / 16 * 2 * kv / (50e9 * 0.8) + 25e-6
    for st, t in zip(r.stages, r.stage_times, strict=True):
        assert t.kv == pytest.approx(st.params.blocks * (2 * one + scatter), rel=1e-12)
    slow = max(r.stage_times, key=lambda t: t.total)
    assert r.breakdown["kv_comm"] == pytest.approx(16 * slow.kv, rel=1e-12)  # m = 128 / (1 x 8) micro batches
    j = r.to_json()
    assert j["layout"]["cp"] == 16 and j["time_s"]["kv_comm"] == r.breakdown["kv_comm"]
    assert j["context"] == {
        "cp": 16,
        "attention": "allgather",
        "tokens_per_rank": 8192,
        "kv_ranks": 128,
        "kv_link": "inter",
        "kv_bytes_per_collective": kv,
        "kv_grad_bytes_per_collective": 2 * kv,
        "kv_all_gathers_per_layer_per_micro_batch": 2,
        "kv_reduce_scatters_per_layer_per_micro_batch": 1,
        "kv_bytes_sent_per_layer_per_micro_batch": 4 * 15 / 16 * kv,
        "kv_s_per_layer_per_micro_batch": pytest.approx(2 * one + scatter, rel=1e-12),
        "kv_hidden_fraction": 0.0,
        "attention_working_bytes": r.worst.attention_bytes,
    }
    text = r.render()
    assert "tp=8 cp=16 pp=16 dp=8 (16384 ranks)" in text
    assert "cp=16: each GPU holds 8,192 of the 131,072 tokens of a sequence" in text
    assert "251.7 MB sent per GPU" in text and "(cp=16 key/value all-gathers, inter-node link, 0% hidden)" in text
    assert any("key/value all-gathers of mesh.cp=16" in n and "inter-node link" in n for n in r.notes)


def test_key_value_traffic_inside_a_node_with_recompute(make_cfg):
    """tp 1 x cp 8 on one node: NVLink (450 GB/s at 0.8 + 10 us), and recompute gathers once more: 3 all-gathers of
    1 x 131072 x 2 x 1024 / 1 x 2 bytes + 1 reduce-scatter of twice that (fp32) per block and micro batch."""
    r = predict(
        make_cfg(
            *ONE_NODE_8B,
            "model.seq_len=131072",
            "mesh=single",
            "mesh.dp=auto",
            "mesh.cp=8",
            "schedule.recompute=selective",
        )
    )
    kv = 131072 * 2 * 1024 * 2
    one = 7 / 8 * kv / (450e9 * 0.8) + 10e-6
    scatter = 7 / 8 * 2 * kv / (450e9 * 0.8) + 10e-6
    assert r.stage_times[0].kv == pytest.approx(32 * (3 * one + scatter), rel=1e-12)
    assert r.to_json()["context"]["kv_link"] == "intra" and not any("key/value" in n for n in r.notes)


def test_cp1_has_no_key_value_traffic(make_cfg):
    r = predict(make_cfg(*ONE_NODE_8B, "mesh=single", "mesh.tp=8"))
    j = r.to_json()
    assert j["context"] is None and j["layout"]["cp"] == 1 and r.breakdown["kv_comm"] == 0.0
    assert "kv_comm" not in r.render() and "cp=" not in r.render().splitlines()[0]


def test_mesh_auto_splits_a_long_sequence_over_cp_ranks(make_cfg, monkeypatch):
    """llama3_8b at 131,072 tokens on one node of 8 H100: no cp = 1 layout fits 80 GB without sequence parallelism
    (with it, the default, tp 8 does, slower); mesh=auto proposes cp > 1
    (powers of two dividing the node), which p3d-train accepts; the ranking has a cp column and the report a cp line.
    At 2,048 tokens it searches cp = 1 only."""
    search_module = importlib.import_module("p3d.planner.search")  # p3d.planner.search is also the function

    cfg = make_cfg(*ONE_NODE_8B, "model.seq_len=131072", "mesh=auto")
    assert {lay.cp for lay in search_module.candidates(cfg)} == {1, 2, 4, 8}
    report = predict(cfg)
    best = report.layout
    assert best.cp > 1 and report.ranking[0].layout.cp > 1
    assert build_plan(apply_layout(cfg, best), None).cp == best.cp  # p3d-train runs it as it stands
    lines = report.render().splitlines()
    assert f"{'tp':>3} {'cp':>3} {'pp':>3}" in lines[1]
    assert any(line.startswith(f"  cp={best.cp}: each GPU holds") for line in lines)
    with monkeypatch.context() as patched:  # the same search without cp, and without sequence parallelism: nothing fits
        patched.setattr(search_module, "context_degrees", lambda *args: [1])
        with pytest.raises(P3DConfigError, match="no layout of 8 GPUs fits 80 GB"):
            search(make_cfg(*ONE_NODE_8B, "model.seq_len=131072", "mesh=auto", "schedule.sequence_parallel=false"))
    short = make_cfg(*ONE_NODE_8B, "model.seq_len=2048", "mesh=auto")
    assert {lay.cp for lay in search_module.candidates(short)} == {1}
    assert "cp" not in predict(short).render().splitlines()[1].split()


def test_dry_run_of_llama3_405b_at_131k_tokens_on_16k_ranks_prints_memory_per_rank():
    """The issue's dry run: llama3_1_405b, model.seq_len=131072, tp 8 x cp 16 x pp 16 x dp 8 = 16,384 ranks, every
    stage built on the meta device (the shards add up), the mesh map with each rank's cp coordinate, and each
    stage's memory per rank: the planner's figures for the very run p3d-train accepted."""
    from p3d.launch.dryrun import dry_run

    cfg, plan = typed(*LLAMA3_131K, "dry_run=true")
    report = dry_run(cfg, plan)
    text = report.render()
    assert plan.world_size == len(report.mesh_map) == 16384 and report.total == report.closed_form
    assert "dry run: llama3_1_405b on dp=8 x pp=16 x cp=16 x tp=8 (16384 ranks), 8 per node" in text
    assert "  rank     8: dp   0 pp   0 cp   1 tp  0 -> node   1 device 0" in text
    assert "rank = ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp" in text
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("memory per rank (GB;"))
    assert "8,192 tokens of each sequence" in lines[start]
    planned = predict(cfg, plan).stages
    rows = lines[start + 2 : start + 2 + len(planned)]
    for row, stage in zip(rows, planned, strict=True):
        assert row.split()[0] == str(stage.stage) and f" {stage.total / 1e9:.2f}" in row, (row, stage.total)
    assert lines[start + 2 + len(planned)].startswith("  -> ")


def test_layout_reads_mesh_cp(make_cfg):
    """dp=auto is world / (tp cp pp); the layout runs on the torch executor and names cp; apply_layout writes it
    back (and names the mesh with it)."""
    cfg = make_cfg(
        "model=llama3_1_405b",
        "model.seq_len=131072",
        "mesh.tp=8",
        "mesh.cp=16",
        "mesh.pp=16",
        "mesh.dp=auto",
        "cluster=h100_sxm",
        "cluster.nodes=2048",
    )
    lay = layout_of(cfg)
    assert (lay.dp, lay.cp, lay.world_size, lay.dp_cp) == (8, 16, 16384, 128) and lay.torch_executor
    back = apply_layout(cfg, dataclasses.replace(lay, cp=8, dp=16))
    assert (back.mesh.cp, back.mesh.dp, back.mesh.name) == (8, 16, "tp8_pp16_dp16_cp8")


def test_ring_traffic_by_hand(make_cfg):
    """context.attention=ring on Llama 3's layout: per block and micro batch 15 sends of one rank's k and v
    (64 MiB / 16) and 16 of its fp32 dk, dv (twice that), over the NICs; a step's attention (1/16 of the rank's,
    4 b s^2 q / t / 2 / cp FLOPs at 52% of 989 TFLOP/s; its backward 2.5 x) hides every message but the last dk, dv."""
    r = predict(make_cfg(*LLAMA3_131K, "train.dtype=bf16", "context.attention=ring"))
    kv = 1 * 131072 * 2 * 1024 / 8 * 2 / 16
    kv_s, grad_s = kv / (50e9 * 0.8) + 25e-6, 2 * kv / (50e9 * 0.8) + 25e-6
    step = 4 * 131072**2 * 16384 / 8 / 2 / 16 / (989e12 * 0.522) / 16
    assert step > kv_s and 2.5 * step > kv_s + grad_s  # every step hides its messages
    for st, t in zip(r.stages, r.stage_times, strict=True):
        assert t.kv == pytest.approx(st.params.blocks * grad_s, rel=1e-9)
    ctx = r.to_json()["context"]
    assert ctx["attention"] == "ring" and ctx["kv_messages_per_layer_per_micro_batch"] == 30
    assert ctx["kv_grad_messages_per_layer_per_micro_batch"] == 16
    assert ctx["kv_bytes_sent_per_layer_per_micro_batch"] == pytest.approx(30 * kv + 16 * 2 * kv, rel=1e-12)
    assert ctx["kv_hidden_fraction"] == pytest.approx(1 - grad_s / (30 * kv_s + 16 * grad_s), rel=1e-9)
    assert "passed round a ring, 30 sends of k, v + 16 of dk, dv" in r.render()


def test_a_short_ring_step_exposes_what_outlasts_it(make_cfg):
    """tp 1 x cp 8 at 8,192 tokens over the NICs (one node of 1 GPU each): a step computes too little to hide a
    message, and each step exposes its message less its attention."""
    cfg = make_cfg(
        "model=llama3_8b", "cluster=h100_sxm", "cluster.nodes=8", "cluster.gpus_per_node=1", "mesh=single",
        "mesh.cp=8", "mesh.dp=auto", "schedule.micro_batch_size=1", "schedule.global_batch_size=8",
        "context.attention=ring", "train.dtype=bf16",
    )  # fmt: skip
    r = predict(cfg)
    kv = 8192 * 2 * 1024 * 2 / 8
    kv_s, grad_s = kv / (50e9 * 0.8) + 25e-6, 2 * kv / (50e9 * 0.8) + 25e-6
    lay = layout_of(cfg)
    step = sum(machine_of(cfg).gemm(g, lay) for g in block_gemms(cfg, lay)["attn"]) / 8  # the GEMM model's, 1/cp
    at_peak = 4 * 8192**2 * 4096 / 2 / 8 / 989e12 / 8  # a step's causal FLOPs at the H100's peak
    assert at_peak < step < 3 * at_peak
    back = 2.5 * step
    assert kv_s > step and kv_s + grad_s > back
    exposed = 7 * (kv_s - step) + max(0.0, kv_s - back) + 6 * (kv_s + grad_s - back) + (grad_s - back) + grad_s
    assert r.stage_times[0].kv == pytest.approx(32 * exposed, rel=1e-9)


@pytest.mark.parametrize("attention", ["allgather", "ring"])
def test_the_attention_working_set_is_one_layers_and_linear_in_s(make_cfg, attention):
    """The cp attention's working set (what it gathers or passes round, its fp32 gradient sums) is in each stage's
    activations once, doubles with s (no s x s term), and a ring's falls with cp while the all-gather's holds the
    whole sequence's keys and values at any cp."""
    base = ("model=llama3_8b", "cluster=h100_sxm", "cluster.nodes=2", "mesh.tp=2", "mesh.dp=auto",
            f"context.attention={attention}")  # fmt: skip

    def working(seq, cp):
        cfg = make_cfg(*base, f"model.seq_len={seq}", f"mesh.cp={cp}")
        stages = stage_memory(cfg, layout_of(cfg))
        return stages[0].attention_bytes, stages[0]

    (w1, st), (w2, _) = working(16384, 2), working(32768, 2)
    assert w2 == pytest.approx(2 * w1, rel=1e-12) and w1 > 0
    total = st.activation_bytes * st.in_flight + st.recompute_bytes + st.loss_bytes + w1
    assert st.activations_total == pytest.approx(total, rel=1e-12)
    w4, _ = working(16384, 4)
    assert (w4 < w1 / 1.5) if attention == "ring" else (w4 > w1 / 1.5)


def test_cpu_workers_hold_their_process_and_the_data_pool(make_cfg):
    """On cpu every worker's total has the process (measured 0.32 GB) and the data's shuffle pool (shuffle_buffer
    windows of s + 1 tokens, 2 bytes a token of model=tiny's 512 ids); on GPUs neither."""
    from p3d.planner.memory import CPU_WORKER_BYTES, host_bytes

    cpu = make_cfg("mesh=single", "model.seq_len=4096", "mesh.cp=2")
    lay = layout_of(cpu)
    assert host_bytes(cpu, lay) == CPU_WORKER_BYTES + 1024 * 4097 * 2
    assert stage_memory(cpu, lay)[0].host_bytes == host_bytes(cpu, lay)
    assert "for the cpu worker process and its data buffer" in predict(cpu).render()
    gpu = make_cfg(*ONE_NODE_8B, "mesh=single", "mesh.tp=8")
    assert host_bytes(gpu, layout_of(gpu)) == 0.0
