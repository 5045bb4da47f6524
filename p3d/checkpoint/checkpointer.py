"""Checkpoints: atomic, self-describing, independent of the mesh; written by every rank in parallel,
optionally in the background; loading them runs no code (safetensors and JSON only).

Layout of ``<run.dir>/checkpoints/step_<N>/``:
    meta.json                          step, samples, updates applied, mesh, model shape, scheduler, fault
                                       counts, sizes of all files
    run_spec.yaml                      the run spec that wrote it
    tokenizer.json                     a copy of the run's tokenizer (and its tokenizer_config.json), unless byte
    model/pp<p>_tp<t>_dp<d>.safetensors  parameters of coordinate (pp, tp) by global name (+ shard specs),
                                       each written by one of its dp ranks
    optim/pp<p>_tp<t>_dp<d>.safetensors  that dp rank's fragments of the fp32 master weights and Adam moments
    rng/rank<r>.json                   every rank's RNG states
    done/rank<r>.json                  every rank's manifest: its files and their sizes

How a save is written (every rank its share, rank 0 commits once all are fsync'd) is in
p3d.checkpoint.snapshot; the file formats in p3d.checkpoint.files. A save goes to ``.step_<N>.tmp``,
renamed when every file is on disk, and only then does ``latest`` move (written to a temporary name,
then renamed): a crash or a full disk mid-save leaves the previous checkpoint complete and ``latest``
pointing at it. Loading joins the fragments of each (pp, tp) coordinate over the saved dp, so a
checkpoint loads under any dp and ZeRO stage; p3d.checkpoint.reshard re-cuts it for another tp or pp.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from p3d.checkpoint.files import (
    coordinate_reader,
    fsync_dir,
    read_json,
    save_failed,
    write_json,
)
from p3d.checkpoint.find import (
    LATEST,
    LEGACY_FORMAT,
    CheckpointError,
    model_identity,
    prune,
    root,
    step_dir,
    write_latest,
)
from p3d.checkpoint.snapshot import (
    ADAM_KEYS,
    Saver,
    Snapshot,
    collect_manifests,
    drop,
    make_dirs,
    persistent_buffers,
    set_rng_state,
)
from p3d.compat.deepspeed_internals import (
    has_hp_mapping,
    links_optimizer_states,
    relink_optimizer_states,
    wrapped_optimizer,
)
from p3d.parallel.experts.params import is_expert_param
from p3d.parallel.zero.fsdp import is_sharded, local, my_rows, piece_of, sharded_like

FORMAT = "p3d-checkpoint-2"


def shard_specs(module: torch.nn.Module) -> dict[str, dict]:
    """Global parameter name -> how it is cut over tp (rows / cols / replicated)."""
    specs = {}
    for mod_name, mod in module.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            spec = mod.shard_spec() if hasattr(mod, "shard_spec") else {"kind": "replicated"}
            specs[f"{mod_name}.{pname}" if mod_name else pname] = spec
    return specs


@dataclass(frozen=True)
class OptimizerStates:
    """Where this rank's Adam states live: ``optimizer`` (DeepSpeed's ZeRO / bf16 wrapper, whose fp32 partitions
    hold them, or a torch optimizer) and ``owns`` (None: this rank keeps every parameter's states; else the ids
    of the parameters whose states it keeps, torch's ZeroRedundancyOptimizer: its local ``optim`` steps those)."""

    optimizer: Any
    owns: set[int] | None = None


def _link_optimizer_states(states: OptimizerStates) -> None:
    """Make every parameter's view of its Adam moments valid in DeepSpeed's ZeRO / bf16 optimizers.

    They link those views once, right after the step of the first param group, when torch's lazily
    created states of the other groups (our no-decay group) do not exist yet; the views of those
    groups then stay empty. Create any missing state (zeros, step 0, as AdamW would) and re-link."""
    wrapper = states.optimizer
    if not links_optimizer_states(wrapper):
        return
    base = wrapped_optimizer(wrapper)
    for group in base.param_groups:
        for flat in group["params"]:
            if not base.state[flat]:
                base.state[flat] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    **{k: torch.zeros_like(flat) for k in ADAM_KEYS},
                }
    relink_optimizer_states(wrapper)


