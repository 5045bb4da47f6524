"""Context parallelism on CPU: tokens/s and saved activation bytes per rank, cp1 against cp2 (issue 35).

    .venv/bin/python bench/cp.py                                   # model=small, seq_len 2048
    .venv/bin/python bench/cp.py --steps 4 --passes 2 --set model=small model.seq_len=1024

Three layouts of the same run (micro batch 1, global batch 2, fp32), each in its own gloo worker processes (one
thread each), built as p3d-train builds them and all on the torch executor (torch's Schedule1F1B, which cp needs),
on the same seeded init and data:
- ``single``: cp1 on one process, the whole 2048-token sequences;
- ``dp2``: cp1 on two processes, one sequence each (what two processes do without cp: the throughput ceiling);
- ``cp2``: two processes splitting every sequence, 1024 tokens each (chunks r and 3 - r of 4).
Per layout:
- tokens/s: the global batch's tokens over the slowest rank's ``train_batch`` wall time, median of the steps after
  the first of each pass (the layouts take turns, every other pass reversed, so a slow spell of the machine does not
  fall on one layout only);
- saved MB/rank: every tensor autograd saves for backward during one micro batch's forward and loss on a rank
  (``torch.autograd.graph.saved_tensors_hooks``, once per storage, parameters left out), beside the planner's
  figure for it (``p3d.planner.memory.stage_memory``: ``activation_bytes`` of the stage, which holds every layer);
- attention MB: the same count over the attention modules only.
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

BENCH = ("model=small", "model.seq_len=2048", "schedule.micro_batch_size=1", "schedule.global_batch_size=2")
LAYOUTS = {"single": (1, ["mesh=single"]), "dp2": (2, ["mesh=dp2"]), "cp2": (2, ["mesh=single", "mesh.cp=2"])}


def saved_bytes(pipe, ids, labels) -> tuple[int, int]:
    """(whole stage, attention only): bytes autograd keeps for one micro batch's forward and loss on this rank."""
    import torch

    from p3d.model.attention import Attention
    from p3d.parallel.pipeline.specs import VocabParallelLoss

    params = {p.untyped_storage().data_ptr() for p in pipe.module.parameters()}
    held: dict[int, int] = {}
    attention: dict[int, int] = {}
    inside = [False]

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            held.setdefault(storage.data_ptr(), storage.nbytes())
            if inside[0]:
                attention.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    for module in pipe.module.modules():
        if isinstance(module, Attention):
            module.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
            module.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    loss_fn = VocabParallelLoss(pipe.cfg.model, pipe.plan.padded_vocab_size, pipe.mesh)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(pipe.chunks[0](pipe.local_tokens(ids)), pipe.local_tokens(labels))
    loss.backward()  # the cp backward's collectives pair up on both ranks
    pipe.optimizer.zero_grad(set_to_none=True)
    return sum(held.values()), sum(attention.values())


def _worker(rank: int, world: int, overrides: list[str], steps: int, out_path: str) -> None:
    import datetime

    import deepspeed
    import torch
    import torch.distributed as dist

    from p3d.data.loader import micro_batches
    from p3d.parallel.mesh import Mesh
    from p3d.train.executors.torch_schedules import TorchExecutor
    from p3d.train.worker import set_up_cpu_worker
    from tests.helpers.runs import typed

    set_up_cpu_worker()
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=1800))
    cfg, plan = typed(*overrides, f"train.steps={steps}")
    mesh = Mesh.from_plan(plan, rank).with_groups()
    with tempfile.TemporaryDirectory(prefix=f"p3d-bench-cp-{rank}-") as tmp:
        ex = TorchExecutor(cfg, plan, mesh, rank, torch.device("cpu"), tmp)
        s = cfg.schedule
        data = micro_batches(cfg.data, cfg.model.seq_len, s.global_batch_size, s.micro_batch_size, plan.dp,
                             mesh.dp_rank, cfg.train.seed, 0, None)  # fmt: skip
        ids, labels = next(data)
        saved = saved_bytes(ex.pipe, ids, labels)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            ex.train_batch(data)
            slowest = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times.append(float(slowest))
    if rank == 0:
        from p3d.planner.memory import stage_memory
        from p3d.planner.shapes import layout_of

        planned = stage_memory(cfg, layout_of(cfg))[0].activation_bytes
        tokens = cfg.schedule.global_batch_size * cfg.model.seq_len
        Path(out_path).write_text(json.dumps({"tokens": tokens, "times": times, "saved": saved, "planned": planned}))


def one(layout: str, args) -> dict:
    from tests.helpers.dist import run_distributed

    world, mesh = LAYOUTS[layout]
    with tempfile.TemporaryDirectory(prefix="p3d-bench-cp-") as tmp:
        out = Path(tmp) / "result.json"
        run_distributed(_worker, world, [*mesh, "train.save_every=0", *args.set], args.steps, str(out), timeout=7200)
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--steps", type=int, default=3, help="steps per run; the first is dropped")
    ap.add_argument("--passes", type=int, default=2, help="passes over the layouts, every other one reversed")
    ap.add_argument("--set", nargs="*", default=None, help=f"overrides (default: {' '.join(BENCH)})")
    args = ap.parse_args()
    args.set = list(BENCH if args.set is None else args.set)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results: dict[str, list[dict]] = {}
    for n in range(args.passes):
        for layout in args.layouts if n % 2 == 0 else args.layouts[::-1]:
            results.setdefault(layout, []).append(one(layout, args))
            print(f"{layout}: pass {n + 1} done", file=sys.stderr, flush=True)
    print(f"{' '.join(args.set)}; {args.passes} passes x {args.steps} steps (first dropped); "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    print(f"{'layout':<7} {'procs':>5} {'tokens/s':>9} {'vs single':>9} {'step s':>7} {'saved MB/rank':>13} "
          f"{'planned MB':>10} {'attention MB':>12}")  # fmt: skip
    base = None
    for layout in args.layouts:
        runs = results[layout]
        step = statistics.median(t for r in runs for t in r["times"][1:])
        tok = runs[0]["tokens"] / step
        base = base or (tok if layout == "single" else None)
        ratio = f"{tok / base:>8.2f}x" if base else f"{'':>9}"
        whole, attention = runs[0]["saved"]
        print(f"{layout:<7} {LAYOUTS[layout][0]:>5} {tok:>9,.0f} {ratio} {step:>7.2f} {whole / 1e6:>13.1f} "
              f"{runs[0]['planned'] / 1e6:>10.1f} {attention / 1e6:>12.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
