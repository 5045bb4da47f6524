"""``python -m p3d.cli.worker <run_spec.yaml>``: one worker process (p3d.train.worker), with RANK, WORLD_SIZE and
LOCAL_RANK set by p3d's local launcher, torchrun or srun."""

from __future__ import annotations

import sys

from p3d.train.worker import main

if __name__ == "__main__":
    sys.exit(main())
