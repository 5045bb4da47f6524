"""Every attempt of a run keeps its logs (p3d.rundir.attempts, issue 50): a header per attempt in every rank log,
what follows the last one the current attempt, the hang reports of the one before kept under another name."""

from __future__ import annotations

import json
import re

from p3d.parallel import hang
from p3d.rundir.attempts import attempts_logged, current_attempt, earlier_hang_report, start_attempt

HEADER = re.compile(r"^\[p3d \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] p3d: attempt (\d+): (.*)$")


def test_each_attempt_appends_a_header_to_every_rank_log_and_keeps_what_was_there(tmp_path):
    logs = tmp_path / "logs"
    assert start_attempt(logs, 4, "4 workers here") == 1
    for rank in range(4):
        with open(logs / f"rank{rank}.log", "a") as f:
            f.write(f"[rank {rank}] step 1\n[rank {rank}] worker failed: RuntimeError: boom\nTraceback ...\n")
    assert start_attempt(logs, 2, "2 workers here") == 2  # an elastic run on the nodes left: 2 ranks
    with open(logs / "rank0.log", "a") as f:
        f.write("[rank 0] step 2\n")
    assert attempts_logged(logs) == 2
    text = (logs / "rank0.log").read_text()
    lines = text.splitlines()
    assert [m.groups() for m in map(HEADER.match, lines) if m] == [
        ("1", "4 workers here"),
        ("2", "2 workers here"),
    ]
    assert "[rank 0] worker failed: RuntimeError: boom" in text  # the first attempt's failure is kept
    assert current_attempt(text) == "[rank 0] step 2\n"
    # a rank the run no longer has: its log says that nothing after the header is its own
    rank3 = (logs / "rank3.log").read_text()
    assert HEADER.match(rank3.splitlines()[-1]) and current_attempt(rank3) == ""
    assert current_attempt("no header here\n") == "no header here\n"


def test_the_hang_reports_of_an_attempt_are_kept_aside_when_the_next_one_starts(tmp_path):
    logs = tmp_path / "logs"
    start_attempt(logs, 2, "2 workers here")
    for rank in (0, 1):
        hang.report_path(logs, rank).write_text(json.dumps({"rank": rank, "peers": [1 - rank]}))
    assert sorted(hang.read_reports(logs)) == [0, 1]
    start_attempt(logs, 2, "2 workers here")
    assert hang.read_reports(logs) == {}  # the launcher's watch sees no hang of the new attempt
    kept = earlier_hang_report(logs, 1, 1)
    assert kept.name == "rank1.hang.attempt1.json" and json.loads(kept.read_text()) == {"rank": 1, "peers": [0]}
    assert sorted(p.name for p in logs.iterdir()) == [
        "rank0.hang.attempt1.json",
        "rank0.log",
        "rank1.hang.attempt1.json",
        "rank1.log",
    ]
