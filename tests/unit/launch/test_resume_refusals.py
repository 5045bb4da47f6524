"""A resume's refusals (issue 50, item 6): the fix suggested is one the resume accepts (p3d.config.resume_rules
refuses a new model.seq_len), and the value's source is the resumed run's spec, where it came from, not the group
file this command line would have composed."""

from __future__ import annotations

import json
import shutil

import pytest

from p3d.config.errors import P3DConfigError
from p3d.launch.check import check_resume
from p3d.rundir.spec import write_spec
from tests.helpers.runs import suggested_fixes, typed


def _resumable(tmp_path, *first_run: str):
    """A run directory whose run_spec.yaml is the first run's, and a checkpoint of its step 1 (meta and spec)."""
    run = tmp_path / "run"
    cfg, plan = typed(*first_run, run_dir=str(run))
    spec = write_spec(cfg, plan, run)
    ckpt = run / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    shutil.copy(spec, ckpt / spec.name)
    (ckpt / "meta.json").write_text(json.dumps({"step": 1}))
    return run, spec, ckpt


CASES = {
    # the first run's command line, the resume's, the refusal's start (the source: the spec)
    "cp4 on a 36-token run": (
        ("mesh=single", "model.seq_len=36"),
        ("mesh.cp=4",),
        "model.seq_len=36 (resumed run {spec}) must be a multiple of 8 with mesh.cp=4",
    ),
    "HSDP resumed on one replica": (
        ("mesh=dp4", "zero=stage3", "zero.shard_size=2"),
        ("mesh=tp2_pp2",),
        "zero.shard_size=2 (resumed run {spec}) must divide the dp degree 1",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_resume_refusal_names_the_spec_and_suggests_what_the_resume_accepts(case, tmp_path):
    first, resume, start = CASES[case]
    run, spec, ckpt = _resumable(tmp_path, *first)
    again = ("train.resume=auto", "train.steps=2", *resume)
    with pytest.raises(P3DConfigError) as err:
        typed(*again, run_dir=str(run))
    message = str(err.value)
    assert message.startswith(start.format(spec=spec)), message
    fixes = suggested_fixes(message)
    assert fixes, message
    for fix in fixes:
        cfg, _ = typed(*again, *fix, run_dir=str(run))  # the rules accept it ...
        check_resume(cfg, ckpt, 1)  # ... and so does the resume (model.seq_len may not change)


def test_a_value_this_command_line_gives_is_not_the_specs(tmp_path):
    run, _, _ = _resumable(tmp_path, "mesh=single", "model.seq_len=36")
    with pytest.raises(P3DConfigError) as err:
        typed("train.resume=auto", "train.steps=2", "mesh.cp=4", "model.seq_len=36", run_dir=str(run))
    assert str(err.value).startswith("model.seq_len=36 must be"), str(err.value)  # with_source says: command line


def test_trace_steps_named_on_a_resume_must_be_steps_it_trains(tmp_path, monkeypatch):
    """Issue 64, item 22: ``train.trace_steps=[1]`` on a resume from step 1 was silently ignored, where a fresh run
    refuses a step outside its own. Steps the resumed run's spec carries (traced before) are not asked again."""
    import p3d.launch.check as check

    run, spec, ckpt = _resumable(tmp_path, "mesh=single", "train.trace_steps=[1]")
    line = ["train.resume=auto", "train.steps=3", "train.trace_steps=[1,3]"]
    monkeypatch.setattr(check, "given_overrides", lambda: line)
    cfg, _ = typed(*line, run_dir=str(run))
    with pytest.raises(P3DConfigError) as err:
        check_resume(cfg, ckpt, 1)
    assert str(err.value) == (
        f"train.trace_steps=[1, 3]: step 1 was trained before checkpoint {ckpt} (step 1), which this resume starts "
        "from; try train.trace_steps=[3]"
    )
    monkeypatch.setattr(check, "given_overrides", lambda: line[:2])  # the spec's [1]: left to the run before
    check_resume(typed(*line[:2], "train.trace_steps=[1]", run_dir=str(run))[0], ckpt, 1)
