"""Relative paths (p3d.rundir.paths), in-process: resolved against the directory given, frozen absolute in the
run spec, the rendezvous file's URL absolute."""

from __future__ import annotations

from pathlib import Path

import pytest

# ---- the pieces, without processes


def test_paths_resolve_against_the_given_directory(tmp_path):
    from p3d.rundir.paths import absolute, absolute_globs, hydra_output_overrides, missing_run_dirs, remove_if_empty

    assert absolute("runs/exp1", tmp_path) == tmp_path / "runs" / "exp1"
    assert absolute("~/x", tmp_path) == Path.home() / "x"
    assert absolute("a/../b c", tmp_path) == tmp_path / "b c"
    assert absolute_globs("data/*.txt, /abs/*.jsonl", tmp_path) == f"{tmp_path}/data/*.txt,/abs/*.jsonl"
    assert hydra_output_overrides(["run.dir=runs/a"], tmp_path) == [
        "run.dir=runs/a",
        f"hydra.run.dir='{tmp_path}/runs/a'",
        "hydra.output_subdir=null",  # a single run writes no .hydra/: run_spec.yaml is its config
    ]
    assert hydra_output_overrides(["run.dir=a", "hydra.run.dir=b"], tmp_path) == [
        "run.dir=a",
        "hydra.run.dir=b",
        "hydra.output_subdir=null",
    ]
    # the directories Hydra will make for a run that may be refused, and taking back only empty ones
    (tmp_path / "runs").mkdir()
    made = missing_run_dirs(["run.dir=runs/a/b"], tmp_path)
    assert made == [tmp_path / "runs" / "a" / "b", tmp_path / "runs" / "a"]
    assert missing_run_dirs(["-m", "run.dir=runs/a/b"], tmp_path) == []
    (tmp_path / "runs" / "a" / "b").mkdir(parents=True)
    remove_if_empty(made)
    assert (tmp_path / "runs").is_dir() and not (tmp_path / "runs" / "a").exists()
    (tmp_path / "runs" / "a" / "b").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "b" / "kept").write_text("")
    remove_if_empty(made)
    assert (tmp_path / "runs" / "a" / "b" / "kept").is_file()
    assert hydra_output_overrides(["-m", "run.dir=s", "train.seed=1,2"], tmp_path) == [
        "-m",
        "train.seed=1,2",
        f"hydra.sweep.dir='{tmp_path}/s'",
    ]
    assert hydra_output_overrides(["train.steps=2"], tmp_path) == ["train.steps=2", "hydra.output_subdir=null"]
    assert hydra_output_overrides(["-m", "train.steps=2,3"], tmp_path) == ["-m", "train.steps=2,3"]


def test_config_paths_are_frozen_absolute(tmp_path, monkeypatch):
    from p3d.launch.check import typed_config
    from tests.helpers.runs import compose

    monkeypatch.chdir(tmp_path)
    cfg = typed_config(
        compose(
            "data=files",
            "data.path='corpus/*.txt,more/x.jsonl'",
            "data.tokenizer=tok/t.json",
            "train.resume=runs/old/checkpoints/step_00000002",
            "tokenizer.out=tok/new.json",
            run_dir="runs/exp1",
        )
    )
    assert cfg.run.dir == str(tmp_path / "runs/exp1")
    assert cfg.data.path == f"{tmp_path}/corpus/*.txt,{tmp_path}/more/x.jsonl"
    assert cfg.data.tokenizer == str(tmp_path / "tok/t.json")
    assert cfg.train.resume == str(tmp_path / "runs/old/checkpoints/step_00000002")
    assert cfg.tokenizer.out == str(tmp_path / "tok/new.json")
    keep = typed_config(compose("train.resume=auto", run_dir="/abs/run"))
    assert (keep.data.tokenizer, keep.train.resume, keep.run.dir) == ("byte", "auto", "/abs/run")


def test_file_rendezvous_url_is_absolute():
    from p3d.parallel.rendezvous import file_url

    assert file_url(Path("/tmp/a b/.rendezvous-x")) == "file:///tmp/a b/.rendezvous-x"  # torch does not unquote
    with pytest.raises(ValueError):
        file_url(Path("runs/exp1/.rendezvous-x"))
