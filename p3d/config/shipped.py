"""The files p3d ships inside its package, found through ``importlib.resources`` so that an editable install, a
wheel and a checkout all find the same ones (nothing is found relative to the repository):

    p3d/conf/      the Hydra config groups (model, mesh, schedule, zero, cluster, data, logger, hydra/launcher); the
                   checkout's ``conf/`` is a link to it
    p3d/recipes/   the batch and launch scripts (slurm/train.sbatch, slurm/prepare.sbatch, torchrun.sh); the
                   checkout's ``recipes/`` is a link to it, for ``sbatch recipes/slurm/train.sbatch``
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def package_root() -> Path:
    """The directory of the installed ``p3d`` package (a plain directory: p3d is never imported from a zip)."""
    return Path(str(files("p3d")))


def conf_dir() -> Path:
    return package_root() / "conf"


def shipped(path: str | Path) -> Path:
    """``path`` as given when absolute, else one of the package's own files (``recipes/slurm/train.sbatch``)."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else package_root() / path
