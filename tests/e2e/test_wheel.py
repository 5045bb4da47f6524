"""The wheel (issue 32): p3d's Hydra groups (p3d/conf/), its recipes (p3d/recipes/) and the Slurm sweep launcher
(hydra_plugins/) ship in it, and p3d-train runs from it, installed into a scratch directory, outside the checkout."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers.runs import ROOT

# What the wheel must hold besides the modules: the groups Hydra composes from, the batch and launch
# scripts p3d runs through p3d.config.shipped, and the launcher package Hydra finds by its namespace.
SHIPPED = [
    "p3d/conf/config.yaml",
    "p3d/conf/hydra/launcher/p3d_slurm.yaml",
    "p3d/recipes/slurm/train.sbatch",
    "p3d/recipes/slurm/prepare.sbatch",
    "p3d/recipes/torchrun.sh",
    "hydra_plugins/p3d_launcher/__init__.py",
    "hydra_plugins/p3d_launcher/p3d_slurm_launcher.py",
]
# run directly (recipes/torchrun.sh in its header); sbatch reads the .sbatch files, which need no mode
EXECUTABLE = ["p3d/recipes/torchrun.sh"]

# Run with the wheel's site first on sys.path: which p3d (and which launcher) a command of it imports.
PROBE = """
import json, sys
import p3d, p3d.cli.train, p3d.launch.compose, p3d.config.shipped as shipped
from hydra.core.plugins import Plugins
Plugins.instance()  # Hydra's plugin scan: imports every hydra_plugins.* module, as p3d-train's compose does
import hydra_plugins.p3d_launcher.p3d_slurm_launcher as launcher
files = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())}
print(json.dumps({
    "p3d": p3d.__file__,
    "conf": str(shipped.conf_dir()),
    "recipe": str(shipped.shipped("recipes/slurm/train.sbatch")),
    "launcher": launcher.__file__,
    "modules": {n: f for n, f in files.items() if f},
    "prefix": sys.prefix,
}))
"""


def git(*args: str) -> str:
    """Read-only: ``--no-optional-locks`` keeps ``git status`` from refreshing the index (and taking its lock)."""
    return subprocess.run(
        ["git", "--no-optional-locks", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


def checkout_state() -> list[str]:
    """``git status`` with the ignored entries too (an in-place build's build/ and *.egg-info are ignored, so
    plain ``--porcelain`` would not see them), less Python's bytecode caches, which any import may write."""
    lines = git("status", "--porcelain", "--ignored").splitlines()
    return [line for line in lines if "__pycache__" not in line]


def copy_checkout(dest: Path) -> None:
    """The working tree's files git knows of or would add (tracked, plus untracked ones not ignored; a file
    deleted from the tree is left out), links kept as links (``recipes -> p3d/recipes`` stays a relative
    link, valid in the copy): what ``pip wheel .`` would build from, without the checkout's ignored files."""
    names = git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    for name in sorted(set(filter(None, names))):
        src = ROOT / name
        if not src.is_symlink() and not src.is_file():
            continue  # deleted in the working tree (or a submodule)
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / name, follow_symlinks=False)


def run(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )


