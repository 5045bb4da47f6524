"""Inside a Slurm job: the worker step, the rendezvous, requeueing, and the helpers the recipe calls.

``recipes/slurm/train.sbatch`` does its own ``srun`` in bash (the recipe is meant to be read and
edited); :func:`run_step` is the same step for p3d-train running inside an allocation (a sweep job of
the submitit launcher, or ``salloc``). Both: one task per rank, ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``
from ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` (p3d.train.worker maps them), ``MASTER_ADDR`` the
first host of the node list, ``MASTER_PORT`` a free port there, rank logs in ``<run.dir>/logs/``, and
SIGUSR1 / SIGTERM forwarded to the workers, which checkpoint and exit with status 75; the job then
requeues itself and the next start resumes from the newest checkpoint.

    python -m p3d.cli.slurm layout <run_dir>   # the recipe: world, tasks per node, ... of the spec
    python -m p3d.cli.slurm resume <run_dir>   # the recipe after a requeue: train.resume=auto

Every srun is an attempt of the run (p3d.rundir.attempts): the rank logs are appended to (``--open-mode=append``),
each after a header line, and the hang reports of the srun before are kept under another name.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from p3d import exit_codes
from p3d.jobs.follow import follow
from p3d.jobs.slurm.groupjob import hostfile_path, hostfile_text, node_order, parse_node_features
from p3d.jobs.slurm.submit import SLURM_TIMEOUT_S, group_placement_warning, job_shape
from p3d.rundir.attempts import start_attempt
from p3d.rundir.files import log_job, rank_log
from p3d.rundir.files import logs as run_logs
from p3d.rundir.lease import alive


def hostnames(nodelist: str) -> list[str]:
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=SLURM_TIMEOUT_S, check=True
    )
    return out.stdout.split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def master_port(master: str) -> int:
    """A free port when this process runs on the master host (the batch step runs on the first
    node), else one derived from the job id; MASTER_PORT in the environment wins."""
    if os.environ.get("MASTER_PORT", "0") not in ("", "0"):
        return int(os.environ["MASTER_PORT"])
    if master in (socket.gethostname(), socket.gethostname().split(".")[0]):
        return free_port()
    return 20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 12000


def step_env(plan) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "P3D_INIT_METHOD"):
        env.pop(key, None)  # the workers take their rank from SLURM_* and rendezvous over env://
    master = hostnames(env["SLURM_JOB_NODELIST"])[0]
    env.update(MASTER_ADDR=master, MASTER_PORT=str(master_port(master)), PYTHONUNBUFFERED="1")
    if plan.backend == "gloo":
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    return env


def srun_command(lay, spec: Path, python: str = sys.executable) -> list[str]:
    logs = run_logs(spec.parent)
    # Not --kill-on-bad-exit: a rank that saved its part of a checkpoint and exits 75 a moment before the
    # others would get them killed mid-exit. --wait bounds how long the others may outlive a failed rank.
    cmd = [
        "srun",
        "--kill-on-bad-exit=0",
        f"--wait={os.environ.get('P3D_SRUN_WAIT', '60')}",
        f"--nodes={lay.nodes}",
        f"--ntasks={lay.world_size}",
        f"--ntasks-per-node={lay.ntasks_per_node}",
        f"--output={logs}/rank%t.log",
        "--open-mode=append",
    ]
    if os.environ.get("SLURM_CPUS_PER_TASK"):  # srun (22.05+) no longer inherits it from the job
        cmd.append(f"--cpus-per-task={os.environ['SLURM_CPUS_PER_TASK']}")
    return cmd + [python, "-m", "p3d.cli.worker", str(spec)]


def link_job_log(run_dir: Path, job: str) -> None:
    """<run dir>/slurm-<job>.out -> the job's output file, wherever sbatch put it."""
    try:
        out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return
    std_out = next((w.split("=", 1)[1] for w in out.stdout.split() if w.startswith("StdOut=")), "")
    link = run_dir / f"slurm-{job}.out"
    if std_out and Path(std_out) != link and not link.exists():
        link.symlink_to(std_out)


