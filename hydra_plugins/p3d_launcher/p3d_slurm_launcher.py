"""``hydra/launcher=p3d_slurm``: see :mod:`p3d.dist.sweep`."""

from p3d.dist.sweep import P3DSlurmLauncher as _P3DSlurmLauncher


class P3DSlurmLauncher(_P3DSlurmLauncher):
    """Hydra's submitit Slurm launcher, one job per sweep point sized from that point's mesh."""
