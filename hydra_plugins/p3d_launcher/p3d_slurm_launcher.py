"""``hydra/launcher=p3d_slurm``: see :mod:`p3d.launch.sweep`."""

from p3d.launch.sweep import P3DSlurmLauncher as _P3DSlurmLauncher


class P3DSlurmLauncher(_P3DSlurmLauncher):
    """Hydra's submitit Slurm launcher, one job per sweep point sized from that point's mesh."""