def requeue(cfg, run_dir: Path) -> bool:
    """scontrol requeue this job when the config allows another restart; True when requeued."""
    job = os.environ.get("SLURM_JOB_ID")
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    if not job or not cfg.cluster.requeue or restarts >= cfg.cluster.max_requeues:
        print(
            f"p3d: workers stopped after a checkpoint; not requeued (cluster.requeue={cfg.cluster.requeue}, "
            f"restart {restarts} of at most {cfg.cluster.max_requeues})",
            flush=True,
        )
        return False
    print(f"p3d: workers saved a checkpoint and stopped; requeueing job {job} (restart {restarts + 1})", flush=True)
    log_job(run_dir, f"{job} requeue after restart {restarts}")
    out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
    if out.returncode:
        print(f"p3d: scontrol requeue {job} failed: {out.stderr.strip()}", file=sys.stderr, flush=True)
    return out.returncode == 0


def start_srun_attempt(run_dir: str | Path, plan=None) -> int:
    """Before an srun: its attempt header in every rank log and the hang reports of the srun before set aside
    (p3d.rundir.attempts). Returns where the logging rank's log ends then: where this srun's output begins."""
    if plan is None:
        from p3d.rundir.spec import read_spec

        _, plan = read_spec(run_dir)
    job, start = os.environ.get("SLURM_JOB_ID", "?"), os.environ.get("SLURM_RESTART_COUNT", "0")
    start_attempt(run_logs(run_dir), plan.world_size, f"srun of {plan.world_size} tasks, job {job} (start {start})")
    return rank_log(run_dir, plan.logging_rank).stat().st_size


def follow_srun(log: str, offset: str, pid: str) -> int:
    """The recipe's console while srun (``pid``) runs: the logging rank's ``log`` from ``offset`` on, less a
    failure report (p3d.jobs.follow): after a lost node or a killed worker the survivors' lost connections are
    no failure of theirs, and after an error a rank raised the recipe prints that rank's last lines itself."""
    follow(Path(log), lambda: not alive(int(pid)), sys.stdout, 0.5, int(offset), held=[])
    return 0


def run_step(cfg, plan, spec: Path) -> int:
    """Run the workers as one srun step of this allocation; returns srun's status (75: preempted)."""
    lay = job_shape(cfg, plan)
    run_dir = spec.parent
    start = start_srun_attempt(run_dir, plan)
    env = step_env(plan)
    cmd = srun_command(lay, spec)
    job = os.environ.get("SLURM_JOB_ID", "?")
    log_job(
        run_dir,
        f"{job} step start (restart {os.environ.get('SLURM_RESTART_COUNT', '0')}) on "
        f"{os.environ.get('SLURM_JOB_NODELIST', '?')}",
    )
    print(
        f"p3d: run dir {run_dir}\np3d: {cfg.model.name} on mesh {plan.dims.degrees()}: "
        f"srun {lay.world_size} tasks ({lay.nodes} node(s) x {lay.ntasks_per_node}) in job {job}, master "
        f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}; logs in {run_dir / 'logs'}",
        flush=True,
    )
    warning = group_placement_warning(cfg)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    link_job_log(run_dir, job)
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)  # srun passes SIGUSR1 / SIGTERM on to every task

    old = {s: signal.signal(s, forward) for s in (signal.SIGUSR1, signal.SIGTERM)}
    log = rank_log(run_dir, plan.logging_rank)  # appended to by each step of the job (--open-mode=append)
    follower = threading.Thread(
        target=follow, args=(log, lambda: proc.poll() is not None, sys.stdout, 0.5, start), daemon=True
    )
    follower.start()
    try:
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    follower.join(timeout=5)
    log_job(run_dir, f"{job} step exit {rc}")
    if rc == exit_codes.PREEMPTED and requeue(cfg, run_dir):
        # This run of the job ends here: no result, no status (a submitit job must not report one, or the
        # sweep would take it for the point's outcome); the requeued run starts p3d-train again and resumes.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    if rc and rc != exit_codes.PREEMPTED:
        hang_summary(str(run_dir))
        print(
            f"p3d: srun exited with status {rc}; the rank logs are in {run_dir / 'logs'}", file=sys.stderr, flush=True
        )
    return rc


# ---- helpers the batch recipe calls


