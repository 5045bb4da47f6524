"""``p3d-train``: compose the config once (Hydra), validate it, freeze the run spec, launch workers.

    p3d-train                                   # tiny Llama on dp2_pp2_tp2, 8 CPU processes
    p3d-train mesh=tp2_pp2 train.steps=50
    p3d-train mesh=tp8_pp8 model=llama70b cluster=h100_sxm cluster.nodes=8 schedule=large dry_run=true
    p3d-train -m mesh=dp2,tp2,pp2               # one run per mesh

Exit status: 0 done; 2 a config error (one line naming the field and the fix, before any worker
starts); 1 a worker failed (the rank is named); 75 stopped by a signal after saving; 128+N stopped by
signal N. The work is in p3d.launch; this module only turns its status into the process's.
"""

from __future__ import annotations

import os
import signal
import sys

from p3d.console import error


def main() -> None:
    """Console script ``p3d-train``."""
    from p3d.launch.compose import run_hydra
    from p3d.launch.train import train_task

    try:
        status = run_hydra(train_task)
    except KeyboardInterrupt:  # Ctrl-C before the workers started (once they run, p3d.jobs.stop handles it)
        error("interrupted (Ctrl-C) before training started; nothing was trained")
        status = 128 + signal.SIGINT
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run is over: a Ctrl-C now would only break the teardown
    skip_atexit = status == 128 + signal.SIGINT or "RANK" in os.environ
    if skip_atexit or "torch" in sys.modules:
        # Ctrl-C twice: the workers are gone; skip the interpreter's slow teardown. Under an external launcher
        # (RANK set) this process was a worker: skip the teardown that can abort on gloo's threads. With torch
        # imported to fork the workers (p3d.jobs.forked), its module teardown alone takes ~1 s: run the atexit
        # functions (7 ms here) and skip the rest.
        from p3d.train.worker import leave

        if not skip_atexit:
            import atexit

            atexit._run_exitfuncs()
        leave(status)
    sys.exit(status)


if __name__ == "__main__":
    main()
