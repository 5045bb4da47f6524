"""The console of a run: what the logging rank appends to its log file, copied as it comes.

The worker writes its own log (``<run.dir>/logs/rank<R>.log``), so it never depends on the process that shows
it: a launcher killed or a closed terminal leaves the worker training and its log whole (a worker that
wrote into a pipe to the launcher died at its next line once the launcher was gone). The local launcher
follows the log every 50 ms; the Slurm step every 0.5 s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO


def follow(path: Path, finished: Callable[[], bool], out: TextIO, interval: float, offset: int = 0) -> None:
    """Copy what is appended to ``path`` after ``offset`` to ``out`` (a progress bar's carriage returns
    included) until ``finished()`` holds; what was written before that is copied too."""
    while True:
        done = finished()
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        if chunk:
            offset += len(chunk)
            try:
                out.write(chunk.decode(errors="replace"))
                out.flush()
            except (OSError, ValueError):  # the console went away (a closed terminal): the log keeps it all
                pass
        if done:
            return
        time.sleep(interval)