class Checkpointer:
    """A run's checkpoints, built once per run by its executor: :meth:`save` (collective, every rank its share,
    in the background when asynchronous) and :meth:`load` (every rank its slices, under this run's mesh).

    ``module``: this rank's pipeline module (its stage); ``states``: where its Adam states live; ``scheduler``:
    the LR schedule (its state is recorded); ``chunks``: a torch pipeline schedule's ``(bounds, [(chunk index,
    chunk module), ...])``, each chunk saved as the stage of that index (``model/pp<c>_...``) and ``bounds``
    (p * v + 1 long) as ``stage_bounds``, so the checkpoint stays cut by layer name and loads under any schedule;
    None: one stage per pp rank, the plan's bounds."""

    def __init__(self, cfg, plan, mesh, run_dir, module, states: OptimizerStates, scheduler, device, chunks=None):
        self.cfg, self.plan, self.mesh, self.run_dir = cfg, plan, mesh, Path(run_dir)
        self.module, self.states, self.scheduler = module, states, scheduler
        self.chunks = chunks if chunks is not None else (plan.stage_bounds, [(mesh.pp_rank, module)])
        asynchronous = cfg.train.async_save if cfg.train.async_save is not None else plan.backend == "nccl"
        self.saver = Saver(asynchronous, device)

    @property
    def asynchronous(self) -> bool:
        return self.saver.asynchronous

    def wait(self) -> None:
        """Until a background save in flight is written (raises on every rank if it failed anywhere)."""
        self.saver.wait()

    def save(self, step: int, samples: int, extra: dict) -> Path:
        """Collective: every rank calls it after the same step. Waits for the previous save, copies this rank's
        share to host memory and writes it (in the background when asynchronous). Returns the directory the
        checkpoint will have once complete. ``extra``: more fields of meta.json (data and fault counts)."""
        return _save(self, step, samples, extra)

    def load(self, path: Path) -> dict:
        """Parameters, optimizer states and RNG of checkpoint ``path`` under this run's mesh; returns its
        meta.json (the caller continues the LR schedule after :func:`updates_applied` updates)."""
        return _load(self, Path(path))


def updates_applied(meta: dict) -> int:
    """The optimizer updates before a checkpoint (steps discarded by the fault rules apply none); a checkpoint
    from before that count was kept resumes at its step."""
    return int(meta.get("optimizer_steps", meta["step"]))


def _save(ck: Checkpointer, step: int, samples: int, extra: dict) -> Path:
    saver, module, mesh, cfg, run_dir = ck.saver, ck.module, ck.mesh, ck.cfg, ck.run_dir
    saver.wait()  # one save at a time; raises on every rank if the previous one failed anywhere
    ckpt_root = root(run_dir)
    final = step_dir(run_dir, step)
    tmp = ckpt_root / f".{final.name}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        drop(tmp)  # debris of a crashed save of the same step
    dist.barrier()
    if has_hp_mapping(module):
        _link_optimizer_states(ck.states)
    bounds, parts = ck.chunks
    snaps = [
        (
            f"pp{c}_tp{mesh.tp_rank}_dp{mesh.dp_rank}" + (f"_cp{mesh.cp_rank}" if mesh.cp > 1 else ""),
            Snapshot(ck.states, m, mesh, shard_specs(m), saver.host, f"pp{c}/"),
        )
        for c, m in parts
    ]
    meta = _meta(cfg, mesh, bounds, step, samples, ck.scheduler, extra) if rank == 0 else {}

    def write() -> None:
        make_dirs(tmp)
        Snapshot.write_all(snaps, tmp, rank)

    def commit(own_write_s: float = 0.0) -> None:
        _commit(tmp, final, ckpt_root, run_dir, cfg, meta, cfg.cluster.timeout_s + 2 * own_write_s)

    def write_and_commit() -> None:  # asynchronous: rank 0 learns that the others are done from their manifests
        try:
            t0 = time.monotonic()
            write()
            if rank == 0:  # the others write about as much as rank 0 did: give them twice its time and more
                commit(time.monotonic() - t0)
        except BaseException:
            if rank == 0:
                drop(tmp)
            raise

    try:
        if saver.asynchronous:
            saver.start(write_and_commit)
        else:  # agree that every rank's files are written, then commit
            saver.start(write)
            saver.wait()
            if rank == 0:
                saver.start(commit)
            saver.wait()
    except BaseException:
        if rank == 0:
            drop(tmp)  # never left for a checkpoint, and its space is freed at once
        raise
    return final


