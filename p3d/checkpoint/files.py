"""Checkpoint files that load without running code, written durably.

- Tensors: safetensors files (a JSON header, then raw bytes); our own per-file index (names, fragment
  offsets, shard specs) is JSON in the header's metadata under ``p3d``.
- Everything else (meta.json, RNG states, every rank's manifest): JSON.
- Checkpoints of the previous format (``p3d-checkpoint-1``, ``torch.save`` pickles) are read with
  ``torch.load(weights_only=True)``, which refuses any pickle that would build objects other than
  tensors and plain containers; their RNG states (numpy objects) are not read.

Every file is fsync'd before its writer reports it; a write that fails (disk full, I/O error) raises
:class:`CheckpointSaveError`, one line naming the path and the free space. Every file gets the mode the
umask gives (0644 under umask 022), safetensors files too (:func:`save_safetensors`), so that teammates
on shared storage can read a checkpoint or an export.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

import torch

from p3d.checkpoint.find import LEGACY_FORMAT, RESUME_EARLIER, CheckpointError


class CheckpointSaveError(CheckpointError):
    """A save that could not be written (disk full, I/O error); the previous checkpoint is untouched."""


def free_space(path: Path) -> str:
    """Free bytes on the file system holding ``path`` (or its nearest existing parent), for messages."""
    for p in (path, *path.parents):
        if p.exists():
            free = shutil.disk_usage(p).free
            return f"{free / 2**20:.1f} MiB free on the file system of {p}"
    return "free space unknown"


def save_failed(path: Path, exc: OSError) -> CheckpointSaveError:
    why = os.strerror(exc.errno) if exc.errno else str(exc)
    hint = "; free space or move run.dir, then resume with train.resume=auto" if exc.errno == errno.ENOSPC else ""
    return CheckpointSaveError(f"checkpoint save failed writing {path}: {why} ({free_space(path)}){hint}")


def _umask_from_proc() -> int | None:
    """This process's umask as Linux reports it (``Umask:`` in /proc/self/status, Linux 4.7 and later):
    read without setting it, so safe in the background thread of an asynchronous save."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _umask_by_setting() -> int:
    """``os.umask`` reads the umask only by setting it, for the whole process: racy once threads write
    files, so done once, at import (in the main thread), where /proc cannot tell."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _umask_at_import() -> int:
    found = _umask_from_proc()
    return _umask_by_setting() if found is None else found


_UMASK_AT_IMPORT = _umask_at_import()


def umask() -> int:
    """The process's umask, read without changing it (from any thread)."""
    now = _umask_from_proc()
    return _UMASK_AT_IMPORT if now is None else now


def save_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """safetensors' ``save_file``, the file then given the mode ``open()`` gives (0o666 less the umask):
    save_file writes it 0600 whatever the umask, which keeps teammates on shared storage from reading a
    checkpoint or an export while the JSON beside it is readable."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~umask())


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    try:
        fsync_file(path)
    except OSError:  # some file systems cannot fsync a directory; the rename is then as durable as they allow
        pass


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], index: dict) -> int:
    """A safetensors file, fsync'd; returns its size."""
    try:
        save_safetensors(path, tensors, {"p3d": json.dumps(index)})
        fsync_file(path)
        return path.stat().st_size
    except OSError as exc:
        raise save_failed(path, exc) from None
    except Exception as exc:  # safetensors' own error wraps the OS error: "... (os error 28)"
        code = re.search(r"os error (\d+)", str(exc))
        if code is None:
            raise
        raise save_failed(path, OSError(int(code.group(1)), str(exc))) from None


