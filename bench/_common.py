"""What the bench scripts share: running ``p3d-train`` and reading its records, composing a config as p3d-train does,
gloo workers built as p3d-train builds them, the order in which the variants of a bench take turns, and what the
benches count (a process's RSS and CPU time, the bytes autograd saves). Nothing here runs on import: torch and p3d are
imported where they are used, so that a script's ``--help`` is quick.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def bench_parser(doc: str):
    """(the script's parser, its subcommands): ``doc``, the script's docstring, is the description."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    return ap, ap.add_subparsers(dest="command", required=True)


def add_command(commands, fn) -> argparse.ArgumentParser:
    """The subcommand named as ``fn`` and described by its docstring; ``fn(args)`` runs it."""
    doc = inspect.cleandoc(fn.__doc__)
    p = commands.add_parser(fn.__name__, help=doc.split("\n")[0], description=doc,
                            formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.set_defaults(run=fn)
    return p


def run_command(ap: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the command line) and run the subcommand it names; its exit status. The options it
    gets are plain data (they travel to worker processes)."""
    args = ap.parse_args(argv)
    return vars(args).pop("run")(args)


def usage_error(args: argparse.Namespace, message: str) -> NoReturn:
    """Exit as argparse does on options that do not go together: status 2, the command and the message."""
    print(f"{Path(sys.argv[0]).name} {args.command}: error: {message}", file=sys.stderr)
    sys.exit(2)


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as the benches print them beside their figures."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def turns(items: Sequence[T], passes: int) -> Iterator[tuple[int, T]]:
    """(pass, item) over ``passes`` passes, every other one in reverse order (A B, B A, ...), so that a slow spell of
    the machine does not fall on one item only."""
    for n in range(passes):
        for item in items if n % 2 == 0 else items[::-1]:
            yield n, item


def median_of(records: Iterable[dict], key: str) -> float | None:
    """The median of a numeric field over the records that have it; None when none has."""
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


# ---- p3d-train and p3d-plan as a user runs them
def p3d_train(
    overrides: Sequence[str],
    run_dir: Path,
    env: dict[str, str] | None = None,
    timeout: float | None = 3600,
    cwd: Path = ROOT,
    program: Sequence[str] = (sys.executable, "-m", "p3d.cli"),
    unset: Sequence[str] = (),
) -> list[dict]:
    """Run ``p3d-train <overrides> run.dir=<run_dir>`` (``program``: another checkout's console script, say) and
    return its metrics.jsonl records; exit with the output's tail if it fails. ``env`` adds to this environment,
    from which the variables ``unset`` names are taken out first."""
    from p3d.rundir.files import read_metrics

    cmd = [*program, *overrides, f"run.dir={run_dir}"]
    base = {k: v for k, v in os.environ.items() if k not in unset}
    done = subprocess.run(cmd, cwd=cwd, env={**base, **(env or {})}, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return read_metrics(run_dir)


def p3d_plan(*args: str, timeout: float = 1800) -> str:
    """``p3d-plan <args>``'s standard output; exit with the output's tail if it fails."""
    cmd = [sys.executable, "-m", "p3d.cli.plan", *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout


def composed(overrides: Sequence[str]):
    """(Config, RunPlan) composed through Hydra's compose API and validated exactly as p3d-train does it."""
    from hydra import compose, initialize_config_dir

    from p3d.config.schema import register_configs
    from p3d.launch.check import prepare
    from p3d.launch.compose import CONFIG_PATH

    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        return prepare(compose("config", overrides=list(overrides)))


def compose_spec(overrides: Sequence[str], run_dir: Path):
    """:func:`composed` with ``run.dir=<run_dir>``, and the run spec written there (what a worker reads)."""
    from p3d.rundir.spec import write_spec

    cfg, plan = composed([*overrides, f"run.dir={run_dir}"])
    write_spec(cfg, plan, run_dir)
    return cfg, plan


# ---- gloo workers, built as p3d-train builds them
def run_workers(worker, world: int, *args, timeout: float) -> dict:
    """``worker(rank, world, *args, out_path)`` on ``world`` gloo processes (tests/helpers/dist.py); what rank 0
    wrote to ``out_path`` as JSON."""
    from tests.helpers.dist import run_distributed

    with tempfile.TemporaryDirectory(prefix="p3d-bench-") as tmp:
        out = Path(tmp) / "result.json"
        run_distributed(worker, world, *args, str(out), timeout=timeout)
        return json.loads(out.read_text())


def init_worker(timeout_s: int) -> None:
    """In a gloo worker: a p3d-train CPU worker's settings (one thread, freed memory kept), DeepSpeed's process
    group."""
    import datetime

    import deepspeed

    from p3d.train.worker import set_up_cpu_worker

    set_up_cpu_worker()
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def start_worker(rank: int, overrides: Sequence[str], timeout_s: int):
    """:func:`init_worker`, then (Config, RunPlan, Mesh) of the run these overrides make, as p3d-train makes them."""
    from p3d.parallel.mesh import Mesh
    from tests.helpers.runs import typed

    init_worker(timeout_s)
    cfg, plan = typed(*overrides)
    return cfg, plan, Mesh.from_plan(plan, rank).with_groups()


def replica_batches(cfg, dp: int = 1, dp_rank: int = 0):
    """The (inputs, labels) micro batches p3d's trainer feeds replica ``dp_rank`` of ``dp``, step after step."""
    from p3d.data.loader import micro_batches

    s = cfg.schedule
    return micro_batches(cfg.data, cfg.model.seq_len, s.global_batch_size, s.micro_batch_size, dp, dp_rank,
                         cfg.train.seed)  # fmt: skip


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (a step ends when its slowest rank does)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


# ---- what the benches count
class SavedTensors:
    """Bytes autograd saves for backward inside ``with``: each storage once, the storages of ``params`` left out;
    ``part`` the same count over the stretches where ``inside`` is set (one kind of module, say)."""

    def __init__(self, params):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.held: dict[int, int] = {}
        self.part: dict[int, int] = {}
        self.inside = False

    def pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.held.setdefault(storage.data_ptr(), storage.nbytes())
            if self.inside:
                self.part.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    def __enter__(self):
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.held.values())


def rss_bytes() -> int:
    """This process's resident set size now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- a worker's CPU time at each step it records (Linux /proc): the CPU seconds between two step records move far
# less than wall time when other processes compete for the cores
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
POLL_S = 0.02


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15 of stat)


def find_pid(marker: str) -> int | None:
    """The p3d-train worker of this run: a process named ``p3d-rank0`` (p3d.train.worker.name_process) whose
    command line holds ``marker`` (its run directory: in the spec path of a fresh worker, or the launcher's
    ``run.dir=`` of a forked one)."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                name = (d / "comm").read_text().strip()
                cmdline = (d / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if name == "p3d-rank0" and marker in cmdline:
                return int(d.name)
    return None


def run_monitored(cmd: list[str], env: dict, log: Path, out: Path, timeout: float, worker_marker: str | None = None,
                  cwd: Path | None = None):  # fmt: skip
    """Run ``cmd``; each time the worker appends a line to ``out`` (one per optimizer step), read the
    worker's CPU time. Returns (records, each with ``cpu_s``: the CPU seconds since the previous record or None,
    process wall seconds). The worker is ``cmd`` itself, or (p3d-train) the process whose command line holds
    ``worker_marker``."""
    from p3d.rundir.files import read_metrics

    t0 = time.perf_counter()
    marks: list[float | None] = []
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
        pid = None if worker_marker else proc.pid
        size, lines = -1, 0
        try:
            while True:
                done = proc.poll() is not None
                if pid is None and worker_marker:
                    pid = find_pid(worker_marker)
                try:
                    new_size = out.stat().st_size
                except OSError:
                    new_size = -1
                if new_size != size:
                    size = new_size
                    n = out.read_bytes().count(b"\n")
                    if n > lines:
                        cpu = proc_cpu_s(pid) if pid else None
                        marks.extend([cpu] * (n - lines))  # several lines at once: the extra intervals read ~0
                        lines = n
                if done:
                    break
                if time.perf_counter() - t0 > timeout:
                    proc.kill()
                    sys.exit(f"bench: {' '.join(cmd[:3])} ... took over {timeout:.0f} s; see {log}")
                time.sleep(POLL_S)
        except BaseException:
            proc.kill()
            raise
    secs = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        sys.exit(f"bench: {' '.join(cmd[:3])} ... failed with status {proc.returncode}; last lines of {log}:\n{tail}")
    records = read_metrics(out)
    for i, r in enumerate(records):  # CPU seconds between this step's record and the previous one's
        a, b = (marks[i - 1] if 0 < i <= len(marks) else None), (marks[i] if i < len(marks) else None)
        r["cpu_s"] = b - a if a is not None and b is not None else None
    return records, secs


def base_env(threads: int) -> dict[str, str]:
    """This environment with ``threads`` torch threads, DeepSpeed on CPU and Hugging Face offline."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "DS_ACCELERATOR": "cpu",
            "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip


def run_p3d_monitored(overrides: list[str], run_dir: Path, threads: int, timeout: float, keep: bool):
    """``p3d-train mesh=single <overrides>`` with its worker's CPU time read at each step record: (records, wall s)."""
    import shutil

    p3d_train = Path(sys.executable).with_name("p3d-train")
    cmd = [str(p3d_train)] if p3d_train.exists() else [sys.executable, "-m", "p3d.cli"]
    run_dir.mkdir(parents=True)
    records, secs = run_monitored([*cmd, "mesh=single", *overrides, f"run.dir={run_dir}"], base_env(threads),
                                  run_dir.with_suffix(".log"), run_dir / "metrics.jsonl", timeout,
                                  worker_marker=str(run_dir), cwd=ROOT)  # fmt: skip
    if not keep:  # p3d saves a checkpoint after its last step (outside the timed steps): ~1.5 GB for model=small
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return records, secs


def summarize(runs: list[list[dict]], warmup: int, tokens_per_step: int) -> dict:
    """Medians over the steps after ``warmup`` of every run: step time, tokens/s, worker CPU seconds per step."""
    kept = [r["step_time_s"] for run in runs for r in run[warmup:]]
    cpu = [r["cpu_s"] for run in runs for r in run[warmup:] if r.get("cpu_s")]
    med = statistics.median(kept)
    return {
        "kept_steps": len(kept),
        "median_step_s": med,
        "min_step_s": min(kept),
        "max_step_s": max(kept),
        "median_tokens_per_s": tokens_per_step / med,
        "best_tokens_per_s": tokens_per_step / min(kept),
        "per_round_median_step_s": [statistics.median([r["step_time_s"] for r in run[warmup:]]) for run in runs],
        "median_cpu_s_per_step": statistics.median(cpu) if len(cpu) == len(kept) else None,
    }
