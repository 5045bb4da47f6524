"""``p3d-prepare``: tokenize a corpus once into a token store (p3d.launch.prepare)."""

from __future__ import annotations

import sys


def main() -> None:
    from p3d.launch.compose import run_hydra
    from p3d.launch.prepare import prepare_task

    sys.exit(run_hydra(prepare_task, writes_outputs=False))


if __name__ == "__main__":
    main()
