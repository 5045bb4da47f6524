"""``p3d-train``'s task: prepare, take the run directory's lease, freeze the spec, launch; an exit status."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from omegaconf import DictConfig

from p3d import exit_codes
from p3d.console import say
from p3d.launch.check import check_run, preflight, prepare
from p3d.launch.compose import config_error, given_overrides, is_multirun, report_error, with_source
from p3d.layout.run_plan import P3DConfigError
from p3d.rundir import files as run_dir
from p3d.rundir.lease import take_lease


def train_task(cfg_node: DictConfig) -> int:
    multirun = is_multirun()
    lease = None
    try:
        cfg, plan = prepare(cfg_node)
        if not cfg.dry_run:
            preflight(cfg, plan)
            lease = take_lease(cfg)  # one run per run.dir, from before anything is written (p3d.rundir.lease)
            cfg = check_run(cfg, multirun)
    except P3DConfigError as exc:
        if lease is not None:
            lease.release()
        return _refused(str(exc), multirun)
    if cfg.dry_run:  # what the launch would say: the stages, and the pre-flight's refusal of a layout that won't fit
        from p3d.launch.dryrun import dry_run

        report = dry_run(cfg, plan)
        print(report.render(), flush=True)
        return exit_codes.OK if report.refusal is None else _refused(report.refusal, multirun)
    try:
        return _launch(cfg, plan, lease)
    except P3DConfigError as exc:  # the Slurm partition cannot hold the job: nothing was submitted
        return _refused(f"{exc} (nothing was submitted)", multirun)
    finally:
        if lease is not None:
            lease.release()  # the last worker has exited (or the lease went to a submitted Slurm job)


def _refused(message: str, multirun: bool) -> int:
    """A config error: one line; a sweep point records why it was skipped, where p3d-report reads it."""
    if multirun:
        from hydra.core.hydra_config import HydraConfig

        run_dir.write_status(
            HydraConfig.get().runtime.output_dir, "skipped", exit_codes.CONFIG_ERROR, reason=with_source(message)
        )
    return config_error(message, multirun)


def _refuse_elastic_in_one_step(cfg) -> None:
    """Inside an allocation without the recipe (salloc, a sweep's job) the run is one srun step, which never
    restarts: cluster.elastic.min_nodes would be ignored there. Refused before the spec is written."""
    if cfg.cluster.launcher.value != "slurm" or cfg.cluster.elastic.min_nodes is None:
        return
    from p3d.jobs.slurm.submit import FREEZE_ONLY_ENV, inside_allocation

    if inside_allocation() and os.environ.get(FREEZE_ONLY_ENV) != "1":
        raise P3DConfigError(
            f"cluster.elastic.min_nodes={cfg.cluster.elastic.min_nodes} needs the batch recipe's restarts; "
            "submit with p3d-train cluster=slurm (or sbatch recipes/slurm/train.sbatch) from outside an "
            "allocation, or drop cluster.elastic.min_nodes"
        )


def _launch(cfg, plan, lease) -> int:
    if "RANK" in os.environ:
        return _run_as_worker(cfg, plan)

    _refuse_elastic_in_one_step(cfg)
    from p3d.jobs.elastic import at_start

    resized = at_start(cfg, plan)  # an elastic run resumed on another node count: one line, and the change recorded
    if resized is not None:
        print(resized.line, flush=True)

    from p3d.jobs.forked import worker_imports
    from p3d.jobs.local import launch_local
    from p3d.launch.freeze import freeze, undone_if_refused
    from p3d.rundir.spec import read_spec

    change = resized.event if resized is not None else None
    if cfg.cluster.launcher.value == "slurm":
        from p3d.jobs.slurm.submit import FREEZE_ONLY_ENV, check_submittable, dispatch, inside_allocation

        if inside_allocation() and os.environ.get(FREEZE_ONLY_ENV) != "1":  # salloc, or a sweep's job: one srun step
            from p3d.jobs.slurm.step import run_step

            return run_step(cfg, plan, freeze(cfg, plan, cfg.run.dir, layout_change=change))
        if os.environ.get(FREEZE_ONLY_ENV) != "1":
            check_submittable(cfg, plan)  # a job the partition cannot hold: refused before anything is written
        with undone_if_refused(cfg.run.dir):  # sbatch refused it: nothing was submitted, nothing is left
            return dispatch(cfg, plan, freeze(cfg, plan, cfg.run.dir, layout_change=change), lease)
    spec = freeze(cfg, plan, cfg.run.dir, layout_change=change)
    say(f"run dir {spec.parent}")
    say(
        f"{cfg.model.name} on mesh {plan.dims.degrees()}: "
        f"starting {plan.world_size} workers ({plan.backend}); logs in {run_dir.logs(spec.parent)}"
    )
    # the lease names the workers as soon as they exist: a launcher killed now leaves a lease that stays live
    from p3d.jobs.restart import run_with_restarts
    from p3d.jobs.stop import StopSignals

    signals = StopSignals({}, sys.stdout, spec.parent, cfg.train.keep_last)  # one for every launch of the run

    def launch_once(failure: dict) -> int:
        on_started = lease.refresh if lease is not None else None
        now_cfg, now_plan = read_spec(spec)  # a restart re-froze it: an elastic run's world and imports may change
        now_imports = worker_imports(now_cfg.schedule.pipeline.value, now_cfg.zero.stage)
        return launch_local(
            spec, now_plan, on_started=on_started, failure=failure, imports=now_imports, signals=signals
        )

    from p3d.launch.requeue import resume_spec

    rc = run_with_restarts(
        launch_once, spec.parent, cfg.train.max_restarts, resume_spec, stopped=lambda: bool(signals.received)
    )
    if rc == 0:
        say(f"done; metrics in {spec.parent / run_dir.METRICS}")
    return rc


def _run_as_worker(cfg, plan) -> int:
    """Under torchrun / srun (RANK set): every rank composed the same spec; rank 0 writes it."""
    from p3d.parallel.rendezvous import RendezvousError
    from p3d.rundir.spec import write_spec
    from p3d.train import worker

    if not any(o.startswith("run.dir=") for o in given_overrides()):
        return report_error(
            "under an external launcher (RANK is set) every rank must agree on the run "
            "directory; add run.dir=<a path all ranks share>"
        )
    spec = Path(cfg.run.dir) / run_dir.SPEC
    if int(os.environ["RANK"]) == 0:
        write_spec(cfg, plan, cfg.run.dir)
    try:
        return worker.run(spec, cfg, plan)
    except RendezvousError as exc:
        sys.stderr.flush()
        return report_error(f"rank {os.environ['RANK']}: {exc}", exit_codes.RENDEZVOUS_FAILED)
