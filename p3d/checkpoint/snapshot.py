"""Saving a checkpoint: every rank writes what it holds, in parallel, optionally in the background.

At the step boundary each rank copies to host memory (``Snapshot``):
- its ZeRO / bf16 partition of the fp32 master weights and Adam moments: the fragment of every
  parameter that its partition holds (a range of the flattened parameter), so the optimizer state is
  written by all dp ranks, each its 1/dp; under torch's ZeroRedundancyOptimizer (a torch pipeline schedule
  with ZeRO-1: ``OptimizerStates.owns``, the ids of the parameters this rank's optimizer steps) the whole states of
  the parameters it owns, each one fragment at start 0;
- the parameters, and without ZeRO (every replica holds everything) the optimizer state too: the
  coordinate's flattened tensors cut into dp even parts, one per dp rank (``dp_slices``);
- its RNG states (JSON).
Then (in a background thread with ``train.async_save``) it writes them to
``.step_<N>.tmp/{model,optim}/pp<p>_tp<t>_dp<d>.safetensors`` and ``rng/rank<r>.json``, fsyncs them,
and last writes its manifest ``done/rank<r>.json`` (file -> size). Rank 0 then waits for every rank's
manifest, checks every listed file is on disk at its size, writes ``meta.json`` (fsync'd), renames the
directory to ``step_<N>``, moves ``latest`` and prunes. A rank whose write fails writes
``done/rank<r>.failed`` instead; rank 0 then drops the whole directory.

No collective runs in the background: ``Saver.wait`` (called by every rank at the next save and at
the end of the run, also after a stop signal) joins the thread and agrees, in one all-reduce, whether
any rank's save failed; if one did, every rank raises.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from p3d.checkpoint.files import CheckpointSaveError, fsync_dir, save_failed, write_json, write_tensors
from p3d.compat.deepspeed_internals import has_hp_mapping, hp_fragment
from p3d.parallel.experts.params import is_expert_param
from p3d.parallel.zero.fsdp import flat_range, is_sharded, local, piece_of

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _host(t: torch.Tensor, dtype=None) -> torch.Tensor:
    """A host copy that training's in-place updates cannot change."""
    return t.detach().to("cpu", dtype=dtype, copy=True).contiguous()