def mesh_record(mesh) -> dict:
    """The layout a checkpoint was written under (for information, and to restore each rank's RNG on the same one)."""
    return {"tp": mesh.tp, "pp": mesh.pp, "dp": mesh.dp, **({"cp": mesh.cp} if mesh.cp > 1 else {})}


def _meta(cfg, mesh, bounds: list[int], step: int, samples: int, scheduler, extra: dict) -> dict:
    sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    return {
        "format": FORMAT,
        "step": step,
        "samples": samples,
        "mesh": mesh_record(mesh),
        "zero": cfg.zero.stage,
        "dtype": cfg.train.dtype.value,
        "model": model_identity(cfg),
        "tokenizer": cfg.data.tokenizer,
        "stage_bounds": list(bounds),  # a torch schedule's chunks are its stages here (p * v of them)
        "pipeline": cfg.schedule.pipeline.value,  # for information: loading never needs it
        "scheduler": sched,
        # updates applied (steps discarded by train.on_nonfinite / on_spike=skip apply none): Adam's step
        # count and the LR schedule's position on resume; older checkpoints lack it and resume at "step"
        "optimizer_steps": scheduler.last_epoch,
        **extra,
    }


def _commit(tmp: Path, final: Path, ckpt_root: Path, run_dir, cfg, meta: dict, wait_s: float) -> None:
    """Rank 0, once every rank's files are fsync'd (it waits up to ``wait_s`` for their manifests): the
    spec, the tokenizer, meta.json (last), the rename, ``latest``, pruning."""
    from p3d.data.tokenizer import tokenizer_files
    from p3d.rundir.spec import SPEC_NAME

    files = collect_manifests(tmp, dist.get_world_size(), wait_s)
    try:
        # copyfile, not copy: the copies get the umask's mode like every other file, not their source's
        shutil.copyfile(Path(run_dir) / SPEC_NAME, tmp / SPEC_NAME)
        files[SPEC_NAME] = (tmp / SPEC_NAME).stat().st_size
        for i, f in enumerate(tokenizer_files(cfg.data.tokenizer)):  # the tokenizer travels with the weights
            name = "tokenizer.json" if i == 0 else f.name
            shutil.copyfile(f, tmp / name)
            files[name] = (tmp / name).stat().st_size
    except OSError as exc:
        raise save_failed(Path(exc.filename or tmp), exc) from None
    write_json(tmp / "meta.json", {**meta, "files": dict(sorted(files.items()))})  # last: marks it complete
    fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(ckpt_root)
    try:
        write_latest(ckpt_root, final.name)
    except OSError as exc:
        raise save_failed(ckpt_root / LATEST, exc) from None
    prune(ckpt_root, cfg.train.keep_last)


# ---- loading (workers)


def reader(path: Path, meta: dict):
    """The tensors of a checkpoint by (kind, pp, tp) coordinate, either format; see ckpt_files."""
    return coordinate_reader(path, meta)


