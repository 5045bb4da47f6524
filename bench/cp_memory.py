"""Context parallelism's memory: one attention layer's forward + backward peak per rank as the sequence doubles
(issue 52).

    .venv/bin/python bench/cp_memory.py                                 # model=small's attention, s 2048..16384
    .venv/bin/python bench/cp_memory.py --seq 2048 4096 --layouts cp1 cp2 cp2-ring cp4

One ``Attention`` module of the model's shape (q|k|v projection, RoPE, the attention core, output projection), fp32,
micro batch 1, on gloo worker processes of one thread each: ``cp1`` is one process on the whole sequence (torch's
SDPA), ``cpN`` and ``cpN-ring`` are N processes splitting it (context.attention=allgather or ring). Per layout and
sequence, rank 0's peak of tensor memory during the layer's forward and backward, beyond its input and weights
(tests/helpers/memory.py: the running sum of torch's allocations, exact, no timing) and its growth per doubling of
s; then the same for the attention core alone (rotated q, k, v in: the cp attention, or SDPA at cp1) beside the
planner's figure for it (``p3d.planner.context.attention_core_bytes``: the output and log-sum-exp it saves, its
working set at its peak and the q, k, v gradients it returns).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUTS = {"cp1": (1, "allgather"), "cp2": (2, "allgather"), "cp2-ring": (2, "ring"), "cp4": (4, "allgather"),
           "cp4-ring": (4, "ring")}  # fmt: skip


def _worker(rank: int, world: int, overrides: list[str], variant: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from p3d.model.attention import Attention
    from p3d.parallel.context.attention import context_parallel_attention
    from p3d.parallel.mesh import Mesh
    from p3d.planner.context import attention_core_bytes
    from p3d.planner.shapes import Layout
    from tests.helpers.memory import peak_allocated
    from tests.helpers.runs import typed

    cfg, _ = typed(*overrides, f"mesh.cp={world}", f"context.attention={variant}")
    m = cfg.model
    mesh = Mesh(tp=1, pp=1, dp=1, cp=world, rank=rank, cp_group=dist.group.WORLD if world > 1 else None)
    attn = Attention(m, mesh, "attn", cfg.train.seed, cp_attention=variant)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(1, m.seq_len // world, m.hidden_size, generator=gen, requires_grad=True)
    upstream = torch.randn(1, m.seq_len // world, m.hidden_size, generator=gen)

    def step():
        attn(x).backward(upstream)

    step()  # the weights' gradients exist from here on, as in training after the first step
    layer = peak_allocated(step)
    # the core alone: this rank's rotated q, k and v in, the output and the q, k, v gradients out
    nh, nkv, hd, sl = m.n_heads, m.n_kv_heads, m.hidden_size // m.n_heads, m.seq_len // world
    q, k, v = (torch.randn(1, n, sl, hd, generator=gen, requires_grad=True) for n in (nh, nkv, nkv))
    grad = torch.randn(1, nh, sl, hd, generator=gen)

    def core():
        if world == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nh != nkv)
        else:
            out = context_parallel_attention(q, k, v, dist.group.WORLD, world, rank, variant)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    if rank == 0:
        planned = attention_core_bytes(cfg, Layout(1, 1, 1, 1, 1, cp=world))
    core_peak = peak_allocated(core)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"layer": layer, "core": core_peak, "planned": planned}))


def one(layout: str, seq: int, model: str) -> dict:
    from tests.helpers.dist import run_distributed

    world, variant = LAYOUTS[layout]
    overrides = [f"model={model}", f"model.seq_len={seq}", "mesh=single", "schedule.micro_batch_size=1"]
    with tempfile.TemporaryDirectory(prefix="p3d-bench-cp-memory-") as tmp:
        out = Path(tmp) / "result.json"
        run_distributed(_worker, world, overrides, variant, str(out), timeout=3600)
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", nargs="+", default=["cp1", "cp2", "cp2-ring"], choices=list(LAYOUTS))
    ap.add_argument("--seq", nargs="+", type=int, default=[2048, 4096, 8192, 16384])
    ap.add_argument("--model", default="small")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"model={args.model}, fp32, micro batch 1: rank 0's forward + backward peak of one attention layer and")
    print("of its core (q, k, v in), MB; the planner's core figure")
    print(f"{'layout':<9} {'seq':>6} {'layer MB':>9} {'x/doubling':>10} {'core MB':>9} {'planned':>9} {'plan/core':>9}")
    for layout in args.layouts:
        last = None
        for seq in args.seq:
            r = one(layout, seq, args.model)
            growth = f"{r['layer'] / last:>9.2f}x" if last else f"{'':>10}"
            print(f"{layout:<9} {seq:>6} {r['layer'] / 1e6:>9.1f} {growth} {r['core'] / 1e6:>9.1f} "
                  f"{r['planned'] / 1e6:>9.1f} {r['planned'] / r['core']:>9.2f}", flush=True)  # fmt: skip
            last = r["layer"]


if __name__ == "__main__":
    main()
