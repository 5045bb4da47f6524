"""Checkpoint files in-process: dp fragments join to the unsharded tensor, RNG states survive JSON, every
dp rank writes an even part, and a pickle is refused without running it."""

from __future__ import annotations

import json
import pickle
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from p3d.checkpoint.files import CheckpointError, CheckpointSaveError, coordinate_reader, read_tensors, write_tensors
from p3d.checkpoint.snapshot import HostBuffers, collect_manifests, dp_slices, rng_state, set_rng_state


def _write_fragments(ckpt: Path, full: dict[str, torch.Tensor], cuts: list[int]) -> None:
    """Every tensor flattened and cut at ``cuts`` (offsets into the concatenation, as ZeRO-1 cuts its
    flat group), one file per dp rank, as ckpt_save.Snapshot writes them."""
    (ckpt / "optim").mkdir(parents=True)
    flat = torch.cat([t.reshape(-1) for t in full.values()])
    bounds = [0, *cuts, flat.numel()]
    offsets, at = {}, 0
    for name, t in full.items():
        offsets[name] = (at, t.numel())
        at += t.numel()
    for d in range(len(bounds) - 1):
        lo, hi = bounds[d], bounds[d + 1]
        tensors, index = {}, {}
        for name, (start, numel) in offsets.items():
            a, b = max(lo, start), min(hi, start + numel)
            if a < b:
                for k, scale in (("master", 1.0), ("exp_avg", 2.0), ("exp_avg_sq", 3.0)):
                    tensors[f"{name}/{k}"] = (flat[a:b] * scale).clone()
                index[name] = {
                    "start": a - start,
                    "shape": list(full[name].shape),
                    "keys": ["exp_avg", "exp_avg_sq", "master"],
                }
        write_tensors(ckpt / "optim" / f"pp0_tp0_dp{d}.safetensors", tensors, index)


def test_dp_fragments_matches_unsharded(tmp_path):
    torch.manual_seed(0)
    full = {"0.w": torch.randn(5, 7), "1.b": torch.randn(3), "2.w": torch.randn(4, 6)}
    _write_fragments(tmp_path, full, cuts=[9, 40])  # rank 0: part of 0.w; rank 1: the rest, 1.b, part of 2.w
    got = coordinate_reader(tmp_path, {"format": "p3d-checkpoint-2", "mesh": {"dp": 3}})("optim", 0, 0)
    assert got.keys() == full.keys()
    for name, t in full.items():
        assert torch.equal(got[name]["master"], t)
        assert torch.equal(got[name]["exp_avg"], t * 2) and torch.equal(got[name]["exp_avg_sq"], t * 3)


def test_a_missing_fragment_is_named(tmp_path):
    full = {"0.w": torch.randn(5, 7)}
    _write_fragments(tmp_path, full, cuts=[10])
    read = coordinate_reader(tmp_path, {"format": "p3d-checkpoint-2", "mesh": {"dp": 2}})
    (tmp_path / "optim" / "pp0_tp0_dp1.safetensors").unlink()
    with pytest.raises(CheckpointError, match="pp0_tp0_dp1.safetensors cannot be read"):
        read("optim", 0, 0)
    write_tensors(tmp_path / "optim" / "pp0_tp0_dp1.safetensors", {}, {})  # present but empty
    with pytest.raises(CheckpointError, match="cover 10 of 35 values"):
        read("optim", 0, 0)


class _CreatesAFile:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_is_refused_without_running_it(tmp_path):
    f, marker = tmp_path / "x.safetensors", tmp_path / "marker"
    f.write_bytes(pickle.dumps({"w": _CreatesAFile(marker)}))
    with pytest.raises(CheckpointError, match=f"checkpoint file {f} cannot be read"):
        read_tensors(f)
    assert not marker.exists()


def test_rng_states_survive_json():
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    state = json.loads(json.dumps(rng_state()))
    first = (random.random(), np.random.rand(), torch.rand(2))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    set_rng_state(state)
    again = (random.random(), np.random.rand(), torch.rand(2))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])


def test_every_dp_rank_writes_an_even_part_of_every_coordinate():
    numels = [50304 * 768, *([768 * 2304, 768 * 768, 768 * 4096, 2048 * 768, 768, 768] * 6)]
    for dp in (1, 2, 3, 4):
        parts = [dp_slices(numels, dp, d) for d in range(dp)]
        written = [sum(n for _, n in p) for p in parts]
        assert max(written) - min(written) <= 1, written  # max/mean bytes per rank 1.0
        for i, n in enumerate(numels):  # each tensor's parts tile it exactly, in dp-rank order
            pieces = [p[i] for p in parts if p[i][1]]
            assert pieces[0][0] == 0 and sum(k for _, k in pieces) == n
            assert all(a[0] + a[1] == b[0] for a, b in zip(pieces, pieces[1:]))


def test_host_copies_of_cpu_tensors_do_not_follow_training():
    """On CPU the snapshot's copies are plain copies: training's in-place updates after the step
    boundary do not reach them, and they are cast as asked."""
    host = HostBuffers()
    master, moment = torch.arange(6, dtype=torch.float32), torch.ones(4, dtype=torch.bfloat16)
    a, b = host.copy("optim/w/master", master[1:5]), host.copy("optim/w/exp_avg", moment, torch.float32)
    host.ready()
    master.add_(100.0)
    moment.mul_(3)
    assert torch.equal(a, torch.arange(1, 5, dtype=torch.float32))
    assert b.dtype == torch.float32 and torch.equal(b, torch.ones(4))
    assert a.data_ptr() != host.copy("optim/w/master", master[1:5]).data_ptr()  # a new copy each save


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned path needs CUDA (not run on CPU)")
def test_host_copies_from_cuda_go_to_pinned_buffers_reused_across_saves():
    host = HostBuffers()
    t = torch.arange(8, dtype=torch.bfloat16, device="cuda")
    first = host.copy("optim/w/master", t, torch.float32)
    host.ready()
    assert first.is_pinned() and torch.equal(first, torch.arange(8, dtype=torch.float32))
    t.add_(1)
    second = host.copy("optim/w/master", t, torch.float32)
    host.ready()
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, torch.arange(1, 9, dtype=torch.float32))


def test_rank_0_stops_waiting_for_a_rank_that_never_writes_its_manifest(tmp_path):
    """A rank that died without writing ``.failed``: rank 0's commit gives up after its bound, in one
    line naming the missing rank, instead of waiting on."""
    (tmp_path / "done").mkdir()
    (tmp_path / "model.bin").write_bytes(b"x" * 3)
    (tmp_path / "done" / "rank0.json").write_text(json.dumps({"model.bin": 3}))
    t0 = time.monotonic()
    with pytest.raises(CheckpointSaveError, match=r"ranks \[1\] wrote no manifest within 0 s") as err:
        collect_manifests(tmp_path, 2, timeout_s=0.2)
    assert time.monotonic() - t0 < 5 and "\n" not in str(err.value)
    (tmp_path / "done" / "rank1.json").write_text(json.dumps({}))
    sizes = {f"done/rank{r}.json": (tmp_path / "done" / f"rank{r}.json").stat().st_size for r in (0, 1)}
    assert collect_manifests(tmp_path, 2, timeout_s=0.2) == {"model.bin": 3, **sizes}
