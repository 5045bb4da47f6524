"""The one error a config that cannot run raises; its own module so that any layer can raise it."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class P3DConfigError(ValueError):
    """A config that cannot run. The message is one line: field, value, fix.

    A rule that can name several fixes gives them as ``fixes``, each one or more overrides (``mesh.pp=2``,
    ``mesh=pp2``, ``schedule.pipeline=1f1b schedule.virtual_stages=1``), the preferred first, or a function that
    lists them (made only when asked: the planner's search meets thousands of refusals and reads none). The
    message is ``problem; try <the first>`` until :meth:`settled` keeps only those the same command accepts
    (``p3d.layout.fixes.settle``, run by ``build_plan`` and ``check_config``)."""

    def __init__(self, message: str, fixes: Sequence[str] | Callable[[], Sequence[str]] = ()):
        super().__init__(message)
        self.problem = message
        self._fixes = fixes

    @property
    def fixes(self) -> tuple[str, ...]:
        if callable(self._fixes):
            self._fixes = tuple(self._fixes())
        return tuple(self._fixes)

    def __str__(self) -> str:
        return f"{self.problem}; try {self.fixes[0]}" if self.fixes else self.problem

    def settled(self, accepted: Sequence[str]) -> P3DConfigError:
        """The same refusal suggesting ``accepted`` only (the first two: ``try A, or B``); none: the problem alone.
        The result has no fixes left to settle."""
        shown = ", or ".join(accepted[:2])
        return P3DConfigError(f"{self.problem}; try {shown}" if shown else self.problem)
