"""The console of a run (p3d.jobs.follow, p3d.jobs.local.Console): the logging rank's log as it grows, its
failure report held back for the launcher to show or drop (issue 50: a lost node's survivor printed a traceback
before a recovery that succeeded)."""

from __future__ import annotations

import io

from p3d.jobs import local
from p3d.jobs.follow import follow, split_failure
from p3d.jobs.restart import failed_tail, raised_error
from p3d.rundir.attempts import start_attempt

STEPS = "step 1/3 | loss 6.24\nstep 2/3 | loss 6.21\n"
FAILURE = (
    "[rank 0] worker failed: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4\n"
    'Traceback (most recent call last):\n  File "loop.py", line 154, in train\nRuntimeError: Connection closed\n'
)


def _written_in_pieces(path, pieces):
    """A ``finished`` for follow(): each call appends the next piece to ``path``; done once all are written."""
    left = list(pieces)

    def finished():
        if left:
            with open(path, "a") as f:
                f.write(left.pop(0))
        return not left

    return finished


def test_a_failure_report_is_held_back_even_when_its_first_line_comes_in_pieces(tmp_path):
    log, out, held = tmp_path / "rank0.log", io.StringIO(), []
    log.write_text("")
    text = STEPS + FAILURE
    cut = len(STEPS) + 7  # "[rank 0" read, "] worker failed: ..." not yet
    follow(log, _written_in_pieces(log, [text[:cut], text[cut:], ""]), out, 0, held=held)
    assert out.getvalue() == STEPS and "".join(held) == FAILURE
    out, held = io.StringIO(), []
    follow(log, lambda: True, out, 0)  # without ``held``: everything, as it is written
    assert out.getvalue() == text


def test_lines_that_only_begin_like_a_failure_are_shown(tmp_path):
    assert split_failure("step 1\n[rank 0] placement: host vm\n") == (
        "step 1\n[rank 0] placement: host vm\n",
        "",
        False,
    )
    assert split_failure("step 1\n[rank 12] wor") == ("step 1\n", "[rank 12] wor", False)  # kept for the next read
    assert split_failure("[WARNING] [real_accelerator.py:213]") == ("[WARNING] [real_accelerator.py:213]", "", False)
    log, out, held = tmp_path / "rank0.log", io.StringIO(), []
    log.write_text("")
    follow(log, _written_in_pieces(log, ["step 1\n[rank 0] pla", "cement: host vm\n[rank", ""]), out, 0, held=held)
    assert out.getvalue() == "step 1\n[rank 0] placement: host vm\n[rank" and held == []


def _console(tmp_path, show_failure: bool) -> tuple[str, bool]:
    log = tmp_path / "logs" / "rank0.log"
    start_attempt(log.parent, 1, "1 worker here")
    with open(log, "a") as f:
        f.write("[rank 0] an earlier attempt's line\n")
    start_attempt(log.parent, 1, "1 worker here")
    with open(log, "a") as f:
        f.write(STEPS + FAILURE)
    out = io.StringIO()
    shown = local.Console(log, out, offset=log.stat().st_size - len(STEPS + FAILURE))
    shown.start()
    wrote = shown.drain(show_failure=show_failure)
    return out.getvalue(), wrote


def test_the_console_drops_the_report_of_a_lost_nodes_survivor_and_shows_any_other(tmp_path):
    assert _console(tmp_path / "lost", show_failure=False) == (STEPS, True)  # p3d.jobs.local._report_lost_nodes
    assert _console(tmp_path / "other", show_failure=True) == (STEPS + FAILURE, True)  # a failure of its own


def test_the_last_lines_of_a_failed_rank_are_its_current_attempts(tmp_path):
    logs = tmp_path / "logs"
    start_attempt(logs, 2, "2 workers here")
    (logs / "rank1.log").write_text((logs / "rank1.log").read_text() + "[rank 1] worker failed: ValueError: old\n")
    start_attempt(logs, 2, "2 workers here")
    assert local._tail(logs / "rank1.log") == ""  # nothing of this attempt yet
    assert raised_error(tmp_path) is None and failed_tail(tmp_path) is None  # the old failure is not this one's
    with open(logs / "rank0.log", "a") as f:
        f.write(FAILURE)  # a lost peer
    with open(logs / "rank1.log", "a") as f:
        f.write("step 4\n[rank 1] worker failed: ValueError: bad data\n")
    assert local._tail(logs / "rank1.log") == "step 4\n[rank 1] worker failed: ValueError: bad data"
    assert raised_error(tmp_path) == "[rank 1] worker failed: ValueError: bad data"
    assert (
        failed_tail(tmp_path, 1)
        == f"p3d: last lines of {logs / 'rank1.log'}:\n[rank 1] worker failed: ValueError: bad data"
    )


def test_the_slurm_recipe_starts_each_srun_as_an_attempt_and_follows_it_less_the_failure(tmp_path, monkeypatch, capsys):
    """``python -m p3d.cli.slurm attempt / follow / failed``, as recipes/slurm/train.sbatch runs them around srun."""
    from pathlib import Path

    from p3d.cli.slurm import main
    from p3d.parallel import hang
    from p3d.rundir.spec import write_spec
    from tests.helpers.runs import typed

    run = tmp_path / "run"
    cfg, plan = typed("mesh=dp2", run_dir=str(run))
    run.mkdir()
    write_spec(cfg, plan, run)
    logs = run / "logs"
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert main(["attempt", str(run)]) == 0
    hang.report_path(logs, 1).write_text('{"rank": 1, "peers": [0]}')
    (logs / "rank1.log").write_text((logs / "rank1.log").read_text() + "[rank 1] p3d: no progress for 60 s\n")
    capsys.readouterr()
    assert main(["attempt", str(run)]) == 0  # the next srun
    offset = int(capsys.readouterr().out)
    log = logs / f"rank{plan.logging_rank}.log"
    assert offset == log.stat().st_size and log.read_text().endswith(
        "p3d: attempt 2: srun of 2 tasks, job 7 (start 1)\n"
    )
    assert hang.read_reports(logs) == {} and (logs / "rank1.hang.attempt1.json").is_file()
    assert "[rank 1] p3d: no progress for 60 s" in (logs / "rank1.log").read_text()  # the hang stacks are kept
    with open(log, "a") as f:
        f.write(STEPS + FAILURE)
    gone = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no such process: srun has ended
    assert main(["follow", str(log), str(offset), str(gone)]) == 0
    assert capsys.readouterr().out == STEPS
    assert main(["failed", str(run)]) == 0
    assert capsys.readouterr().out.startswith(f"p3d: last lines of {log}:\n")
