"""File modes under a umask: what p3d writes must be as readable as the umask allows (issue 31), like
the files ``open()`` and ``mkdir()`` create."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def umask(mask: int) -> Iterator[None]:
    """This process's umask set to ``mask`` for the block (tests run in the main thread), then restored."""
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def wrong_modes(root: Path, mask: int) -> dict[str, str]:
    """Every file and directory under ``root`` (``root`` too) whose mode is not what open() / mkdir()
    give under ``mask``: {path relative to root: "0o600, want 0o644"}; empty when all are right."""
    wrong = {}
    for p in (root, *sorted(root.rglob("*"))):
        got = stat.S_IMODE(p.lstat().st_mode)
        want = (0o777 if p.is_dir() else 0o666) & ~mask
        if got != want:
            wrong[str(p.relative_to(root))] = f"{got:#o}, want {want:#o}"
    return wrong
