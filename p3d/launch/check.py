"""From a composed config to a checked, typed config and run plan, before anything is written:
``prepare`` (types, presets, HF shape and tokenizer, absolute paths, every rule, the run plan),
``preflight`` (the memory plan), ``check_run`` (the checkpoint to resume, the run directory, the data).
Each raises :class:`P3DConfigError` with one line naming the field and the fix."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig

from p3d.config.schema import RopeScaling
from p3d.console import say
from p3d.launch.compose import given_overrides
from p3d.layout.elastic_rules import is_elastic
from p3d.layout.fixes import Pins
from p3d.layout.run_plan import P3DConfigError, build_plan, check_config, fill_derived
from p3d.rundir.files import METRICS, holds_run


def tokenizer_vocab(data_cfg) -> int:
    from p3d.data.tokenizer import load_tokenizer

    try:
        return load_tokenizer(data_cfg.tokenizer).vocab_size
    except (OSError, ValueError) as exc:
        raise P3DConfigError(str(exc)) from None


def command_pins(overrides: list[str], resuming: bool = False) -> Pins:
    """What a refusal's suggested fix cannot move on this command line (p3d.layout.fixes): the dotted fields it
    sets, and on a resume the fields that may not change (p3d.config.resume_rules)."""
    from p3d.config.resume_rules import refuses
    from p3d.launch.compose import config_groups
    from p3d.launch.resume_base import named_on_the_command_line

    _, fields = named_on_the_command_line(overrides, config_groups())
    return Pins(frozenset(fields), refuses if resuming else None)


def typed_config(cfg_node: DictConfig | dict, resolve_auto: bool = True, pins: Pins | None = None):
    """The typed Config with the device preset filled in and ``mesh=auto`` resolved by the planner. ``pins``: what a
    suggested fix cannot move (default: the fields this command line sets)."""
    from omegaconf.errors import OmegaConfBaseException

    from p3d.rundir.paths import resolve_config_paths
    from p3d.rundir.spec import to_config

    try:
        cfg = fill_derived(to_config(cfg_node))
    except OmegaConfBaseException as exc:
        raise P3DConfigError(str(exc).splitlines()[0]) from None
    cfg = resolve_config_paths(cfg)  # every user-given path absolute, against the directory the command ran from
    if cfg.model.init_from:
        cfg = with_hf_shape(cfg)
    cfg = with_tokenizer(cfg)
    check_family(cfg.model)
    # field bounds and the model's shape: what p3d-plan cannot compute either
    check_config(cfg, pins if pins is not None else command_pins(given_overrides()))
    warn_context(cfg.model)
    if cfg.calibration:  # a file of another machine or software is refused before the planner uses it
        from p3d.planner.calibration import check_file

        check_file(cfg)
    if cfg.mesh.name == "auto" and resolve_auto:
        from p3d.planner.search import resolve_auto as planned_layout

        cfg = planned_layout(cfg)  # the best layout (and on cluster.groups, its blocks and micro batches per group)
    return cfg


def with_hf_shape(cfg):
    """``model.init_from``: the model shape comes from the HF config.json, once every tensor of the checkpoint is
    checked to be one the model reads, of its shape (p3d.hf.check: headers only, no torch); a field also set on the
    command line must agree with it, but for how the run trains the model (``TRAINING_CHOICES``: the experts'
    balancing, and a context extension's RoPE scaling and context), where the command line's value wins."""
    import dataclasses

    from p3d.hf.check import import_fields
    from p3d.hf.names import HFImportError

    where = cfg.model.init_from
    try:
        fields = import_fields(where, drop_mtp=cfg.model.drop_mtp)
    except HFImportError as exc:
        raise P3DConfigError(str(exc)) from None
    overrides = given_overrides()
    for key, value in _flat(fields):
        given = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith(f"model.{key}=")]
        if not given:
            continue
        if key in TRAINING_CHOICES:  # how the model is trained, not its shape: the command line's
            group, name = key.split(".", 1) if "." in key else (None, key)
            if group is None:
                fields[name] = getattr(cfg.model, name)
            else:
                assert fields[group] is not None and getattr(cfg.model, group) is not None
                chosen = getattr(getattr(cfg.model, group), name)
                fields[group] = dataclasses.replace(fields[group], **{name: chosen})
        elif str(_get(cfg.model, key)) != str(value):
            shown = "null" if value is None else getattr(value, "value", value)
            raise P3DConfigError(
                f"model.{key}={given[-1]} disagrees with {where}/config.json ({shown}); drop the "
                f"override or set model.{key}={shown}"
            )
    name = f"hf:{Path(where).name}"
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=name, **fields))


def check_family(m) -> None:
    """``model.family`` names an architecture p3d knows (p3d.hf.architectures), or is null."""
    from p3d.hf.architectures import BY_FAMILY

    if m.family is not None and m.family not in BY_FAMILY:
        raise P3DConfigError(
            f"model.family={m.family} is not an architecture p3d knows ({', '.join(BY_FAMILY)}, docs/models.md); "
            "try model.family=null (Llama, or Mixtral with experts)"
        )


def warn_context(m) -> None:
    """One line when model.seq_len is longer than the context the model is made for (``max_position_embeddings``,
    the imported checkpoint's or the preset's). A warning, not a refusal: training past it is how a context is
    extended (with a RoPE scaling to match); the export then writes model.seq_len as the model's context."""
    if m.max_position_embeddings is not None and m.seq_len > m.max_position_embeddings:
        source = f"{m.init_from}/config.json's" if m.init_from else "the model's"
        say(
            f"warning: model.seq_len={m.seq_len} is longer than {source} max_position_embeddings="
            f"{m.max_position_embeddings}: positions past {m.max_position_embeddings} were never trained (a context "
            "extension sets model.rope_scaling to match); p3d-export will write max_position_embeddings="
            f"{m.seq_len}",
            stream=sys.stderr,
        )


# model fields a run may set beside model.init_from: how the experts are trained (config.json holds their shape
# and routing, which must agree with it), and a context extension's RoPE scaling and context (docs/models.md)
TRAINING_CHOICES = (
    "moe.aux_loss_coef",
    "moe.bias_update_rate",
    "moe.capacity_factor",
    "max_position_embeddings",
    *(f"rope_scaling.{f}" for f in RopeScaling.__dataclass_fields__),
)


def _flat(fields: dict) -> list[tuple[str, object]]:
    """(key, value) of the model fields, a mixture of experts' as moe.<field>."""
    import dataclasses

    out: list[tuple[str, object]] = []
    for key, value in fields.items():
        if dataclasses.is_dataclass(value):
            out += [(f"{key}.{k}", v) for k, v in dataclasses.asdict(value).items()]  # type: ignore[arg-type]
        else:
            out.append((key, value))
    return out


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj


def with_tokenizer(cfg):
    """``data.tokenizer=auto`` resolved: with ``data=prepared`` the stores' own tokenizer, else the tokenizer.json
    of ``model.init_from`` when it has one, else ``byte``; with ``model.init_from``, another tokenizer is refused and
    the vocabulary checked."""
    import dataclasses

    from p3d.config.schema import DataSource
    from p3d.data.store import StoreError, stores_tokenizer
    from p3d.data.tokenizer import AUTO
    from p3d.hf.names import HFImportError
    from p3d.hf.tokenizer import import_tokenizer

    spec = cfg.data.tokenizer
    try:
        if spec == AUTO and cfg.data.source == DataSource.prepared and (cfg.data.path or cfg.data.mix):
            spec = stores_tokenizer(cfg.data)  # the stores' own: p3d-prepare's closing line trains as it says
        tokenizer = import_tokenizer(spec, cfg.model.init_from, cfg.model.vocab_size)
    except (HFImportError, StoreError) as exc:
        raise P3DConfigError(str(exc)) from None
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=tokenizer))


