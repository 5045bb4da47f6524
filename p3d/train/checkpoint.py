"""Checkpoints: atomic, self-describing, independent of the data-parallel degree.

Layout of ``<run.dir>/checkpoints/step_<N>/``:
    meta.json             step, samples consumed, mesh, model shape, scheduler, sizes of all files
    run_spec.yaml         the run spec that wrote it
    tokenizer.json        a copy of the run's tokenizer (and its tokenizer_config.json), unless byte
    model/pp<p>_tp<t>.pt  this (pp, tp) coordinate's parameters by global name, and how each is sharded
    optim/pp<p>_tp<t>.pt  fp32 master weight and Adam moments of each of those parameters, whole over dp
    rng/rank<r>.pt        every rank's RNG states

Parameters and optimizer states are saved per (pp, tp) coordinate by its dp rank 0, with the ZeRO
partitions gathered over dp, so a checkpoint loads under any dp and any ZeRO stage. A save is
written to ``.step_<N>.tmp``, renamed when every file is on disk, and only then does ``latest``
move (written to a temporary name, then renamed): a crash mid-save leaves the previous
checkpoint complete and ``latest`` pointing at it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from p3d.ds_compat import has_hp_mapping, links_optimizer_states, relink_optimizer_states, wrapped_optimizer
from p3d.run_dir import CHECKPOINTS

FORMAT = "p3d-checkpoint-1"
LATEST = "latest"
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
RESUME_EARLIER = "resume an earlier checkpoint with train.resume=<its directory>"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed; the message names the file and what to do. ``problem`` is
    the message without the advice (``fix``), for tools that advise otherwise (p3d-export)."""

    def __init__(self, problem: str, fix: str | None = None):
        super().__init__(f"{problem}; {fix}" if fix else problem)
        self.problem, self.fix = problem, fix


def root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def step_dir(run_dir: str | Path, step: int) -> Path:
    return root(run_dir) / f"step_{step:08d}"


def shard_specs(module: torch.nn.Module) -> dict[str, dict]:
    """Global parameter name -> how it is cut over tp (rows / cols / replicated)."""
    specs = {}
    for mod_name, mod in module.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            spec = mod.shard_spec() if hasattr(mod, "shard_spec") else {"kind": "replicated"}
            specs[f"{mod_name}.{pname}" if mod_name else pname] = spec
    return specs


def _link_optimizer_states(engine) -> None:
    """Make every parameter's view of its Adam moments valid in DeepSpeed's ZeRO / bf16 optimizers.

    They link those views once, right after the step of the first param group, when torch's lazily
    created states of the other groups (our no-decay group) do not exist yet; the views of those
    groups then stay empty. Create any missing state (zeros, step 0, as AdamW would) and re-link."""
    wrapper = engine.optimizer
    if not links_optimizer_states(wrapper):
        return
    base = wrapped_optimizer(engine)
    for group in base.param_groups:
        for flat in group["params"]:
            if not base.state[flat]:
                base.state[flat] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    **{k: torch.zeros_like(flat) for k in ADAM_KEYS},
                }
    relink_optimizer_states(wrapper)


def _gather_optimizer_state(engine, module, keep: bool) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter: fp32 master and Adam moments, whole. Under ZeRO / bf16 this is a collective over
    the dp group (every dp rank calls it); only a rank with ``keep`` copies the result to the CPU."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out: dict[str, dict[str, torch.Tensor]] = {}
    hp = has_hp_mapping(module)
    if not (hp or keep):
        return out  # ZeRO-0 fp32: each replica holds the whole state; nothing to join
    if hp:
        _link_optimizer_states(engine)
    for name, p in module.named_parameters():
        if hp:
            state = {k: safe_get_full_optimizer_state(p, k) for k in ADAM_KEYS}
            state["master"] = safe_get_full_fp32_param(p)
        else:
            raw = engine.optimizer.state.get(p, {})
            state = {k: raw[k] for k in ADAM_KEYS if k in raw}
            state["master"] = p.detach()
        if keep:
            out[name] = {k: v.detach().float().cpu().clone() for k, v in state.items() if v is not None}
    return out


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _write_latest(ckpt_root: Path, name: str) -> None:
    tmp = ckpt_root / f".{LATEST}.tmp"
    tmp.write_text(name + "\n")
    os.replace(tmp, ckpt_root / LATEST)


