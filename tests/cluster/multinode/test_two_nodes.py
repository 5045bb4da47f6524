"""p3d across two Slurm nodes (n1, n2: separate network namespaces and hostnames; gloo between them):
the batch recipe reproduces the single-node losses exactly, each rank runs where the mesh and the dry
run place it, and a node lost mid-run (during a checkpoint save) costs only the steps since the
newest complete checkpoint: the job is requeued, resumes there, and ends with the same losses.

The reference is the same run on one machine (the local launcher, 8 workers): same config, same data,
same init, fp32; equality is exact (the floats in metrics.jsonl compared with ==)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from p3d.checkpoint import find as checkpoint
from p3d.layout.dims import ParallelDims
from tests.helpers.runs import p3d_train
from tests.helpers.slurm import PLACEMENT, RECIPE, client_env, hosts_of, losses, placements

STEPS, SAVE_EVERY = 16, 4
RUN = ("mesh=dp2_pp2_tp2", "model=tiny", f"train.steps={STEPS}", f"train.save_every={SAVE_EVERY}")


@pytest.fixture(scope="module")
def single_node_losses(tmp_path_factory) -> dict[int, float]:
    """The run on one machine: p3d's local launcher, 8 workers."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    result = p3d_train(*RUN, f"run.dir={run_dir}", timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    found = losses(run_dir)
    assert sorted(found) == list(range(1, STEPS + 1))
    return found


def sbatch_two_node_job(two_nodes, tmp_path: Path, run_dir: Path, *extra: str) -> str:
    return two_nodes.sbatch(
        "--nodes=2",
        "--ntasks-per-node=4",
        "--time=30",  # the recipe's time-limit signal comes 300 s before it: not in a test on a loaded machine
        f"--output={tmp_path}/job-%j.out",
        RECIPE,
        *RUN,
        f"run.dir={run_dir}",
        *extra,
    )


