"""``p3d-plan``: memory per GPU and step time of a config (p3d.launch.plan); ``p3d-plan calibrate ...``: measure
this machine and write the calibration file the planner reads (p3d.launch.calibrate)."""

from __future__ import annotations

import sys


def main() -> None:
    from p3d.launch.compose import run_hydra

    if sys.argv[1:2] == ["calibrate"]:
        from p3d.launch.calibrate import calibrate_task

        del sys.argv[1]
        sys.exit(run_hydra(calibrate_task, writes_outputs=False))
    from p3d.launch.plan import plan_task

    sys.exit(run_hydra(plan_task, writes_outputs=False))


if __name__ == "__main__":
    main()