def save(engine, module, mesh, cfg, plan, run_dir, step: int, samples: int, scheduler, extra: dict) -> Path:
    """Collective: every rank calls it after the same step. Returns the checkpoint directory."""
    from p3d.config.spec import SPEC_NAME
    from p3d.data.tokenizer import tokenizer_files

    ckpt_root = root(run_dir)
    final = step_dir(run_dir, step)
    tmp = ckpt_root / f".{final.name}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        for sub in ("model", "optim", "rng"):
            (tmp / sub).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    optim_state = _gather_optimizer_state(engine, module, keep=mesh.dp_rank == 0)  # every dp rank joins
    coord = f"pp{mesh.pp_rank}_tp{mesh.tp_rank}"
    if mesh.dp_rank == 0:
        params = {name: p.detach().cpu().clone() for name, p in module.named_parameters()}
        torch.save({"params": params, "shard": shard_specs(module)}, tmp / "model" / f"{coord}.pt")
        torch.save(optim_state, tmp / "optim" / f"{coord}.pt")
    torch.save(_rng_state(), tmp / "rng" / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.copy(Path(run_dir) / SPEC_NAME, tmp / SPEC_NAME)
        for i, f in enumerate(tokenizer_files(cfg.data.tokenizer)):  # the tokenizer travels with the weights
            shutil.copy(f, tmp / ("tokenizer.json" if i == 0 else f.name))
        files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
        sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
        meta = {
            "format": FORMAT,
            "step": step,
            "samples": samples,
            "mesh": {"tp": mesh.tp, "pp": mesh.pp, "dp": mesh.dp},
            "zero": cfg.zero.stage,
            "dtype": cfg.train.dtype.value,
            "model": _model_identity(cfg),
            "tokenizer": cfg.data.tokenizer,
            "stage_bounds": plan.stage_bounds,
            "scheduler": sched,
            "files": files,
            **extra,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")  # last: marks it complete
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_latest(ckpt_root, final.name)
        _prune(ckpt_root, cfg.train.keep_last)
    dist.barrier()
    return final


def _complete(ckpt_root: Path) -> list[Path]:
    """Checkpoints whose save finished (meta.json is written last), oldest first."""
    return sorted(d for d in ckpt_root.glob("step_*") if (d / "meta.json").is_file())


def _prune(ckpt_root: Path, keep_last: int) -> None:
    complete = _complete(ckpt_root)
    for old in complete[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for stale in ckpt_root.glob(".step_*.tmp"):  # a save that crashed before its rename
        shutil.rmtree(stale, ignore_errors=True)


def _model_identity(cfg) -> dict:
    """The fields that make two runs the same model (the preset name does not count)."""
    m = cfg.model
    return {
        k: getattr(m, k)
        for k in (
            "n_layers",
            "hidden_size",
            "n_heads",
            "n_kv_heads",
            "ffn_hidden_size",
            "vocab_size",
            "tie_embeddings",
            "rope_theta",
            "norm_eps",
        )
    }


# ---- finding and checking (launcher side: JSON and file sizes only, no tensors)


def find(run_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint ``train.resume`` names: none -> None; auto -> the newest complete one (None if
    there is none); else that directory, which must be a complete checkpoint."""
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume).expanduser().resolve()
        verify(path)
        return path
    ckpt_root = root(run_dir)
    pointer = ckpt_root / LATEST
    if pointer.is_file():
        candidate = ckpt_root / pointer.read_text().strip()
        if (candidate / "meta.json").is_file():
            return candidate
    complete = _complete(ckpt_root)
    return complete[-1] if complete else None


def verify(path: Path) -> dict:
    """meta.json of a complete checkpoint whose files are all present at their recorded sizes."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(
            f"train.resume={path}: no complete checkpoint there (no meta.json)", "try train.resume=auto"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"checkpoint file {meta_path} is corrupt ({exc})", RESUME_EARLIER) from None
    for rel, size in meta.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing", RESUME_EARLIER)
        if f.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint file {f} is truncated ({f.stat().st_size} of {size} bytes)", RESUME_EARLIER
            )
    return meta


def check_compatible(meta: dict, cfg, path: Path) -> None:
    """Refuse a checkpoint of another model or tokenizer; any mesh and ZeRO stage may resume it."""
    want = _model_identity(cfg)
    diff = {k: (meta["model"].get(k), v) for k, v in want.items() if meta["model"].get(k) != v}
    if diff:
        k, (was, now) = next(iter(diff.items()))
        raise CheckpointError(
            f"checkpoint {path} holds another model: model.{k}={was} there, {now} here; "
            f"resume with model.{k}={was} or start a new run.dir"
        )
    if meta.get("tokenizer") != cfg.data.tokenizer:
        raise CheckpointError(
            f"checkpoint {path} was trained with data.tokenizer={meta.get('tokenizer')}, "
            f"this run uses {cfg.data.tokenizer}; resume with data.tokenizer={meta.get('tokenizer')}"
        )


# ---- loading (workers)


def _load_file(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint file {path} cannot be read ({type(exc).__name__}: {exc})", RESUME_EARLIER
        ) from None


def _local_states(path: Path, meta: dict, module, mesh, plan):
    """name -> this rank's {master, exp_avg, exp_avg_sq}. The saving layout's own file when tp and the
    stage boundaries are unchanged; else assembled from the saved shards and re-cut for this mesh."""
    from p3d.train.reshard import ShardedCheckpoint, shard_from_full

    same_layout = meta["mesh"]["tp"] == mesh.tp and meta["stage_bounds"] == list(plan.stage_bounds)
    if same_layout:
        optim = _load_file(path / "optim" / f"pp{mesh.pp_rank}_tp{mesh.tp_rank}.pt")
        return lambda name: optim[name]
    source = ShardedCheckpoint(path, meta, _load_file)
    specs = shard_specs(module)

    def resharded(name: str) -> dict:
        return {k: shard_from_full(v, specs[name], mesh.tp, mesh.tp_rank) for k, v in source.optim(name).items()}

    return resharded


def load(path: Path, engine, module, mesh, plan, scheduler) -> dict:
    """Restore parameters, optimizer states and RNG under this run's mesh, and set the scheduler to the
    checkpoint's step (this run's schedule; see p3d.config.resume_rules); returns meta.json."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    from p3d.train.optim import resume_schedule

    meta = json.loads((path / "meta.json").read_text())
    states = _local_states(path, meta, module, mesh, plan)
    hp = has_hp_mapping(module)
    if hp:
        _link_optimizer_states(engine)
    step_t = torch.tensor(float(meta["step"]))
    with torch.no_grad():
        for name, p in module.named_parameters():
            try:
                state = states(name)
            except KeyError:
                raise CheckpointError(f"checkpoint {path} has no parameter {name}") from None
            if tuple(state["master"].shape) != tuple(p.shape):
                raise CheckpointError(
                    f"checkpoint {path}: {name} has shape {tuple(state['master'].shape)}, this "
                    f"rank needs {tuple(p.shape)}"
                )
            p.copy_(state["master"].to(p.dtype))
            if hp:
                safe_set_full_fp32_param(p, state["master"].to(p.device))
                for k in ADAM_KEYS:
                    safe_set_full_optimizer_state(p, state[k].to(p.device), k)
            else:
                engine.optimizer.state[p] = {"step": step_t.clone(), **{k: state[k].to(p.device) for k in ADAM_KEYS}}
    if hp:  # Adam's bias correction: the base optimizer's step count per (flat) parameter
        base = wrapped_optimizer(engine)
        for st in base.state.values():
            if "step" in st:
                st["step"] = step_t.clone() if torch.is_tensor(st["step"]) else meta["step"]
    resume_schedule(scheduler, meta["step"])  # this run's lr and schedule, at the checkpoint's step
    rng = path / "rng" / f"rank{dist.get_rank()}.pt"
    if rng.is_file() and meta["mesh"] == {"tp": mesh.tp, "pp": mesh.pp, "dp": mesh.dp}:
        state = _load_file(rng)
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
    return meta
