"""A submission refused after the run was frozen (sbatch refused it: nothing was submitted) leaves the run directory
as it found it (issue 64, item 21: run_spec.yaml, deepspeed_config.json and specs/ stayed in outputs/...)."""

from __future__ import annotations

import pytest

from p3d.config.errors import P3DConfigError
from p3d.launch.freeze import freeze, undone_if_refused
from tests.helpers.runs import typed


def test_a_refused_submission_takes_back_what_the_freeze_wrote(tmp_path):
    run = tmp_path / "run"
    cfg, plan = typed("mesh=pp2", run_dir=str(run))  # 1f1b: DeepSpeed's JSON too
    with pytest.raises(P3DConfigError), undone_if_refused(run):
        spec = freeze(cfg, plan, run)
        assert {p.name for p in run.iterdir()} == {"run_spec.yaml", "deepspeed_config.json", "specs"}
        raise P3DConfigError("cluster.partition=nopart: sbatch refused the job")
    assert list(run.iterdir()) == []
    spec = freeze(cfg, plan, run)  # a run there already: a refused resume puts back its files as they were
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    resumed, plan2 = typed("mesh=pp2", "schedule.pipeline=interleaved_1f1b", run_dir=str(run))
    with pytest.raises(P3DConfigError), undone_if_refused(run):
        freeze(resumed, plan2, run)
        assert spec.read_bytes() != before[spec.relative_to(run)]
        raise P3DConfigError("refused")
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
