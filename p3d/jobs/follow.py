"""The console of a run: what the logging rank appends to its log file, copied as it comes.

The worker writes its own log (``<run.dir>/logs/rank<R>.log``), so it never depends on the process that shows
it: a launcher killed or a closed terminal leaves the worker training and its log whole (a worker that
wrote into a pipe to the launcher died at its next line once the launcher was gone). The local launcher
follows the log every 50 ms; the Slurm step every 0.5 s.

A worker's failure report (``[rank N] worker failed: ...`` and its traceback) can be held back: the launcher
decides once it knows why the workers ended. A survivor of a lost node fails with a lost connection, the expected
consequence, not a failure of its own: its report stays in its log and the console says which node was lost
(p3d.jobs.local); any other failure is shown as it was written.
"""

from __future__ import annotations

import codecs
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

FAILED = re.compile(r"\[rank \d+\] worker failed: ")  # p3d.train.worker's first line of a failure
_FAILED_SHAPE = "[rank 0] worker failed: "  # FAILED with every number as 0: what a partial line is checked against


def _may_begin_failure(tail: str) -> bool:
    """Whether ``tail`` (the end of what was read) may be the start of a failure line still being written."""
    return _FAILED_SHAPE.startswith(re.sub(r"\d+", "0", tail))


def split_failure(text: str) -> tuple[str, str, bool]:
    """(what to show now, what to keep for the next read, whether the kept part is a failure report): the text
    before a failure line, or before a last partial line that may begin one; the rest is kept."""
    found = FAILED.search(text)
    if found:
        return text[: found.start()], text[found.start() :], True
    start = text.rfind("[")
    if start >= 0 and _may_begin_failure(text[start:]):
        return text[:start], text[start:], False
    return text, "", False


def follow(
    path: Path,
    finished: Callable[[], bool],
    out: TextIO,
    interval: float,
    offset: int = 0,
    held: list[str] | None = None,
) -> None:
    """Copy what is appended to ``path`` after ``offset`` to ``out`` (a progress bar's carriage returns
    included) until ``finished()`` holds; what was written before that is copied too. With ``held`` (a list), a
    failure report and all that follows it is appended there instead, for the caller to show or drop."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending, failing = "", False
    while True:
        done = finished()
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        offset += len(chunk)
        text, pending = pending + decoder.decode(chunk, final=done), ""
        if held is not None and failing:
            held.append(text)
            text = ""
        elif held is not None:
            text, rest, failing = split_failure(text)
            if failing:
                held.append(rest)
            elif done:  # a last partial line that began like a failure line but ended otherwise
                text += rest
            else:
                pending = rest
        if text:
            try:
                out.write(text)
                out.flush()
            except (OSError, ValueError):  # the console went away (a closed terminal): the log keeps it all
                pass
        if done:
            return
        time.sleep(interval)
