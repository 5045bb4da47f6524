"""Sweeps: ``p3d-train -m mesh=dp4,tp2_pp2,pp4 ...``.

- :class:`P3DSlurmLauncher` (``hydra/launcher=p3d_slurm``, picked by ``cluster=slurm``): Hydra's
  submitit Slurm launcher, one job per point, each sized from that point's mesh and cluster config by
  the same rules as ``p3d-train cluster=slurm`` (:func:`p3d.jobs.slurm.submit.job_shape`), since the world size
  differs between points (a submitit array would give every point the same resources). Every point
  is validated before submission; an infeasible one is reported, recorded and never submitted. The
  job runs p3d-train in its batch step (no srun around it), which starts the workers as one srun step.
The callback that records each point's outcome and prints the report at the end is
:class:`p3d.launch.report.SweepCallback`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from p3d import exit_codes
from p3d.console import error, say
from p3d.jobs.slurm.submit import check_fits, checked_time_limit, job_shape, partition_info, time_minutes
from p3d.launch.report_rows import mesh_label
from p3d.layout.run_plan import P3DConfigError
from p3d.rundir.files import write_status
from p3d.rundir.lease import check_free


def _not_run(overrides, task_cfg, cfg, status: int) -> JobReturn:
    """The outcome of a point that produced no result (skipped or failed), with its exit status."""
    return JobReturn(
        overrides=list(overrides),
        cfg=task_cfg,
        hydra_cfg=cfg,
        working_dir=os.getcwd(),
        task_name=cfg.hydra.job.name,
        status=JobStatus.COMPLETED,
        _return_value=status,
    )


def _resume_auto(overrides: list[str]) -> list[str]:
    """A requeued sweep job runs the same point again: let it resume its own checkpoint."""
    if any(o.lstrip("+~").startswith("train.resume=") for o in overrides):
        return overrides
    return [*overrides, "train.resume=auto"]


class P3DSlurmLauncher(SlurmLauncher):
    """One submitit Slurm job per feasible sweep point, resources derived per point."""

    def _point_config(self, overrides: list[str], idx: int) -> tuple[DictConfig, DictConfig, Path]:
        """(full config, task config, output dir) of one point, as run_job will see them."""
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.num = idx
            cfg.hydra.job.id = f"job_id_for_{idx}"
        HydraConfig.instance().set_config(cfg)
        out = Path(str(cfg.hydra.sweep.dir)) / str(OmegaConf.select(cfg, "hydra.sweep.subdir"))
        with read_write(cfg.hydra.runtime), open_dict(cfg.hydra.runtime):
            cfg.hydra.runtime.output_dir = str(out.resolve())
        HydraConfig.instance().set_config(cfg)
        task_cfg = copy.deepcopy(cfg)
        with read_write(task_cfg), open_dict(task_cfg):
            del task_cfg["hydra"]
        return cfg, task_cfg, out

    def _params(self, cfg, lay) -> dict[str, Any]:
        c = cfg.cluster
        # The job is one submitit task (its result pickle) that runs p3d-train in the batch step; the
        # allocation it starts the workers in is given here, out of submitit's sight: nodes and tasks.
        extra: dict[str, Any] = {"nodes": lay.nodes, "ntasks_per_node": lay.ntasks_per_node, "open-mode": "append"}
        if lay.gpus_per_node:
            extra["gpus_per_node"] = lay.gpus_per_node
        if lay.cpus_per_task:
            extra["cpus_per_task"] = lay.cpus_per_task
        extra["requeue" if c.requeue else "no-requeue"] = True
        if c.signal_s > 0:  # to the worker step (not the batch step): they checkpoint, exit 75, the job requeues
            extra["signal"] = f"USR1@{c.signal_s}"
        for line in c.extra_sbatch:
            key, eq, value = line.lstrip("-").partition("=")
            extra[key] = value if eq else True
        limit = checked_time_limit(c)
        params: dict[str, Any] = dict(
            nodes=1,
            tasks_per_node=1,
            name=c.job_name,
            timeout_min=time_minutes(c.time) if limit else self.params.get("timeout_min", 60),
            slurm_use_srun=False,
            slurm_stderr_to_stdout=True,
            slurm_additional_parameters=extra,
        )
        for key in ("partition", "account", "qos", "constraint"):
            if getattr(c, key) is not None:
                params[f"slurm_{key}"] = getattr(c, key)
        if c.setup:
            params["slurm_setup"] = list(c.setup)
        return params

    def _skip(self, overrides, task_cfg, cfg, out: Path, idx: int, msg: str) -> JobReturn:
        error(f"point #{idx} ({' '.join(filter_overrides(overrides))}) skipped, not submitted: {msg}")
        write_status(
            out, "skipped", exit_codes.CONFIG_ERROR, reason=msg, mesh=mesh_label(task_cfg), overrides=list(overrides)
        )
        return _not_run(overrides, task_cfg, cfg, 2)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        from p3d.launch.check import preflight, prepare
        from p3d.launch.compose import with_source

        assert self.config is not None and self.hydra_context is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        executor = submitit.AutoExecutor(
            folder=self.params["submitit_folder"],
            cluster="slurm",
            slurm_max_num_timeout=self.params.get("max_num_timeout", 0),
        )
        partitions: dict[Any, Any] = {}
        original = HydraConfig.instance().cfg
        slots: list[Any] = []
        try:
            for i, point in enumerate(job_overrides):
                idx = initial_job_idx + i
                overrides = _resume_auto(list(point))
                cfg_full, task_cfg, out = self._point_config(overrides, idx)
                try:
                    cfg, plan = prepare(task_cfg)
                    preflight(cfg, plan)
                    check_free(out)  # a live run holds this point's directory: do not submit into it
                    lay = job_shape(cfg, plan)
                    if cfg.cluster.partition not in partitions:
                        partitions[cfg.cluster.partition] = partition_info(cfg.cluster.partition)
                    check_fits(lay, partitions[cfg.cluster.partition], plan)
                    params = self._params(cfg, lay)
                except P3DConfigError as exc:
                    slots.append(self._skip(overrides, task_cfg, cfg_full, out, idx, with_source(str(exc))))
                    continue
                executor.update_parameters(**params)
                try:
                    job = executor.submit(
                        self, overrides, "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()
                    )
                except Exception as exc:  # sbatch refused it (account, qos, ...): skip the point
                    why = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
                    slots.append(self._skip(overrides, task_cfg, cfg_full, out, idx, f"sbatch refused it: {why}"))
                    continue
                say(
                    f"point #{idx} ({' '.join(filter_overrides(overrides))}): Slurm job {job.job_id}, "
                    f"{lay.nodes} node(s) x {lay.ntasks_per_node} tasks; run dir {out}"
                )
                slots.append((job, overrides, task_cfg, cfg_full, out))
        finally:
            HydraConfig.instance().cfg = original
        return [s if isinstance(s, JobReturn) else self._wait(*s) for s in slots]

    @staticmethod
    def _wait(job, overrides, task_cfg, cfg, out: Path) -> JobReturn:
        """The job's JobReturn; a job that died without one (cancelled, killed, node failure) is
        reported as failed in the table instead of ending the sweep."""
        try:
            return job.results()[0]
        except Exception as exc:  # submitit raises several kinds
            reason = f"Slurm job {job.job_id} {job.state}: {str(exc).strip().splitlines()[0] if str(exc) else exc!r}"
            error(reason)
            write_status(
                out, "failed", exit_codes.WORKER_FAILED, reason=reason, job_id=job.job_id, mesh=mesh_label(task_cfg)
            )
            return _not_run(overrides, task_cfg, cfg, 1)
