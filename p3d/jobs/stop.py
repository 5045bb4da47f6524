"""How the local launcher passes stop signals on to its workers.

- SIGTERM / SIGUSR1 (Slurm's time limit, preemption, ``kill``): forwarded as they are; each worker
  finishes the step in flight, the run saves a checkpoint and the workers exit with
  ``exit_codes.PREEMPTED``.
- The first SIGINT (Ctrl-C) does the same (the workers get SIGTERM), with one console line saying so.
- A second SIGINT aborts at once: the workers are killed (SIGKILL: no traceback from any rank). A save can be
  cut anywhere (while its files are written, between its rename and ``latest``, while old checkpoints are
  pruned), so once the workers are gone the launcher settles the checkpoints (``p3d.checkpoint.find.settle``: the
  unfinished save dropped, ``train.keep_last`` kept, ``latest`` at the newest complete one) and says what is
  on disk. If the workers had already saved and exited by then, the line says so and the run ends as after
  one Ctrl-C (``exit_codes.PREEMPTED``).
- Once the workers have stopped, a Ctrl-C is answered with one line until p3d-train exits: never a
  KeyboardInterrupt in the launcher's own teardown (its atexit functions included).

Workers run in their own sessions (``start_new_session``), so a terminal's Ctrl-C, which goes to the
whole foreground process group, reaches only the launcher, and every worker hears it from here, once.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping
from typing import TextIO

from p3d import exit_codes
from p3d.checkpoint.find import on_disk, settle
from p3d.jobs.forked import Worker

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Installed while the workers run (:meth:`install`, :meth:`restore`); ``received`` lists the
    signals the launcher got."""

    def __init__(self, procs: Mapping[int, Worker], console: TextIO, run_dir=None, keep_last: int = 0):
        """``run_dir`` and ``keep_last`` (its ``train.keep_last``): the checkpoints a second Ctrl-C settles and
        reports; ``received`` also counts a Ctrl-C between two launches of a run with restarts (no restart)."""
        self.procs = procs
        self.console = console
        self.run_dir, self.keep_last = run_dir, keep_last  # whose checkpoints a second Ctrl-C reports
        self.received: list[int] = []
        self.aborted = False
        self._old: dict[int, Callable | int | None] = {}

    def install(self) -> StopSignals:
        self._old = {s: signal.signal(s, self._handle) for s in FORWARDED}
        return self

    def restore(self) -> None:
        """SIGTERM and SIGUSR1 as they were; SIGINT answered by :meth:`_after_stop` from now on."""
        for s, h in self._old.items():
            signal.signal(s, self._after_stop if s == signal.SIGINT else h)

    def settled(self) -> str:
        """After an abort, once every worker is reaped: the checkpoints settled, and what is on disk."""
        return f"p3d: {settle(self.run_dir, self.keep_last)}" if self.run_dir is not None else ""

    def _after_stop(self, signum: int, _frame) -> None:
        self.received.append(signum)
        self._say("p3d: Ctrl-C: the workers have already stopped; p3d-train is exiting")

    def _send(self, signum: int) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signum)
                except ProcessLookupError:
                    pass

    def _say(self, line: str) -> None:
        try:
            self.console.write(line + "\n")
            self.console.flush()
        except (OSError, RuntimeError, ValueError):  # a closed console or a write already in progress
            pass

    def _handle(self, signum: int, _frame) -> None:
        first_int = signum == signal.SIGINT and signal.SIGINT not in self.received
        self.received.append(signum)
        if signum != signal.SIGINT:
            self._send(signum)
        elif first_int:
            self._say(
                "p3d: Ctrl-C: the workers finish the step in flight, save a checkpoint and stop "
                "(exit status 75; resume with train.resume=auto); press Ctrl-C again to abort without saving"
            )
            self._send(signal.SIGTERM)
        elif not any(p.poll() is None for p in self.procs.values()):
            # the first Ctrl-C's save was quicker than the second press: nothing is left to abort
            saved = all(p.returncode == exit_codes.PREEMPTED for p in self.procs.values())
            where = f"; {on_disk(self.run_dir)}" if self.run_dir is not None else ""
            self._say(
                f"p3d: second Ctrl-C: the workers had already {'saved a checkpoint and ' if saved else ''}stopped"
                + where
            )
        else:
            self.aborted = True
            self._send(signal.SIGKILL)
            self._say("p3d: second Ctrl-C: stopping the workers at once, without finishing the step in flight")
