"""Our checkpoint writer against torch.distributed.checkpoint (DCP) on the same per-rank state (issue 14): the code of
``bench/checkpoint.py dcp`` (its --help says what it measures), apart because it imports torch's distributed
checkpointing at the top."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from safetensors import safe_open

from p3d.checkpoint.files import coordinate_reader, read_json, read_tensors
from p3d.checkpoint.snapshot import Snapshot, _host


def coords(ckpt: Path) -> list[tuple[int, int, int]]:
    """(pp, tp, dp) of every rank's file in the checkpoint, in a fixed order (one bench rank each)."""
    out = []
    for f in sorted((ckpt / "model").glob("pp*_tp*_dp*.safetensors")):
        p, t, d = (int(x[2:]) for x in f.stem.split("_"))
        out.append((p, t, d))
    return out


def sharded(flat: torch.Tensor, start: int, numel: int, group) -> object:
    """A flattened parameter's fragment as a 1-D ShardedTensor of the whole flattened parameter."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    shards = []
    if flat.numel():
        meta = ShardMetadata([start], [flat.numel()], f"rank:{dist.get_rank()}/cpu")
        shards = [Shard(flat, meta)]
    return init_from_local_shards(shards, numel, process_group=group)


def dcp_state(ckpt: Path, pp: int, tp: int, dp: int, group) -> dict:
    """This rank's state as DCP keys: ``pp<p>.tp<t>.<param>.<key>``, each a ShardedTensor over dp."""
    state = {}
    for kind in ("model", "optim"):
        tensors, index = read_tensors(ckpt / kind / f"pp{pp}_tp{tp}_dp{dp}.safetensors")
        # every dp rank must build the same ShardedTensors (a collective each): iterate the union of names
        names = sorted(index_union(ckpt, kind, pp, tp))
        for name in names:
            entry = index.get(name)
            numel = _numel(ckpt, kind, pp, tp, name)
            for k in index_union(ckpt, kind, pp, tp)[name]["keys"]:
                flat = tensors[f"{name}/{k}"] if entry else torch.empty(0)
                start = entry["start"] if entry else 0
                state[f"pp{pp}.tp{tp}.{name}.{k}"] = sharded(flat, start, numel, group)
    return state


_UNION: dict = {}


