"""``p3d-train``: compose the config once (Hydra), validate it, freeze the run spec, launch workers.

    p3d-train                                   # tiny Llama on dp2_pp2_tp2, 8 CPU processes
    p3d-train mesh=tp2_pp2 train.steps=50
    p3d-train mesh=tp8_pp8 model=llama70b dry_run=true
    p3d-train -m mesh=dp2,tp2,pp2               # one run per mesh

Exit status: 0 done; 2 a config error (one line naming the field and the fix, before any worker
starts); 1 a worker failed (the rank is named); 128+N stopped by signal N.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import tempfile
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from p3d import exit_codes
from p3d.config.schema import register_configs
from p3d.config.validate import P3DConfigError, build_plan, check_config, fill_cluster
from p3d.run_lock import take_lease

CONFIG_PATH = str(Path(__file__).resolve().parents[1] / "conf")


def tokenizer_vocab(data_cfg) -> int:
    from p3d.data.tokenizer import load_tokenizer

    try:
        return load_tokenizer(data_cfg.tokenizer).vocab_size
    except (OSError, ValueError) as exc:
        raise P3DConfigError(str(exc)) from None


def typed_config(cfg_node: DictConfig, resolve_auto: bool = True):
    """The typed Config with the device preset filled in and ``mesh=auto`` resolved by the planner."""
    from omegaconf.errors import OmegaConfBaseException

    from p3d.config.spec import to_config
    from p3d.paths import resolve_config_paths

    try:
        cfg = fill_cluster(to_config(cfg_node))
    except OmegaConfBaseException as exc:
        raise P3DConfigError(str(exc).splitlines()[0]) from None
    cfg = resolve_config_paths(cfg)  # every user-given path absolute, against the directory the command ran from
    if cfg.model.init_from:
        cfg = with_hf_shape(cfg)
    cfg = with_tokenizer(cfg)
    check_config(cfg)  # field bounds and the model's shape: what p3d-plan cannot compute either
    if cfg.mesh.name == "auto" and resolve_auto:
        from p3d.plan import apply_layout, best_layout

        cfg = apply_layout(cfg, best_layout(cfg))
    return cfg


def with_hf_shape(cfg):
    """``model.init_from``: the model shape comes from the HF config.json; a field also set on the
    command line must agree with it."""
    import dataclasses

    from p3d.hf import HFImportError, SafetensorsDir, model_fields, read_config

    where = cfg.model.init_from
    try:
        fields = model_fields(read_config(where), where)
        SafetensorsDir(where)  # every shard present
    except HFImportError as exc:
        raise P3DConfigError(str(exc)) from None
    overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    for key, value in fields.items():
        given = [o.split("=", 1)[1] for o in overrides if o.startswith(f"model.{key}=")]
        if given and str(getattr(cfg.model, key)) != str(value):
            raise P3DConfigError(f"model.{key}={given[-1]} disagrees with {where}/config.json ({value}); drop the "
                                 f"override or set model.{key}={value}")
    name = f"hf:{Path(where).name}"
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=name, **fields))


def with_tokenizer(cfg):
    """``data.tokenizer=auto`` resolved: the tokenizer.json of ``model.init_from`` when it has one, else
    ``byte``; with ``model.init_from``, another tokenizer is refused and the vocabulary checked."""
    import dataclasses

    from p3d.hf import HFImportError
    from p3d.hf_tokenizer import import_tokenizer

    try:
        tokenizer = import_tokenizer(cfg.data.tokenizer, cfg.model.init_from, cfg.model.vocab_size)
    except HFImportError as exc:
        raise P3DConfigError(str(exc)) from None
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=tokenizer))


def prepare(cfg_node: DictConfig):
    """Typed config and run plan, or P3DConfigError."""
    cfg = typed_config(cfg_node)
    return cfg, build_plan(cfg, tokenizer_vocab(cfg.data), for_training=not cfg.dry_run)


def preflight(cfg) -> None:
    """Refuse a layout the planner predicts not to fit device memory (plan.force=true skips this)."""
    from p3d.plan import plan as plan_memory

    report = plan_memory(cfg)
    if report.fits or cfg.plan.force:
        return
    print(report.render(), file=sys.stderr)
    mem = report.to_json()["memory_gb"]
    lay = report.layout
    need = (f"{mem['all_ranks']:.3g} GB for its {lay.world_size} workers together" if report.shared_host
            else f"{mem['total']:.3g} GB on its most loaded device")
    raise P3DConfigError(f"the layout tp={lay.tp} pp={lay.pp} dp={lay.dp} is predicted to need {need}, "
                         f"more than cluster.memory_gb={cfg.cluster.memory_gb}: see the breakdown above "
                         "or p3d-plan; try more stages or tensor parallelism, schedule.recompute=full, zero=stage1, "
                         "or plan.force=true")


def check_run(cfg, multirun: bool = False):
    """What needs the disk and the data, before any worker starts: the checkpoint to resume (``auto``
    resolved to a directory, checked complete and of this model), a run directory that already holds a
    run (never overwritten without ``train.resume``), the data (opens, has the text column, has enough
    tokens), and the W&B group of a sweep."""
    import dataclasses

    from p3d.data.check import check_data
    from p3d.train import checkpoint

    run_dir = Path(cfg.run.dir)
    try:
        found = checkpoint.find(run_dir, cfg.train.resume)
        if found is not None:
            meta = checkpoint.verify(found)
            checkpoint.check_compatible(meta, cfg, found)
    except checkpoint.CheckpointError as exc:
        raise P3DConfigError(str(exc)) from None
    changes = check_resume(cfg, found, meta["step"]) if found is not None else []
    if cfg.train.resume == "none" and ((run_dir / "metrics.jsonl").exists() or checkpoint.find(run_dir, "auto")):
        raise P3DConfigError(f"run.dir={run_dir} already holds a run (metrics.jsonl / checkpoints); resume it with "
                             "train.resume=auto, or choose a new run.dir")
    try:
        check_data(cfg.data, cfg.model.seq_len, need_val=cfg.train.eval_every > 0)
    except (OSError, ValueError, KeyError) as exc:
        raise P3DConfigError(str(exc).strip("'\"")) from None
    if found is None and cfg.train.resume == "auto":
        print(f"p3d: no checkpoint in {checkpoint.root(run_dir)}; starting from step 0", flush=True)
    for line in changes:
        print(f"p3d: {line}", flush=True)
    train = dataclasses.replace(cfg.train, resume=str(found) if found else "none")
    logger = cfg.logger
    if multirun and logger.group is None:
        logger = dataclasses.replace(logger, group=Path(HydraConfig.get().sweep.dir).name)
    return dataclasses.replace(cfg, train=train, logger=logger)


def check_resume(cfg, ckpt: Path, step: int) -> list[str]:
    """The lines saying what this resume changes (p3d.config.resume_rules), or P3DConfigError for a field
    that may not change or a train.steps not above the checkpoint's step."""
    from p3d.config import resume_rules
    from p3d.config.spec import resume_changes

    changes = resume_changes(cfg, ckpt)
    refused = resume_rules.refusal(changes, str(ckpt), step, cfg.train.steps)
    if refused:
        raise P3DConfigError(refused)
    return [c.line(step + 1) for c in resume_rules.printed(changes)]


