"""Sequence parallelism x recompute on model=small, tp2: activation memory (RSS) and tokens/s.

    .venv/bin/python bench/sp_recompute.py                    # seq_len 256, 3 timed rounds
    .venv/bin/python bench/sp_recompute.py --seq-len 512 --rounds 5

Two gloo processes (one thread each) form the tp group. Each builds the six models, SP off/on x
recompute none/selective/full, from the same seed with p3d's own layers (``build_layer_specs``, what a
pipeline stage holds; ``full`` checkpoints each block with ``torch.utils.checkpoint``, saving its input
as DeepSpeed's activation checkpointing does), then trains them in turn, one step each per round, so the
machine's load hits every configuration alike. Per step it measures:

- activation bytes: every tensor autograd saves for backward during the forward pass and the loss
  (``torch.autograd.graph.saved_tensors_hooks``, once per storage, parameters left out), the figure the
  planner models (``p3d.planner.memory``: blocks, embedding, final norm and head of one micro batch on one
  stage holding every layer, its ``activation_bytes``), printed next to it with both factors SP off / on;
- RSS fwd: the process RSS after the forward pass and the loss minus the RSS before it (can differ from
  the saved bytes: glibc may hand out freed heap memory again, and transient buffers count);
- peak: the highest RSS a sampling thread (every 2 ms) sees during the step, minus the RSS before it
  (the step's weight gradients included: they are freed after each step);
- tokens/s: micro_batch x seq_len / step wall time, and per CPU second of the worker process (steadier
  on a shared machine: time spent waiting for a core does not count); medians over the rounds, the
  first one left out.

The six models share one copy of the parameters (SP and recompute change none).

The workers run with glibc's ``MALLOC_MMAP_THRESHOLD_=65536`` (buffers above 64 KB their own mappings,
unmapped when freed), so RSS falls back between steps.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import SavedTensors, composed, rss_bytes

TP = 2
CONFIGS = [(sp, rc) for rc in ("none", "selective", "full") for sp in (False, True)]


class PeakRSS:
    """The highest RSS seen by a thread polling /proc/self/statm while the block runs."""

    def __enter__(self):
        self.peak, self._stop = rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def _overrides(args, sp: bool, rc: str) -> list[str]:
    return [
        "model=small",
        f"mesh=tp{TP}",
        f"model.seq_len={args.seq_len}",
        f"schedule.micro_batch_size={args.micro_batch}",
        f"schedule.global_batch_size={args.micro_batch}",
        f"schedule.sequence_parallel={str(sp).lower()}",
        f"schedule.recompute={rc}",
        "run.dir=/tmp/p3d-bench-sp",
    ]


def _worker(rank: int, args, store: str, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint

    from p3d.model.llama import TransformerBlock
    from p3d.parallel.mesh import Mesh
    from p3d.pipeline.specs import SequentialModel, VocabParallelLoss, build_layer_specs

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=TP, timeout=datetime.timedelta(seconds=1800)
    )
    cfg, plan = composed(_overrides(args, False, "none"))
    mesh = Mesh(tp=TP, pp=1, dp=1, rank=rank, tp_group=dist.group.WORLD)
    models = {}
    for sp, rc in CONFIGS:
        torch.manual_seed(cfg.train.seed)
        specs = build_layer_specs(
            cfg.model,
            plan.padded_vocab_size,
            mesh,
            cfg.train.seed,
            sequence_parallel=sp,
            recompute_attention=rc == "selective",
        )
        model = SequentialModel(specs, VocabParallelLoss(cfg.model, plan.padded_vocab_size, mesh))
        if models:  # the same parameters (SP and recompute change none): one copy of the weights in memory
            model.load_state_dict(next(iter(models.values())).state_dict(), assign=True)
        models[(sp, rc)] = model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (args.micro_batch, args.seq_len + 1), generator=g)
    inputs, labels = ids[:, :-1], ids[:, 1:]

    def step(model, full: bool) -> tuple[float, int, int, int, float]:
        model.zero_grad(set_to_none=True)  # the step's weight gradients count in its peak
        saved = SavedTensors(model.parameters())
        before = rss_bytes()
        t0, c0 = time.perf_counter(), time.process_time()
        with PeakRSS() as peak:
            with saved:
                x = inputs
                for layer, f in zip(model.layers, model._funcs):
                    full_block = full and isinstance(layer, TransformerBlock)
                    x = checkpoint(f, x, use_reentrant=False) if full_block else f(x)
                loss = model.loss_fn(x, labels)
            held = rss_bytes() - before
            del x
            loss.backward()
        cpu = time.process_time() - c0
        return time.perf_counter() - t0, saved.total, held, peak.peak - before, cpu

    for r in range(args.rounds + 1):
        for sp, rc in CONFIGS:
            dist.barrier()
            queue.put((rank, r, sp, rc, *step(models[(sp, rc)], rc == "full")))
        if rank == 0:
            print(f"round {r} done at {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
    dist.destroy_process_group()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds after one left out")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    import torch.multiprocessing as mp

    from p3d.config.schema import Recompute
    from p3d.planner.memory import stage_memory
    from p3d.planner.shapes import Layout

    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned workers' glibc
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, args, os.path.join(tmp, "store"), queue)) for r in range(TP)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            print(f"a worker failed: exit codes {[p.exitcode for p in procs]}", file=sys.stderr)
            return 1
    rows = []
    while not queue.empty():
        rows.append(queue.get())

    planned = {}
    for sp, rc in CONFIGS:
        cfg, _ = composed(_overrides(args, sp, rc))
        assert cfg.schedule.recompute == Recompute(rc)
        stage = stage_memory(cfg, Layout(TP, 1, 1, args.micro_batch, 1))[0]
        planned[(sp, rc)] = stage.activation_bytes

    def med(key, col: int, rank: int = 0) -> float:  # rank 0's figures; round 0 left out
        return statistics.median(row[col] for row in rows if (row[2], row[3]) == key and row[0] == rank and row[1])

    load = os.getloadavg()
    mb = 2**20
    print(
        f"model=small tp{TP}, micro batch {args.micro_batch} x seq {args.seq_len}, fp32, {args.rounds} rounds "
        f"(medians, rank 0); load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores"
    )
    print(
        f"{'recompute':<10} {'SP':<4} {'tokens/s':>9} {'tok/CPU s':>9} {'saved MiB':>9} {'plan MiB':>9} "
        f"{'RSS fwd':>8} {'peak MiB':>9}"
    )
    for sp, rc in CONFIGS:
        seconds, saved, held, peak, cpu = (med((sp, rc), c) for c in (4, 5, 6, 7, 8))
        tokens = args.micro_batch * args.seq_len
        print(
            f"{rc:<10} {'on' if sp else 'off':<4} {tokens / seconds:>9.1f} {tokens / cpu:>9.1f} {saved / mb:>9.2f} "
            f"{planned[(sp, rc)] / mb:>9.2f} {held / mb:>8.1f} {peak / mb:>9.1f}"
        )
    print("activation bytes SP off / SP on: measured (planned)")
    for rc in ("none", "selective", "full"):
        measured = med((False, rc), 5) / med((True, rc), 5)
        print(f"  {rc:<10} {measured:.3f} ({planned[(False, rc)] / planned[(True, rc)]:.3f})")
    for col, what in ((4, "tokens/s"), (8, "tokens per CPU second")):
        ratio = med((True, "none"), col) / med((True, "selective"), col)
        print(f"{what} of selective recompute with SP, against none with SP: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
