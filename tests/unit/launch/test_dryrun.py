"""The dry run (p3d.launch.dryrun), in-process: exact parameter counts of every stage, with SP and recompute, under
a torch schedule, in the unit that fits; where workers may be forked."""

from __future__ import annotations

import pytest

from p3d.layout.geometry import total_params
from tests.helpers.runs import typed
from tests.helpers.tiers import with_slow


def _expected_rank_params(m, tp, pp_rank, n_blocks, last):
    """Independent closed form of one rank's parameters under Megatron-style sharding."""
    hd = m.hidden_size // m.n_heads
    sharded = m.hidden_size * hd * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.hidden_size * m.ffn_hidden_size
    n = n_blocks * (sharded // tp + 2 * m.hidden_size)
    vocab_rows = -(-m.vocab_size // tp)
    if pp_rank == 0:
        n += vocab_rows * m.hidden_size
    if last:
        n += m.hidden_size + vocab_rows * m.hidden_size
    return n


def test_dry_run_llama70b_tp8_pp8_counts():
    from p3d.launch.dryrun import dry_run

    cfg, plan = typed("mesh=tp8_pp8", "model=llama70b", "dry_run=true", "schedule=large")
    report = dry_run(cfg, plan)
    assert report.total == total_params(cfg.model) == 70_553_706_496
    assert len(report.params) == 64 and len(report.mesh_map) == 64
    # partition=cost: the head weighs 1.2 blocks, so the last stage gives up a block (9 + head = 10.2 blocks'
    # work) and the busiest stage does 11 blocks' work, against 11.2 with ten blocks everywhere
    blocks = [sum(name.startswith("block") for name in report.stage_layers[pp]) for pp in range(8)]
    assert blocks == [10, 10, 10, 10, 10, 10, 11, 9]
    for (pp, tp), n in report.params.items():
        assert n == _expected_rank_params(cfg.model, 8, pp, blocks[pp], pp == 7), (pp, tp)


def test_dry_run_with_sp_and_recompute_counts_the_same_parameters():
    """Sequence parallelism and recompute change no parameter: the dry run's per-rank counts stay."""
    from p3d.launch.dryrun import dry_run

    base = ("model=tiny", "mesh=tp2_pp2", "model.tie_embeddings=true", "dry_run=true")
    plain = dry_run(*typed(*base, "schedule.sequence_parallel=false"))
    sp = dry_run(
        *typed(
            *base,
            "schedule.sequence_parallel=true",
            "schedule.recompute=selective",
            "schedule.recompute_swiglu=true",
        )
    )
    assert sp.cfg.schedule.sequence_parallel and not plain.cfg.schedule.sequence_parallel
    assert sp.total == plain.total == total_params(sp.cfg.model)
    assert (sp.params, sp.owned, sp.padding, sp.stage_layers) == (
        plain.params,
        plain.owned,
        plain.padding,
        plain.stage_layers,
    )


@pytest.mark.parametrize(
    "overrides,words",
    [
        ((), "total from shards: 262,720 (262.7K); closed form: 262,720; match"),
        (("model=small", "mesh=single"), "total from shards: 123,587,328 (123.6M); closed form: 123,587,328; match"),
    ],
    ids=["tiny", "small"],
)
def test_dry_run_counts_parameters_in_the_unit_that_fits(overrides, words):
    """Issue 31, item 8e: not ``262,720 (0.00 B)``."""
    from p3d.launch.dryrun import dry_run

    assert words in dry_run(*typed("dry_run=true", *overrides)).render().splitlines()


def test_human_counts_have_four_digits_and_the_unit_that_fits():
    from p3d.console import human_count

    cases = {7: "7", 999: "999", 262_720: "262.7K", 999_960: "1M", 124_439_808: "124.4M", 70_553_706_496: "70.55B"}
    assert {n: human_count(n) for n in cases} == cases
    assert human_count(1_250_000_000_000) == "1.25T"


@pytest.mark.parametrize(
    "pipeline",
    [("schedule.pipeline=interleaved_1f1b", "schedule.virtual_stages=2"), ("schedule.pipeline=zbv",)],
    ids=["interleaved_1f1b", "zbv"],
)
def test_dry_run_of_a_torch_schedule_prints_each_ranks_chunks_and_exact_counts(pipeline):
    """The chunks of every pp rank (loop placement: c mod p; V: r and 2p-1-r), and each rank's parameter count equal
    to the ChunkModules a worker builds (tied table: a copy on each holder under loop placement, one shared under V)."""
    import torch.nn as nn

    from p3d.launch.dryrun import dry_run
    from p3d.parallel.mesh import Mesh
    from p3d.pipeline.chunks import ChunkModule
    from p3d.pipeline.specs import build_layer_specs

    cfg, plan = typed("mesh=pp2", "model.tie_embeddings=true", "dry_run=true", "schedule.virtual_stages=2", *pipeline)
    report = dry_run(cfg, plan)
    v_shaped = "zbv" in pipeline[0]
    assert report.rank_chunks == ([[0, 3], [1, 2]] if v_shaped else [[0, 2], [1, 3]])
    text = report.render()
    assert "pp   1 chunk   3: block3, final_norm, head" in text or "pp   0 chunk   3: block3, final_norm, head" in text
    assert report.total == total_params(cfg.model)
    bounds = [0, 2, 3, 4, 7]  # tiny, pp2 x 2 chunks, partition=blocks
    for pp, chunks in enumerate(report.rank_chunks):
        specs = build_layer_specs(cfg.model, plan.padded_vocab_size, Mesh.from_plan(plan, pp), cfg.train.seed)
        tied: dict = {}
        built = nn.ModuleList([ChunkModule(specs, bounds[c], bounds[c + 1], tied) for c in chunks])
        assert report.params[(pp, 0)] == sum(p.numel() for p in built.parameters()), pp


def test_workers_are_forked_only_where_it_is_safe(monkeypatch):
    """gloo only (no CUDA in a forked child); never with P3D_WORKER_START=exec; never beside a thread that is
    not the run lease's heartbeat (a fork copies only the calling thread, and a lock held by another would
    stay held in the child), nor where the kernel's thread count cannot be read or shows threads Python does
    not know of (gloo's, in a process that ran collectives)."""
    import threading
    import types

    from p3d.jobs import forked

    def threads(*names):
        found = [threading.main_thread(), *(types.SimpleNamespace(name=n) for n in names)]
        monkeypatch.setattr(forked.threading, "enumerate", lambda: found)
        monkeypatch.setattr(forked, "native_threads", lambda: len(found))

    monkeypatch.delenv(forked.WORKER_START, raising=False)
    threads()
    assert forked.can_fork("gloo")
    assert not forked.can_fork("nccl")
    monkeypatch.setenv(forked.WORKER_START, "exec")
    assert not forked.can_fork("gloo")
    monkeypatch.setenv(forked.WORKER_START, "fork")
    threads("p3d-lease")
    assert forked.can_fork("gloo")
    threads("a-stranger")
    assert not forked.can_fork("gloo")
    threads()
    monkeypatch.setattr(forked, "native_threads", lambda: None)  # not Linux
    assert not forked.can_fork("gloo")
    monkeypatch.setattr(forked, "native_threads", lambda: 40)
    assert not forked.can_fork("gloo")


def test_dry_run_mixtral_on_64_ranks_with_ep_counts_dense_and_expert_parameters_per_rank():
    """Issue 34: mixtral_8x7b on dp4 (ep4) x pp4 x tp4: each rank holds 2 of the 8 experts of its 8 blocks, cut
    over tp; the shards (each ep rank's experts counted once) add up to the published 46.7B."""
    from p3d.launch.dryrun import dry_run

    cfg, plan = typed(
        "model=mixtral_8x7b", "mesh.tp=4", "mesh.pp=4", "mesh.dp=4", "mesh.ep=4", "schedule.global_batch_size=64"
    )
    report = dry_run(cfg, plan)
    m = cfg.model
    per_expert = 3 * m.hidden_size * m.moe.expert_ffn_size // 4  # one expert's slice on one tp rank
    assert len(report.mesh_map) == 64 and len(report.params) == 16
    for (pp, tp), experts in report.experts.items():
        blocks = sum(name.startswith("block") for name in report.stage_layers[pp])
        assert experts == blocks * 2 * per_expert, (pp, tp)
    assert report.total == total_params(m) == 46_702_792_704
    text = report.render()
    assert "dp=4 (ep=4) x pp=4 x tp=4" in text and "2 of the 8 routed experts" in text
    assert "pp   0 tp  0:     821,624,832 = dense 116,981,760 + experts 704,643,072" in text
    assert "active per token (top-2 routed experts): 12,879,925,248 (12.88B)" in text


# issue 50: 386 GB predicted for 2 workers sharing 24 (with issue 52, each worker's process and data pool)
TOO_BIG = ("model=small", "mesh=dp2", "model.seq_len=65536")


def test_a_dry_run_refuses_what_the_launch_refuses_in_the_same_line(capsys, tmp_path):
    """The launch's pre-flight refuses a layout predicted not to fit (cpu workers: their sum against the host's
    cluster.memory_gb); its dry run says the same: the memory table, the verdict, the launch's line and status 2.
    With plan.force=true both go on."""
    from p3d.launch.train import train_task
    from tests.helpers.runs import compose

    launch = train_task(compose(*TOO_BIG, run_dir=str(tmp_path / "a")))
    refusal = capsys.readouterr().err.strip().splitlines()[-1]
    assert launch == 2 and "predicted to need 386 GB for its 2 workers together" in refusal, refusal
    dry = train_task(compose(*TOO_BIG, "dry_run=true", run_dir=str(tmp_path / "b")))
    out = capsys.readouterr()
    assert dry == 2 and out.err.strip().splitlines() == [refusal], out.err
    assert "  -> DOES NOT FIT: 385.55 GB of 24 GB for the 2 workers together" in out.out.splitlines(), out.out
    forced = train_task(compose(*TOO_BIG, "dry_run=true", "plan.force=true", run_dir=str(tmp_path / "c")))
    out = capsys.readouterr()
    assert forced == 0 and not out.err.strip(), out.err
    assert "DOES NOT FIT (plan.force=true: p3d-train launches it anyway)" in out.out
    assert not any(tmp_path.iterdir()), sorted(tmp_path.rglob("*"))  # refused or dry: nothing written


def test_a_dry_run_that_fits_says_so_and_exits_0(capsys):
    from p3d.launch.train import train_task
    from tests.helpers.runs import compose

    assert train_task(compose("model=small", "mesh=dp2", "dry_run=true")) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("  -> fits: ") and last.endswith("of 24 GB for the 2 workers together"), last


def test_a_dry_run_over_groups_shows_each_ranks_group_and_the_split_it_runs():
    """Issue 64, item 10: ``p3d-train cluster=mixed_h100_a100 model=llama3_8b mesh=auto dry_run=true`` shows which
    group each node and rank is on, the blocks and micro batches the planner split over the groups (what the run
    starts with), each group's memory and the split's predicted step against the uniform one."""
    from p3d.launch.dryrun import dry_run

    cfg, plan = typed("cluster=mixed_h100_a100", "model=llama3_8b", "mesh=auto", "dry_run=true")
    text = dry_run(cfg, plan).render()
    lines = text.splitlines()
    assert "cluster.groups: node 0: group 0 (1 x h100_sxm); node 1: group 1 (1 x a100_80gb)" in lines
    per_node = plan.world_size // 2
    for rank in (0, plan.world_size - 1):
        row = next(x for x in lines if x.startswith(f"  rank {rank:>5}:"))
        assert row.split("-> ")[1].startswith(f"node {rank // per_node:>3} group {rank // per_node}"), row
    assert cfg.schedule.stage_blocks or cfg.schedule.replica_micro_batches  # mesh=auto planned an uneven split
    split = [x for x in lines if x.strip().startswith("schedule.stage_blocks=")]
    assert len(split) == 1 and split[0].endswith(f" schedule.replica_micro_batches={plan.replica_micro_batches}")
    if cfg.schedule.stage_blocks:
        assert split[0].startswith(f"  schedule.stage_blocks={cfg.schedule.stage_blocks} ")
    assert "    0: 1 x h100_sxm" in text and "    1: 1 x a100_80gb" in text and "uniform split" in text


CARD_70B = ("mesh=tp8_pp8", "model=llama70b", "cluster=h100_sxm", "cluster.nodes=8")


@pytest.mark.parametrize("extra", [(), ("schedule=large",)], ids=["default", "large"])
def test_the_design_cards_70b_line_fits_with_headroom_by_default(extra):
    """Issue 64, item 12: ``p3d-train mesh=tp8_pp8 model=llama70b cluster=h100_sxm cluster.nodes=8 dry_run=true``
    (and the README's line, with schedule=large) fits its own cluster as it stands, below 90 % of an H100's memory:
    sequence parallelism is on with tp 8, and the preset's schedule takes one sequence per micro batch."""
    from p3d.planner import predict
    from p3d.planner.verdict import fit_refusal, headroom_warning

    cfg, plan = typed(*CARD_70B, "dry_run=true", *extra)
    report = predict(cfg, plan)  # what the dry run's verdict and the launch's pre-flight read
    assert cfg.schedule.sequence_parallel and fit_refusal(report) is None
    assert report.worst.total <= 0.9 * report.capacity_bytes and headroom_warning(report) is None


def test_a_plan_above_90_percent_of_a_device_is_warned_about_in_one_line(capsys):
    """Issue 64, item 12: a layout that fits with less than 10 % of a device to spare gets one warning line, in
    p3d-plan's warnings, before a launch (the pre-flight, which still launches it) and in the dry run."""
    import dataclasses

    from p3d.launch.check import preflight
    from p3d.launch.dryrun import dry_run
    from p3d.planner import predict

    crowded = (*CARD_70B, "schedule.micro_batch_size=2")  # 79.4 GB of 80
    line = "stage 0 uses 79.4 GB of 80 GB (99%), more than 90%"
    cfg, plan = typed(*crowded)
    assert [w for w in predict(cfg).warnings if "more than 90%" in w][0].startswith(line)
    preflight(cfg, plan)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"p3d: warning: {line}"), err
    # the dry run, of 2 cpu workers on a host with 5 % more memory than they need together
    cfg, plan = typed("model=tiny", "mesh=dp2", "dry_run=true")
    need = predict(cfg, plan).all_ranks_bytes / 1e9
    tight = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, memory_gb=need * 1.05))
    text = dry_run(tight, plan).render().splitlines()
    warned = [x for x in text if x.startswith("warning: the 2 cpu workers together use")]
    assert len(warned) == 1 and "(95%), more than 90%" in warned[0], text[-3:]