def _with_source(message: str) -> str:
    """Insert where the offending field was set: 'mesh.tp=4 (mesh/tp4.yaml) must divide ...'."""
    head, _, rest = message.partition(" ")
    field = head.split("=", 1)[0]
    if "=" not in head or not re.fullmatch(r"[a-z_]+\.[a-z0-9_]+", field):  # not one field (e.g. tp*pp*dp)
        return message
    hc = HydraConfig.get()
    if any(o.lstrip("+~").startswith(f"{field}=") for o in hc.overrides.task):
        where = "command line"
    else:
        group = field.split(".", 1)[0]
        choice = hc.runtime.choices.get(group)
        where = f"{group}/{choice}.yaml" if choice else "config.yaml"
    return f"{head} ({where}) {rest}"


def fail(msg: str, status: int = 2):
    print(f"p3d: {msg}", file=sys.stderr, flush=True)
    sys.exit(status)


def _run_as_worker(cfg, plan) -> int:
    """Under torchrun / srun (RANK set): every rank composed the same spec; rank 0 writes it."""
    from p3d import worker
    from p3d.config.spec import write_spec

    if not any(o.startswith("run.dir=") for o in HydraConfig.get().overrides.task):
        fail("under an external launcher (RANK is set) every rank must agree on the run directory; "
             "add run.dir=<a path all ranks share>")
    spec = Path(cfg.run.dir) / "run_spec.yaml"
    if int(os.environ["RANK"]) == 0:
        write_spec(cfg, plan, cfg.run.dir)
    from p3d.dist.rendezvous import RendezvousError

    try:
        status = worker.run(spec, cfg, plan)
    except RendezvousError as exc:
        fail(f"rank {os.environ['RANK']}: {exc}", exit_codes.RENDEZVOUS_FAILED)
    if status:
        sys.exit(status)
    return status