@pytest.mark.timeout(600)
def test_the_wheel_ships_its_configs_and_trains_outside_the_checkout(tmp_path):
    """Build the wheel (``pip wheel --no-index --no-deps --no-build-isolation``: setuptools from this venv, no
    network) from a copy of the working tree, since setuptools writes build/ and p3d.egg-info/ into the tree
    it builds; install it with ``pip install --no-deps --target`` into a scratch directory (its dependencies
    stay the venv's) and run its console scripts (``<target>/bin/p3d-train``, whose ``#!`` is this venv's
    python) from a directory with a space in its name, outside the checkout.

    Which p3d runs: PYTHONPATH=<target> puts the wheel's files on sys.path before site-packages, and
    setuptools' editable-install finder (``__editable___p3d_*_finder``, from a .pth in site-packages) is
    appended to the end of sys.meta_path, after the ordinary path finder, so ``import p3d`` finds the
    wheel's package and never the checkout's. One leak remains: that finder also adds the checkout's
    ``hydra_plugins/`` to the ``hydra_plugins`` namespace package (after the wheel's), so a launcher module
    missing from the wheel would be imported from the checkout without an error. Hence the listing of the
    wheel below, and the probe, run with the same environment, that every p3d and hydra_plugins module a
    p3d-train imports (Hydra's plugin scan included) is the wheel's."""
    python = sys.executable
    before = checkout_state()

    src, wheelhouse, site = tmp_path / "src", tmp_path / "wheelhouse", tmp_path / "scratch site"
    copy_checkout(src)
    pip = [python, "-m", "pip"]
    build = run(
        [*pip, "wheel", "--no-index", "--no-deps", "--no-build-isolation", "-w", str(wheelhouse), str(src)],
        cwd=tmp_path,
        env=dict(os.environ),
    )
    assert build.returncode == 0, build.stdout
    (wheel,) = wheelhouse.glob("p3d-*.whl")

    with zipfile.ZipFile(wheel) as zf:
        modes = {i.filename: i.external_attr >> 16 for i in zf.infolist()}
    names = set(modes)
    top = {n.split("/")[0] for n in names}
    assert top == {"p3d", "hydra_plugins", wheel.name.split("-py")[0] + ".dist-info"}, f"the wheel's top level: {top}"
    want = SHIPPED + [str(p.relative_to(ROOT)) for p in sorted((ROOT / "p3d/conf").glob("*/*.yaml"))]
    assert len(want) > 40 and not [n for n in want if n not in names], sorted(set(want) - names)
    for name in EXECUTABLE:
        assert modes[name] & stat.S_IXUSR, f"{name} lost its executable bit in the wheel: {modes[name]:#o}"

    install = run(
        [*pip, "install", "--no-index", "--no-deps", "--target", str(site), str(wheel)],
        cwd=tmp_path,
        env=dict(os.environ),
    )
    assert install.returncode == 0, install.stdout
    bin_dir = site / "bin"
    assert (bin_dir / "p3d-train").is_file() and (bin_dir / "p3d-plan").is_file(), sorted(os.listdir(site))
    for name in EXECUTABLE:
        assert os.access(site / name, os.X_OK), name

    home = tmp_path / "my runs"  # a user's folder: outside the checkout, a space in its path
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        PYTHONPATH=str(site),
        DS_ACCELERATOR="cpu",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        WANDB_MODE="disabled",
        OMP_NUM_THREADS="1",
    )

    probe = run([python, "-c", PROBE], cwd=home, env=env)
    assert probe.returncode == 0, probe.stdout
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    for key in ("p3d", "conf", "recipe", "launcher"):
        assert Path(found[key]).is_relative_to(site), (key, found[key])
    assert Path(found["recipe"]).is_file()
    ours = {n: Path(f) for n, f in found["modules"].items() if n.split(".")[0] == "p3d" or "p3d_launcher" in n}
    assert "hydra_plugins.p3d_launcher.p3d_slurm_launcher" in ours and "p3d.cli.train" in ours, sorted(ours)
    elsewhere = {n: str(f) for n, f in ours.items() if not f.is_relative_to(site)}
    assert not elsewhere, f"imported from outside the wheel: {elsewhere}"
    venv = Path(found["prefix"])  # the checkout's .venv/ may hold the dependencies; nothing else of it is used
    checkout = {n: f for n, f in found["modules"].items() if ROOT in Path(f).parents and venv not in Path(f).parents}
    assert not checkout, f"imported from the checkout: {checkout}"

    # the dry run: the default job (tiny on dp2_pp2_tp2) and another option of three groups; no file written
    dry = run([str(bin_dir / "p3d-train"), "dry_run=true"], cwd=home, env=env)
    assert dry.returncode == 0, dry.stdout
    assert "tiny on dp=2 x pp=2 x tp=2" in dry.stdout and "closed form" in dry.stdout, dry.stdout
    assert "; match" in dry.stdout, dry.stdout
    big = ["model=llama3_8b", "mesh=tp8_pp1", "cluster=h100_sxm", "cluster.nodes=1", "dry_run=true"]
    dry = run([str(bin_dir / "p3d-train"), *big], cwd=home, env=env)
    assert dry.returncode == 0, dry.stdout
    assert "llama3_8b on dp=1 x pp=1 x tp=8" in dry.stdout and "; match" in dry.stdout, dry.stdout
    plan = run([str(bin_dir / "p3d-plan"), "mesh=tp2_pp2"], cwd=home, env=env)
    assert plan.returncode == 0, plan.stdout
    assert "tiny (llama" in plan.stdout and "tp=2 pp=2 dp=1" in plan.stdout, plan.stdout
    assert not list(home.iterdir()), f"a dry run or p3d-plan wrote {sorted(os.listdir(home))}"

    # two steps on one process, the run directory relative to the working directory
    train = run([str(bin_dir / "p3d-train"), "mesh=single", "train.steps=2", "run.dir=run"], cwd=home, env=env)
    assert train.returncode == 0, train.stdout
    run_dir = home / "run"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2], steps
    assert (run_dir / "checkpoints" / "step_00000002" / "meta.json").is_file()
    assert (run_dir / "run_spec.yaml").is_file()

    # entries only: one that went away is someone else's edit (a build adds files, it removes none)
    new = sorted(set(checkout_state()) - set(before))
    assert not new, f"building or running the wheel changed the checkout: {new}"