def _local_states(path: Path, meta: dict, module, mesh, bounds: list[int], stage: int, source=None):
    """name -> this rank's {master, exp_avg, exp_avg_sq} for ``module``, stage ``stage`` of ``bounds``. The
    saving layout's own coordinate when tp and the stage boundaries are unchanged; else assembled from the
    saved shards (``source``, a ShardedCheckpoint, shared by a rank's chunks) and re-cut for this mesh. A routed
    experts' stacked weight is saved with every expert of its layer: this ep rank's share is cut from it."""
    from p3d.checkpoint.reshard import ShardedCheckpoint, shard_from_full

    read = reader(path, meta)
    experts = {name for name, p in module.named_parameters() if is_expert_param(p)}

    def ep_share(name: str, states: dict) -> dict:
        if name not in experts or mesh.ep == 1:
            return states
        return {k: v.chunk(mesh.ep, dim=0)[mesh.ep_rank] for k, v in states.items()}

    same_layout = meta["mesh"]["tp"] == mesh.tp and meta["stage_bounds"] == list(bounds)
    if same_layout:
        optim = read("optim", stage, mesh.tp_rank)
        return lambda name: ep_share(name, optim[name])
    source = source or ShardedCheckpoint(path, meta, read)
    specs = shard_specs(module)

    def resharded(name: str) -> dict:
        states = {k: shard_from_full(v, specs[name], mesh.tp, mesh.tp_rank) for k, v in source.optim(name).items()}
        return ep_share(name, states)

    return resharded


def _load(ck: Checkpointer, path: Path) -> dict:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    from p3d.checkpoint.reshard import ShardedCheckpoint

    module, mesh, plan, held = ck.module, ck.mesh, ck.plan, ck.states
    meta = read_json(path / "meta.json")
    legacy = meta.get("format") == LEGACY_FORMAT
    if legacy and dist.get_rank() == plan.logging_rank:  # the rank whose output reaches the console
        print(
            f"p3d: note: checkpoint {path} is in the previous format ({LEGACY_FORMAT}: torch.save files); its tensors "
            "are read with torch.load(weights_only=True), its RNG states are not restored, and the next save "
            f"writes the new format ({FORMAT})",
            flush=True,
        )
    bounds, parts = ck.chunks
    source = ShardedCheckpoint(path, meta, reader(path, meta))
    targets = [(m, _local_states(path, meta, m, mesh, bounds, c, source)) for c, m in parts]
    hp = has_hp_mapping(module)
    if hp:
        _link_optimizer_states(held)
    applied = updates_applied(meta)
    step_t = torch.tensor(float(applied))
    with torch.no_grad():
        for name, p, states in ((n, p, st) for m, st in targets for n, p in m.named_parameters()):
            try:
                state = states(name)
            except KeyError:
                raise CheckpointError(f"checkpoint {path} has no parameter {name}") from None
            if tuple(state["master"].shape) != tuple(p.shape):
                raise CheckpointError(
                    f"checkpoint {path}: {name} has shape {tuple(state['master'].shape)}, this "
                    f"rank needs {tuple(p.shape)}"
                )
            if is_sharded(p):  # ZeRO-2/3: this dp rank's rows of the parameter and of its moments
                local(p).copy_(my_rows(state["master"], *piece_of(p)[:2]).to(p.dtype))
                held.optimizer.state[p] = {"step": step_t.clone(), **{k: sharded_like(p, state[k]) for k in ADAM_KEYS}}
                continue
            p.copy_(state["master"].to(p.dtype))
            if hp:
                safe_set_full_fp32_param(p, state["master"].to(p.device))
                for k in ADAM_KEYS:
                    safe_set_full_optimizer_state(p, state[k].to(p.device), k)
            elif held.owns is None or id(p) in held.owns:  # ZeRO-1 (torch): the owner only
                held.optimizer.state[p] = {"step": step_t.clone(), **{k: state[k].to(p.device) for k in ADAM_KEYS}}
    if hp:  # Adam's bias correction: the base optimizer's step count per (flat) parameter
        base = wrapped_optimizer(held.optimizer)
        for st in base.state.values():
            if "step" in st:
                st["step"] = step_t.clone() if torch.is_tensor(st["step"]) else applied
    for m, _ in targets:  # the routers' selection biases, from the model files
        for name, buf in persistent_buffers(m):
            try:
                buf.copy_(source.param(name).to(buf.device, buf.dtype))
            except KeyError:
                raise CheckpointError(f"checkpoint {path} has no buffer {name}") from None
    rng = path / "rng" / f"rank{dist.get_rank()}.json"
    if not legacy and rng.is_file() and meta["mesh"] == mesh_record(mesh):
        set_rng_state(read_json(rng))
    return meta
