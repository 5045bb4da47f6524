"""Every start of a run's workers is an attempt, and every attempt's logs are kept (issue 50).

An attempt: the first launch, each restart within one (``train.max_restarts``), each re-plan of an elastic run on the
nodes left, each ``train.resume=auto`` launch, each ``srun`` of the Slurm recipe and each start of a requeued job. Each
worker appends to ``logs/rank<N>.log``; before an attempt's workers start, every rank log gets one header line

    [p3d 2025-01-01 12:00:00] p3d: attempt 2: 2 workers on this machine

(the logs of ranks an elastic run no longer has get it too: nothing after it is theirs), so a log holds every attempt
in order, the failure and the hang stacks of an earlier one included, and what follows the last header is the
current one (:func:`current_attempt`: the launcher's last lines of a failed rank, the Slurm restart's cause). The hang
reports of the attempt before (``rank<N>.hang.json``, which the launcher watches for) are set aside as
``rank<N>.hang.attempt<K>.json``, where the watch no longer finds them.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

HANG_SUFFIX = ".hang.json"  # logs/rank<N>.hang.json: a rank's hang report (p3d.parallel.hang) in this attempt
HEADER = re.compile(r"^\[p3d [^\]\n]*\] p3d: attempt (\d+)\b[^\n]*\n?", re.M)


def hang_report(logs: Path, rank: int) -> Path:
    return logs / f"rank{rank}{HANG_SUFFIX}"


def earlier_hang_report(logs: Path, rank: int, attempt: int) -> Path:
    return logs / f"rank{rank}.hang.attempt{attempt}.json"


def current_attempt(text: str) -> str:
    """What a rank log holds after its last attempt header (all of it in a log without one)."""
    ends = [m.end() for m in HEADER.finditer(text)]
    return text[ends[-1] :] if ends else text


def attempts_logged(logs: Path) -> int:
    """The number of the last attempt whose header rank 0's log holds; 0 when none."""
    path = logs / "rank0.log"
    if not path.is_file():
        return 0
    last = 0
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("[p3d ") and (m := HEADER.match(line)):
                last = int(m.group(1))
    return last


def start_attempt(logs: Path, world: int, what: str) -> int:
    """Before the workers of an attempt start: set the previous attempt's hang reports aside and append the new
    attempt's header (``what``: how it runs) to the logs of ranks 0..world-1 and of any other rank log there.
    Returns the attempt's number."""
    logs.mkdir(parents=True, exist_ok=True)
    before = attempts_logged(logs)
    for report in logs.glob(f"rank*{HANG_SUFFIX}"):
        if (number := report.name[4 : -len(HANG_SUFFIX)]).isdigit():
            report.replace(earlier_hang_report(logs, int(number), before))
    attempt = before + 1
    header = f"[p3d {time.strftime('%Y-%m-%d %H:%M:%S')}] p3d: attempt {attempt}: {what}\n"
    ranks = set(range(world)) | {int(p.stem[4:]) for p in logs.glob("rank*.log") if p.stem[4:].isdigit()}
    for rank in sorted(ranks):
        with open(logs / f"rank{rank}.log", "a") as log:
            log.write(header)
    return attempt