def index_union(ckpt: Path, kind: str, pp: int, tp: int) -> dict[str, dict]:
    """{name: index entry (shape, keys)} over every dp rank's file of a coordinate (safetensors headers)."""
    key = (kind, pp, tp)
    if key not in _UNION:
        out: dict[str, dict] = {}
        for f in sorted((ckpt / kind).glob(f"pp{pp}_tp{tp}_dp*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                out.update(json.loads(h.metadata()["p3d"]))
        _UNION[key] = out
    return _UNION[key]


def _numel(ckpt, kind, pp, tp, name) -> int:
    n = 1
    for s in index_union(ckpt, kind, pp, tp)[name]["shape"]:
        n *= s
    return n


def snapshot_of(ckpt: Path, pp: int, tp: int, dp: int, rank: int) -> Snapshot:
    """A Snapshot holding exactly what this rank's files hold (our writer then writes it)."""
    snap = object.__new__(Snapshot)
    snap.params, snap.params_index = read_tensors(ckpt / "model" / f"pp{pp}_tp{tp}_dp{dp}.safetensors")
    snap.optim, snap.optim_index = read_tensors(ckpt / "optim" / f"pp{pp}_tp{tp}_dp{dp}.safetensors")
    snap.rng = read_json(ckpt / "rng" / f"rank{rank}.json") if (ckpt / "rng" / f"rank{rank}.json").exists() else {}
    return snap


def host_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [_host(t) for t in tensors]


def start_async(fut: list, state: dict, writer, group) -> None:
    fut.append(dcp.async_save(state, storage_writer=writer, process_group=group))


def timed(fn) -> float:
    """Wall time of ``fn`` on every rank, max over ranks (a save is done when the last rank is)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def dir_bytes_per_rank(d: Path, files_of_rank) -> int:
    return sum(f.stat().st_size for f in files_of_rank(d))


def worker(rank: int, world: int, ckpt: Path, out: Path, repeat: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    async_group = dist.new_group(backend="gloo")  # DCP's background collectives, apart from the main group
    pp, tp, dp = coords(ckpt)[rank]
    meta = read_json(ckpt / "meta.json")
    ndp = meta["mesh"]["dp"]
    all_coords = coords(ckpt)
    groups = {}
    for p, t in sorted({(p, t) for p, t, _ in all_coords}):
        ranks = [r for r, c in enumerate(all_coords) if c[:2] == (p, t)]
        groups[(p, t)] = (dist.new_group(ranks, backend="gloo"), ranks)
    group, dp_ranks = groups[(pp, tp)]
    assert len(dp_ranks) == ndp

    snap = snapshot_of(ckpt, pp, tp, dp, rank)
    t0 = time.perf_counter()
    state = dcp_state(ckpt, pp, tp, dp, group)
    build = time.perf_counter() - t0
    coord = f"pp{pp}_tp{tp}_dp{dp}"
    figures: dict[str, list[float]] = {k: [] for k in ("ours", "ours_stall", "dcp", "dcp_async_stall", "dcp_async")}
    for i in range(repeat):
        ours = out / f"ours_{i}"
        if rank == 0:
            for sub in ("model", "optim", "rng", "done"):
                (ours / sub).mkdir(parents=True, exist_ok=True)
        dist.barrier()
        tensors = [*snap.params.values(), *snap.optim.values()]
        figures["ours_stall"].append(timed(partial(host_copies, tensors)))
        figures["ours"].append(timed(partial(snap.write, ours, coord, rank)))
        sync_writer = dcp.FileSystemWriter(str(out / f"dcp_{i}"))
        figures["dcp"].append(timed(partial(dcp.save, state, storage_writer=sync_writer)))
        fut: list = []
        t_start = time.perf_counter()
        writer = dcp.FileSystemWriter(str(out / f"dcpa_{i}"))
        figures["dcp_async_stall"].append(timed(partial(start_async, fut, state, writer, async_group)))
        fut[0].result()
        t = torch.tensor([time.perf_counter() - t_start])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        figures["dcp_async"].append(t.item())
        dist.barrier()
        if i < repeat - 1 and rank == 0:  # keep the last round's files for the sizes and the load
            for d in ("ours", "dcp", "dcpa"):
                shutil.rmtree(out / f"{d}_{i}")
        dist.barrier()

    last = repeat - 1
    ours_bytes = sum(
        f.stat().st_size for sub in ("model", "optim") for f in [out / f"ours_{last}" / sub / f"{coord}.safetensors"]
    )
    dcp_bytes = sum(f.stat().st_size for f in (out / f"dcp_{last}").glob(f"__{rank}_*.distcp"))
    sizes = torch.tensor([float(ours_bytes), float(dcp_bytes)])
    gathered = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(gathered, sizes)
    builds = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(builds, torch.tensor([build]))

    del state, snap, tensors, fut  # free the save state before the loads (8 ranks share the host's memory)
    # load under dp1: each coordinate whole, as plain tensors, on the coordinate's dp rank 0, no collective
    load_ok, t_dcp_load, t_ours_load = True, 0.0, 0.0
    if dp == 0:
        target = {}
        for kind in ("model", "optim"):
            for name, entry in index_union(ckpt, kind, pp, tp).items():
                for k in entry["keys"]:
                    target[f"pp{pp}.tp{tp}.{name}.{k}"] = torch.zeros(_numel(ckpt, kind, pp, tp, name))
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(out / f"dcp_{last}")), no_dist=True)
        t_dcp_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        read = coordinate_reader(ckpt, meta)
        model, optim = read("model", pp, tp), read("optim", pp, tp)
        t_ours_load = time.perf_counter() - t0
        for name, p in model["params"].items():
            load_ok &= torch.equal(target[f"pp{pp}.tp{tp}.{name}.param"], p.reshape(-1))
        for name, states in optim.items():
            for k, v in states.items():
                load_ok &= torch.equal(target[f"pp{pp}.tp{tp}.{name}.{k}"], v.reshape(-1))
    res = torch.tensor([float(load_ok), t_dcp_load, t_ours_load])
    loads = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(loads, res)

    if rank == 0:
        med = {k: statistics.median(v) for k, v in figures.items()}
        print(f"ranks {world} ({', '.join(f'pp{p}_tp{t}_dp{d}' for p, t, d in all_coords)}); {repeat} rounds, medians")
        for label, key in (
            ("ours  sync save (write+fsync)", "ours"),
            ("ours  async stall (host copy)", "ours_stall"),
            ("DCP   save (FileSystemWriter)", "dcp"),
            ("DCP   async_save stall       ", "dcp_async_stall"),
            ("DCP   async_save until done  ", "dcp_async"),
        ):
            print(f"{label}: {med[key]:.2f} s  (rounds {', '.join(f'{x:.2f}' for x in figures[key])})")
        for j, who in ((0, "ours"), (1, "DCP ")):
            b = [g[j].item() for g in gathered]
            print(
                f"bytes per rank {who}: max {max(b) / 1e6:.1f} MB, mean {statistics.mean(b) / 1e6:.1f} MB, "
                f"max/mean {max(b) / statistics.mean(b):.2f}"
            )
        print(f"DCP metadata file: {(out / f'dcp_{last}' / '.metadata').stat().st_size / 1e3:.0f} kB (rank 0)")
        print(f"building the ShardedTensors (not in the save times): max {max(b.item() for b in builds):.2f} s")
        ok = all(x[0].item() for x in loads)
        lt = [x for x in loads if x[1].item() > 0]
        print(
            f"load under dp1 (same pp/tp) with DCP's resharding: {'identical to our joiner' if ok else 'DIFFERS'}; "
            f"per coordinate DCP {statistics.mean(x[1].item() for x in lt):.2f} s, "
            f"ours {statistics.mean(x[2].item() for x in lt):.2f} s"
        )
        print("load under another tp / pp: not expressible in DCP's keys here (needs reshard.py either way)")
        print(f"load average now {os.getloadavg()[0]:.1f}")
    dist.barrier()
    dist.destroy_process_group()


def compare(checkpoint: Path, repeat: int, port: int, out: Path | None) -> None:
    """Every rank of ``checkpoint`` (a p3d-checkpoint-2 step directory) as a gloo process: the saves and loads timed,
    printed by rank 0."""
    ckpt = checkpoint.resolve()
    world = len(coords(ckpt))
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {ckpt}", flush=True)
    with tempfile.TemporaryDirectory(prefix="p3d-bench-dcp-", dir=out or ckpt.parent) as tmp:
        mp.spawn(worker, args=(world, ckpt, Path(tmp), repeat, port), nprocs=world)
