"""Slurm: the job a mesh needs, whether the partition can hold it, and its submission.

``p3d-train cluster=slurm ...`` composes and validates here, freezes the run spec, then:

- outside an allocation: submits ``recipes/slurm/train.sbatch`` with ``--nodes``,
  ``--ntasks-per-node`` (one task per GPU) and ``--gpus-per-node`` derived from the mesh and the
  cluster config (:func:`sbatch_args`; with ``cluster.groups``, one heterogeneous job of a component per
  group, p3d.jobs.slurm.hetjob; an elastic run over groups, one ordinary job, p3d.jobs.slurm.groupjob),
  after checking the partition can hold it (``sinfo``; each group's partition and constraint), and prints
  the job id and its log;
- inside an allocation (a sweep job of the submitit launcher, or ``salloc``): starts the workers
  right there as one ``srun`` step (:mod:`p3d.jobs.slurm.step`).

The derivation is pure (``job_shape``, ``sbatch_args``, ``check_fits``) and unit-tested; everything that
talks to Slurm goes through ``sbatch``, ``sinfo`` and ``scontrol`` with a timeout.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from p3d import exit_codes
from p3d.config.shipped import shipped
from p3d.jobs.slurm.groupjob import groupjob_args
from p3d.jobs.slurm.hetjob import Component, components, hetjob_args, refusal_fields
from p3d.layout.run_plan import P3DConfigError
from p3d.rundir.files import log_job, write_status
from p3d.rundir.lease import FREEZE_ONLY_ENV  # set by the recipe: p3d-train freezes the spec and returns

SLURM_TIMEOUT_S = 60


@dataclass(frozen=True)
class JobShape:
    """What one job of this run asks Slurm for: one task per rank (per GPU)."""

    nodes: int
    ntasks_per_node: int
    gpus_per_node: int | None  # None on cpu: no GPUs requested
    cpus_per_task: int | None

    @property
    def world_size(self) -> int:
        return self.nodes * self.ntasks_per_node


def job_shape(cfg, plan) -> JobShape:
    """Nodes and tasks per node from the mesh (plan) and the cluster config. Raises P3DConfigError."""
    c = cfg.cluster
    world = plan.world_size
    if c.nodes < 1:
        raise P3DConfigError(f"cluster.nodes={c.nodes} must be at least 1; try cluster.nodes=1")
    if c.gpus_per_node is None:  # cpu workers: the mesh decides the world, spread evenly over the nodes
        if world % c.nodes:
            raise P3DConfigError(
                f"cluster.nodes={c.nodes} does not divide the mesh's {world} ranks "
                f"(dp={plan.dp} x pp={plan.pp} x tp={plan.tp}); try cluster.nodes=1"
            )
        per_node = world // c.nodes
    else:
        per_node = c.gpus_per_node
        if per_node < 1 or per_node * c.nodes != world:
            raise P3DConfigError(
                f"cluster.gpus_per_node={per_node} x cluster.nodes={c.nodes} must equal the mesh's "
                f"{world} ranks; try mesh.dp=auto"
            )
    if c.nodes > 1 and per_node % plan.tp:
        raise P3DConfigError(
            f"mesh.tp={plan.tp} must divide the {per_node} ranks per node, so that a TP group stays "
            f"inside one node; try cluster.nodes={max(1, world // max(plan.tp, per_node))}"
        )
    if c.cpus_per_task is not None and c.cpus_per_task < 1:
        raise P3DConfigError(f"cluster.cpus_per_task={c.cpus_per_task} must be positive or null")
    gpus = None if c.device == "cpu" else per_node
    return JobShape(nodes=c.nodes, ntasks_per_node=per_node, gpus_per_node=gpus, cpus_per_task=c.cpus_per_task)


_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def time_seconds(value: str) -> int:
    """Slurm's --time formats (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in seconds."""
    m = _TIME.match(str(value).strip())
    if not m:
        raise P3DConfigError(
            f"cluster.time={value} is not a Slurm time limit; try cluster.time=01:00:00 (or minutes, or D-HH:MM:SS)"
        )
    days, a, b, c = m.groups()
    if days is not None:  # D-H, D-H:M, D-H:M:S
        secs = int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    elif c is not None:  # H:M:S
        secs = int(a) * 3600 + int(b) * 60 + int(c)
    elif b is not None:  # M:S
        secs = int(a) * 60 + int(b)
    else:  # M
        secs = int(a) * 60
    if secs <= 0:
        raise P3DConfigError(f"cluster.time={value} must be positive; try cluster.time=01:00:00")
    return secs


