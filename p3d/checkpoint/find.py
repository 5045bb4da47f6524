"""Finding and checking a checkpoint without loading it: JSON and file sizes only, no torch, so that the
launcher (p3d-train's checks before any worker starts, p3d-export's choice of step) stays quick to start.
The formats are in p3d.checkpoint.files; saving and loading in p3d.checkpoint.checkpointer."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from p3d.rundir.files import CHECKPOINTS

LATEST = "latest"
LEGACY_FORMAT = "p3d-checkpoint-1"
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


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """Checkpoints whose save finished (meta.json is written last), oldest first."""
    return sorted(d for d in ckpt_root.glob("step_*") if (d / "meta.json").is_file())


def model_identity(cfg) -> dict:
    """The fields that make two runs the same model (the preset name does not count)."""
    m = cfg.model
    identity = {
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
    if getattr(m, "moe", None) is not None:  # the experts' tensors: a dense checkpoint has none (key absent)
        e = m.moe
        identity["moe"] = {
            k: getattr(e, k) for k in ("n_experts", "expert_ffn_size", "n_shared_experts", "first_dense_layers")
        }
    for key, default in OPTIONAL.items():  # the families' fields: present only when set (older checkpoints: none)
        value = getattr(m, key, default)
        if key == "head_dim" and value == m.hidden_size // m.n_heads:
            value = None  # hidden / heads, said or not: the same model
        if key == "rope_scaling" and getattr(value, "rope_type", None) is None:
            value = None  # plain RoPE
        if value != default:
            identity[key] = _plain(value)
    return identity


# model fields a checkpoint's identity names only when they differ from these (p3d.config.schema.ModelConfig)
OPTIONAL = {"head_dim": None, "qkv_bias": False, "qk_norm": False, "rope_scaling": None}


def _plain(value):
    """A JSON value of a model field: a dataclass as a dict, an enum as its value."""
    if dataclasses.is_dataclass(value):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    return getattr(value, "value", value)


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
    complete = complete_checkpoints(ckpt_root)
    return complete[-1] if complete else None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory; the rename is then as durable as they allow
        pass
    finally:
        os.close(fd)


def write_latest(ckpt_root: Path, name: str) -> None:
    """Point ``latest`` at checkpoint ``name``: written to a temporary name, fsync'd, renamed."""
    tmp = ckpt_root / f".{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt_root / LATEST)
    _fsync_dir(ckpt_root)


def prune(ckpt_root: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete checkpoints (0: all) and drop what unfinished saves left. An old
    checkpoint is renamed out of the ``step_*`` names before it is deleted, so that a prune cut short (a kill)
    never leaves a ``step_*`` directory with its meta.json but not all its files."""
    complete = complete_checkpoints(ckpt_root)
    for old in complete[:-keep_last] if keep_last > 0 else []:
        doomed = old.with_name(f".pruned-{old.name}")
        os.replace(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    for stale in (*ckpt_root.glob(".step_*.tmp"), *ckpt_root.glob(".pruned-step_*")):  # a save or prune cut short
        shutil.rmtree(stale, ignore_errors=True)


def settle(run_dir: str | Path, keep_last: int) -> str:
    """After workers were killed (a second Ctrl-C) at any point of a save: drop the unfinished save, keep
    ``keep_last``, point ``latest`` at the newest complete checkpoint; one phrase saying what is on disk."""
    ckpt_root = root(run_dir)
    if ckpt_root.is_dir():
        prune(ckpt_root, keep_last)
        complete = complete_checkpoints(ckpt_root)
        pointer = ckpt_root / LATEST
        if complete and (not pointer.is_file() or pointer.read_text().strip() != complete[-1].name):
            write_latest(ckpt_root, complete[-1].name)  # killed between a save's rename and its pointer
    return on_disk(run_dir)


def on_disk(run_dir: str | Path) -> str:
    """``the newest complete checkpoint is <dir> (step N); train.resume=auto continues from it``, or that
    there is none."""
    complete = complete_checkpoints(root(run_dir)) if root(run_dir).is_dir() else []
    if not complete:
        return f"no checkpoint in {root(run_dir)}: train.resume=auto would start from step 0"
    step = json.loads((complete[-1] / "meta.json").read_text()).get("step", "?")
    return f"the newest complete checkpoint is {complete[-1]} (step {step}); train.resume=auto continues from it"


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
    want = model_identity(cfg)
    absent = [k for k in ("moe", *OPTIONAL) if k in meta["model"] and k not in want]  # MoE vs dense either way, ...
    keys = [*want, *absent]
    diff = {k: (meta["model"].get(k), want.get(k)) for k in keys if meta["model"].get(k) != want.get(k)}
    if diff:
        k, (was, now) = next(iter(diff.items()))
        if k == "moe":  # {field: value} or null: name the first field that differs
            was, now = was or {}, now or {}
            sub = next(f for f in (*was, *now) if was.get(f) != now.get(f))
            k, was, now = f"moe.{sub}", was.get(sub, "null (dense)"), now.get(sub, "null (dense)")
        elif k in OPTIONAL:  # absent on one side: the default
            was, now = (OPTIONAL[k] if v is None else v for v in (was, now))
        raise CheckpointError(
            f"checkpoint {path} holds another model: model.{k}={was} there, {now} here; "
            f"resume with model.{k}={was} or start a new run.dir"
        )
    if meta.get("tokenizer") != cfg.data.tokenizer:
        raise CheckpointError(
            f"checkpoint {path} was trained with data.tokenizer={meta.get('tokenizer')}, "
            f"this run uses {cfg.data.tokenizer}; resume with data.tokenizer={meta.get('tokenizer')}"
        )
