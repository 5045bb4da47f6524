"""``p3d-plan calibrate cluster=slurm`` on the local one-node Slurm (issue 36): the probes run as one srun step on a
node, the file lands where ``calibration=`` points, and p3d-plan with ``cluster=slurm`` uses it from outside the
allocation (the cpu model and cores of a cluster's nodes are not compared with the planning host's)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.runs import output_tail, p3d_plan

QUICK = {"P3D_CALIBRATE_QUICK": "1"}  # every call outside any allocation (SLURM_* dropped)


@pytest.mark.timeout(420)
def test_calibrate_runs_on_a_node_and_the_plan_uses_it(slurm_cluster, tmp_path):
    out = tmp_path / "cal.json"
    made = p3d_plan(
        "calibrate",
        "cluster=slurm",
        "cluster.time=10",
        "model=tiny",
        "mesh=dp2",
        f"calibration={out}",
        env=QUICK,
        drop_env="SLURM_",
    )
    assert made.returncode == 0, output_tail(made)
    assert "on one node of the cluster: srun --nodes=1 --ntasks=1 --exclusive --cpus-per-task=2" in made.stdout
    raw = json.loads(out.read_text())
    assert raw["machine"]["device"] == "cpu" and raw["compute"]["blocks"]

    moved = dict(raw, machine={**raw["machine"], "cpu_model": "the nodes' cpu", "cores": 64})  # another machine
    other = tmp_path / "nodes.json"
    other.write_text(json.dumps(moved))
    plan = p3d_plan(
        "cluster=slurm", "model=tiny", "mesh=dp2", f"calibration={other}", "format=json", env=QUICK, drop_env="SLURM_"
    )
    assert plan.returncode == 0, output_tail(plan)
    assert json.loads(plan.stdout)["assumptions"]["calibration"] == str(other)
    local = p3d_plan("model=tiny", "mesh=dp2", f"calibration={other}")  # a local run trains here: refused
    assert local.returncode == 2 and 'cpu_model="the nodes\' cpu"' in local.stderr, output_tail(local)
