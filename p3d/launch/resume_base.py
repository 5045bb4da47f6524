"""A resume starts from the run it resumes: ``p3d-train train.resume=auto run.dir=r1 train.steps=8`` is r1's own
run spec with ``train.steps=8`` on top, not p3d's defaults with ``train.steps=8``.

Hydra composes every command line from the defaults, so a resume that named only what changes used to get the
default mesh, no logger, no validation and no periodic checkpoints (issue 31). Here the composed config is laid
over the resumed run's spec (the newest segment's ``run_spec.yaml`` for ``train.resume=auto``; the checkpoint's
own copy for a checkpoint path), and only what the command line names is taken from the composition:

- a group (``mesh=pp4``): that whole section, as the group file gives it with the dotted overrides on it;
- a field (``train.steps=8``, ``~train.foo``): that field;
- a field that follows from another (``FOLLOWS``: a preset's numbers from ``cluster.device``, the chunks per rank
  from ``schedule.pipeline``, sequence parallelism from ``mesh.tp``), when its source changed and the command line
  does not name it: re-derived, as a fresh launch would;
- ``run.dir``, ``train.resume`` and ``dry_run`` always: they describe this launch;
- an elastic run (``cluster.elastic.min_nodes``) resumed on another ``cluster.nodes`` with no mesh named: the layout
  follows the nodes (``mesh.dp=auto`` over the pinned node size; the planner's with ``vary=any``), as after a lost node.

What then differs from the checkpoint is printed and checked by ``p3d.config.resume_rules`` as before.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from p3d.rundir.files import SPEC
from p3d.rundir.spec import config_part

# field -> the fields derived from it when unset (p3d.layout.run_plan.fill_derived)
FOLLOWS = {
    "cluster.device": (
        "cluster.gpus_per_node",
        "cluster.peak_tflops",
        "cluster.memory_gb",
        "cluster.intra_node_gbps",
        "cluster.inter_node_gbps",
        "train.dtype",
    ),
    "schedule.pipeline": ("schedule.virtual_stages", "schedule.stage_blocks"),
    # an uneven layout belongs to the cluster and mesh it was planned for (a heterogeneous run resumed on a
    # homogeneous cluster runs the even one; with cluster.groups the planner splits again: p3d.planner.hetero)
    # and the cluster-wide figures that stand for the groups (p3d.layout.hetero.cluster_figures: MFU's peak, the
    # pre-flight's memory, the links), or for the one device without them
    "cluster.groups": (
        "schedule.stage_blocks",
        "schedule.replica_micro_batches",
        "cluster.peak_tflops",
        "cluster.memory_gb",
        "cluster.intra_node_gbps",
        "cluster.inter_node_gbps",
    ),
    "mesh.pp": ("schedule.stage_blocks",),
    # sequence parallelism unset is on wherever tp > 1 (run_plan.sequence_parallel_default): the spec holds what it
    # came to, which another tp or cp derives again, as a fresh launch would (an old spec's false stays on its mesh)
    "mesh.tp": ("schedule.sequence_parallel",),
    "mesh.cp": ("schedule.sequence_parallel",),
    "schedule.virtual_stages": ("schedule.stage_blocks",),
    "mesh.dp": ("schedule.replica_micro_batches",),
    "schedule.global_batch_size": ("schedule.replica_micro_batches",),
    "schedule.micro_batch_size": ("schedule.replica_micro_batches",),
}
THIS_LAUNCH = ("run.dir", "train.resume", "dry_run")


def _get(tree: dict, key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(tree: dict, key: str, value: Any, present: bool = True) -> None:
    *path, last = key.split(".")
    node = tree
    for part in path:
        node = node.setdefault(part, {})
    if present:
        node[last] = copy.deepcopy(value)
    else:
        node.pop(last, None)


def _has(tree: dict, key: str) -> bool:
    *path, last = key.split(".")
    node: Any = tree
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return isinstance(node, dict) and last in node


def named_on_the_command_line(overrides: list[str], groups: set[str]) -> tuple[set[str], set[str]]:
    """(groups chosen, dotted fields set or deleted) by Hydra command-line overrides such as ``mesh=pp4``,
    ``train.steps=8``, ``+train.x=1``, ``~train.x``; Hydra's own (``hydra.*``, ``hydra/launcher=...``) are left out."""
    chosen: set[str] = set()
    fields: set[str] = set()
    for text in overrides:
        key = text.split("=", 1)[0].lstrip("~+").split("@", 1)[0]
        if key.startswith("hydra"):
            continue
        (chosen if key in groups else fields).add(key)
    return chosen, fields


