"""``p3d-plan``: memory per GPU and step time of a config (p3d.launch.plan)."""

from __future__ import annotations

import sys


def main() -> None:
    from p3d.launch.compose import run_hydra
    from p3d.launch.plan import plan_task

    sys.exit(run_hydra(plan_task, writes_outputs=False))


if __name__ == "__main__":
    main()