def train_task(cfg_node: DictConfig) -> int:
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    lease = None
    try:
        cfg, plan = prepare(cfg_node)
        if not cfg.dry_run:
            preflight(cfg)
            lease = take_lease(cfg)  # one run per run.dir, from before anything is written (p3d.run_lock)
            cfg = check_run(cfg, multirun)
    except P3DConfigError as exc:
        if lease is not None:
            lease.release()
        msg = _with_source(str(exc))
        if multirun:
            print(f"p3d: skipped this point, config error: {msg}", file=sys.stderr, flush=True)
            return exit_codes.CONFIG_ERROR
        fail(f"config error: {msg}")
    if cfg.dry_run:
        from p3d.dryrun import dry_run

        print(dry_run(cfg, plan).render(), flush=True)
        return 0
    try:
        return _launch(cfg, plan, multirun, lease)
    finally:
        if lease is not None:
            lease.release()  # the last worker has exited (or the lease went to a submitted Slurm job)


def _launch(cfg, plan, multirun: bool, lease) -> int:
    if "RANK" in os.environ:
        return _run_as_worker(cfg, plan)

    from p3d.config.spec import write_spec
    from p3d.dist.launch import launch_local
    from p3d.config.deepspeed_json import DS_CONFIG_NAME, deepspeed_config

    spec = write_spec(cfg, plan, cfg.run.dir)
    (spec.parent / DS_CONFIG_NAME).write_text(json.dumps(deepspeed_config(cfg, plan), indent=2) + "\n")
    if cfg.cluster.launcher.value == "slurm":
        from p3d.dist.slurm import dispatch

        return dispatch(cfg, plan, spec, multirun, lease)
    print(f"p3d: run dir {spec.parent}\np3d: {cfg.model.name} on mesh dp={plan.dp} x pp={plan.pp} x tp={plan.tp}: "
          f"starting {plan.world_size} workers ({plan.backend}); logs in {spec.parent / 'logs'}", flush=True)
    rc = launch_local(spec, plan)
    if rc == 0:
        print(f"p3d: done; metrics in {spec.parent / 'metrics.jsonl'}", flush=True)
    elif not multirun:
        if rc == 128 + signal.SIGINT:  # Ctrl-C twice: the workers are gone; do not wait for the interpreter's teardown
            if lease is not None:
                lease.release()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
        sys.exit(rc)
    return rc


def _no_hydra_outputs(argv: list[str], name: str) -> list[str]:
    """Keep Hydra from creating output directories for a command that writes no run."""
    keys = {a.split("=", 1)[0].lstrip("+~") for a in argv if "=" in a}
    defaults = {"hydra.output_subdir": "null", "hydra.run.dir": ".",
                "hydra.sweep.dir": str(Path(tempfile.gettempdir()) / name)}
    return argv + [f"{k}={v}" for k, v in defaults.items() if k not in keys]


def run_hydra(task, writes_outputs: bool = True) -> None:
    """Compose with Hydra and run ``task``; a config Hydra cannot compose (unknown group option,
    bad override, wrong type) exits 2, like every other config error."""
    if not writes_outputs:
        sys.argv = [sys.argv[0]] + _no_hydra_outputs(sys.argv[1:], Path(sys.argv[0]).name)
    else:  # with run.dir given, Hydra's own output (.hydra/) goes inside it, never to ./outputs
        from p3d.paths import hydra_output_overrides

        sys.argv = [sys.argv[0]] + hydra_output_overrides(sys.argv[1:])
    started = []

    def task_started(cfg_node: DictConfig):
        started.append(True)
        return task(cfg_node)

    register_configs()
    try:
        hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")(task_started)()
    except SystemExit as exc:
        if not started and exc.code not in (0, None) and not isinstance(exc, exit_codes.SweepNotDone):
            sys.exit(exit_codes.CONFIG_ERROR)
        raise


def train() -> None:
    """Console script ``p3d-train``."""
    try:
        run_hydra(train_task)
    except KeyboardInterrupt:  # Ctrl-C before the workers started (once they run, p3d.dist.stop handles it)
        print("p3d: interrupted (Ctrl-C) before training started; nothing was trained", file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGINT)


if __name__ == "__main__":
    train()
