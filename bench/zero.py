"""ZeRO stages 0-3 on dp2_pp2 and dp4 (4 processes): tokens/s, model-state bytes per rank, dp_comm_s (issue 33).

    .venv/bin/python bench/zero.py                                   # model=small, s = 256, 8 sequences a step
    .venv/bin/python bench/zero.py --meshes dp4 --steps 5 --set model.seq_len=512

Each (mesh, stage) runs in its own 4 gloo worker processes, built as p3d-train builds them
(``p3d.train.executors.build_executor``: stages 0 and 1 run on DeepSpeed's 1f1b engine, 2 and 3 on torch's
Schedule1F1B with FSDP2), on the same seeded init and data. The stages take turns, and a second pass runs them in
the reverse order, so that a slow spell of the machine does not fall on one stage only.
- tokens/s: the global batch's tokens over the wall time of ``train_batch``, median of the steps after the first
  of each pass (the slowest rank sets a step's time: every rank's step ends in the same collectives).
- model-state bytes per rank: every tensor the module and the optimizer hold (parameters, gradients, Adam moments,
  DeepSpeed's fp32 partitions and flat buffers; a sharded tensor's local piece), each storage once, counted as
  the last step's optimizer step starts (gradients reduced, moments allocated); the largest rank. Beside it
  ``p3d-plan``'s figure for the same run (parameters + gradients + optimizer of its most loaded stage).
- dp_comm_s: seconds of the step blocked in dp collectives (``metrics.jsonl``'s dp_comm_exposed_s: mean over ranks),
  median.
Targets (issue 33): stage 2 within 10% of stage 1's tokens/s, stage 3 within 25%; on dp4, stage 3's model-state
bytes per rank at most 0.55 of stage 1's. The machine's load is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import load_average, replica_batches, run_workers, start_worker, turns  # noqa: E402

BENCH = ("model=small", "model.seq_len=256", "schedule.micro_batch_size=1", "schedule.global_batch_size=8")
STAGES = (0, 1, 2, 3)
WORLD = 4
HOLDERS = ("torch", "deepspeed", "p3d")  # the modules whose objects' tensors held_bytes follows


def held_bytes(module, optimizer) -> int:
    """Bytes of every distinct storage the module's parameters and gradients and the optimizer's tensors use."""
    import torch
    import torch.nn as nn

    from p3d.parallel.zero.fsdp import local

    storages: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        storage = local(t).untyped_storage()
        if storage.data_ptr():
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())

    def walk(obj, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            add(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, depth)
        elif depth < 4 and not isinstance(obj, nn.Module) and type(obj).__module__.startswith(HOLDERS):
            for v in getattr(obj, "__dict__", {}).values():  # an optimizer, its inner optimizer, its param groups
                walk(v, depth + 1)

    for p in module.parameters():
        add(p)
        if p.grad is not None:
            add(p.grad)
    walk(optimizer, 0)
    return sum(storages.values())


def _worker(rank: int, world: int, overrides: list[str], steps: int, out_path: str) -> None:
    import warnings

    import torch

    from p3d.train.executors import build_executor
    from p3d.train.loop import Stopper, step_stats

    warnings.filterwarnings("ignore", message="Seems like `optimizer.step()` has been overridden")  # ours, counting
    cfg, plan, mesh = start_worker(rank, [*overrides, f"train.steps={steps}"], 600)
    device = torch.device("cpu")
    with tempfile.TemporaryDirectory(prefix=f"p3d-bench-zero-{rank}-") as tmp:
        ex = build_executor(cfg, plan, mesh, rank, device, tmp)
        optimizer = ex.engine.optimizer if hasattr(ex, "engine") else ex.pipe.optimizer
        counted: list[int] = []
        step_fn = optimizer.step

        def counting_step(*args, **kwargs):
            counted.append(held_bytes(ex.module, optimizer))
            return step_fn(*args, **kwargs)

        optimizer.step = counting_step
        data = replica_batches(cfg, plan.dp, mesh.dp_rank)
        rows = []
        for _ in range(steps):
            t0 = time.perf_counter()
            ex.train_batch(data if ex.reads_data else None)
            step_time = time.perf_counter() - t0
            times = torch.tensor([step_time])
            torch.distributed.all_reduce(times, op=torch.distributed.ReduceOp.MAX)  # the slowest rank's step
            ex.timer.take()
            _, _, _, _, comm = step_stats(Stopper(), 0.0, ex.timer.take_compute(), ex.timer.take_comm(["dp"]),
                                          device, None)  # fmt: skip
            rows.append((float(times), comm["dp_comm_exposed_s"]))
        held = torch.tensor([float(counted[-1])])
        torch.distributed.all_reduce(held, op=torch.distributed.ReduceOp.MAX)
    if rank == 0:
        tokens = cfg.schedule.global_batch_size * cfg.model.seq_len
        Path(out_path).write_text(json.dumps({"tokens": tokens, "rows": rows, "held": float(held)}))


def planned_bytes(overrides: list[str]) -> float:
    from p3d.planner.search import predict
    from tests.helpers.runs import typed

    cfg, plan = typed(*overrides)
    return max(s.params_bytes + s.grads_bytes + s.optimizer_bytes for s in predict(cfg, plan).stages)


def one(mesh: str, stage: int, args) -> dict:
    overrides = [f"mesh={mesh}", f"zero=stage{stage}", "train.save_every=0", *args.set]
    result = run_workers(_worker, WORLD, overrides, args.steps, timeout=3600)
    result["planned"] = planned_bytes(overrides)
    return result


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--meshes", nargs="+", default=["dp2_pp2", "dp4"])
    ap.add_argument("--steps", type=int, default=4, help="steps per run; the first is dropped")
    ap.add_argument("--passes", type=int, default=2, help="passes over the stages, every other one reversed")
    ap.add_argument("--set", nargs="*", default=None, help=f"overrides (default: {' '.join(BENCH)})")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.set = list(BENCH if args.set is None else args.set)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results: dict[tuple[str, int], list[dict]] = {}
    for mesh in args.meshes:
        for n, stage in turns(STAGES, args.passes):
            results.setdefault((mesh, stage), []).append(one(mesh, stage, args))
            print(f"{mesh} zero=stage{stage}: pass {n + 1} of {args.passes} done", file=sys.stderr, flush=True)
    print(f"{' '.join(args.set)}, {WORLD} processes, {args.passes} passes x {args.steps} steps (first dropped); "
          f"load average {load_average()}")  # fmt: skip
    print(f"{'mesh':<8} {'zero':>4} {'tokens/s':>9} {'vs st1':>7} {'state MB/rank':>13} {'vs st1':>7} "
          f"{'planned MB':>10} {'dp_comm_s':>9} {'step s':>7}")  # fmt: skip
    for mesh in args.meshes:
        summary = {}
        for stage in STAGES:
            runs = results[(mesh, stage)]
            rows = [row for r in runs for row in r["rows"][1:]]
            step = statistics.median(t for t, _ in rows)
            summary[stage] = dict(
                tok=runs[0]["tokens"] / step, step=step, comm=statistics.median(c for _, c in rows),
                held=max(r["held"] for r in runs), planned=runs[0]["planned"],
            )  # fmt: skip
        for stage, f in summary.items():
            print(f"{mesh:<8} {stage:>4} {f['tok']:>9,.0f} {f['tok'] / summary[1]['tok']:>6.2f}x "
                  f"{f['held'] / 1e6:>13,.1f} {f['held'] / summary[1]['held']:>6.2f}x {f['planned'] / 1e6:>10,.1f} "
                  f"{f['comm']:>9.3f} {f['step']:>7.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
