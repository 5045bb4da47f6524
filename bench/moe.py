"""Mixture of experts on CPU workers: expert parallelism's tokens/s, the all-to-all's share of the step and the load
imbalance (issue 34); one MoE layer's grouped GEMM against the loop over experts it replaced (issue 53).

    .venv/bin/python bench/moe.py ep                       # moe_tiny scaled up: h 256, 8 experts of 512, top-2
    .venv/bin/python bench/moe.py ep --layouts dp2:1 dp2:2 --steps 6
    .venv/bin/python bench/moe.py ep --deepspeed           # and the ep1 layouts on DeepSpeed's engine
    .venv/bin/python bench/moe.py layer                    # one layer, 64 experts top-6, grouped vs loop; E 8 vs 64

- ``ep``: layouts ``mesh:ep`` in their own gloo processes: tokens/s, all-to-all seconds and share, imbalance, expert
  bytes per rank;
- ``layer``: one ``MoEFeedForward``, grouped GEMM against the per-expert loop, at 64 and 8 experts.
``bench/moe.py <command> --help`` says how each measures.
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

from bench._common import (  # noqa: E402
    add_command,
    bench_parser,
    load_average,
    replica_batches,
    run_command,
    run_workers,
    slowest,
    start_worker,
    turns,
)

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
WORLD = {"dp2": 2, "dp4": 4, "dp2_pp2": 4, "dp2_tp2": 4}
LAYER = ("model=moe_tiny", "model.hidden_size=256", "model.moe.expert_ffn_size=128", "model.moe.top_k=6")


def _ep_worker(rank: int, world: int, overrides: list[str], steps: int, torch_executor: bool, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from p3d.train.executors import build_executor
    from p3d.train.executors.torch_schedules import TorchExecutor
    from p3d.train.metrics import ExpertFigures

    cfg, plan, mesh = start_worker(rank, [*overrides, f"train.steps={steps}"], 600)
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
        data = replica_batches(cfg, plan.dp, mesh.dp_rank)
        rows = []
        for _ in range(steps):
            a2a[0] = 0.0
            t0 = time.perf_counter()
            ex.train_batch(data if ex.reads_data else None)
            step = time.perf_counter() - t0
            times = torch.tensor([step, a2a[0] / world])
            dist.all_reduce(times)  # [sum of steps, mean a2a]
            step = slowest(step)
            imbalance = figures.after_step(device, discarded=False)["moe_load_imbalance"]  # the bench keeps every step
            rows.append((step, float(times[1]), statistics.mean(imbalance)))
    if rank == 0:
        from p3d.parallel.experts.params import is_expert_param

        tokens = cfg.schedule.global_batch_size * cfg.model.seq_len
        experts = sum(p.numel() * p.element_size() for p in ex.module.parameters() if is_expert_param(p))
        Path(out_path).write_text(json.dumps({"tokens": tokens, "rows": rows, "experts": experts}))


def ep(args) -> int:
    """Expert parallelism on CPU: tokens/s, the all-to-all's share of the step, and the load imbalance (issue 34).

    A layout is ``mesh:ep`` (dp2:2 = mesh=dp2 mesh.ep=2). Each runs in its own gloo worker processes, built as
    p3d-train builds them, on the same seeded init and data; every layout runs on the torch executor (torch's
    Schedule1F1B), so that ep1 and ep2 differ in nothing else (``--deepspeed`` adds DeepSpeed's engine for the ep1
    layouts). The layouts take turns, and a second pass runs them in reverse order, so that a slow spell of the
    machine does not fall on one layout only.
    - tokens/s: the global batch's tokens over the slowest rank's ``train_batch`` wall time, median of the steps after
      the first of each pass;
    - all-to-all share: seconds inside ``all_to_all_single`` (the dispatch and combine of every MoE layer, forward and
      backward, and the small all-to-all of the counts), mean over ranks, over the step time; a rank waiting in it
      for a slower peer counts too;
    - load imbalance: max / mean tokens per expert of each MoE layer over the step's batch (``moe_load_imbalance``),
      mean over layers and steps;
    - expert MB/rank: the routed experts' fp32 weights one rank holds (E / ep experts of each MoE block).
    """
    args.set = list(BENCH if args.set is None else args.set)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs = [(layout, True) for layout in args.layouts]
    if args.deepspeed:
        runs += [(layout, False) for layout in args.layouts if layout.endswith(":1")]
    results: dict[tuple[str, bool], list[dict]] = {}
    for n, (layout, torch_executor) in turns(runs, args.passes):
        mesh, ep = layout.split(":")
        overrides = [f"mesh={mesh}", f"mesh.ep={ep}", "train.save_every=0", *args.set]
        result = run_workers(_ep_worker, WORLD[mesh], overrides, args.steps, torch_executor, timeout=3600)
        results.setdefault((layout, torch_executor), []).append(result)
        print(f"{layout} ({'torch' if torch_executor else 'deepspeed'}): pass {n + 1} done", file=sys.stderr,
              flush=True)  # fmt: skip
    print(f"{' '.join(args.set)}; {args.passes} passes x {args.steps} steps (first dropped); "
          f"load average {load_average()}")  # fmt: skip
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
    return 0


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


def layer(args) -> int:
    """One MoE layer's grouped GEMM against the loop over experts it replaced (issue 53): tokens/s, E = 64 and E = 8 at
    equal active parameters (top-6 experts of the same width: E changes only the parameters a token does not use).

    The four (grouped and loop, 64 and 8 experts) take turns ``--passes`` times, every other pass reversed, each pass
    ``--steps`` timed repetitions after one that warms up; medians. One process, one thread, fp32.
    """
    import torch

    torch.set_num_threads(1)
    cases = [(64, False), (64, True), (8, False), (8, True)]
    times: dict[tuple[int, bool], list[float]] = {c: [] for c in cases}
    for _, case in turns(cases, args.passes):
        times[case] += _layer_step(*case, args.tokens, args.steps)
    print(f"{' '.join(LAYER)}, {args.tokens} tokens, fp32, 1 thread; {args.passes} passes x {args.steps} "
          f"forward+backward; load average {load_average()}")  # fmt: skip
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
    return 0


def parser() -> argparse.ArgumentParser:
    ap, commands = bench_parser(__doc__)
    p = add_command(commands, ep)
    p.add_argument("--layouts", nargs="+", default=["dp2:1", "dp2:2", "dp2_pp2:1", "dp2_pp2:2"])
    p.add_argument("--steps", type=int, default=5, help="steps per run; the first is dropped")
    p.add_argument("--passes", type=int, default=2, help="passes over the layouts, every other one reversed")
    p.add_argument("--deepspeed", action="store_true", help="also run the ep1 layouts on DeepSpeed's engine")
    p.add_argument("--set", nargs="*", default=None, help=f"overrides (default: {' '.join(BENCH)})")

    p = add_command(commands, layer)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per forward")
    p.add_argument("--steps", type=int, default=5, help="timed forward+backward passes per pass")
    p.add_argument("--passes", type=int, default=2, help="passes over the four, every other one reversed")
    return ap


if __name__ == "__main__":
    sys.exit(run_command(parser()))
