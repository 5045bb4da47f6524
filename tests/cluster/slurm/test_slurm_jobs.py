"""End to end on a real Slurm cluster (one node here; see conftest.py): the batch recipe, p3d-train
cluster=slurm, a -m sweep through Hydra's submitit launcher with its report, and a job that gets the
time-limit signal, checkpoints, requeues itself and resumes. Tiny meshes on CPU (gloo).

Each job has a Slurm time limit and each wait a deadline; job states come from scontrol and sacct."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
import uuid

import pytest

from tests.helpers.runs import ROOT, p3d_train
from tests.helpers.slurm import RECIPE, complete_checkpoints, run, steps_done, stopped_requeued_and_resumed, wait_for


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "schedule",
    [  # slow tier (17 s): kept: 1f1b; the executor a run uses does not depend on how Slurm starts its workers
        pytest.param((), id="1f1b"),
        pytest.param(
            ("schedule.pipeline=interleaved_1f1b", "schedule.virtual_stages=2"),
            id="interleaved_1f1b",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_sbatch_recipe_trains_a_4_rank_mesh(slurm_cluster, tmp_path, schedule):
    """sbatch recipes/slurm/train.sbatch <overrides>: 4 srun tasks, metrics, checkpoint, one log; under
    DeepSpeed's 1f1b and under a torch schedule (its checkpoint cut into p v = 4 chunks)."""
    run_dir = tmp_path / "run"
    job = slurm_cluster.sbatch(
        "--ntasks-per-node=4",
        "--time=5",
        "--signal=B:USR1@30",
        f"--output={tmp_path}/job-%j.out",
        RECIPE,
        "mesh=tp2_pp2",
        "train.steps=3",
        f"run.dir={run_dir}",
        *schedule,
    )
    state = slurm_cluster.wait(job, timeout=240)
    log = (tmp_path / f"job-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    rows = slurm_cluster.wait_accounted(job)
    assert rows[-1]["State"] == "COMPLETED" and rows[-1]["ExitCode"] == "0:0", rows
    step0 = [r for r in slurm_cluster.sacct(job, steps=True) if r["JobID"] == f"{job}.0"]
    assert step0 and step0[0]["NTasks"] == "4" and step0[0]["State"] == "COMPLETED", step0  # one srun task per rank
    assert steps_done(run_dir) == [1, 2, 3]
    assert complete_checkpoints(run_dir), f"no complete checkpoint under {run_dir / 'checkpoints'}"
    meta = json.loads((run_dir / "checkpoints" / complete_checkpoints(run_dir)[-1] / "meta.json").read_text())
    assert meta["pipeline"] == ("interleaved_1f1b" if schedule else "1f1b")
    assert len(meta["stage_bounds"]) == (5 if schedule else 3)
    assert sorted(p.name for p in (run_dir / "logs").glob("rank*.log")) == [f"rank{r}.log" for r in range(4)]
    assert "srun 4 tasks (1 node(s) x 4)" in log and "step     3/3" in log and "done; metrics in" in log
    assert (run_dir / f"slurm-{job}.out").resolve() == (tmp_path / f"job-{job}.out").resolve()  # linked in the run dir
    spec = (run_dir / "run_spec.yaml").read_text()
    assert "launcher: slurm" in spec and "world_size: 4" in spec


@pytest.mark.timeout(300)
def test_p3d_train_cluster_slurm_submits_and_the_job_completes(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    result = p3d_train(
        "cluster=slurm",
        "mesh=pp2",
        "train.steps=3",
        "cluster.time=5",
        "cluster.signal_s=30",
        f"run.dir={run_dir}",
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    match = re.search(r"submitted Slurm job (\d+): .* 1 node\(s\) x 2 tasks", result.stdout)
    assert match, result.stdout
    job = match.group(1)
    assert f"job log {run_dir}/slurm-{job}.out" in result.stdout
    state = slurm_cluster.wait(job, timeout=240)
    log = (run_dir / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert steps_done(run_dir) == [1, 2, 3]
    assert complete_checkpoints(run_dir)
    detail = run("scontrol", "show", "job", job).stdout
    assert "NumNodes=1" in detail and "NumTasks=2" in detail and "TimeLimit=00:05:00" in detail, detail
    assert "gres/gpu" not in detail  # device=cpu asks for no GPUs
    assert json.loads((run_dir / "p3d_status.json").read_text())["job_id"] == job
    report = subprocess.run(
        [sys.executable, "-m", "p3d.cli.report", str(run_dir), "--no-plot"], capture_output=True, text=True, timeout=60
    )
    assert report.returncode == 0 and re.search(r"pp2 .* 3/3\s+done", report.stdout), report.stdout + report.stderr


@pytest.mark.timeout(120)
def test_a_mesh_larger_than_the_partition_is_refused_before_submitting(slurm_cluster, tmp_path):
    name = f"p3d-refused-{uuid.uuid4().hex[:8]}"
    result = p3d_train(
        "cluster=slurm",
        "mesh=tp2_pp2",
        "mesh.dp=4",
        "schedule.global_batch_size=32",
        f"cluster.job_name={name}",
        f"run.dir={tmp_path / 'run'}",
        timeout=90,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert re.search(
        r"needs 16 tasks x 1 CPUs = 16 CPUs per node, but the nodes of partition \w+ have \d+", result.stderr
    ), result.stderr
    assert "nothing was submitted" in result.stderr
    assert not (tmp_path / "run").exists()  # refused before the spec is written (issue 64, item 21)
    assert run("squeue", "-h", "-n", name).stdout.strip() == ""
    assert run("sacct", "-n", "-X", "--name", name, "-S", "now-1hour").stdout.strip() == ""
    nopart = p3d_train("cluster=slurm", "mesh=tp2_pp2", "cluster.partition=nopart", f"run.dir={tmp_path / 'run'}")
    assert nopart.returncode == 2 and not (tmp_path / "run").exists(), nopart.stdout + nopart.stderr
    assert "p3d: config error: cluster.partition=nopart (command line): Slurm lists no nodes there" in nopart.stderr


@pytest.mark.slow  # 26 s: make test keeps a submitit sweep and its report in tests/cluster/multinode
@pytest.mark.timeout(420)
def test_sweep_through_submitit_runs_one_job_per_point_and_reports(slurm_cluster, tmp_path):
    """p3d-train -m cluster=slurm: two Slurm jobs (2 and 4 ranks), one infeasible point never submitted."""
    sweep = tmp_path / "sweep"
    result = p3d_train(
        "-m",
        "cluster=slurm",
        "mesh=pp2",
        "mesh.tp=1,2,8",
        "train.steps=3",
        "cluster.time=5",
        "cluster.signal_s=30",
        f"hydra.sweep.dir={sweep}",
        timeout=400,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-4000:]  # the skipped point: the sweep is not all done
    assert "p3d: 1 of 3 sweep points not done (1 skipped: point 2); exit status 2" in result.stderr, out[-4000:]
    jobs = re.findall(r"point #(\d) \(.*\): Slurm job (\d+), 1 node\(s\) x (\d) tasks", result.stdout)
    assert [(p, t) for p, _, t in jobs] == [("0", "2"), ("1", "4")], out[-4000:]
    assert re.search(r"point #2 \(.*mesh.tp=8.*\) skipped, not submitted: mesh.tp=8 .*must divide", result.stderr)
    for _, job, _ in jobs:
        assert slurm_cluster.wait_accounted(job)[-1]["State"] == "COMPLETED"
    # the report printed at the end of the sweep: both rows, and the skipped point
    table = result.stdout[result.stdout.index("p3d-report:") :]
    assert "every point: dp1 pp2 cp1 ep1, ZeRO-0, 1f1b v=1, recompute none" in table, table  # the shared axes
    assert re.search(r"^0\s+pp2\s+2\s+1\s+[\d,]+\s+[\d.]+%.*3/3\s+done$", table, re.M), table  # ranks, tp
    assert re.search(r"^1\s+pp2\s+4\s+2\s+[\d,]+\s+[\d.]+%.*3/3\s+done$", table, re.M), table
    assert re.search(r"^2\s+.*skipped: mesh.tp=8", table, re.M), table
    with open(sweep / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["tp"], r["status"]) for r in rows] == [("1", "done"), ("2", "done"), ("", "skipped")]
    assert all(float(r["tokens_per_s"]) > 0 and float(r["final_loss"]) > 0 for r in rows[:2])
    assert (sweep / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for point, job in (("0", jobs[0][1]), ("1", jobs[1][1])):
        assert steps_done(sweep / point) == [1, 2, 3]
        assert json.loads((sweep / point / "p3d_status.json").read_text()) | {
            "status": "done",
            "job_id": job,
        } == json.loads((sweep / point / "p3d_status.json").read_text())


@pytest.mark.timeout(420)
def test_time_limit_signal_checkpoints_requeues_and_resumes(slurm_cluster, tmp_path):
    """The signal --signal=B:USR1@N sends before the time limit (sent here at once with scancel --batch):
    the recipe passes it to the workers, they save a checkpoint and exit 75, the job requeues itself
    (same id, same run dir) and the next start resumes from that checkpoint to the last step.

    Needs the durable-runs contract: SIGUSR1 -> checkpoint under <run.dir>/checkpoints/, exit 75;
    a spec with train.resume=auto resumes from the newest complete checkpoint."""
    run_dir = tmp_path / "run"
    steps = 12
    job = slurm_cluster.sbatch(
        "--ntasks-per-node=4",
        "--time=10",
        "--signal=B:USR1@60",
        f"--output={tmp_path}/job-%j.out",
        RECIPE,
        "mesh=tp2_pp2",
        f"train.steps={steps}",
        f"run.dir={run_dir}",
    )
    scancel = lambda: run("scancel", "--batch", "--signal=USR1", job)
    stopped_requeued_and_resumed(slurm_cluster, job, run_dir, tmp_path / f"job-{job}.out", steps, scancel)
    runs = slurm_cluster.wait_accounted(job, runs=2)
    assert [r["State"].split()[0] for r in runs] == ["REQUEUED", "COMPLETED"], runs
    assert steps_done(run_dir) == list(range(1, steps + 1))
    assert f"step_{steps:08d}" in complete_checkpoints(run_dir)


# slow tier (33 s): kept: the time-limit signal's requeue and resume of one job
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_sweep_job_signalled_before_its_time_limit_requeues_and_resumes(slurm_cluster, tmp_path):
    """A sweep point's job gets the time-limit signal (--signal=USR1@N goes to the worker step; sent here
    with scancel): the workers checkpoint and exit 75, the job requeues itself, the requeued run resumes,
    and the sweep waits for it and reports the point done. Needs the durable-runs contract too."""
    sweep = tmp_path / "sweep"
    steps = 16
    cmd = [
        sys.executable,
        "-m",
        "p3d.cli",
        "-m",
        "cluster=slurm",
        "mesh=pp2",
        f"train.steps={steps}",
        "cluster.time=10",
        "cluster.signal_s=60",
        f"hydra.sweep.dir={sweep}",
    ]
    sweep_proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: len(steps_done(sweep / "0")) >= 2, 180, "two training steps")
        job = re.search(r"(\d+) step start", (sweep / "0" / "slurm_jobs.log").read_text()).group(1)
        assert run("scancel", "--signal=USR1", job).returncode == 0  # to the job's steps, not its batch step
        slurm_cluster.wait(job, until={"PENDING"}, timeout=120)
        k = int(complete_checkpoints(sweep / "0")[-1].split("_")[1])
        assert 2 <= k < steps
        slurm_cluster.release_requeued(job)
        out, _ = sweep_proc.communicate(timeout=300)
    finally:
        if sweep_proc.poll() is None:
            sweep_proc.kill()
            sweep_proc.communicate()
    assert sweep_proc.returncode == 0, out[-4000:]
    assert [r["State"].split()[0] for r in slurm_cluster.wait_accounted(job, runs=2)] == ["REQUEUED", "COMPLETED"]
    assert re.search(rf"^0\s+pp2\s+[\d,]+.*{steps}/{steps}\s+done$", out, re.M), out[-3000:]
    log = (sweep / "0" / f"slurm-{job}.out").read_text()
    second = log[log.index("requeueing job") :]
    assert int(re.search(r"step\s+(\d+)/", second).group(1)) == k + 1, second[:3000]
    assert steps_done(sweep / "0") == list(range(1, steps + 1))