# Qwen/Qwen3-235B-A22B: "235B in total, 22B activated"; Llama 3.1 405B: its safetensors' count
QWEN3_235B, LLAMA31_405B = (235_093_634_560, 22_190_763_520), (405_853_388_800, 405_853_388_800)
PLANNED = {
    # mesh=auto's layout of 16 nodes (its search takes the slow tier's time): the model built on it
    "qwen3_235b_a22b-tp1_pp32_dp4": ("qwen3_235b_a22b", 16, ["mesh.tp=1", "mesh.pp=32", "mesh.dp=4"], QWEN3_235B),
    "qwen3_235b_a22b-auto": ("qwen3_235b_a22b", 16, ["mesh=auto"], QWEN3_235B),
    "llama3_1_405b-auto": ("llama3_1_405b", 128, ["mesh=auto"], LLAMA31_405B),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", with_slow(PLANNED, {"qwen3_235b_a22b-auto", "llama3_1_405b-auto"}))
def test_the_published_models_are_planned_and_built_as_their_closed_form(case):
    """``p3d-train model=<preset> cluster=h100_sxm cluster.nodes=N mesh=auto dry_run=true``: the planner picks a
    layout, and the model built on the meta device on every rank of it holds the closed form's parameters (head_dim
    128 apart from 4096 / 64, q/k norms, 128 routed experts in every block; Llama 3.1's scaled RoPE), the active
    count beside it."""
    from p3d.launch.dryrun import dry_run
    from p3d.layout.geometry import active_params

    preset, nodes, mesh, (total, active) = PLANNED[case]
    cfg, plan = typed(
        f"model={preset}", "cluster=h100_sxm", f"cluster.nodes={nodes}", *mesh, "dry_run=true",
        "schedule.global_batch_size=1024",
    )  # fmt: skip
    report = dry_run(cfg, plan)
    assert report.total == total_params(cfg.model) == total
    assert active_params(cfg.model) == plan.n_active_params == active
    if cfg.model.moe is not None:
        assert f"active per token (top-8 routed experts): {active:,}" in report.render()
