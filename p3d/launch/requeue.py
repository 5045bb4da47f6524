"""A restarted or requeued run's spec, frozen again: ``train.resume=auto`` resolved to the newest complete
checkpoint and checked (as ``p3d-train train.resume=auto run.dir=<run_dir>`` would). The local launcher's restarts
(p3d.jobs.restart) and the Slurm recipe after a requeue (``python -m p3d.cli.slurm resume``) call it; an elastic
run's restart on another node count (p3d.jobs.elastic) re-fits the layout and rebuilds the plan here too."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from p3d import exit_codes
from p3d.config.errors import P3DConfigError


def resume_spec(run_dir: str, nodes: int | None = None, event: dict | None = None, groups: list | None = None) -> int:
    """Re-freeze the spec of a requeued job with train.resume=auto resolved to the newest complete
    checkpoint (as ``p3d-train train.resume=auto run.dir=<run_dir>`` would). ``nodes``: an elastic run
    re-fitted to that many nodes (p3d.jobs.elastic.refit), its plan rebuilt and ``event`` recorded with the spec;
    the decision's one line has said what changed, so the per-field lines are not printed. ``groups``: on a cluster of
    groups, the groups those ``nodes`` are (a requeued job's, grown back from its nodes' features:
    p3d.jobs.slurm.regrow)."""
    from p3d.launch.check import check_run, tokenizer_vocab  # check_run resolves auto to a checkpoint dir
    from p3d.launch.freeze import freeze
    from p3d.layout.run_plan import build_plan
    from p3d.rundir.spec import read_spec

    cfg, plan = read_spec(run_dir)
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, resume="auto"), run=dataclasses.replace(cfg.run, dir=str(run_dir))
    )
    try:
        if nodes is not None:
            from p3d.jobs.elastic import refit, with_groups
            from p3d.layout.elastic import pinned

            cfg = with_groups(pinned(cfg, plan), event)  # on cluster.groups: the groups the loss left
            if groups is not None:  # or the groups a requeued job has again
                from p3d.layout.hetero import regrouped

                cfg = dataclasses.replace(cfg, cluster=regrouped(cfg.cluster, groups))
            cfg = refit(cfg, nodes)
            plan = build_plan(cfg, tokenizer_vocab(cfg.data))
        cfg = check_run(cfg, quiet=nodes is not None)
    except P3DConfigError as exc:
        print(f"p3d: cannot resume {run_dir}: {exc}", file=sys.stderr, flush=True)
        return exit_codes.CONFIG_ERROR
    if nodes is not None and event is None:  # a (re)start on another node count than the checkpoint's: say so
        from p3d.jobs.elastic import at_start

        resized = at_start(cfg, plan)
        if resized is not None:
            print(resized.line, flush=True)
            event = resized.event
    freeze(cfg, plan, run_dir, layout_change=event)
    if nodes is None:
        print(f"p3d: resuming {run_dir} from {cfg.train.resume}", flush=True)
    return 0


def resume_in_allocation(run_dir: str) -> int:
    """The Slurm recipe after a requeue: :func:`resume_spec`, an elastic run fitted to the nodes this start of the job
    has (``SLURM_JOB_NUM_NODES``): dp grows back when the requeued job got more nodes than it ran on. Over
    ``cluster.groups`` the groups grow back from the job's nodes' features (p3d.jobs.slurm.regrow), the split
    re-planned; what cannot be placed is refused in one line and the spec is left as it was."""
    import os

    from p3d.rundir.spec import read_spec

    cfg, _ = read_spec(run_dir)
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", cfg.cluster.nodes))
    if cfg.cluster.elastic.min_nodes is None or nodes == cfg.cluster.nodes:
        return resume_spec(run_dir)
    if not cfg.cluster.groups:
        return resume_spec(run_dir, nodes=nodes)
    from p3d.jobs.slurm.regrow import groups_back

    try:
        groups = groups_back(run_dir)
    except (P3DConfigError, OSError, subprocess.SubprocessError) as exc:
        print(f"p3d: cannot resume {run_dir}: {exc}", file=sys.stderr, flush=True)
        return exit_codes.CONFIG_ERROR
    return resume_spec(run_dir, nodes=sum(g.nodes for g in groups), groups=groups)