class HostBuffers:
    """Host copies taken at the step boundary. From an accelerator they go into page-locked (pinned)
    buffers, allocated at the first save and reused by every later one (a save starts only after the
    previous one's write is done, so the buffers are free again), issued ``non_blocking`` and waited for
    once in ``ready()``; from CPU tensors they are plain copies (pinning would gain nothing). The pinned
    path is not exercised by the CPU tests."""

    def __init__(self) -> None:
        self._pinned: dict[str, torch.Tensor] = {}
        self._in_flight = False

    def copy(self, key: str, t: torch.Tensor, dtype=None) -> torch.Tensor:
        t = t.detach()
        if t.device.type == "cpu":
            return _host(t, dtype)
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)  # cast on the device: the pinned buffer then takes a plain copy
        buf = self._pinned.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._pinned[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        self._in_flight = True
        return buf

    def ready(self) -> None:
        """Every copy issued is complete (call before the copies are read or training goes on)."""
        if self._in_flight:
            torch.cuda.synchronize()
            self._in_flight = False


def dp_slices(numels: list[int], dp: int, dp_rank: int) -> list[tuple[int, int]]:
    """(start, numel) of each tensor's flattened elements that ``dp_rank`` writes: the concatenation of
    all of them cut into ``dp`` even parts (as ZeRO-1 cuts its flat group), so every rank writes 1/dp."""
    total = sum(numels)
    lo, hi = total * dp_rank // dp, total * (dp_rank + 1) // dp
    out, at = [], 0
    for n in numels:
        a, b = max(lo, at), min(hi, at + n)
        out.append((a - at, max(0, b - a)))
        at += n
    return out


def holder_slices(named: list[tuple[str, torch.Tensor]], sharded: bool, mesh) -> list[tuple[int, int]]:
    """(start, numel) of each parameter that this rank writes (``dp_slices``): the dense ones cut over the dp ranks,
    which all hold them, the routed experts' over the (dp / ep) x cp ranks of their edp group, the only ones that
    hold them (p3d.layout.dims). ZeRO-2/3: none (each rank writes the piece FSDP2 gave it)."""
    out: list[tuple[int, int]] = [(0, 0)] * len(named)
    if sharded:
        return out
    dense, experts = (mesh.dp_cp, mesh.dp_cp_rank), (mesh.edp, mesh.edp_rank)  # cp ranks hold both
    for expert, (holders, rank) in ((False, dense), (True, experts)):
        mine = [i for i, (_, p) in enumerate(named) if is_expert_param(p) == expert]
        for i, cut in zip(mine, dp_slices([named[i][1].numel() for i in mine], holders, rank)):
            out[i] = cut
    return out


def ep_placement(p: torch.Tensor, mesh) -> tuple[int, list[int]]:
    """(offset, shape) of this rank's parameter ``p`` (whole over dp, as FSDP2 shows it) in the checkpoint's logical
    tensor. A routed experts' stacked weight (p3d.model.experts) holds E / ep experts' rows: the logical tensor
    stacks every expert of the layer, all ep shares in ep rank order, so this rank's share starts ``ep_rank``
    shares in; any other parameter is its own logical tensor (offset 0)."""
    shape = list(p.shape)
    if mesh.ep > 1 and is_expert_param(p):
        return mesh.ep_rank * p.numel(), [shape[0] * mesh.ep, *shape[1:]]
    return 0, shape


BUFFER_ENTRY = {"start": 0, "keys": ["param"], "shard": {"kind": "replicated"}, "buffer": True}


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's buffers that its state dict keeps (the routers' ``expert_bias``), by global name."""
    out = []
    for mod_name, mod in module.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                out.append((f"{mod_name}.{name}" if mod_name else name, buf))
    return out


def rng_state() -> dict:
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {
        "torch": torch.get_rng_state().tolist(),
        "python": [version, list(mt), gauss],
        "numpy": [name, np.asarray(keys).tolist(), pos, has_gauss, cached],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


class Snapshot:
    """One rank's share of a checkpoint, in host memory (taken at the step boundary)."""

    def __init__(self, held, module, mesh, specs: dict[str, dict], host: HostBuffers | None = None, key: str = ""):
        """``held``: where the Adam states live (p3d.checkpoint.checkpointer.OptimizerStates); ``key`` prefixes the
        host buffers' keys (a rank's chunks share names)."""
        host = host or HostBuffers()
        named = list(module.named_parameters())
        sharded = bool(named) and is_sharded(named[0][1])  # ZeRO-2/3 (FSDP2): each dp rank writes the rows it holds
        slices = holder_slices(named, sharded, mesh)
        self.params: dict[str, torch.Tensor] = {}
        self.params_index: dict[str, dict] = {}
        self.optim: dict[str, torch.Tensor] = {}
        self.optim_index: dict[str, dict] = {}
        if mesh.dp_cp_rank == 0:  # persistent buffers (the routers' selection biases): the same on every dp rank
            for name, buf in persistent_buffers(module):
                self.params[f"{name}/param"] = host.copy(f"{key}model/{name}/param", buf.reshape(-1))
                self.params_index[name] = BUFFER_ENTRY | {"shape": list(buf.shape)}
        placed = {name: ep_placement(p, mesh) for name, p in named}  # (offset, logical shape)
        for (name, p), (start, numel) in zip(named, slices):
            if numel:
                offset, shape = placed[name]
                self.params[f"{name}/param"] = host.copy(
                    f"{key}model/{name}/param", p.reshape(-1)[start : start + numel]
                )
                self.params_index[name] = {
                    "start": offset + start,
                    "shape": shape,
                    "keys": ["param"],
                    "shard": specs[name],
                }
        if sharded:
            for name, p in named:
                self._add_piece(host, key, name, p, held.optimizer.state.get(p, {}), specs[name], placed[name])
        elif has_hp_mapping(module):  # the fragments this rank's ZeRO / bf16 partition holds (DeepSpeed: ep = 1)
            for name, p in named:
                frag = hp_fragment(p, ADAM_KEYS)
                if frag is not None and frag[1] > 0:
                    self._add(host, key, name, frag[0], list(p.shape), frag[2])
        elif held.owns is not None:  # torch's ZeroRedundancyOptimizer: whole params per owner
            for name, p in named:
                if id(p) in held.owns:
                    raw = held.optimizer.state.get(p, {})
                    offset, shape = placed[name]
                    states = {"master": p, **{k: raw[k] for k in ADAM_KEYS if k in raw}}
                    self._add(host, key, name, offset, shape, states)
        else:  # every replica holds everything: each writes its even part, like the parameters
            for (name, p), (start, numel) in zip(named, slices):
                raw = held.optimizer.state.get(p, {})
                states = {"master": p, **{k: raw[k] for k in ADAM_KEYS if k in raw}}
                if numel:
                    offset, shape = placed[name]
                    parts = {k: t.reshape(-1)[start : start + numel] for k, t in states.items()}
                    self._add(host, key, name, offset + start, shape, parts)
        host.ready()
        self.rng = rng_state()

    def _add_piece(self, host: HostBuffers, key: str, name: str, p, raw: dict, spec: dict, placed) -> None:
        """A sharded parameter's piece (its dim-0 rows on this dp rank: one flat range) and its Adam moments';
        ``placed``: (offset, shape) of ``p`` in the logical tensor (``ep_placement``)."""
        pieces, index, replica = piece_of(p)
        start, numel = flat_range(p, pieces, index)
        piece = local(p)
        if piece.numel() != numel:  # FSDP2 cut it otherwise than torch.chunk: the offsets would be wrong
            raise RuntimeError(f"{name}: this dp rank holds {piece.numel()} elements, torch.chunk's cut {numel}")
        if not numel or replica:  # HSDP: the first replica of each piece writes it
            return
        offset, shape = placed
        self.params[f"{name}/param"] = host.copy(f"{key}model/{name}/param", piece.reshape(-1))
        self.params_index[name] = {"start": offset + start, "shape": shape, "keys": ["param"], "shard": spec}
        states = {"master": piece, **{k: local(raw[k]) for k in ADAM_KEYS if k in raw}}
        self._add(host, key, name, offset + start, shape, {k: t.reshape(-1) for k, t in states.items()})

    def _add(self, host: HostBuffers, key: str, name: str, start: int, shape: list[int], states: dict) -> None:
        for k, t in states.items():
            self.optim[f"{name}/{k}"] = host.copy(f"{key}optim/{name}/{k}", t.reshape(-1), torch.float32)
        self.optim_index[name] = {"start": start, "shape": shape, "keys": sorted(states)}

    def write(self, tmp: Path, coord: str, rank: int) -> None:
        """This rank's files, fsync'd, then its manifest (the sign that they are complete)."""
        Snapshot.write_all([(coord, self)], tmp, rank)

    @staticmethod
    def write_all(snaps: list[tuple[str, Snapshot]], tmp: Path, rank: int) -> None:
        """The files of every (coordinate, snapshot) of this rank (a torch schedule's rank holds several chunks),
        its RNG states, fsync'd, then its one manifest."""
        done = tmp / "done"
        coords = [coord for coord, _ in snaps]
        try:
            rng = f"rng/rank{rank}.json"
            sizes = {rng: write_json(tmp / rng, snaps[0][1].rng)}
            for coord, snap in snaps:
                model, optim = f"model/{coord}.safetensors", f"optim/{coord}.safetensors"
                sizes[model] = write_tensors(tmp / model, snap.params, snap.params_index)
                sizes[optim] = write_tensors(tmp / optim, snap.optim, snap.optim_index)
            for sub in ("model", "optim", "rng"):
                fsync_dir(tmp / sub)
            # fsync'd under another name, then renamed: rank 0 (which renames the whole directory once it
            # has read every manifest) never sees a manifest before it is whole and durable
            partial = done / f".rank{rank}.json.partial"
            write_json(partial, sizes)
            try:
                os.replace(partial, done / f"rank{rank}.json")
            except OSError as exc:
                raise save_failed(partial, exc) from None
        except BaseException as exc:
            own = [("model", c) for c in coords] + [("optim", c) for c in coords] + [("rng", f"rank{rank}")]
            for sub, name in own:  # frees space first
                for f in (tmp / sub).glob(f"{name}.*"):
                    f.unlink(missing_ok=True)
            try:
                (done / f"rank{rank}.failed").write_text(str(exc).splitlines()[0] if str(exc) else repr(exc))
            except OSError:
                pass
            raise