def prepare(cfg_node: DictConfig, overrides: list[str] | None = None):
    """Typed config and run plan, or P3DConfigError. A resume starts from the resumed run's spec
    (p3d.launch.resume_base), and its refusals name that spec as the source of the values it gave. ``overrides``:
    the command line's (default: Hydra's)."""
    from p3d.launch.compose import config_groups
    from p3d.launch.resume_base import resume_node

    overrides = given_overrides() if overrides is None else overrides
    node, resumed = resume_node(cfg_node, overrides, config_groups())
    try:
        return _prepared(node, command_pins(overrides, resuming=resumed is not None))
    except P3DConfigError as exc:
        if resumed is None:
            raise
        raise P3DConfigError(resumed.sourced(str(exc))) from None


def _prepared(node: DictConfig | dict, pins: Pins):
    cfg = typed_config(node, pins=pins)
    vocab = tokenizer_vocab(cfg.data)
    plan = build_plan(cfg, vocab, for_training=not cfg.dry_run, pins=pins)
    if is_elastic(cfg):
        from p3d.jobs.elastic import refit
        from p3d.layout.elastic import check_floor, pinned

        check_floor(cfg, plan, refit, vocab)  # the run must be able to continue on cluster.elastic.min_nodes
        cfg = pinned(cfg, plan)  # the node size every re-fit keeps, in the spec (on cpu: the mesh's ranks / nodes)
    return cfg, plan


