"""``python -m p3d.cli``: p3d-train (what torchrun and srun start as workers)."""

from p3d.cli.train import main

main()