def resumed_spec_path(run_dir: Path, resume: str) -> Path | None:
    """The spec a resume starts from: ``auto``: the run directory's ``run_spec.yaml``, else (a run directory
    that holds only checkpoints) the newest checkpoint's copy; a checkpoint path: that checkpoint's copy of the
    spec that wrote it. None: nothing to start from (a fresh composition)."""
    from p3d.checkpoint.find import find
    from p3d.rundir.paths import absolute

    if resume == "none":
        return None
    if resume == "auto" and (run_dir / SPEC).is_file():
        return run_dir / SPEC
    ckpt = find(run_dir, "auto") if resume == "auto" else absolute(resume)
    path = ckpt / SPEC if ckpt is not None else None
    return path if path is not None and path.is_file() else None


def over_resumed_run(composed: dict, resumed: dict, overrides: list[str], groups: set[str]) -> dict:
    """The config of a resume: ``resumed`` (a run spec's config part) with what ``overrides`` name taken from
    ``composed`` (the command line's composition), as the module docstring says."""
    chosen, fields = named_on_the_command_line(overrides, groups)
    merged = copy.deepcopy(resumed)
    for group in chosen:
        merged[group] = copy.deepcopy(composed[group])
    for key in (*fields, *THIS_LAUNCH):
        _set(merged, key, _get(composed, key), present=_has(composed, key))
    for source, derived in FOLLOWS.items():
        if _get(merged, source) != _get(resumed, source):
            for key in derived:
                if key not in fields:
                    _set(merged, key, _get(composed, key), present=_has(composed, key))
    if _elastic_resize(merged, resumed) and "mesh" not in chosen and not any(f.startswith("mesh.") for f in fields):
        # an elastic run resumed on another node count (grow back by hand): the layout follows the nodes, as after a
        # lost node (p3d.jobs.elastic.refit): dp from the pinned node size, or the planner's choice (vary=any)
        _set(merged, "mesh.dp", "auto")
        if _get(merged, "cluster.elastic.vary") == "any":
            _set(merged, "mesh.name", "auto")
    return merged


def _elastic_resize(merged: dict, resumed: dict) -> bool:
    """An elastic run resumed on other nodes: another ``cluster.nodes``, or other ``cluster.groups`` (whose sum is the
    nodes: a cluster of groups grows back by naming them)."""
    if _get(merged, "cluster.elastic.min_nodes") is None:
        return False
    return any(_get(merged, key) != _get(resumed, key) for key in ("cluster.nodes", "cluster.groups"))


@dataclass(frozen=True)
class Resumed:
    """Where a resume's values came from: the resumed run's ``spec``, but for ``taken``, the groups and dotted
    fields this launch took from its own composition (as :func:`over_resumed_run` says)."""

    spec: Path
    taken: frozenset[str]

    def gave(self, field: str) -> bool:
        """Whether ``field``'s value came from the resumed run's spec."""
        return not any(field == k or field.startswith(f"{k}.") for k in self.taken)

    def sourced(self, message: str) -> str:
        """A refusal naming a field whose value the resumed run's spec gave, with that spec as its source:
        ``model.seq_len=36 (resumed run /runs/r1/run_spec.yaml) must be ...`` (not the group file this command
        line would compose, which did not give it)."""
        from p3d.launch.compose import insert_source, message_field

        field = message_field(message)
        return insert_source(message, f"resumed run {self.spec}") if field and self.gave(field) else message


def _taken(merged: dict, resumed: dict, overrides: list[str], groups: set[str]) -> set[str]:
    """What :func:`over_resumed_run` took from the command line's composition rather than the resumed spec."""
    chosen, fields = named_on_the_command_line(overrides, groups)
    taken = {*chosen, *fields, *THIS_LAUNCH}
    for source, derived in FOLLOWS.items():
        if _get(merged, source) != _get(resumed, source):
            taken.update(key for key in derived if key not in fields)
    if _elastic_resize(merged, resumed):
        taken.update(("mesh.dp", "mesh.name"))
    return taken


def resume_node(
    cfg_node: DictConfig, overrides: list[str], groups: set[str]
) -> tuple[DictConfig | dict, Resumed | None]:
    """``cfg_node`` as it is for a fresh run (and None), or laid over the spec of the run it resumes (and where
    its values came from)."""
    from p3d.rundir.paths import absolute

    resume = str(cfg_node.train.resume)
    spec = resumed_spec_path(absolute(str(cfg_node.run.dir)), resume) if resume != "none" else None
    if spec is None:
        return cfg_node, None
    resumed = config_part(OmegaConf.to_container(OmegaConf.load(spec)))  # type: ignore[arg-type]
    composed = OmegaConf.to_container(cfg_node, resolve=True)
    merged = over_resumed_run(composed, resumed, overrides, groups)  # type: ignore[arg-type]
    return merged, Resumed(spec, frozenset(_taken(merged, resumed, overrides, groups)))