def preflight(cfg, run_plan) -> None:
    """Refuse a layout the planner predicts not to fit device memory (plan.force=true skips this), and warn in one
    line of one that fits with less than 10 % to spare; the planner models ``run_plan``, the run plan already built
    for ``cfg``."""
    from p3d.console import error
    from p3d.planner import predict
    from p3d.planner.verdict import fit_refusal, headroom_warning

    report = predict(cfg, run_plan)
    refused = fit_refusal(report)
    if refused is None:
        crowded = headroom_warning(report)
        if crowded is not None:  # it launches, with one line on what the plan leaves out
            error(f"warning: {crowded}")
        return
    print(report.render(), file=sys.stderr)
    raise P3DConfigError(refused)


def check_run(cfg, multirun: bool = False, quiet: bool = False):
    """What needs the disk and the data, before any worker starts: the checkpoint to resume (``auto``
    resolved to a directory, checked complete and of this model), a run directory that already holds a
    run (never overwritten without ``train.resume``), the data (opens, has the text column, has enough
    tokens), and the W&B group of a sweep. ``quiet``: the lines of what a resume changes are not printed (an
    elastic re-fit's one line says it)."""
    import dataclasses

    from p3d.checkpoint import find as checkpoint
    from p3d.data.check import check_data

    run_dir = Path(cfg.run.dir)
    try:
        found = checkpoint.find(run_dir, cfg.train.resume)
        if found is not None:
            meta = checkpoint.verify(found)
            checkpoint.check_compatible(meta, cfg, found)
    except checkpoint.CheckpointError as exc:
        raise P3DConfigError(str(exc)) from None
    changes = check_resume(cfg, found, meta["step"]) if found is not None else []
    if cfg.train.resume == "none" and (holds_run(run_dir) or checkpoint.find(run_dir, "auto")):
        raise P3DConfigError(
            f"run.dir={run_dir} already holds a run ({METRICS} / checkpoints); resume it with "
            "train.resume=auto, or choose a new run.dir"
        )
    try:
        check_data(cfg.data, cfg.model.seq_len, need_val=cfg.train.eval_every > 0)
    except (OSError, ValueError, KeyError) as exc:
        raise P3DConfigError(str(exc).strip("'\"")) from None
    if found is None and cfg.train.resume == "auto" and not quiet:
        say(f"no checkpoint in {checkpoint.root(run_dir)}; starting from step 0")
    for line in [] if quiet else changes:
        say(line)
    train = dataclasses.replace(cfg.train, resume=str(found) if found else "none")
    logger = cfg.logger
    if multirun and logger.group is None:
        from hydra.core.hydra_config import HydraConfig

        logger = dataclasses.replace(logger, group=Path(HydraConfig.get().sweep.dir).name)
    return dataclasses.replace(cfg, train=train, logger=logger)


def check_resume(cfg, ckpt: Path, step: int) -> list[str]:
    """The lines saying what this resume changes (p3d.config.resume_rules), or P3DConfigError for a field
    that may not change or a train.steps not above the checkpoint's step."""
    from p3d.config import resume_rules
    from p3d.rundir.spec import resume_changes

    changes = resume_changes(cfg, ckpt)
    refused = resume_rules.refusal(changes, str(ckpt), step, cfg.train.steps)
    if refused:
        raise P3DConfigError(refused)
    check_trace_steps_resumed(cfg, ckpt, step)
    return [c.line(step + 1) for c in resume_rules.printed(changes)]


def check_trace_steps_resumed(cfg, ckpt: Path, step: int) -> None:
    """``train.trace_steps`` named on a resume's command line: each step one the resume trains (step + 1 ..
    train.steps), as a fresh run's must be one of its steps. (Steps a resumed run's own spec carries, traced by the
    run before, are not asked for again.)"""
    traced, given = list(cfg.train.trace_steps), [o.lstrip("+") for o in given_overrides()]
    named = [key for key in ("train.trace_steps=", "train.resume=") if any(o.startswith(key) for o in given)]
    if len(named) < 2:  # not a resume by hand that names them (a requeue or elastic restart resumes by itself)
        return
    past = [k for k in traced if k <= step]
    if past:
        ahead = [k for k in traced if k > step] or [step + 1]
        raise P3DConfigError(
            f"train.trace_steps={traced}: step {past[0]} was trained before checkpoint {ckpt} (step {step}), which "
            f"this resume starts from; try train.trace_steps=[{','.join(map(str, ahead))}]"
        )
