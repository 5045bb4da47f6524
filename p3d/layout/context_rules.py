"""The rules of context parallelism (``mesh.cp``): docs/context.md.

Each raises :class:`P3DConfigError` with one line: field, value, fix. ``build_plan`` runs ``check_context``, so
p3d-train, the dry run and p3d-plan refuse alike, before any worker starts.
"""

from __future__ import annotations

import math

from p3d.config.errors import P3DConfigError
from p3d.config.schema import Config


def sequence_multiple(cp: int, tp: int, sequence_parallel: bool) -> int:
    """What ``model.seq_len`` must be a multiple of: 2 cp head-tail chunks, and under sequence parallelism a
    rank's s / cp tokens split again over tp."""
    return math.lcm(2 * cp, cp * tp) if sequence_parallel and tp > 1 else 2 * cp


def check_context(cfg: Config, tp: int) -> None:
    cp, m, s = cfg.mesh.cp, cfg.model, cfg.schedule
    if cp == 1:
        return
    multiple = sequence_multiple(cp, tp, bool(s.sequence_parallel))
    if m.seq_len % multiple:
        fix = max(multiple, m.seq_len // multiple * multiple)
        why = (
            f"2 x mesh.cp={2 * cp} head-tail chunks, each rank's {m.seq_len}/cp tokens split over mesh.tp={tp} "
            "by sequence parallelism"
            if multiple != 2 * cp
            else f"each sequence is cut into 2 x mesh.cp={2 * cp} equal chunks, two per cp rank"
        )
        raise P3DConfigError(  # seq_len first; a resume, which may not change it, gets a smaller cp
            f"model.seq_len={m.seq_len} must be a multiple of {multiple} with mesh.cp={cp} ({why})",
            [f"model.seq_len={fix}", *(f"mesh.cp={c}" for c in range(cp - 1, 0, -1))],
        )
