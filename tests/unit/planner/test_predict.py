"""The Python API p3d-train uses: predict(cfg) -> report (fits, to_json, render), best_layout(cfg) for mesh=auto."""

from __future__ import annotations

import pytest

from p3d.layout.geometry import block_matmul_params, total_params
from p3d.layout.run_plan import P3DConfigError, build_plan
from p3d.planner import Layout, apply_layout, best_layout, predict

H100_x8 = [
    "cluster.device=h100_sxm",
    "cluster.launcher=slurm",
    "cluster.nodes=8",
    "train.dtype=bf16",
    "zero=stage1",
    "schedule=large",
]


def test_a_replicated_70b_does_not_fit_and_a_sharded_one_does(make_cfg):
    """By hand: bf16 weights alone are 2 bytes x 70.6 B = 141 GB on every GPU with tp = pp = 1, more than
    80 GB; with tp 8 x pp 8 a rank holds about 1/64 of the weights (the first stage one tp slice of the
    embedding more) and the 16-bytes-per-parameter states come to roughly 16 x 1.2 B / ... < 80 GB."""
    flat = predict(make_cfg("model=llama70b", "mesh.tp=1", "mesh.pp=1", *H100_x8))
    assert not flat.fits
    assert flat.worst.params_bytes == 2 * total_params(flat.cfg.model)
    assert any(w.startswith("does not fit") for w in flat.warnings)
    sharded = predict(make_cfg("model=llama70b", "mesh=tp8_pp8", *H100_x8))
    assert sharded.fits
    m = sharded.cfg.model
    first_stage = 10 * (block_matmul_params(m, 8) + 2 * m.hidden_size) + m.vocab_size * m.hidden_size // 8
    assert sharded.stages[0].params.total == first_stage
    assert sharded.to_json()["fits"] is True


def test_best_layout_is_trainable_and_ranked_first(make_cfg):
    cfg = make_cfg("model=llama70b", "mesh=auto", *H100_x8)
    report = predict(cfg)  # mesh=auto through the main entry point: the best layout, with the ranking (one search)
    best = report.layout
    assert isinstance(best, Layout) and best.world_size == 64
    chosen = apply_layout(cfg, best)
    run_plan = build_plan(chosen, None)  # p3d-train accepts it as it stands
    assert (run_plan.tp, run_plan.pp, run_plan.dp) == (best.tp, best.pp, best.dp)
    ranked = report.ranking
    assert ranked and ranked[0].layout == best
    speeds = [r.tokens_per_s for r in ranked]
    assert speeds == sorted(speeds, reverse=True) and all(r.fits for r in ranked)
    assert "mesh=auto" in report.render()
    assert report.to_json()["ranking"][0]["tp"] == best.tp


def test_micro_batches_read_as_p3d_train_prints_them(make_cfg):
    """Issue 31, item 8d: one notation, the count of micro batches, then batch x sequence length (the
    trainer's start line: ``{plan.micro_batches} micro batches of {micro_batch_size} x {seq_len} per replica``)."""
    cfg = make_cfg("model=llama70b", "mesh=tp8_pp8", *H100_x8)
    run_plan = build_plan(cfg, None)
    trainer_words = f"{run_plan.micro_batches} micro batches of {cfg.schedule.micro_batch_size} x {cfg.model.seq_len}"
    header = predict(cfg).render().splitlines()[0]
    assert f"(64 ranks), {trainer_words} per replica, 1f1b" in header, header
    assert trainer_words == "1024 micro batches of 1 x 8192" and "micro batch " not in header


def documented_plans(slow: bool) -> list[str]:
    from tests.helpers.documented import CASES, documented_lines

    lines = [cmd for _, cmd in documented_lines() if cmd.startswith("p3d-plan ")]
    return [cmd for cmd in lines if (cmd in CASES and CASES[cmd].slow) == slow]


@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["fast", "slow"])
def test_the_documented_plans_are_of_configs_p3d_train_accepts(make_cfg, slow):
    """Issue 31, item 8c: each documented ``p3d-plan`` line plans a config p3d-train would run as it stands
    (``cluster.device=h100_sxm cluster.nodes=8`` alone kept the local launcher, which p3d-train refuses
    on 8 nodes; the ``cluster=h100_sxm`` preset brings Slurm). The lines documented.py marks slow (mesh=auto over
    2048 GPUs: a minute) are the slow tier's."""
    lines = documented_plans(slow)
    assert len(lines) >= (2 if not slow else 1), lines
    for line in lines:
        overrides = [w for w in line.split()[1:] if not w.startswith("format=")]
        refused = [w for w in predict(make_cfg(*overrides)).warnings if "p3d-train would refuse" in w]
        assert not refused, (line, refused)


def test_nothing_fits_is_a_config_error(make_cfg):
    cfg = make_cfg(
        "model=llama3_1_405b",
        "mesh=auto",
        "cluster.device=a100_40gb",
        "cluster.launcher=slurm",
        "cluster.nodes=1",
        "train.dtype=bf16",
        "schedule.global_batch_size=64",
    )
    with pytest.raises(P3DConfigError, match="no layout of 8 GPUs fits"):
        best_layout(cfg)


