"""What p3d says to the person at the terminal: one place for the prefix, the stream and the flush.

User-facing lines (progress, where the run is, why it stopped) go through ``say`` (stdout) and
``error`` (stderr, one line, the caller returns an exit status). ``logging`` is kept for diagnostics
a user does not need to see (``p3d.deepspeed``, ``p3d.data``), silent unless configured. Rank logs
carry the worker's own ``[rank N]`` lines; the launcher shows the logging rank's on the console.
"""

from __future__ import annotations

import sys
from typing import TextIO


def say(message: str, prog: str = "p3d", stream: TextIO | None = None) -> None:
    """``<prog>: message`` on stdout (or ``stream``), flushed: the line is visible before what follows."""
    print(f"{prog}: {message}" if prog else message, file=stream or sys.stdout, flush=True)


def error(message: str, prog: str = "p3d") -> None:
    """``<prog>: message`` on stderr, flushed; the caller decides the exit status."""
    say(message, prog, sys.stderr)


def human_count(n: int) -> str:
    """A count in the unit that fits, to four significant digits: 262.7K, 124.4M, 70.55B, 1.25T (below a
    thousand, the number itself)."""
    value = float(n)
    for unit in ("", "K", "M", "B"):
        if abs(float(f"{value:.4g}")) < 1000:  # rounded first: 999,960 is 1000K, so 1M
            return str(n) if not unit else f"{value:.4g}{unit}"
        value /= 1000
    return f"{value:,.4g}T" if abs(value) < 1000 else f"{value:,.0f}T"
