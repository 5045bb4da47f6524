"""A shrunk elastic run over ``cluster.groups`` on Slurm that is requeued grows back (p3d.jobs.slurm.regrow): the
requeued job has all its nodes again, and each group of the run's first spec gets back the job's live nodes of its
feature (at most its count when submitted), the layout re-fitted and the split re-planned, the grow recorded; what
cannot be placed is refused in one line and the spec is kept. And the recipe's restart step, whose host file is gone,
stops with one line. In-process, on fake run directories (tests/unit/jobs/test_elastic.py's); what Slurm would say
(the job's live nodes, their features, its constraint) is given."""

from __future__ import annotations

import json
import shutil

import pytest

from p3d import exit_codes
from p3d.checkpoint import find as checkpoint
from p3d.config.errors import P3DConfigError
from p3d.jobs import elastic
from p3d.jobs.slurm import regrow
from p3d.jobs.slurm.groupjob import grown_groups, hostfile_path, hostfile_text, node_order, parse_node_features
from p3d.launch.requeue import resume_in_allocation, resume_spec
from p3d.planner.search import planned_split
from p3d.rundir.spec import pending_layout_change, read_spec
from tests.helpers.runs import typed
from tests.unit.jobs.test_elastic import fake_run
from tests.unit.jobs.test_groupjob import ELASTIC, GROUPS, SHOW_NODES

SPLIT = ("schedule.stage_blocks=[3,1]", "schedule.replica_micro_batches=[3,5]")  # test_elastic_groups.py's, by hand
ASKED = "[on_n2*1&on_n1*1]"  # the job's --constraint (scontrol show job's Features)
# two fast nodes and a slow one, asked for by feature: [fast*2&slow*1]
THREE = (
    "cluster.groups=[{device: cpu, nodes: 2, constraint: fast}, "
    "{device: cpu, nodes: 1, peak_tflops: 0.05, constraint: slow}]"
)


def _nodes(groups) -> list[tuple[str, int]]:
    return [(g.constraint, g.nodes) for g in groups]


def test_each_group_gets_back_the_jobs_nodes_of_its_feature_at_most_its_count():
    cfg, _ = typed("cluster=slurm", "model=tiny", "mesh=dp2", "mesh.dp=3", "schedule.global_batch_size=18", THREE)
    c, asked = cfg.cluster, "[fast*2&slow*1]"
    three = {"a": {"fast"}, "b": {"fast"}, "c": {"slow"}}
    assert _nodes(grown_groups(c, three, asked)) == [("fast", 2), ("slow", 1)]
    assert _nodes(grown_groups(c, {**three, "d": {"fast"}}, asked)) == [("fast", 2), ("slow", 1)]  # at most 2
    assert _nodes(grown_groups(c, {"b": {"fast"}, "c": {"slow"}}, asked)) == [("fast", 1), ("slow", 1)]
    assert _nodes(grown_groups(c, {"a": {"fast"}, "b": {"fast"}}, None)) == [("fast", 2)]  # no slow node: dropped
    grown = grown_groups(c, three, asked)
    assert [g.peak_tflops for g in grown] == [g.peak_tflops for g in c.groups]  # each group's own numbers kept


@pytest.mark.parametrize(
    "features,constraint,message",
    [
        ({"n1": {"on_n1"}, "n2": {"on_n2"}}, "[gpu*2]", "the job's --constraint=[gpu*2] is not [on_n2*1&on_n1*1]"),
        ({"n1": {"other"}}, ASKED, "none of the job's nodes (n1) has a group's feature (on_n2, on_n1)"),
    ],
    ids=["another-constraint", "no-groups-feature"],
)
def test_groups_that_cannot_be_told_from_the_features_are_refused_in_one_line(features, constraint, message):
    cfg, _ = typed(*ELASTIC, GROUPS)
    with pytest.raises(P3DConfigError) as err:
        grown_groups(cfg.cluster, features, constraint)
    text = str(err.value)
    assert "\n" not in text and text.startswith("cluster.groups: ") and message in text, text
    assert "resume naming the groups (p3d-train train.resume=auto run.dir=<run> cluster.groups='[...]')" in text