def time_minutes(value: str) -> int:
    return -(-time_seconds(value) // 60)


def checked_time_limit(c) -> int | None:
    """cluster.time in seconds (None: the partition's default). A malformed limit, or one the checkpoint
    signal would not fit in, is refused here, not by sbatch (both the recipe and sweep jobs use this)."""
    if c.time is None:
        return None
    limit = time_seconds(c.time)
    if c.signal_s >= limit:
        raise P3DConfigError(
            f"cluster.signal_s={c.signal_s} must be shorter than cluster.time={c.time} "
            f"({limit} s): the checkpoint signal would come at the start; try "
            f"cluster.signal_s={max(1, limit // 5)}"
        )
    return limit


def sbatch_args(cfg, lay: JobShape, run_dir: str | Path) -> list[str]:
    """The sbatch options of this run's job; they override the recipe's #SBATCH header. With ``cluster.groups``:
    one component per group, separated by ':' (p3d.jobs.slurm.hetjob.hetjob_args); an elastic run over groups is one
    ordinary job that asks for each group's nodes by its feature (p3d.jobs.slurm.groupjob.groupjob_args)."""
    c = cfg.cluster
    job_wide = [f"--job-name={c.job_name}"]
    if checked_time_limit(c) is not None:
        job_wide.append(f"--time={c.time}")
    job_wide.append("--requeue" if c.requeue else "--no-requeue")
    if c.elastic.min_nodes is not None:  # a lost node leaves the job running on the others (p3d.jobs.elastic)
        job_wide.append("--no-kill")
    if c.signal_s > 0:  # to the batch shell, which forwards it to the workers (see the recipe)
        job_wide.append(f"--signal=B:USR1@{c.signal_s}")
    job_wide += ["--open-mode=append", f"--output={Path(run_dir).resolve()}/slurm-%j.out"]
    job_wide += c.extra_sbatch  # last: the user's lines win
    if c.groups and c.elastic.min_nodes is not None:  # a hetjob does not outlive a node: one ordinary job
        return groupjob_args(c, lay, job_wide)
    if c.groups:
        return hetjob_args(c, lay, job_wide)
    args = [f"--nodes={lay.nodes}", f"--ntasks-per-node={lay.ntasks_per_node}"]
    if lay.gpus_per_node:
        args.append(f"--gpus-per-node={lay.gpus_per_node}")
    if lay.cpus_per_task:
        args.append(f"--cpus-per-task={lay.cpus_per_task}")
    return args + placement_args(c) + job_wide


def placement_args(c) -> list[str]:
    """--partition, --account, --qos and --constraint of the cluster config (unset: Slurm's default)."""
    return [
        f"--{flag}={getattr(c, flag)}"
        for flag in ("partition", "account", "qos", "constraint")
        if getattr(c, flag) is not None
    ]


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: int
    cpus_per_node: int  # the smallest node's
    gpus_per_node: int  # the smallest node's (0: no GPU GRES)


def parse_gres_gpus(gres: str) -> int:
    """GPUs in a node's GRES string: 'gpu:8', 'gpu:h100:8(S:0-1)', 'gpu:a100:4,nvme:1', '(null)'."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and len(parts) > 1 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def parse_sinfo(text: str, partition: str | None, field: str = "cluster.partition") -> Partition:
    """Rows of ``sinfo -h -N -o '%N|%c|%G|%P'`` (or with ``|%f``, the features, after them): nodes of ``partition``,
    or of the default one (marked *). ``field``: the config field that named the partition, for the error."""
    rows = [line.split("|") for line in text.splitlines() if line.count("|") in (3, 4)]
    if partition is None:
        rows = [r for r in rows if r[3].endswith("*")]
    else:
        rows = [r for r in rows if r[3].rstrip("*") == partition]
    if not rows:
        which = f"{field}={partition}" if partition else f"{field}=null (the default partition)"
        raise P3DConfigError(f"{which}: Slurm lists no nodes there; see `sinfo` and set {field}")
    return _partition(rows)


def _partition(rows: list[list[str]]) -> Partition:
    return Partition(
        name=rows[0][3].rstrip("*"),
        nodes=len({r[0] for r in rows}),
        cpus_per_node=min(int(r[1]) for r in rows),
        gpus_per_node=min(parse_gres_gpus(r[2]) for r in rows),
    )


def component_partition(text: str, comp: Component) -> Partition:
    """The nodes a hetjob component may take: its partition's (``sinfo`` rows with features), less those without
    its constraint when that names one feature. Raises P3DConfigError naming the group's field."""
    part = parse_sinfo(text, comp.partition, comp.partition_field)
    feature = comp.feature
    if feature is None:
        return part
    rows = [
        r
        for r in (line.split("|") for line in text.splitlines() if line.count("|") == 4)
        if r[3].rstrip("*") == part.name
    ]
    with_it = [r for r in rows if feature in r[4].split(",")]
    if not with_it:
        known = sorted({f for r in rows for f in r[4].split(",") if f and f != "(null)"})
        raise P3DConfigError(
            f"{comp.constraint_field}={comp.constraint}: no node of partition {part.name} has that feature "
            f"(its features: {', '.join(known) or 'none'}); set {comp.constraint_field} to one of them, or null"
        )
    found = _partition(with_it)
    if comp.nodes > found.nodes:
        raise P3DConfigError(
            f"{comp.field}.nodes={comp.nodes} exceeds the {found.nodes} node(s) of partition {part.name} with feature "
            f"{feature}; try {comp.field}.nodes={found.nodes}"
        )
    return found


def partition_info(partition: str | None) -> Partition:
    return parse_sinfo(sinfo_nodes(), partition)


def sinfo_nodes() -> str:
    """``sinfo``'s nodes: name|CPUs|GRES|partition|features, one a line."""
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N|%c|%G|%P|%f"], capture_output=True, text=True, timeout=SLURM_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise P3DConfigError(
            f"cluster.launcher=slurm but `sinfo` failed ({exc}); is this a Slurm login node? try cluster=local"
        ) from None
    if out.returncode:
        raise P3DConfigError(f"cluster.launcher=slurm but `sinfo` failed: {out.stderr.strip()}; try cluster=local")
    return out.stdout


