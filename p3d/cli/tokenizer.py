"""``p3d-tokenizer``: train a byte-level BPE on a data config's train split (p3d.launch.tokenizer)."""

from __future__ import annotations

import sys


def main() -> None:
    from p3d.launch.compose import run_hydra
    from p3d.launch.tokenizer import tokenizer_task

    sys.exit(run_hydra(tokenizer_task, writes_outputs=False))


if __name__ == "__main__":
    main()