def failure_reason(tmp: Path) -> str:
    """The first failed rank's reason, as it wrote it into ``done/rank<r>.failed``."""
    for f in sorted((tmp / "done").glob("rank*.failed"), key=lambda f: int(f.name[4:].split(".")[0])):
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        return f"rank {f.name[4:].split('.')[0]}: {text}" if text else f"rank {f.name[4:].split('.')[0]} failed"
    return ""


def collect_manifests(tmp: Path, world: int, timeout_s: float) -> dict[str, int]:
    """Rank 0: every rank's files and sizes, once all have written their manifests; checks each file is
    on disk at its size. Raises CheckpointSaveError when a rank failed (its one-line reason) or when a
    rank wrote neither a manifest nor a failure within ``timeout_s`` (it died or hangs)."""
    done = tmp / "done"
    end = time.monotonic() + timeout_s
    pending = set(range(world))
    files: dict[str, int] = {}
    while pending:
        for r in sorted(pending):
            if (done / f"rank{r}.failed").is_file():
                raise CheckpointSaveError(failure_reason(tmp))
            manifest = done / f"rank{r}.json"
            if manifest.is_file():
                try:
                    files.update(json.loads(manifest.read_text()))
                except ValueError:
                    continue  # being written (it is small; the next look sees it whole)
                files[f"done/rank{r}.json"] = manifest.stat().st_size
                pending.discard(r)
        if pending:
            if time.monotonic() > end:
                raise CheckpointSaveError(
                    f"checkpoint save to {tmp}: ranks {sorted(pending)} wrote no manifest within {timeout_s:.0f} s "
                    "(cluster.timeout_s + twice rank 0's own write); they died or hang, see their logs"
                )
            time.sleep(0.01)
    for rel, size in files.items():
        f = tmp / rel
        if not f.is_file() or f.stat().st_size != size:
            raise CheckpointSaveError(f"checkpoint save to {tmp}: {f} is not on disk at its size ({size} bytes)")
    return files