def test_a_batch_too_small_for_the_cluster_is_refused_naming_one_it_has_layouts_for(make_cfg):
    """DeepSeek-V3 on 2048 H100s with the default 16 sequences: no layout fills its pipelines; the refusal names the
    smallest doubling of the batch that has layouts (with 256: tp8 x pp16 x dp16, a micro batch per stage)."""
    from p3d.planner.search import candidates

    cfg = make_cfg("model=deepseek_v3", "mesh=auto", "cluster=h100_sxm", "cluster.nodes=256")
    with pytest.raises(P3DConfigError) as err:
        best_layout(cfg)
    assert str(err.value).endswith("(each replica's micro batches must fill its pipeline); try "
                                   "schedule.global_batch_size=256"), str(err.value)  # fmt: skip
    assert candidates(make_cfg("model=deepseek_v3", "mesh=auto", "cluster=h100_sxm", "cluster.nodes=256",
                               "schedule.global_batch_size=256"))  # fmt: skip
    assert not candidates(make_cfg("model=deepseek_v3", "mesh=auto", "cluster=h100_sxm", "cluster.nodes=256",
                                   "schedule.global_batch_size=128"))  # fmt: skip


def test_auto_on_cpu_needs_a_gpu_count(make_cfg):
    with pytest.raises(P3DConfigError, match="mesh=auto needs the number of GPUs"):
        best_layout(make_cfg("mesh=auto"))


def test_refused_configs_are_modelled_and_flagged(make_cfg):
    """ZeRO-3 under zbv with tied embeddings: p3d-train refuses it (FSDP2 shards the V's shared table for one
    chunk only); the planner still models FSDP2's shards over dp and says so. Untied, it runs and nothing warns."""
    zbv3 = (
        "model=small",
        "mesh.tp=1",
        "mesh.pp=2",
        "mesh.dp=4",
        "zero.stage=3",
        "schedule.pipeline=zbv",
        "schedule.virtual_stages=2",
        "schedule.global_batch_size=16",
    )
    untied = predict(make_cfg(*zbv3, "model.tie_embeddings=false"))
    assert not any("would refuse" in w for w in untied.warnings), untied.warnings
    r = predict(make_cfg(*zbv3, "model.tie_embeddings=true"))
    assert any("p3d-train would refuse" in w and "model.tie_embeddings=true" in w for w in r.warnings)
    sp = r.stages[0].params.total
    assert r.stages[0].grads_bytes == pytest.approx(sp * 4 / 4)  # fp32, sharded over dp=4
    assert r.stages[0].params_bytes == pytest.approx(sp * 4 / 4)
    assert r.stages[0].step_buffers == pytest.approx(sp * 8)  # gathered weights and unsharded grads in a step
    gpt = predict(
        make_cfg(
            "model=gpt_175b",
            "mesh=tp8_pp8",
            "cluster.device=a100_80gb",
            "cluster.launcher=slurm",
            "cluster.nodes=8",
            "train.dtype=bf16",
            "schedule=large",
        )
    )
    assert any("builds llama only" in w for w in gpt.warnings)
    assert gpt.to_json()["model"]["arch"] == "gpt"


def test_hsdp_shard_groups_across_nodes_are_flagged(make_cfg):
    """zero.shard_size=3 on dp6 with 4 ranks a node: each shard group (ranks 0, 2, 4 for tp 0) crosses nodes; 2 keeps
    each inside one."""
    common = ("model=small", "cluster.device=h100_sxm", "cluster.launcher=slurm", "cluster.nodes=3",
              "cluster.gpus_per_node=4", "mesh.tp=2", "mesh.pp=1", "mesh.dp=6", "zero.stage=3")  # fmt: skip
    crossed = predict(make_cfg(*common, "zero.shard_size=3"))
    assert [w for w in crossed.warnings if "zero.shard_size=3: 4 of the shard groups" in w], crossed.warnings
    kept = predict(make_cfg(*common, "zero.shard_size=2"))
    assert not [w for w in kept.warnings if "shard groups" in w], kept.warnings


def test_layout_that_does_not_divide_the_cluster_is_an_error(make_cfg):
    with pytest.raises(
        P3DConfigError,
        match=r"mesh.tp\*mesh.pp=3 must divide the world size 8 \(cluster.nodes=1 x cluster.gpus_per_node=8\)",
    ):
        predict(
            make_cfg(
                "mesh.tp=3",
                "mesh.pp=1",
                "mesh.dp=auto",
                "model.hidden_size=96",
                "model.n_heads=6",
                "model.n_kv_heads=3",
                "cluster.device=h100_sxm",
                "cluster.launcher=slurm",
            )
        )


def test_report_figures_are_consistent(make_cfg):
    r = predict(
        make_cfg(
            "model=llama3_8b",
            "mesh=tp2_pp2",
            "mesh.dp=auto",
            *H100_x8[:-1],
            "schedule.global_batch_size=256",
            "schedule.micro_batch_size=1",
            "schedule.recompute=full",
        )
    )
    j = r.to_json()
    mem = j["memory_gb"]
    assert mem["total"] == pytest.approx(mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"])
    assert j["tokens_per_s"] * j["step_time_s"] == pytest.approx(256 * r.cfg.model.seq_len)
    assert j["mfu"] == pytest.approx(j["tflops_per_gpu"] / 989.0)
    assert j["hfu"] > j["mfu"]  # full recompute: one more forward of every block
    m = 256 // (1 * 16)  # micro batches per replica
    assert j["bubble"] == pytest.approx((2 - 1) / (m + 2 - 1))  # the idle share of the step
    assert j["time_s"]["step"] == pytest.approx(j["step_time_s"])