def check_fits(lay: JobShape, part: Partition, plan) -> None:
    """Refuse a job the partition can never run. Raises P3DConfigError naming the fix."""
    mesh = f"the mesh (dp={plan.dp} x pp={plan.pp} x tp={plan.tp} = {plan.world_size} ranks)"
    if lay.nodes > part.nodes:
        raise P3DConfigError(
            f"cluster.nodes={lay.nodes} exceeds the {part.nodes} node(s) of partition {part.name}; "
            f"try cluster.nodes={part.nodes} with a smaller mesh, or another cluster.partition"
        )
    cpt = lay.cpus_per_task or 1
    if lay.ntasks_per_node * cpt > part.cpus_per_node:
        fits = part.cpus_per_node // cpt  # ranks one node can hold
        nodes = next(
            (
                n
                for n in range(lay.nodes + 1, lay.world_size + 1)
                if lay.world_size % n == 0 and lay.world_size // n <= fits
            ),
            None,
        )
        spread = (
            f"cluster.nodes={nodes} cluster.gpus_per_node={lay.world_size // nodes}, "
            if nodes and nodes <= part.nodes
            else ""
        )
        raise P3DConfigError(
            f"cluster.nodes={lay.nodes}: {mesh} needs {lay.ntasks_per_node} tasks x {cpt} CPUs = "
            f"{lay.ntasks_per_node * cpt} CPUs per node, but the nodes of partition {part.name} have "
            f"{part.cpus_per_node}; try {spread}a smaller mesh, or fewer cluster.cpus_per_task"
        )
    if lay.gpus_per_node and lay.gpus_per_node > part.gpus_per_node:
        raise P3DConfigError(
            f"cluster.gpus_per_node={lay.gpus_per_node} exceeds the {part.gpus_per_node} GPUs per "
            f"node of partition {part.name}; try cluster.gpus_per_node={part.gpus_per_node} and "
            "more cluster.nodes, or another cluster.partition"
        )


def recipe_path(cfg) -> Path:
    path = shipped(cfg.cluster.recipe)
    if not path.is_file():
        raise P3DConfigError(f"cluster.recipe={cfg.cluster.recipe}: no such batch script ({path})")
    return path


def inside_allocation() -> bool:
    """True in a Slurm job (sweep job, salloc): start the workers here as an srun step."""
    return "SLURM_JOB_ID" in os.environ


def check_submittable(cfg, plan) -> None:
    """Refuse (P3DConfigError, one line) a job the partition can never run (with groups: a group its partition or
    constraint), from ``sinfo``: p3d-train asks before it writes the run's spec, and again as it submits."""
    lay = job_shape(cfg, plan)
    nodes = sinfo_nodes()
    if cfg.cluster.groups:
        for comp in components(cfg.cluster):
            check_fits(dataclasses.replace(lay, nodes=comp.nodes), component_partition(nodes, comp), plan)
    else:
        check_fits(lay, parse_sinfo(nodes, cfg.cluster.partition), plan)