def _shrunk_then_saved(tmp_path):
    """test_elastic_groups.py's run: dp2_pp2 over group 0 (on_n2) and group 1 (on_n1), n2 lost at step 5, the spec
    re-frozen on group 1 alone (dp1_pp2), which then saved step 6 before the time-limit signal."""
    run = fake_run(tmp_path, *ELASTIC, GROUPS, *SPLIT)
    d = elastic.after_loss(run, ["n2"], alive=1, at_step=5, index=[0])
    assert resume_spec(str(run), nodes=d.nodes, event=d.event) == 0
    ckpt = checkpoint.step_dir(run, 6)
    ckpt.mkdir(parents=True)
    meta = json.loads((checkpoint.step_dir(run, 3) / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "step": 6}))
    shutil.copy(run / "run_spec.yaml", ckpt / "run_spec.yaml")
    cfg, plan = read_spec(run)
    assert (_nodes(cfg.cluster.groups), plan.dp) == ([("on_n1", 1)], 1)
    return run


def _requeued(monkeypatch, live: list[str], constraint: str | None = ASKED) -> None:
    """This start of the job: 2 nodes (the job keeps --nodes), ``live`` of n1, n2 up, the job's ``constraint``."""
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    monkeypatch.setenv("SLURM_JOB_ID", "61")
    shown = parse_node_features(SHOW_NODES)
    features = constraint or "(null)"
    job = f"JobId=61 JobName=p3d\n   NodeList=n[1-2] BatchHost=n1\n   Features={features} DelayBoot=00:00:00"
    monkeypatch.setattr(regrow, "show_job", lambda: job)  # scontrol show job's lines
    monkeypatch.setattr(regrow, "live_hosts", lambda shown: live)
    monkeypatch.setattr(regrow, "node_features", lambda hosts: {h: shown[h] for h in hosts})


