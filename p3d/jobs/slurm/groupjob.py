"""An elastic run over ``cluster.groups`` on Slurm (docs/clusters.md, Elastic runs): one ordinary job, not a hetjob.

Slurm 22.05 requeues or ends every component of a heterogeneous job when one of its nodes fails, ``--no-kill`` or not;
an ordinary ``--no-kill`` job goes on on the nodes left. So ``p3d-train`` submits ``sbatch --no-kill --nodes=<sum>
--constraint=[f0*n0&f1*n1...]``: group i's ``n_i`` nodes asked for by its node feature ``f_i`` (each group names one
of its own: p3d.layout.elastic_rules.check_slurm_groups). Slurm lists a job's nodes by name, not in the groups'
order, so before each srun the recipe writes a host file (``SLURM_HOSTFILE``) that lists each group's hosts in the
groups' order, each host once per task, and starts ``srun --distribution=arbitrary``: task r runs on line r's host,
so rank r sits on node r // ranks per node of the groups' order (p3d.layout.hetero) and rank 0, the master, on group
0's first host. After a loss the lost hosts' places in the host file of the srun that failed are their indices in the
run's node order, which p3d.layout.hetero.groups_left turns into the groups left (p3d.jobs.elastic.after_loss). A shrunk
job that is requeued has all its nodes again; each group gets back the live nodes of its feature (:func:`grown_groups`,
p3d.jobs.slurm.regrow).

    python -m p3d.cli.slurm hostfile <run_dir>   # the host file of the job's live nodes; prints "<path> <master>"

Pure functions; what asks Slurm (the live nodes, their features) is p3d.jobs.slurm.step's.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from p3d.config.errors import P3DConfigError
from p3d.rundir.files import logs as run_logs


def constraint_expression(c) -> str:
    """sbatch's ``--constraint`` for the groups of cluster config ``c``: each group's node count of its feature."""
    return "[" + "&".join(f"{g.constraint}*{g.nodes}" for g in c.groups) + "]"


def groupjob_args(c, lay, job_wide: list[str]) -> list[str]:
    """sbatch's options for the groups' ordinary job: every group's nodes, the run's tasks (GPUs, CPUs) per node, the
    groups' one partition, account, qos, the feature counts, then ``job_wide`` (with --no-kill:
    p3d.jobs.slurm.submit)."""
    args = [f"--nodes={sum(g.nodes for g in c.groups)}", f"--ntasks-per-node={lay.ntasks_per_node}"]
    if lay.gpus_per_node:
        args.append(f"--gpus-per-node={lay.gpus_per_node}")
    if lay.cpus_per_task:
        args.append(f"--cpus-per-task={lay.cpus_per_task}")
    place = {"partition": c.groups[0].partition or c.partition, "account": c.account, "qos": c.qos}
    args += [f"--{flag}={value}" for flag, value in place.items() if value is not None]
    return args + [f"--constraint={constraint_expression(c)}"] + job_wide


_NODE = re.compile(r"NodeName=(\S+)")
_FEATURES = re.compile(r"(?:AvailableFeatures|ActiveFeatures)=(\S*)")


def parse_node_features(text: str) -> dict[str, set[str]]:
    """``scontrol show node -o``'s lines: each node's features (available and active)."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        node = _NODE.search(line)
        if node:
            found = {f for value in _FEATURES.findall(line) for f in value.split(",") if f and f != "(null)"}
            out[node.group(1)] = found
    return out


def group_hosts(c, features: dict[str, set[str]]) -> list[list[str]]:
    """Each group's hosts among ``features`` (a job's live nodes), in the groups' order: the hosts with its feature, by
    name, at most its ``nodes``, each host in one group (the first whose feature it has)."""
    taken: list[str] = []
    out = []
    for g in c.groups:
        hosts = sorted(h for h, f in features.items() if g.constraint in f and h not in taken)[: g.nodes]
        taken += hosts
        out.append(hosts)
    return out


def node_order(c, features: dict[str, set[str]]) -> list[str]:
    """The hosts of ``features`` (a job's live nodes) in the groups' order: group i's ``nodes`` hosts with its feature,
    by name, each host in one group. Raises P3DConfigError when a group has fewer hosts than nodes."""
    order: list[str] = []
    for i, (g, hosts) in enumerate(zip(c.groups, group_hosts(c, features))):
        if len(hosts) < g.nodes:
            raise P3DConfigError(
                f"cluster.groups[{i}] ({g.nodes} x {g.device}, feature {g.constraint}): the job has "
                f"{len(hosts)} such node(s) left ({', '.join(sorted(features))}); check `scontrol show node`'s features"
            )
        order += hosts
    return order


def grown_groups(first, features: dict[str, set[str]], job_constraint: str | None) -> list:
    """A requeued groups job's groups (docs/clusters.md, Elastic runs): each group of ``first`` (the cluster config the
    job was submitted with: the run's first spec's) on as many of the job's live nodes ``features`` as have its feature,
    at most its count then; a group with none is left out. ``job_constraint``: the job's ``--constraint`` (scontrol's
    Features; None: not known), which must be the one ``first``'s groups ask for, or they are not the job's groups."""
    asked = constraint_expression(first)
    fix = "resume naming the groups (p3d-train train.resume=auto run.dir=<run> cluster.groups='[...]')"
    if job_constraint is not None and job_constraint != asked:
        raise P3DConfigError(
            f"cluster.groups: the job's --constraint={job_constraint} is not {asked}, the one the run's first "
            f"cluster.groups ask for, so which group a node belongs to is not known; {fix}"
        )
    counts = [len(hosts) for hosts in group_hosts(first, features)]
    if not any(counts):
        raise P3DConfigError(
            f"cluster.groups: none of the job's nodes ({', '.join(sorted(features)) or 'none'}) has a group's feature "
            f"({', '.join(str(g.constraint) for g in first.groups)}); check `scontrol show node`'s features or {fix}"
        )
    return [dataclasses.replace(g, nodes=k) for g, k in zip(first.groups, counts) if k > 0]


def hostfile_text(order: list[str], per_node: int) -> str:
    """SLURM_HOSTFILE for ``srun --distribution=arbitrary``: task r on line r, each host ``per_node`` lines in a row."""
    return "".join(f"{h}\n" * per_node for h in order)


def hostfile_path(run_dir: str | Path) -> Path:
    return run_logs(Path(run_dir)) / f"hostfile-{os.environ.get('SLURM_JOB_ID', '0')}"


def read_order(path: Path) -> list[str]:
    """The hosts of a host file in order, each once: the run's node order of the srun that used it. Raises
    P3DConfigError when the file is missing, unreadable or empty."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise P3DConfigError(f"the host file {path} cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    order = list(dict.fromkeys(text.split()))  # each host once, in the file's order
    if not order:
        raise P3DConfigError(f"the host file {path} is empty")
    return order


def lost_indices(lost: list[str], order: list[str]) -> tuple[list[str], list[int]]:
    """The hosts of ``lost`` that the failed srun ran on (its host file's ``order``; one lost before is not there) and
    their indices in it: the run's node order, whose groups p3d.layout.hetero.group_of_node / groups_left read."""
    now = [h for h in lost if h in order]
    return now, [order.index(h) for h in now]