def write_json(path: Path, obj) -> int:
    """A JSON file, fsync'd; returns its size."""
    try:
        with open(path, "w") as f:
            f.write(json.dumps(obj, indent=1, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return path.stat().st_size
    except OSError as exc:
        raise save_failed(path, exc) from None


def _unreadable(path: Path, exc: BaseException) -> CheckpointError:
    first = (str(exc).strip().splitlines() or [""])[0]  # torch's refusal of a pickle runs to many lines
    return CheckpointError(f"checkpoint file {path} cannot be read ({type(exc).__name__}: {first})", RESUME_EARLIER)


def read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, p3d index) of a safetensors file. Parsing it runs no code: a pickle or garbage in its
    place is refused, naming the file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            index = json.loads((f.metadata() or {}).get("p3d", "{}"))
            return {k: f.get_tensor(k) for k in f.keys()}, index  # noqa: SIM118 (safe_open is not iterable)
    except Exception as exc:
        raise _unreadable(path, exc) from None


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise _unreadable(path, exc) from None


def read_legacy(path: Path):
    """A ``torch.save`` file of the previous format: tensors and plain containers only."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise _unreadable(path, exc) from None


def _join_fragments(path: Path, name: str, parts: list[tuple[int, dict[str, torch.Tensor]]], shape) -> dict:
    """A tensor's whole states from its dp fragments: (start in the flattened tensor, {key: flat})."""
    numel = 1
    for n in shape:
        numel *= n
    first = parts[0][1]
    out = {k: torch.empty(numel, dtype=t.dtype) for k, t in first.items()}
    covered = 0
    for start, states in sorted(parts, key=lambda s: s[0]):
        for k in out:
            out[k][start : start + states[k].numel()] = states[k]
        covered += next(iter(states.values())).numel()
    if covered != numel:
        raise CheckpointError(f"checkpoint {path}: the fragments of {name} cover {covered} of {numel} values")
    return {k: v.view(*shape) for k, v in out.items()}


def _joined(path: Path, files: list[Path]) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict]]:
    """{name: {key: whole tensor}} and {name: index entry} from every dp rank's file of one coordinate."""
    frags: dict[str, list] = {}
    entries: dict[str, dict] = {}
    for f in files:
        tensors, index = read_tensors(f)
        for name, entry in index.items():
            try:
                states = {k: tensors[f"{name}/{k}"] for k in entry["keys"]}
            except KeyError as exc:
                raise CheckpointError(f"checkpoint file {f} lacks tensor {exc}", RESUME_EARLIER) from None
            frags.setdefault(name, []).append((entry["start"], states))
            entries[name] = entry
    return {name: _join_fragments(path, name, parts, entries[name]["shape"]) for name, parts in frags.items()}, entries


def coordinate_reader(path: Path, meta: dict):
    """``read(kind, pp, tp)`` of a checkpoint: kind ``model`` -> {"params": {name: tensor}, "shard":
    {name: spec}}; ``optim`` -> {name: {master, exp_avg, exp_avg_sq}}, whole over dp (joined from
    every dp (and cp) rank's fragments)."""
    if meta.get("format") == LEGACY_FORMAT:
        return lambda kind, pp, tp: _stacked(kind, read_legacy(path / kind / f"pp{pp}_tp{tp}.pt"), path)
    dp, cp = meta["mesh"]["dp"], meta["mesh"].get("cp", 1)
    holders = [f"dp{d}" + (f"_cp{c}" if cp > 1 else "") for d in range(dp) for c in range(cp)]  # the writers' names

    def read(kind: str, pp: int, tp: int) -> dict:
        joined, entries = _joined(path, [path / kind / f"pp{pp}_tp{tp}_{h}.safetensors" for h in holders])
        if kind == "model":
            return _stacked(
                kind,
                {
                    "params": {name: t["param"] for name, t in joined.items()},
                    "shard": {name: e["shard"] for name, e in entries.items()},
                },
                path,
            )
        return _stacked(kind, joined, path)

    return read


def _stacked(kind: str, read: dict, path: Path) -> dict:
    """A coordinate as today's model names it: the per-expert tensors of a checkpoint written before the routed
    experts were stacked, stacked (p3d.checkpoint.per_expert)."""
    from p3d.checkpoint.per_expert import stacked

    if kind == "model":
        params, specs = stacked(read["params"], read["shard"], str(path))
        return {**read, "params": params, "shard": specs}
    return stacked(read, None, str(path))[0]
