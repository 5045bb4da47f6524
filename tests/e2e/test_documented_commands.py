"""Every command line of README.md and the recipe headers, typed as a new user types it: from a fresh
working directory, relative paths, the console scripts on PATH. The Slurm lines run on the local
Slurm in ``tests/cluster/slurm/test_documented_slurm.py``; which line runs how is ``tests/helpers/documented.py``."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.documented import CASES, argv_of, last_step, metrics_files, run_line


def _setup_trained_run1(cwd: Path) -> None:
    done = run_line("p3d-train run.dir=outputs/run1", cwd, ("train.steps=2", "train.save_every=2"))
    assert done.returncode == 0, done.stderr[-3000:]


def _setup_jsonl_corpus(cwd: Path) -> None:
    """A user's own JSON-lines corpus: a text field per line, from the Python sources of the stdlib."""
    import inspect
    import json as json_mod

    (cwd / "corpus").mkdir()
    for part, mod in enumerate((json_mod, re, subprocess)):
        src = inspect.getsource(mod)
        docs = [src[i : i + 2000] for i in range(0, len(src), 2000)]
        with open(cwd / "corpus" / f"part{part}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)


def _setup_txt_corpus(cwd: Path) -> None:
    """A directory of plain .txt files with paragraphs, as a user has them."""
    import inspect

    (cwd / "corpus").mkdir()
    for part, mod in enumerate((json, re, subprocess)):
        paragraphs = [p.strip() for p in inspect.getsource(mod).split("\n\n") if p.strip()]
        (cwd / "corpus" / f"notes{part}.txt").write_text("\n\n".join(paragraphs) + "\n")


SETUPS = {"trained_run1": _setup_trained_run1, "jsonl_corpus": _setup_jsonl_corpus, "txt_corpus": _setup_txt_corpus}


def check_ran(command: str, cwd: Path, started: float, result: subprocess.CompletedProcess) -> None:
    """What a user sees after a documented line that should work: status 0, and the runs it promises."""
    assert result.returncode == 0, f"{command!r} exited {result.returncode}:\n{result.stderr[-4000:]}"
    words = command.split()
    if words[0] in ("p3d-plan",):
        out = result.stdout
        if "format=json" in command:
            layout = json.loads(out)["layout"]
            assert layout["tp"] * layout["pp"] * layout["dp"] == 1024 * 8 and json.loads(out)["fits"]
        elif "mesh=auto" in command:  # a ranking, then the best layout's plan; an MoE's with its experts
            assert "mesh=auto: 5 best" in out, out[-2000:]
            if "moe" in command or "mixtral" in command:
                assert " ep " in out and "active per token" in out, out[-2000:]
            elif "cluster=mixed" in command:  # a heterogeneous cluster: the split, each group's memory, the gap
                assert "heterogeneous plan:" in out and "1 x a100_80gb" in out and "gap to the ideal" in out, out
            else:  # a long sequence: the search tries cp, and the best layout splits the sequence
                assert " cp " in out and "tokens of a sequence" in out, out[-2000:]
        elif "zero=stage3" in command:  # docs/precision.md: the float8 speedup beside the published figures
            assert "note: float8: train.fp8=tensorwise predicts" in out and "published (torchao" in out, out[-2000:]
            assert "does not fit" not in out and "would refuse" not in out, out[-2000:]
        else:  # the layout the line names (the README's: tp8_pp8), and its bubble
            tp, pp = (re.search(rf"mesh\.{d}=(\d+)", command) for d in ("tp", "pp"))
            layout = f"tp={tp[1]} pp={pp[1]}" if tp and pp else "tp=8 pp=8"
            assert layout in out and "bubble" in out, out[-2000:]
        assert not any(cwd.iterdir()), "p3d-plan wrote files"
        return
    if "dry_run=true" in command:
        assert "closed form" in result.stdout and "match" in result.stdout, result.stdout[-2000:]
        assert not any(cwd.iterdir()), f"a dry run wrote {sorted(cwd.rglob('*'))}"
        return
    if words[0] == "p3d-tokenizer":
        assert (cwd / "tok.json").is_file()
        return
    if words[0] == "p3d-prepare":
        assert json.loads((cwd / "store" / "manifest.json").read_text())["train"]["tokens"] > 0
        return
    new = [m for m in metrics_files(cwd) if m.stat().st_mtime >= started]  # a resumed run appends to its own
    points = len(re.search(r"mesh=(\S+)", command).group(1).split(",")) if "-m" in words else 1
    assert len(new) == points, f"{command!r}: expected {points} new run(s), found {new}\n{result.stdout[-2000:]}"
    steps = int(re.findall(r"train\.steps=(\d+)", command)[-1])  # the last value given wins, as in Hydra
    for m in new:
        assert last_step(m) == steps, f"{m}: last step {last_step(m)}, expected {steps}"


def check_export(cwd: Path) -> None:
    bare = "p3d-export run.dir=outputs/run1 out=hf/run1"
    done = run_line(bare, cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (cwd / "hf" / "run1" / "config.json").is_file()
    step = max(int(p.name.split("_")[-1]) for p in (cwd / "outputs" / "run1" / "checkpoints").glob("step_*"))
    every = f"{bare} step={step} max_shard_gb=5 overwrite=true"
    done = run_line(every, cwd)
    assert done.returncode == 0, done.stderr[-3000:]


def _resume_keeps_the_run(cwd: Path, result: subprocess.CompletedProcess) -> None:
    """Issue 31: the resume re-read the defaults (``logger.name: wandb -> none``, ``train.eval_every: 2 -> 0``,
    ``train.save_every: 2 -> 0``, and the default 8-rank mesh without ``mesh=``). It keeps the run's mesh,
    logger, validation and checkpoints, and says only what the command line changed."""
    from p3d.checkpoint import find as ckpt_find
    from p3d.rundir.spec import read_spec

    said = [line for line in result.stdout.splitlines() if line.startswith("p3d: ") and " -> " in line]
    assert said == ["p3d: train.steps: 4 -> 6 from step 5"], result.stdout[-3000:]
    assert "starting 2 workers" in result.stdout  # pp2, not the default dp2_pp2_tp2
    run = cwd / "outputs" / "run1"
    cfg, _ = read_spec(run)
    assert (cfg.mesh.name, cfg.logger.name, cfg.train.eval_every, cfg.train.save_every) == ("pp2", "wandb", 2, 2)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] and "val_loss" in records[-1]
    assert ckpt_find.find(run, "auto").name == "step_00000006"
    assert len(list((run / "wandb").glob("offline-run-*"))) == 2  # W&B logged the resumed segment too


def _traced_step_is_drawn(cwd: Path, result: subprocess.CompletedProcess) -> None:
    """docs/timeline.md: the traced step's file, then the next line, ``p3d-report runs/traced``, draws it."""
    assert (cwd / "runs" / "traced" / "traces" / "step_2.json").is_file()
    done = run_line("p3d-report runs/traced", cwd)
    assert done.returncode == 0 and "timeline of point traced:" in done.stdout, done.stdout[-2000:]
    assert (cwd / "runs" / "traced" / "traces" / "step_2_timeline.png").is_file()


CHECKS = {"resume_keeps_the_run": _resume_keeps_the_run, "traced_step_is_drawn": _traced_step_is_drawn}
RUNNABLE = [cmd for cmd, case in CASES.items() if case.kind in ("run", "refused", "dry")]
FOLLOWERS = {follower for case in CASES.values() for follower in case.then}


@pytest.mark.timeout(1500)
@pytest.mark.parametrize(
    "command",
    [pytest.param(c, marks=pytest.mark.slow) if CASES[c].slow else c for c in RUNNABLE if c not in FOLLOWERS],
)
def test_documented_line(command, tmp_path):
    cwd = tmp_path / "work dir"  # a space, as in many users' home folders
    cwd.mkdir()
    case = CASES[command]
    if case.setup:
        SETUPS[case.setup](cwd)
    for line in (command, *case.then):
        line_case = CASES.get(line, case)
        if line.startswith("p3d-export"):
            check_export(cwd)
            continue
        if line.startswith("p3d-report"):  # the sweep directory this user's sweep printed
            sweep = next(p for p in (cwd / "multirun").glob("*/*") if p.is_dir())
            done = run_line(f"p3d-report {sweep.relative_to(cwd)}", cwd)
            assert done.returncode == 0 and "p3d-report:" in done.stdout, done.stderr[-2000:]
            continue
        if line_case.kind == "dry":  # the config this line would freeze on its GPU nodes, checked by a dry run
            overrides = [w for w in argv_of(line, cwd)[1] if "=" in w and not w.startswith("--")]
            line = " ".join(["p3d-train", *overrides])
        started = time.time()
        result = run_line(line, cwd, line_case.extra)
        if line_case.kind == "refused":
            lines = result.stderr.strip().splitlines()
            assert result.returncode == 2, f"{line!r} exited {result.returncode}:\n{result.stderr[-3000:]}"
            assert len(lines) == 1 and re.search(line_case.expect, lines[0]), result.stderr[-3000:]
            assert not any(cwd.iterdir()), f"a refused line wrote {sorted(cwd.rglob('*'))}"
            continue
        check_ran(" ".join([line, *line_case.extra]), cwd, started, result)
        if line_case.check:
            CHECKS[line_case.check](cwd, result)