def make_dirs(tmp: Path) -> None:
    try:
        for sub in ("model", "optim", "rng", "done"):
            (tmp / sub).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise save_failed(tmp, exc) from None


def drop(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


REASON_BYTES = 512  # the one-line reason a failed rank sends the others


class Saver:
    """Runs saves one at a time, in the background when ``asynchronous``; see the module doc."""

    def __init__(self, asynchronous: bool, device: torch.device):
        self.asynchronous, self.device = asynchronous, device
        self.host = HostBuffers()  # reused by every save (pinned when the state is on an accelerator)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, job) -> None:
        """Run ``job()`` (the writes of one save); the previous save must have been waited for."""
        if not self.asynchronous:
            self._run(job)
            return
        self._thread = threading.Thread(target=self._run, args=(job,), name="p3d-checkpoint-writer", daemon=True)
        self._thread.start()

    def _run(self, job) -> None:
        try:
            job()
        except BaseException as exc:  # reported by wait(), on every rank
            self._error = exc

    def wait(self) -> None:
        """Collective: every rank calls it at the same points. Returns once the save in flight is
        complete on every rank; raises (on every rank) if any rank's save failed, with that rank's own
        one-line reason. The reason travels in the collective, not in a file: on a full disk the
        ``.failed`` file of the failing rank may never be written."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if isinstance(error, OSError):
            error = save_failed(Path(getattr(error, "filename", "") or "."), error)
        reason = self._first_reason(error)
        if error is not None:
            raise error
        if reason:
            raise CheckpointSaveError(f"checkpoint save failed on another rank: {reason}")

    def _first_reason(self, error: BaseException | None) -> str:
        """All-gather of every rank's reason (REASON_BYTES of UTF-8, empty when its save went well);
        the lowest failed rank's, as ``rank <r>: <line>``, or "" when every rank succeeded."""
        text = ""
        if error is not None:
            line = str(error).splitlines()[0] if str(error) else repr(error)
            text = f"rank {dist.get_rank()}: {line}"
        raw = text.encode()[: REASON_BYTES - 1]
        mine = torch.zeros(REASON_BYTES, dtype=torch.uint8, device=self.device)
        if raw:
            mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        for buf in every:
            got = bytes(buf.cpu().tolist()).rstrip(b"\0")
            if got:
                return got.decode(errors="replace")  # a cut mid-character reads as U+FFFD
        return ""
