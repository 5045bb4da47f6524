"""Checkpoints (issue 14): training time lost per save, sync against ``train.async_save``, and bytes written per rank;
our writer against torch.distributed.checkpoint (DCP) on the same per-rank state.

    .venv/bin/python bench/checkpoint.py save                  # model=small on dp2_pp2_tp2, ZeRO-1
    .venv/bin/python bench/checkpoint.py save --steps 12 --save-every 3 --set model.seq_len=64
    .venv/bin/python bench/checkpoint.py save --keep /tmp/i14/small_ckpt   # and keep the sync run's last checkpoint
    .venv/bin/python bench/checkpoint.py dcp <run.dir>/checkpoints/step_<N>   # a p3d-checkpoint-2 step

- ``save``: the real ``p3d-train`` sync and async, the time each save blocks training, bytes per rank;
- ``dcp``: every rank of a checkpoint saves its state with our writer and with DCP (sync and async), then loads it
  under dp1 with each (the code: bench/_dcp.py).
``bench/checkpoint.py <command> --help`` says how each measures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import add_command, bench_parser, run_command  # noqa: E402


def run(mode_async: bool, args, run_dir: Path) -> dict:
    cmd = [
        sys.executable, "-m", "p3d.cli", f"run.dir={run_dir}", f"model={args.model}", f"mesh={args.mesh}",
        f"zero={args.zero}", f"train.steps={args.steps}", f"train.save_every={args.save_every}", "train.keep_last=1",
        f"train.async_save={'true' if mode_async else 'false'}", *args.set,
    ]  # fmt: skip
    stamps: dict[int, float] = {}
    metrics = run_dir / "metrics.jsonl"
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = 0
    while proc.poll() is None or seen < args.steps:
        if metrics.exists():
            lines = metrics.read_text().splitlines()
            now = time.monotonic()
            for line in lines[seen:]:
                try:
                    stamps[json.loads(line)["step"]] = now
                except ValueError:
                    break
                seen += 1
        if proc.poll() is not None and (not metrics.exists() or seen >= len(metrics.read_text().splitlines())):
            break
        time.sleep(0.005)
    out = proc.communicate()[0]
    if proc.returncode != 0:
        sys.exit(f"p3d-train failed ({proc.returncode}):\n{out[-3000:]}")
    wall = time.monotonic() - t0
    saves = {s for s in range(1, args.steps) if s % args.save_every == 0}
    gaps = {s: stamps[s + 1] - stamps[s] for s in range(1, args.steps) if s in stamps and s + 1 in stamps}
    plain = [g for s, g in gaps.items() if s not in saves and s > args.warmup]
    median = statistics.median(plain)
    lost = [gaps[s] - median for s in sorted(saves) if s in gaps]
    ckpt = max((run_dir / "checkpoints").glob("step_*"))
    per_rank = [sum(json.loads(f.read_text()).values()) for f in sorted((ckpt / "done").glob("rank*.json"))]
    if args.keep and not mode_async:  # the sync run's last checkpoint, e.g. for bench/checkpoint.py dcp
        shutil.move(ckpt, args.keep)
    return {
        "median_step_s": median,
        "plain_steps_s": plain,
        "lost_per_save_s": lost,
        "bytes_per_rank": per_rank,
        "wall_s": wall,
    }


def save(args) -> int:
    """Training time lost per checkpoint save, sync vs ``train.async_save``, and bytes written per rank (issue 14).

    Each mode runs the real ``p3d-train`` (run directory in a temp dir) with the same config; the bench
    polls ``metrics.jsonl`` every 5 ms and stamps the wall time at which each step's record appears. The
    interval between two records is one step plus whatever blocked the loop after the earlier one: a
    save, when that step saved. Time lost per save = the interval after a saving step minus the median
    interval after non-saving steps (the first ``--warmup`` intervals dropped). With ``async_save`` the
    loss is the host copy at the step boundary plus any slowdown of the next step by the background
    write; the write itself is what the sync mode loses. Bytes per rank come from the last checkpoint's
    manifests (``done/rank<r>.json``). Targets (issue 14): async loss <= 10% of the sync save's; max/mean
    bytes per rank <= 1.5 with ZeRO-1. Quote the machine's load (printed) with the figures.
    """
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="p3d-bench-ckpt-") as tmp:
        for mode in (False, True):
            name = "async" if mode else "sync"
            results[name] = run(mode, args, Path(tmp) / name)
            r = results[name]
            b = r["bytes_per_rank"]
            print(
                f"{name:5s}: median step {r['median_step_s']:.2f} s (steps without a save: "
                f"{min(r['plain_steps_s']):.2f} to {max(r['plain_steps_s']):.2f} s); lost per save "
                f"{', '.join(f'{x:.2f}' for x in r['lost_per_save_s'])} s (mean "
                f"{statistics.mean(r['lost_per_save_s']):.2f} s); bytes per rank max {max(b) / 1e6:.1f} MB, "
                f"mean {statistics.mean(b) / 1e6:.1f} MB, max/mean {max(b) / statistics.mean(b):.2f}; "
                f"wall {r['wall_s']:.0f} s; load average now {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    ratio = statistics.mean(results["async"]["lost_per_save_s"]) / statistics.mean(results["sync"]["lost_per_save_s"])
    print(f"async loss / sync loss per save: {ratio:.1%} (target <= 10%)")
    if args.json:
        options = {k: v for k, v in vars(args).items() if k != "command"}
        args.json.write_text(json.dumps({"args": options, **results}, indent=1, default=str))
    return 0


def dcp(args) -> int:
    """Our checkpoint writer against torch.distributed.checkpoint (DCP) on the same per-rank state (issue 14).

    The state is a real run's: each of the checkpoint's ranks (one per (pp, tp, dp) file, 8 for
    dp2_pp2_tp2) is started as a gloo process on CPU and reads its own ``model/`` and ``optim/`` files back:
    its 1/dp of the coordinate's parameters and its ZeRO fragments of master / exp_avg / exp_avg_sq, each a
    range of a flattened parameter. Every rank then saves that same state, timed as max over ranks after a
    barrier, ``--repeat`` times each:

    - ours: ``p3d.checkpoint.snapshot.Snapshot.write`` (two safetensors files + JSON, fsync'd, manifest);
    - DCP ``save`` with ``FileSystemWriter`` (fsync on). A fragment is a 1-D ``ShardedTensor`` of the
      flattened parameter of its (pp, tp) coordinate, sharded over the coordinate's dp group at the
      fragment's offset: DTensor ``Shard(0)`` cannot express ZeRO's arbitrary offsets;
    - DCP ``async_save`` (thread, default stager): the stall is the time until it returns; the write
      finishes in the background (its total is printed too). Our async stall is the host copy
      (``p3d.checkpoint.snapshot._host`` of every tensor), which is what ``train.async_save`` blocks training for.

    Then the DCP checkpoint is loaded under another layout: dp1 (each (pp, tp) coordinate whole, as plain
    tensors) with DCP's own resharding planner, and compared with our joiner (``coordinate_reader``) on
    our files. tp / pp changes are not expressible in DCP's keys here (a fragment of a flattened tp shard
    is not a block of the logical tensor); they need ``reshard.py`` either way. A checkpoint to use:
    ``bench/checkpoint.py save --keep <dir>`` (step 13 of ``--steps 13 --save-every 4`` for the docs' figures).
    """
    from bench._dcp import compare

    compare(args.checkpoint, args.repeat, args.port, args.out)
    return 0


def parser() -> argparse.ArgumentParser:
    ap, commands = bench_parser(__doc__)
    p = add_command(commands, save)
    p.add_argument("--model", default="small")
    p.add_argument("--mesh", default="dp2_pp2_tp2")
    p.add_argument("--zero", default="stage1")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--set", nargs="*", default=["model.seq_len=64", "schedule.global_batch_size=8", "schedule.micro_batch_size=2"]
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--keep", type=Path, help="move the sync run's last checkpoint here (it must not exist)")

    p = add_command(commands, dcp)
    p.add_argument("checkpoint", type=Path, help="a p3d-checkpoint-2 step directory")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--port", type=int, default=29731)
    p.add_argument("--out", type=Path, default=None, help="where to write (default: a temp dir next to it)")
    return ap


if __name__ == "__main__":
    sys.exit(run_command(parser()))
