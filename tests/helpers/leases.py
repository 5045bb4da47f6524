"""A run directory's lease, written by hand as another holder would have left it."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from p3d.rundir.lease import LOCK_NAME


def write_lease(run_dir: Path, **fields) -> None:
    body = {
        "pid": 1,
        "host": socket.gethostname(),
        "what": "p3d-train",
        "started": "then",
        "heartbeat": time.time(),
        "token": "t0",
        "workers": [],
        "slurm_job": None,
        "slurm_restart": None,
        **fields,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_NAME).write_text(json.dumps(body))
