"""``python -m p3d.cli.lease {acquire|heartbeat|release} <run_dir> --pid PID``: the Slurm recipe's hold on the run
directory's lease (p3d.rundir.lease) for its srun step: the batch shell (``--pid $$``) holds it."""

from __future__ import annotations

import argparse
import sys
import time

from p3d import exit_codes
from p3d.config.errors import P3DConfigError
from p3d.console import error
from p3d.rundir.lease import HEARTBEAT_S, Lease, alive, held_by


def main(argv: list[str] | None = None) -> int:
    """The Slurm recipe's commands: the batch shell (``--pid $$``) holds the lease for its srun step."""
    ap = argparse.ArgumentParser(prog="python -m p3d.cli.lease")
    ap.add_argument("command", choices=["acquire", "heartbeat", "release"])
    ap.add_argument("run_dir")
    ap.add_argument("--pid", type=int, required=True)
    args = ap.parse_args(argv)
    if args.command == "acquire":
        try:
            Lease.acquire(args.run_dir, pid=args.pid, what="the Slurm recipe")
        except P3DConfigError as exc:
            error(str(exc))
            return exit_codes.CONFIG_ERROR
        return exit_codes.OK
    lease = held_by(args.run_dir, args.pid)
    if lease is None:
        return exit_codes.OK
    if args.command == "release":
        lease.release()
        return exit_codes.OK
    while alive(args.pid) and lease.refresh():  # heartbeat: until the batch shell ends
        time.sleep(HEARTBEAT_S)
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
