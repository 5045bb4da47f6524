"""Expert parallelism on CPU: tokens/s, the all-to-all's share of the step, and the load imbalance (issue 34); and
one MoE layer's grouped GEMM against the loop over experts it replaced (issue 53, ``--layer``).

    .venv/bin/python bench/moe.py                          # moe_tiny scaled up: h 256, 8 experts of 512, top-2
    .venv/bin/python bench/moe.py --layouts dp2:1 dp2:2 --steps 6
    .venv/bin/python bench/moe.py --layer                  # one layer, 64 experts top-6, grouped vs loop; E 8 vs 64

A layout is ``mesh:ep`` (dp2:2 = mesh=dp2 mesh.ep=2). Each runs in its own gloo worker processes, built as p3d-train
builds them, on the same seeded init and data; every layout runs on the torch executor (torch's Schedule1F1B),
so that ep1 and ep2 differ in nothing else (``--deepspeed`` adds DeepSpeed's engine for the ep1 layouts). The
layouts take turns, and a second pass runs them in reverse order, so that a slow spell of the machine does not fall
on one layout only.
- tokens/s: the global batch's tokens over the slowest rank's ``train_batch`` wall time, median of the steps after
  the first of each pass;
- all-to-all share: seconds inside ``all_to_all_single`` (the dispatch and combine of every MoE layer, forward and
  backward, and the small all-to-all of the counts), mean over ranks, over the step time; a rank waiting in it for a
  slower peer counts too;
- load imbalance: max / mean tokens per expert of each MoE layer over the step's batch (``moe_load_imbalance``),
  mean over layers and steps;
- expert MB/rank: the routed experts' fp32 weights one rank holds (E / ep experts of each MoE block).
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

BENCH = (
    "model=moe_tiny",
    "model.hidden_size=256",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.ffn_hidden_size=1024",
    "model.seq_len=256",
    "model.moe.n_experts=8",
    "model.moe.expert_ffn_size=512",
    "schedule.micro_batch_size=2",
    "schedule.global_batch_size=16",
)


def _worker(rank: int, world: int, overrides: list[str], steps: int, torch_executor: bool, out_path: str) -> None:
    import datetime

    import deepspeed
    import torch
    import torch.distributed as dist

    from p3d.data.loader import micro_batches
    from p3d.parallel.mesh import Mesh
    from p3d.train.executors import build_executor
    from p3d.train.executors.torch_schedules import TorchExecutor
    from p3d.train.metrics import ExpertFigures
    from p3d.train.worker import set_up_cpu_worker
    from tests.helpers.runs import typed

    set_up_cpu_worker()
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=600))
    cfg, plan = typed(*overrides, f"train.steps={steps}")
    mesh = Mesh.from_plan(plan, rank).with_groups()
    device = torch.device("cpu")
    a2a = [0.0]
    original = dist.all_to_all_single

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            a2a[0] += time.perf_counter() - t0

    dist.all_to_all_single = timed
    with tempfile.TemporaryDirectory(prefix=f"p3d-bench-moe-{rank}-") as tmp:
        make = TorchExecutor if torch_executor else build_executor
        ex = make(cfg, plan, mesh, rank, device, tmp)
        figures = ExpertFigures(cfg.model, ex.module)
        s = cfg.schedule
        data = micro_batches(cfg.data, cfg.model.seq_len, s.global_batch_size, s.micro_batch_size, plan.dp,
                             mesh.dp_rank, cfg.train.seed, 0, None)  # fmt: skip
        rows = []
        for _ in range(steps):
            a2a[0] = 0.0
            t0 = time.perf_counter()
            ex.train_batch(data if ex.reads_data else None)
            step = time.perf_counter() - t0
            times = torch.tensor([step, a2a[0] / world])
            dist.all_reduce(times)  # [sum of steps, mean a2a]
            slowest = torch.tensor([step])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            imbalance = figures.after_step(device)["moe_load_imbalance"]
            rows.append((float(slowest), float(times[1]), statistics.mean(imbalance)))
    if rank == 0:
        from p3d.parallel.experts.params import is_expert_param

        tokens = cfg.schedule.global_batch_size * cfg.model.seq_len
        experts = sum(p.numel() * p.element_size() for p in ex.module.parameters() if is_expert_param(p))
        Path(out_path).write_text(json.dumps({"tokens": tokens, "rows": rows, "experts": experts}))


def one(layout: str, torch_executor: bool, args) -> dict:
    from tests.helpers.dist import run_distributed

    mesh, ep = layout.split(":")
    world = {"dp2": 2, "dp4": 4, "dp2_pp2": 4, "dp2_tp2": 4}[mesh]
    overrides = [f"mesh={mesh}", f"mesh.ep={ep}", "train.save_every=0", *args.set]
    with tempfile.TemporaryDirectory(prefix="p3d-bench-moe-") as tmp:
        out = Path(tmp) / "result.json"
        run_distributed(_worker, world, overrides, args.steps, torch_executor, str(out), timeout=3600)
        return json.loads(out.read_text())


LAYER = ("model=moe_tiny", "model.hidden_size=256", "model.moe.expert_ffn_size=128", "model.moe.top_k=6")


def _layer_step(n_experts: int, loop: bool, tokens: int, reps: int) -> list[float]:
    """Seconds of ``reps`` forward+backward passes of one MoE feed-forward (one process, fp32) of ``LAYER`` with
    ``n_experts``; ``loop``: its routed experts computed by the per-expert loop (tests/helpers/moe_loop.py)."""
    import torch

    from p3d.model.moe import MoEFeedForward
    from p3d.parallel.mesh import Mesh
    from tests.helpers.moe_loop import use_loop
    from tests.helpers.runs import compose_config

    cfg = compose_config(*LAYER, f"model.moe.n_experts={n_experts}").model
    moe = MoEFeedForward(cfg, Mesh(tp=1, pp=1, dp=1), 1, seed=3).train()
    if loop:
        use_loop(moe)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, tokens, cfg.hidden_size, generator=gen).requires_grad_()
    dy = torch.randn(1, tokens, cfg.hidden_size, generator=gen)
    times = []
    for _ in range(reps + 1):  # the first warms up
        t0 = time.perf_counter()
        (moe(x) * dy).sum().backward()
        times.append(time.perf_counter() - t0)
        moe.zero_grad(set_to_none=True)
        x.grad = None
    return times[1:]


def layer_bench(args) -> None:
    """``--layer``: tokens/s of one MoE layer, grouped GEMM against the loop, E = 64 and E = 8 at equal active
    parameters (top-6 experts of the same width: E changes only the parameters a token does not use); the four
    take turns ``--passes`` times, each pass ``--steps`` timed repetitions; medians."""
    import torch

    torch.set_num_threads(1)
    cases = [(64, False), (64, True), (8, False), (8, True)]
    times: dict[tuple[int, bool], list[float]] = {c: [] for c in cases}
    for n in range(args.passes):
        for case in cases if n % 2 == 0 else cases[::-1]:
            times[case] += _layer_step(*case, args.tokens, args.steps)
    print(f"{' '.join(LAYER)}, {args.tokens} tokens, fp32, 1 thread; {args.passes} passes x {args.steps} "
          f"forward+backward; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    print(f"{'experts':>7} {'compute':<8} {'step ms':>8} {'tokens/s':>9} {'grouped vs loop':>15}")
    for n_experts in (64, 8):
        grouped = statistics.median(times[(n_experts, False)])
        loop = statistics.median(times[(n_experts, True)])
        for name, t in (("grouped", grouped), ("loop", loop)):
            ratio = f"{loop / grouped:>14.2f}x" if name == "grouped" else ""
            print(f"{n_experts:>7} {name:<8} {t * 1e3:>8.1f} {args.tokens / t:>9,.0f} {ratio}")
    g64, g8 = (statistics.median(times[(e, False)]) for e in (64, 8))
    l64, l8 = (statistics.median(times[(e, True)]) for e in (64, 8))
    print(f"E=64 / E=8 step time at equal active parameters: grouped {g64 / g8:.2f}x, loop {l64 / l8:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layer", action="store_true", help="one MoE layer: grouped GEMM vs the loop (issue 53)")
    ap.add_argument("--tokens", type=int, default=1024, help="--layer: tokens per forward")
    ap.add_argument("--layouts", nargs="+", default=["dp2:1", "dp2:2", "dp2_pp2:1", "dp2_pp2:2"])
    ap.add_argument("--steps", type=int, default=5, help="steps per run; the first is dropped")
    ap.add_argument("--passes", type=int, default=2, help="passes over the layouts, every other one reversed")
    ap.add_argument("--deepspeed", action="store_true", help="also run the ep1 layouts on DeepSpeed's engine")
    ap.add_argument("--set", nargs="*", default=None, help=f"overrides (default: {' '.join(BENCH)})")
    args = ap.parse_args()
    if args.layer:
        layer_bench(args)
        return
    args.set = list(BENCH if args.set is None else args.set)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs = [(layout, True) for layout in args.layouts]
    if args.deepspeed:
        runs += [(layout, False) for layout in args.layouts if layout.endswith(":1")]
    results: dict[tuple[str, bool], list[dict]] = {}
    for n in range(args.passes):
        for key in runs if n % 2 == 0 else runs[::-1]:
            results.setdefault(key, []).append(one(*key, args))
            print(f"{key[0]} ({'torch' if key[1] else 'deepspeed'}): pass {n + 1} done", file=sys.stderr, flush=True)
    print(f"{' '.join(args.set)}; {args.passes} passes x {args.steps} steps (first dropped); "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    print(f"{'mesh':<8} {'ep':>2} {'executor':<10} {'tokens/s':>9} {'vs ep1':>7} {'step s':>7} {'a2a s':>6} "
          f"{'a2a share':>9} {'imbalance':>9} {'expert MB/rank':>14}")  # fmt: skip
    base: dict[str, float] = {}
    for layout, torch_executor in runs:
        mesh, ep = layout.split(":")
        rows = [row for r in results[(layout, torch_executor)] for row in r["rows"][1:]]
        step = statistics.median(t for t, _, _ in rows)
        a2a = statistics.median(a for _, a, _ in rows)
        tok = results[(layout, torch_executor)][0]["tokens"] / step
        if ep == "1" and torch_executor:
            base[mesh] = tok
        ratio = f"{tok / base[mesh]:>6.2f}x" if mesh in base else f"{'':>7}"
        name = "torch" if torch_executor else "deepspeed"
        held = results[(layout, torch_executor)][0]["experts"] / 1e6
        print(f"{mesh:<8} {ep:>2} {name:<10} {tok:>9,.0f} {ratio} {step:>7.3f} {a2a:>6.3f} {a2a / step:>8.1%} "
              f"{statistics.mean(i for _, _, i in rows):>9.2f} {held:>14.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