@pytest.mark.timeout(600)  # (the single-node run of the fixture counts too)
def test_two_node_job_reproduces_single_node_losses_and_places_ranks_as_the_mesh_says(
    two_nodes, single_node_losses, tmp_path
):
    """sbatch --nodes=2 --ntasks-per-node=4 recipes/slurm/train.sbatch mesh=dp2_pp2_tp2: ranks 0-3 on
    the first node, 4-7 on the second (rank = (pp * dp + dp_rank) * tp + tp_rank, 4 per node): every
    TP group inside one node, every PP group across both, each DP group inside one (its two replicas
    of a stage share a node). The same map as the dry run's, and the same losses as on one machine."""
    run_dir = tmp_path / "run"
    job = sbatch_two_node_job(two_nodes, tmp_path, run_dir)
    state = two_nodes.wait(job, timeout=400)
    log = (tmp_path / f"job-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert "srun 8 tasks (2 node(s) x 4)" in log and "master n1:" in log, log[-3000:]

    assert losses(run_dir) == single_node_losses  # exact: every step, every bit

    placed = placements(run_dir)
    assert sorted(placed) == list(range(8))
    mesh = ParallelDims(tp=2, pp=2, dp=2, procs_per_node=4)
    host = {rank: p[0] for rank, p in placed.items()}
    assert set(host.values()) == {"n1", "n2"}
    for rank, (h, dp, pp, tp, local) in placed.items():
        assert (dp, pp, tp) == mesh.coords_of(rank) and local == mesh.local_rank_of(rank), placed
        assert h == ("n1", "n2")[mesh.node_of(rank)], placed  # node i of the mesh = host i of the allocation
    assert all(len(hosts) == 1 for hosts in hosts_of(mesh.tp_ranks(), host)), placed
    assert all(len(hosts) == 2 for hosts in hosts_of(mesh.pp_ranks(), host)), placed
    assert all(len(hosts) == 1 for hosts in hosts_of(mesh.dp_ranks(), host)), placed


@pytest.mark.timeout(180)
def test_dry_run_in_a_two_node_allocation_prints_each_ranks_host(two_nodes, tmp_path):
    """The dry run inside a two-node allocation names the host of every rank: the map the job above follows."""
    out = tmp_path / "dry.out"
    python = client_env()["P3D_PYTHON"]
    cmd = f"{python} -m p3d.cli dry_run=true cluster=slurm cluster.nodes=2 mesh=dp2_pp2_tp2 model=tiny"
    job = two_nodes.sbatch("--nodes=2", "--ntasks-per-node=4", "--time=5", f"--output={out}", f"--wrap={cmd}")
    assert two_nodes.wait(job, timeout=150) == "COMPLETED", out.read_text()[-3000:]
    text = out.read_text()
    assert "node i is host i of the allocation: n1 n2" in text, text[-3000:]
    rows = re.findall(r"rank\s+(\d+): dp\s+(\d+) pp\s+(\d+) tp\s+(\d+) -> node\s+(\d+) \((\w+)\)", text)
    mesh = ParallelDims(tp=2, pp=2, dp=2, procs_per_node=4)
    expected = [(r, *mesh.coords_of(r), mesh.node_of(r), ("n1", "n2")[mesh.node_of(r)]) for r in range(8)]
    assert [(int(r), int(d), int(p), int(t), int(n), h) for r, d, p, t, n, h in rows] == expected, text


def _text(folder: Path, pattern: str) -> str:
    return "".join(f.read_text(errors="replace") for f in folder.glob(pattern)) if folder.is_dir() else ""


def complete_steps(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    return sorted(int(d.name.split("_")[1]) for d in root.glob("step_*") if (d / "meta.json").is_file())


def saving_step(run_dir: Path) -> int | None:
    """The step of a save in progress (its .step_<N>.tmp directory exists), if any."""
    for tmp in (run_dir / "checkpoints").glob(".step_*.tmp") if (run_dir / "checkpoints").is_dir() else ():
        return int(tmp.name.split("_")[1].split(".")[0])
    return None


# slow tier (113 s): kept in make test: the two-node job, and the requeue on a Slurm signal
# (cluster/slurm/test_slurm_jobs.py)
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_node_lost_during_a_save_requeues_and_resumes_to_the_same_losses(two_nodes, single_node_losses, tmp_path):
    """kill-node n2 (SIGKILL to everything on it) while the checkpoint of step 8 is being written: the
    save in flight never completes, the previous checkpoint stays complete and loadable, Slurm marks n2
    down and requeues the job (--requeue; NODE_FAIL), which waits for two nodes; after revive-node n2
    it starts again, resumes from the newest complete checkpoint and ends with the uninterrupted run's
    losses at every step after it, bit for bit."""
    run_dir = tmp_path / "run"
    job = sbatch_two_node_job(two_nodes, tmp_path, run_dir)
    log_path = tmp_path / f"job-{job}.out"
    deadline = time.monotonic() + 300
    while len(PLACEMENT.findall(_text(run_dir / "logs", "rank*.log"))) < 8:  # every worker is up
        assert time.monotonic() < deadline, f"the workers did not start: {log_path.read_text()[-3000:]}"
        assert two_nodes.state(job) in ("PENDING", "RUNNING", "CONFIGURING"), log_path.read_text()[-3000:]
        time.sleep(0.5)
    on_n2 = two_nodes.pids_on("n2")  # slurmd, slurmstepd, ranks 4-7: SIGKILLed the moment a save begins
    # A save of the tiny model takes about 0.1 s: this loop must run when it wakes up, also on a loaded
    # machine (under `nice` the workers would outrun it), so it runs at a high priority (root: see conftest)
    priority = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, -10)
    try:
        kill_step, checked = None, time.monotonic()
        while kill_step is None or kill_step < 2 * SAVE_EVERY:
            if time.monotonic() - checked > 2:
                assert time.monotonic() < deadline, f"no save of step >= {2 * SAVE_EVERY} began: {two_nodes.show(job)}"
                assert two_nodes.state(job) == "RUNNING", log_path.read_text()[-3000:]
                checked = time.monotonic()
            time.sleep(0.001)
            kill_step = saving_step(run_dir)
        two_nodes.kill_node("n2", first=on_n2)
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, priority)
    killed_at = time.monotonic()
    try:
        state = two_nodes.wait(job, until={"PENDING", "COMPLETED", "FAILED", "CANCELLED"}, timeout=180)
        requeued_after = time.monotonic() - killed_at
        assert state == "PENDING", log_path.read_text()[-3000:]
        complete = complete_steps(run_dir)
        assert kill_step not in complete, f"the save of step {kill_step} finished before the node was lost"
        resume_step = complete[-1]
        assert resume_step == kill_step - SAVE_EVERY, complete
        checkpoint.verify(run_dir / "checkpoints" / f"step_{resume_step:08d}")  # every file at its recorded size
        assert two_nodes.show(job)["Restarts"] == "1"
    finally:
        two_nodes.revive_node("n2")
    two_nodes.release_requeued(job)
    state = two_nodes.wait(job, timeout=480)
    log = log_path.read_text()
    assert state == "COMPLETED", log[-4000:]
    second = log[log.index("(restart 1)") :]
    first_step = re.search(r"step\s+(\d+)/", second)
    assert first_step and int(first_step.group(1)) == resume_step + 1, second[:3000]
    resumed = losses(run_dir)
    assert resumed == single_node_losses  # every step, the final one included: bit for bit
    figures = {
        "kill_during_save_of_step": kill_step,
        "resumed_from_step": resume_step,
        "requeued_after_s": round(requeued_after, 1),
        "final_loss": resumed[STEPS],
        "final_loss_uninterrupted": single_node_losses[STEPS],
    }
    print("node loss:", json.dumps(figures))
