"""Hydra loads launcher plugins only from the ``hydra_plugins`` namespace; the implementation is
:class:`p3d.launch.sweep.P3DSlurmLauncher` (``hydra/launcher=p3d_slurm``, chosen by ``cluster=slurm``)."""
