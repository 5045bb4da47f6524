"""``p3d-plan calibrate`` as a user runs it (issue 36): a quick calibration of model=tiny dp2 x tp2 (its block
alone and on two tp ranks, DeepSpeed's gradient copies, the collectives) writes a file this machine accepts;
p3d-plan and ``p3d-train mesh=auto ... dry_run=true`` use it; a copy made with another torch is refused in one line
(exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p3d.planner import calibration
from tests.helpers.runs import output_tail, p3d_plan, p3d_train


@pytest.mark.timeout(300)
def test_quick_calibration_is_written_accepted_and_used(tmp_path):
    out = tmp_path / "cal.json"
    made = p3d_plan("calibrate", "model=tiny", "mesh=dp2_tp2", f"calibration={out}", env={"P3D_CALIBRATE_QUICK": "1"})
    assert made.returncode == 0, output_tail(made)
    raw = json.loads(out.read_text())
    calibration.check_identity(raw, "cpu", str(out))
    assert {(b["tp"], b["recompute"]) for b in raw["compute"]["blocks"]} == {(2, "none")}
    if calibration.cores() >= 2:  # the block again on 2 real tp ranks, its all-reduces in
        assert [(b["tp"], b["recompute"]) for b in raw["compute"]["tp_blocks"]] == [(2, "none")]
    assert raw["compute"]["engine_copy_s_per_param"] > 0  # dp2: DeepSpeed's copies around the all-reduce
    assert any((f["op"], f["n"]) == ("all_reduce", 2) for f in raw["collectives"]["fits"])
    if calibration.cores() >= 2:  # DeepSpeed's reduce timed whole on 2 real ranks (dp2: groups of 2)
        reduce = [f for f in raw["collectives"]["fits"] if f["op"] == "engine_reduce"]
        assert [f["n"] for f in reduce] == [2] and reduce[0]["points"][0][1] > 0, reduce
    assert "use it: p3d-plan" in made.stdout

    plan = p3d_plan("model=tiny", "mesh=dp2_tp2", f"calibration={out}", "format=json")
    assert plan.returncode == 0, output_tail(plan)
    assert json.loads(plan.stdout)["assumptions"]["calibration"] == str(out)

    dry = p3d_train(
        "model=tiny", "mesh=auto", "cluster.gpus_per_node=4", f"calibration={out}", "dry_run=true", timeout=180
    )
    assert dry.returncode == 0, output_tail(dry)

    doctored = tmp_path / "other-torch.json"
    raw["software"]["torch"] = "1.0.0"
    doctored.write_text(json.dumps(raw))
    refused = p3d_plan("model=tiny", "mesh=dp2", f"calibration={doctored}")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, output_tail(refused)
    assert f"calibration={Path(doctored)}" in lines[0] and "p3d-plan calibrate" in lines[0]
