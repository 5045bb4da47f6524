"""p3d across two Slurm nodes (n1, n2: separate network namespaces and hostnames; gloo between them):
the batch recipe reproduces the single-node losses exactly, each rank runs where the mesh and the dry
run place it, and a node lost mid-run (during a checkpoint save) costs only the steps since the
newest complete checkpoint: the job is requeued, resumes there, and ends with the same losses.

The reference is the same run on one machine (the local launcher, 8 workers): same config, same data,
same init, fp32; equality is exact (the floats in metrics.jsonl compared with ==)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from p3d.dist.mesh import Mesh
from p3d.metrics import read_metrics
from tests.conftest import ROOT, p3d_train
from tests.multinode.conftest import client_env

pytestmark = pytest.mark.procs

RECIPE = str(ROOT / "recipes" / "slurm" / "train.sbatch")
STEPS, SAVE_EVERY = 16, 4
RUN = ("mesh=dp2_pp2_tp2", "model=tiny", f"train.steps={STEPS}", f"train.save_every={SAVE_EVERY}")
PLACEMENT = re.compile(r"\[rank (\d+)\] placement: host (\S+) dp (\d+) pp (\d+) tp (\d+) local (\d+)")


def losses(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(run_dir)}


@pytest.fixture(scope="module")
def single_node_losses(tmp_path_factory) -> dict[int, float]:
    """The run on one machine: p3d's local launcher, 8 workers."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    result = p3d_train(*RUN, f"run.dir={run_dir}", timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    found = losses(run_dir)
    assert sorted(found) == list(range(1, STEPS + 1))
    return found


def placements(run_dir: Path) -> dict[int, tuple[str, int, int, int, int]]:
    """rank -> (host, dp, pp, tp, local rank) from the placement line of each rank's log (first start)."""
    found = {}
    for log in sorted((run_dir / "logs").glob("rank*.log")):
        match = PLACEMENT.search(log.read_text())
        assert match, f"no placement line in {log}"
        rank, host, *coords = match.groups()
        found[int(rank)] = (host, *map(int, coords))
    return found


def hosts_of(groups: list[list[int]], host: dict[int, str]) -> list[set[str]]:
    return [{host[r] for r in group} for group in groups]


def sbatch_two_node_job(two_nodes, tmp_path: Path, run_dir: Path, *extra: str) -> str:
    return two_nodes.sbatch(
        "--nodes=2",
        "--ntasks-per-node=4",
        "--time=10",
        f"--output={tmp_path}/job-%j.out",
        RECIPE,
        *RUN,
        f"run.dir={run_dir}",
        *extra,
    )


@pytest.mark.timeout(420)
def test_two_node_job_reproduces_single_node_losses_and_places_ranks_as_the_mesh_says(
    two_nodes, single_node_losses, tmp_path
):
    """sbatch --nodes=2 --ntasks-per-node=4 recipes/slurm/train.sbatch mesh=dp2_pp2_tp2: ranks 0-3 on
    the first node, 4-7 on the second (rank = (pp * dp + dp_rank) * tp + tp_rank, 4 per node): every
    TP group inside one node, every PP group across both, each DP group inside one (its two replicas
    of a stage share a node). The same map as the dry run's, and the same losses as on one machine."""
    run_dir = tmp_path / "run"
    job = sbatch_two_node_job(two_nodes, tmp_path, run_dir)
    state = two_nodes.wait(job, timeout=300)
    log = (tmp_path / f"job-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert "srun 8 tasks (2 node(s) x 4)" in log and "master n1:" in log, log[-3000:]

    assert losses(run_dir) == single_node_losses  # exact: every step, every bit

    placed = placements(run_dir)
    assert sorted(placed) == list(range(8))
    mesh = Mesh(tp=2, pp=2, dp=2, procs_per_node=4)
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
    mesh = Mesh(tp=2, pp=2, dp=2, procs_per_node=4)
    expected = [(r, *mesh.coords_of(r), mesh.node_of(r), ("n1", "n2")[mesh.node_of(r)]) for r in range(8)]
    assert [(int(r), int(d), int(p), int(t), int(n), h) for r, d, p, t, n, h in rows] == expected, text


def steps_done(run_dir: Path) -> list[int]:
    try:
        return sorted(losses(run_dir))
    except (OSError, ValueError):
        return []


def complete_steps(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    return sorted(int(d.name.split("_")[1]) for d in root.glob("step_*") if (d / "meta.json").is_file())


def saving_step(run_dir: Path) -> int | None:
    """The step of a save in progress (its .step_<N>.tmp directory exists), if any."""
    for tmp in (run_dir / "checkpoints").glob(".step_*.tmp"):
        return int(tmp.name.split("_")[1].split(".")[0])
    return None
