"""The decision after a lost node (p3d.jobs.elastic) on a fake run directory: a spec, a checkpoint's meta.json and the
steps logged; the re-freeze on the nodes left (p3d.launch.requeue.resume_spec) and the restart loop around both."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from p3d import exit_codes
from p3d.checkpoint import find as checkpoint
from p3d.jobs import elastic
from p3d.jobs.restart import run_with_restarts
from p3d.launch.requeue import resume_spec
from p3d.layout.run_plan import build_plan
from p3d.rundir.spec import pending_layout_change, read_spec, write_spec
from tests.helpers.runs import compose_config

ELASTIC = ("model=tiny", "mesh=dp2_pp2", "cluster.nodes=2", "cluster.elastic.min_nodes=1", "train.save_every=3")


def fake_run(run_dir: Path, *overrides: str, logged: int = 4, saved: int | None = 3) -> Path:
    """What a run of ``overrides`` leaves after ``logged`` steps with a checkpoint at step ``saved``."""
    from p3d.checkpoint.find import model_identity

    cfg = compose_config(*overrides, f"run.dir={run_dir}")
    write_spec(cfg, build_plan(cfg), run_dir)
    if saved is not None:
        ckpt = checkpoint.step_dir(run_dir, saved)
        ckpt.mkdir(parents=True)
        meta = {"step": saved, "samples": saved * 16, "model": model_identity(cfg), "tokenizer": cfg.data.tokenizer}
        (ckpt / "meta.json").write_text(json.dumps(meta))
        shutil.copy(run_dir / "run_spec.yaml", ckpt / "run_spec.yaml")
    records = [{"step": s, "loss": 5.0, "grad_norm": 1.0} for s in range(1, logged + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def test_a_lost_node_shrinks_dp_and_says_so_in_one_line(tmp_path):
    run = fake_run(tmp_path, *ELASTIC)
    d = elastic.after_loss(run, ["1"], alive=1, at_step=5)
    assert (d.action, d.nodes) == ("resize", 1)
    assert d.line == (
        "p3d: elastic: node 1 lost at step 5; resumed step 3 on 1 node as dp1 x pp2 x tp1, 8 micro batches per replica"
    )
    assert d.event is not None
    assert {k: d.event[k] for k in ("kind", "cause", "lost_nodes", "at_step", "resumed_step", "steps_redone")} == {
        "kind": "shrink",
        "cause": "node 1 lost",
        "lost_nodes": ["1"],
        "at_step": 5,
        "resumed_step": 3,
        "steps_redone": 1,
    }
    assert (d.event["old"]["mesh"], d.event["new"]["mesh"]) == ("dp2 x pp2 x tp1", "dp1 x pp2 x tp1")
    assert d.event["since"] == pytest.approx((run / "metrics.jsonl").stat().st_mtime)


def test_below_min_nodes_stops_and_keeps_the_checkpoint(tmp_path):
    run = fake_run(tmp_path, *ELASTIC, "cluster.elastic.min_nodes=2")
    d = elastic.after_loss(run, ["1"], alive=1, at_step=5)
    assert (d.action, d.event) == ("stop", None)
    assert d.line == (
        "p3d: elastic: node 1 lost at step 5; 1 node left, below cluster.elastic.min_nodes=2: stopping; the newest "
        "checkpoint (step 3) is kept: resume with train.resume=auto when nodes return"
    )


def test_a_run_that_is_not_elastic_keeps_the_restart_rule(tmp_path):
    run = fake_run(tmp_path, "model=tiny", "mesh=dp2_pp2")
    assert elastic.after_loss(run, ["0"], alive=0, at_step=5).action == "same"


def test_the_refreeze_rebuilds_the_plan_and_keeps_the_change_for_the_worker(tmp_path, capsys):
    run = fake_run(tmp_path, *ELASTIC)
    d = elastic.after_loss(run, ["1"], alive=1, at_step=5)
    assert resume_spec(str(run), nodes=d.nodes, event=d.event) == 0
    assert capsys.readouterr().out == ""  # the decision's line is the one line
    cfg, plan = read_spec(run)
    assert (cfg.cluster.nodes, cfg.cluster.gpus_per_node, cfg.mesh.dp, cfg.schedule.global_batch_size) == (1, 2, 1, 16)
    assert (plan.world_size, plan.dp, plan.micro_batches) == (2, 1, 8)
    assert cfg.train.resume == str(checkpoint.step_dir(run, 3))
    ds = json.loads((run / "deepspeed_config.json").read_text())
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"]) == (16, 8)
    assert pending_layout_change(run, 3) == d.event  # the first launch after step 3 records it
    assert pending_layout_change(run, 6) is None  # a later resume within the segment does not


def _restarts(run: Path, failures: list[dict]) -> tuple[int, list[tuple], str]:
    """(status, the refreeze calls, the console) of the restart loop whose launches fail with ``failures``, then
    succeed."""
    calls: list[tuple] = []
    launched: list[dict] = []

    def launch(failure: dict) -> int:
        launched.append(failure)
        if len(launched) <= len(failures):
            failure.update(failures[len(launched) - 1])
            return exit_codes.WORKER_FAILED
        return exit_codes.OK

    def refreeze(run_dir: str, nodes: int | None = None, event: dict | None = None) -> int:
        calls.append((run_dir, nodes, event is not None))
        return 0

    console = io.StringIO()
    rc = run_with_restarts(launch, run, 0, refreeze, console=console)  # train.max_restarts=0: not needed
    return rc, calls, console.getvalue()


LOST = {"restartable": True, "cause": "node 1 lost", "lost_nodes": ["1"], "alive_nodes": 1}


def test_the_restart_loop_resizes_outside_max_restarts(tmp_path):
    run = fake_run(tmp_path, *ELASTIC)
    rc, calls, out = _restarts(run, [LOST])
    assert (rc, calls) == (0, [(str(run), 1, True)])
    assert out.startswith("p3d: elastic: node 1 lost at step 5; resumed step 3 on 1 node")


def test_the_restart_loop_stops_below_min_nodes_with_its_exit_status(tmp_path):
    run = fake_run(tmp_path, *ELASTIC, "cluster.elastic.min_nodes=2")
    rc, calls, out = _restarts(run, [LOST])
    assert (rc, calls) == (exit_codes.NODES_LOST, [])
    assert out.count("\n") == 1


def test_a_resume_on_more_nodes_lets_dp_follow_unless_the_mesh_is_named():
    from p3d.launch.resume_base import over_resumed_run

    groups = {"mesh", "cluster", "train", "run"}
    resumed = {
        "mesh": {"name": "dp2_pp2", "tp": 1, "pp": 2, "dp": 1},
        "cluster": {"nodes": 1, "gpus_per_node": 2, "elastic": {"min_nodes": 1, "vary": "dp"}},
        "train": {"resume": "none"},
        "run": {"dir": "r"},
    }
    composed = {
        "mesh": {"name": "pp2", "tp": 1, "pp": 2, "dp": 1},
        "cluster": {"nodes": 2, "gpus_per_node": None, "elastic": {"min_nodes": None, "vary": "dp"}},
        "train": {"resume": "auto"},
        "run": {"dir": "r"},
    }
    grown = over_resumed_run(composed, resumed, ["train.resume=auto", "cluster.nodes=2"], groups)
    assert (grown["cluster"]["nodes"], grown["cluster"]["gpus_per_node"], grown["mesh"]["dp"]) == (2, 2, "auto")
    named = over_resumed_run(composed, resumed, ["cluster.nodes=2", "mesh.dp=1"], groups)
    assert named["mesh"]["dp"] == 1  # the command line's, refused by the world-size rule if it does not fit
    plain = {**resumed, "cluster": {**resumed["cluster"], "elastic": {"min_nodes": None, "vary": "dp"}}}
    assert over_resumed_run(composed, plain, ["cluster.nodes=2"], groups)["mesh"]["dp"] == 1  # not elastic: as today


def test_at_start_records_a_grow_when_the_checkpoint_ran_on_fewer_nodes(tmp_path):
    run = fake_run(tmp_path, *ELASTIC)
    d = elastic.after_loss(run, ["1"], alive=1, at_step=5)
    assert resume_spec(str(run), nodes=d.nodes, event=d.event) == 0
    ckpt = checkpoint.step_dir(run, 6)  # what the run on 1 node saves
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 6}))
    shutil.copy(run / "run_spec.yaml", ckpt / "run_spec.yaml")
    cfg = compose_config(*ELASTIC, f"run.dir={run}", "cluster.gpus_per_node=2", f"train.resume={ckpt}")
    grown = elastic.at_start(cfg, build_plan(cfg))
    assert grown is not None and grown.event is not None
    assert grown.line == (
        "p3d: elastic: 2 nodes now (was 1); resumed step 6 on 2 nodes as dp2 x pp2 x tp1, 4 micro batches per replica"
    )
    assert (grown.event["kind"], grown.event["at_step"], grown.event["old"]["dp"], grown.event["new"]["dp"]) == (
        "grow",
        7,
        1,
        2,
    )
    same = compose_config(*ELASTIC, f"run.dir={run}", "cluster.nodes=1", "mesh.dp=1", f"train.resume={ckpt}")
    assert elastic.at_start(same, build_plan(same)) is None


# ---- the Slurm recipe's side: the same decision after a failed srun, and the fit after a requeue


@pytest.mark.parametrize(
    "least,lost,status,nodes", [(1, ["n2"], 0, 1), (2, ["n2"], exit_codes.NODES_LOST, None), (1, [], 1, None)]
)
def test_slurm_restart_of_an_elastic_run_resizes_or_stops(tmp_path, monkeypatch, least, lost, status, nodes):
    from p3d.jobs import restart
    from p3d.jobs.slurm import step

    run = fake_run(tmp_path, *ELASTIC, f"cluster.elastic.min_nodes={least}")
    monkeypatch.setattr(step, "allocation", lambda srun_err: (lost, 2 - len(lost)))
    calls: list[int | None] = []

    def refreeze(run_dir: str, nodes: int | None = None, event: dict | None = None) -> int:
        calls.append(nodes)
        return 0

    console = io.StringIO()
    got = restart.slurm_restart(run, exit_codes.WORKER_FAILED, tmp_path / "srun.err", refreeze, console=console)
    assert (got, calls[:1] or [None]) == (status, [nodes])
    if lost:  # one line, the elastic decision's; no lost node: today's rule (max_restarts=0: fail)
        assert console.getvalue().startswith("p3d: elastic: node n2 lost at step 5;")
        assert console.getvalue().count("\n") == 1


def test_a_requeued_elastic_job_is_fitted_to_the_nodes_it_got(tmp_path, monkeypatch, capsys):
    from p3d.launch.requeue import resume_in_allocation

    run = fake_run(tmp_path, *ELASTIC)
    d = elastic.after_loss(run, ["1"], alive=1, at_step=5)
    assert resume_spec(str(run), nodes=d.nodes, event=d.event) == 0  # now on 1 node, dp1
    ckpt = checkpoint.step_dir(run, 6)
    ckpt.mkdir(parents=True)
    cfg, _ = read_spec(run)
    meta = json.loads((checkpoint.step_dir(run, 3) / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "step": 6}))
    shutil.copy(run / "run_spec.yaml", ckpt / "run_spec.yaml")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    assert resume_in_allocation(str(run)) == 0
    assert "p3d: elastic: 2 nodes now (was 1); resumed step 6 on 2 nodes as dp2 x pp2 x tp1" in capsys.readouterr().out
    cfg, plan = read_spec(run)
    assert (cfg.cluster.nodes, plan.dp, plan.micro_batches) == (2, 2, 4)
    assert pending_layout_change(run, 6)["kind"] == "grow"


def test_vary_any_plans_sequence_parallelism_with_the_new_layout():
    """Issue 64, item 12: sequence parallelism that the old layout derived (tp 2: on) does not hold the re-plan to
    layouts with tp > 1: ``vary=any`` on the nodes left plans as a fresh mesh=auto launch there would."""
    import dataclasses

    from p3d.layout.elastic import pinned

    over = ("model=tiny", "mesh=dp2_tp2", "cluster.nodes=2", "cluster.elastic.min_nodes=1", "cluster.elastic.vary=any")
    cfg = compose_config(*over, "train.save_every=3")
    cfg = pinned(cfg, build_plan(cfg))
    assert cfg.schedule.sequence_parallel is True
    fresh = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, sequence_parallel=None))
    refit, expected = elastic.refit(cfg, 1), elastic.refit(fresh, 1)
    assert (refit.mesh, refit.schedule.sequence_parallel) == (expected.mesh, expected.schedule.sequence_parallel)
    assert refit.schedule.sequence_parallel is (refit.mesh.tp > 1)
    build_plan(refit)  # p3d-train accepts it