def submit(cfg, plan, spec: Path) -> tuple[str, Path]:
    """sbatch the recipe on the frozen spec; returns (job id, job log). Raises P3DConfigError when the
    job cannot fit the partition (with groups: a group its partition or constraint), RuntimeError when sbatch
    refuses it."""
    run_dir = spec.parent.resolve()
    lay = job_shape(cfg, plan)
    args = sbatch_args(cfg, lay, run_dir)
    recipe = recipe_path(cfg)
    check_submittable(cfg, plan)
    try:
        job_id = sbatch(cfg.cluster, args, recipe, [], P3D_RUN_DIR=str(run_dir))
    except RuntimeError as exc:
        fields = refusal_fields(cfg.cluster, str(exc)) if cfg.cluster.groups else None
        if fields is None:
            raise
        raise P3DConfigError(f"{fields}: {str(exc).splitlines()[0]}; check them against `sinfo -o '%P %f'`") from None
    log_job(run_dir, f"{job_id} submitted: {' '.join(args)}")
    write_status(run_dir, "submitted", None, job_id=job_id)
    return job_id, run_dir / f"slurm-{job_id}.out"


def sbatch(c, args: list[str], script: Path, script_args: list[str], **env_vars: str) -> str:
    """``sbatch --parsable <args> <script> <script_args>`` with the cluster's setup lines (P3D_SETUP), this
    python (P3D_PYTHON) and ``env_vars`` in the job's environment; returns the job id. RuntimeError when
    sbatch fails or refuses the job. Every p3d submission goes through here."""
    env = dict(os.environ, P3D_PYTHON=sys.executable, **env_vars)
    if c.setup:
        env["P3D_SETUP"] = "\n".join(c.setup)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", FREEZE_ONLY_ENV):
        env.pop(key, None)
    cmd = ["sbatch", "--parsable", *args, str(script), *script_args]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=SLURM_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"sbatch failed: {exc}") from None
    if out.returncode:
        raise RuntimeError(f"sbatch refused the job: {out.stderr.strip()}\n  command: {' '.join(cmd)}")
    return out.stdout.strip().split(";")[0]


def dispatch(cfg, plan, spec: Path, lease=None) -> int:
    """p3d-train with cluster.launcher=slurm, after the spec is frozen and outside an allocation (inside one,
    p3d.jobs.slurm.step.run_step starts the workers): submit the recipe. ``lease`` (p3d.rundir.lease): the run
    directory's lease, handed to the job once it is submitted. Raises P3DConfigError when the partition
    cannot hold the job (nothing is submitted); returns the exit status."""
    if os.environ.get(FREEZE_ONLY_ENV) == "1":  # the recipe froze the spec; it starts the workers itself
        return exit_codes.OK
    try:
        job_id, log = submit(cfg, plan, spec)
    except RuntimeError as exc:
        print(f"p3d: {exc}", file=sys.stderr, flush=True)
        return exit_codes.WORKER_FAILED
    if lease is not None:
        lease.hand_to_job(job_id)
    lay = job_shape(cfg, plan)
    gpus = f", {lay.gpus_per_node} GPUs each" if lay.gpus_per_node else ""
    comps = components(cfg.cluster)
    sizes = " + ".join(f"{c.nodes}" for c in comps)
    het = f"; a heterogeneous job, one component per group ({sizes} node(s))" if comps else ""
    if comps and cfg.cluster.elastic.min_nodes is not None:
        het = f"; one --no-kill job, each group's nodes by its feature ({sizes} node(s)), ranks in the groups' order"
    print(
        f"p3d: submitted Slurm job {job_id}: {cfg.model.name} on mesh {plan.dims.degrees()}, "
        f"{lay.nodes} node(s) x {lay.ntasks_per_node} tasks{gpus}{het}\n"
        f"p3d: run dir {spec.parent}\np3d: job log {log}\n"
        f"p3d: watch it with: squeue -j {job_id}; tail -f {log}",
        flush=True,
    )
    return exit_codes.OK


def group_placement_warning(cfg) -> str | None:
    """cluster.groups run inside an ordinary allocation (a sweep job, salloc): one job of cluster.nodes nodes, so Slurm
    chose which nodes hold which group's ranks; the split still trains the same model, at the planned pace only if the
    nodes came in the groups' order. None without groups, and inside a heterogeneous job (``SLURM_HET_SIZE``), whose
    components are the groups (p3d-train outside an allocation submits one: p3d.jobs.slurm.hetjob)."""
    groups = cfg.cluster.groups
    if not groups or os.environ.get("SLURM_HET_SIZE"):
        return None
    named = ", ".join(f"{g.nodes} x {g.device}" for g in groups)
    return (
        f"p3d: warning: cluster.groups ({named}) inside the ordinary Slurm job {os.environ.get('SLURM_JOB_ID', '?')}: "
        "Slurm may have given a group's ranks another group's nodes (the same model, at another pace); to pin them, "
        "run p3d-train outside an allocation, which submits one hetjob component per group (docs/clusters.md)"
    )