def test_a_requeued_shrunk_groups_job_grows_back_to_both_groups_re_planned(tmp_path, monkeypatch, capsys):
    run = _shrunk_then_saved(tmp_path)
    _requeued(monkeypatch, ["n1", "n2"])
    assert resume_in_allocation(str(run)) == 0
    out = capsys.readouterr().out
    cfg, plan = read_spec(run)
    # group 0 (on_n2, the fast one) is back first, with its own peak; group 1 keeps half of it
    assert [(g.constraint, g.nodes, g.peak_tflops) for g in cfg.cluster.groups] == [
        ("on_n2", 1, 0.1),
        ("on_n1", 1, 0.05),
    ]
    assert (cfg.cluster.nodes, plan.dp, plan.pp, cfg.schedule.global_batch_size) == (2, 2, 2, 16)
    ours = planned_split(cfg).schedule  # the split the planner chooses for the groups back, not the old hand one
    assert (cfg.schedule.stage_blocks, cfg.schedule.replica_micro_batches) == (
        ours.stage_blocks,
        ours.replica_micro_batches,
    )
    assert sum(plan.replica_micro_batches) == 8 and len(plan.replica_micro_batches) == 2
    line = next(ln for ln in out.splitlines() if ln.startswith("p3d: elastic:"))
    assert line.startswith("p3d: elastic: 2 nodes now (was 1); resumed step 6 on 2 nodes as dp2 x pp2 x tp1, "), line
    assert "; groups 1 x cpu + 1 x cpu (were 1 x cpu), split " in line and line.endswith("(was the even split)"), line
    change = pending_layout_change(run, 6)
    assert change is not None
    assert (change["kind"], change["at_step"], change["old"]["groups"], change["new"]["groups"]) == (
        "grow",
        7,
        "1 x cpu",
        "1 x cpu + 1 x cpu",
    )
    assert (change["old"]["dp"], change["new"]["dp"], change["lost_nodes"]) == (1, 2, [])
    # the recipe's host file for the next srun: group 0's n2 first again (ranks 0-1), then n1
    order = node_order(cfg.cluster, parse_node_features(SHOW_NODES))
    assert hostfile_text(order, plan.world_size // cfg.cluster.nodes) == "n2\nn2\nn1\nn1\n"


def test_a_requeued_job_whose_lost_node_is_still_down_stays_on_the_group_left(tmp_path, monkeypatch, capsys):
    run = _shrunk_then_saved(tmp_path)
    _requeued(monkeypatch, ["n1"])
    assert resume_in_allocation(str(run)) == 0
    cfg, plan = read_spec(run)
    assert (_nodes(cfg.cluster.groups), plan.dp) == ([("on_n1", 1)], 1)
    assert "p3d: elastic:" not in capsys.readouterr().out  # nothing changed: no grow


@pytest.mark.parametrize(
    "drop_first_spec,constraint,message",
    [
        (False, "[on_n1*2]", "cluster.groups: the job's --constraint=[on_n1*2] is not [on_n2*1&on_n1*1]"),
        (True, ASKED, "cluster.groups: the run's first spec "),
    ],
    ids=["another-constraint", "first-spec-gone"],
)
def test_groups_that_cannot_be_placed_stop_the_resume_in_one_line_and_keep_the_spec(
    tmp_path, monkeypatch, capsys, drop_first_spec, constraint, message
):
    run = _shrunk_then_saved(tmp_path)
    if drop_first_spec:
        (run / "specs" / "from_step_00000000.yaml").unlink()
    _requeued(monkeypatch, ["n1", "n2"], constraint)
    spec_before = (run / "run_spec.yaml").read_text()
    assert resume_in_allocation(str(run)) == exit_codes.CONFIG_ERROR
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"p3d: cannot resume {run}: {message}"), err
    assert "resume naming the groups (p3d-train train.resume=auto run.dir=" in err, err
    assert (run / "run_spec.yaml").read_text() == spec_before  # nothing written is lost
    assert (checkpoint.step_dir(run, 6) / "meta.json").is_file()


@pytest.mark.parametrize("host_file", ["missing", "empty"])
def test_the_recipes_restart_without_its_host_file_stops_in_one_line(tmp_path, monkeypatch, capsys, host_file):
    """``python -m p3d.cli.slurm restart`` after n2 was lost, the failed srun's host file gone (or empty): which group
    n2 held is not known, so one line and status 1 (the recipe stops, the checkpoint kept), not a traceback."""
    from p3d.cli import slurm as cli
    from p3d.jobs.slurm import step

    monkeypatch.setenv("SLURM_JOB_ID", "52")
    run = fake_run(tmp_path / "run", *ELASTIC, GROUPS)
    if host_file == "empty":
        hostfile_path(run).parent.mkdir(parents=True, exist_ok=True)
        hostfile_path(run).write_text("")
    monkeypatch.setattr(step, "allocation", lambda srun_err: (["n2"], 1))
    spec_before = (run / "run_spec.yaml").read_text()
    status = cli.main(["restart", str(run), str(exit_codes.WORKER_FAILED), str(tmp_path / "srun.err")])
    out = capsys.readouterr()
    lines = (out.out + out.err).strip().splitlines()
    assert status == 1 and len(lines) == 1, lines
    reason = "cannot be read (No such file or directory)" if host_file == "missing" else "is empty"
    assert lines[0].startswith(f"p3d: elastic: node n2 lost, but the host file {hostfile_path(run)} {reason}: ")
    assert "which group each lost host was in is not known; not restarting, the newest checkpoint is kept" in lines[0]
    assert (run / "run_spec.yaml").read_text() == spec_before