def print_layout(run_dir: str) -> int:
    """One line for the recipe: world tasks_per_node nodes backend logging_rank requeue max_requeues gpus elastic
    hostfile (1: an elastic run over groups, whose srun places the ranks by a host file: p3d.jobs.slurm.groupjob)."""
    from p3d.rundir.spec import read_spec

    cfg, plan = read_spec(run_dir)
    lay = job_shape(cfg, plan)
    print(
        lay.world_size,
        lay.ntasks_per_node,
        lay.nodes,
        plan.backend,
        plan.logging_rank,
        int(cfg.cluster.requeue),
        cfg.cluster.max_requeues,
        lay.gpus_per_node or 0,
        int(cfg.cluster.elastic.min_nodes is not None),
        int(bool(cfg.cluster.groups) and cfg.cluster.elastic.min_nodes is not None),
    )
    return 0


NODE_FAILURE = re.compile(r"Node failure on (\S+)")


def allocation(srun_err: Path) -> tuple[list[str], int]:
    """(the nodes this job lost, the nodes it has left), after an srun failed: the job's first nodes
    (``SLURM_JOB_NODELIST``, which keeps them) less the ones ``scontrol show job`` still lists (a node Slurm marked
    down leaves the job's NodeList then); srun's ``Node failure on n2`` lines when scontrol lists them all still."""
    first = hostnames(os.environ["SLURM_JOB_NODELIST"])
    live = live_hosts(first)
    lost = [n for n in first if n not in live]
    if not lost and srun_err.is_file():
        named = set(NODE_FAILURE.findall(srun_err.read_text(errors="replace")))
        lost = [n for n in first if n in named]
    return lost, len(first) - len(lost)


def show_job() -> str:
    """``scontrol show job`` of this job."""
    return subprocess.run(
        ["scontrol", "show", "job", os.environ["SLURM_JOB_ID"]], capture_output=True, text=True, timeout=SLURM_TIMEOUT_S
    ).stdout


def live_hosts(first: list[str] | None = None, shown: str | None = None) -> list[str]:
    """This job's nodes now: ``scontrol show job``'s NodeList (``shown``, else asked; a node Slurm marked down has
    left it); ``first`` (else the job's first nodes, ``SLURM_JOB_NODELIST``) when scontrol lists none."""
    first = hostnames(os.environ["SLURM_JOB_NODELIST"]) if first is None else first
    shown = show_job() if shown is None else shown
    found = re.search(r"(?<![A-Za-z])NodeList=(\S+)", shown)
    return hostnames(found.group(1)) if found and found.group(1) != "(null)" else first


def node_features(hosts: list[str]) -> dict[str, set[str]]:
    """Each of ``hosts``' node features (``scontrol show node``'s AvailableFeatures and ActiveFeatures)."""
    out = subprocess.run(
        ["scontrol", "show", "node", "-o", ",".join(hosts)],
        capture_output=True,
        text=True,
        timeout=SLURM_TIMEOUT_S,
        check=True,
    )
    return parse_node_features(out.stdout)


def write_hostfile(run_dir: str) -> int:
    """The recipe before each srun of an elastic run over groups: the host file (p3d.jobs.slurm.groupjob) of the job's
    live nodes for the spec's groups (those left after a loss). Prints ``<path> <master host>``."""
    from p3d.rundir.spec import read_spec

    cfg, plan = read_spec(run_dir)
    order = node_order(cfg.cluster, node_features(live_hosts()))
    path = hostfile_path(run_dir)
    path.write_text(hostfile_text(order, job_shape(cfg, plan).ntasks_per_node))
    print(path, order[0])
    return 0


def hang_summary(run_dir: str) -> int:
    """After srun failed: the hang reports of the workers (p3d.parallel.hang), if any, as one paragraph; 1 if none."""
    from p3d.parallel import hang
    from p3d.parallel.mesh import Mesh
    from p3d.rundir.spec import read_spec

    reports = hang.read_reports(run_logs(Path(run_dir)))
    if not reports:
        return 1
    _, plan = read_spec(run_dir)
    print(hang.summarize(reports, None, Mesh.from_plan(plan, 0)), flush=True)
    return 0
