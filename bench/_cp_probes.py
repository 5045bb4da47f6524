"""What the commands of bench/cp.py measure inside the processes they start: the bytes autograd saves on a rank and the
step times of a layout (``layouts``), one attention layer's peak on a rank (``attention``), and a p3d-train run in
this process with each worker's RSS and glibc heap sampled every 5 ms (``rss``: at the highest RSS, malloc's bytes in
use and free inside its heap; the most in use at once and the rest of the RSS then; what ``malloc_trim(0)`` hands back
at the end; glibc only: ``mallinfo2``, ``malloc_trim``)."""

from __future__ import annotations

import ctypes
import json
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench._common import SavedTensors, replica_batches, rss_bytes, slowest, start_worker


# ---- layouts
def saved_bytes(pipe, ids, labels) -> tuple[int, int]:
    """(whole stage, attention only): bytes autograd keeps for one micro batch's forward and loss on this rank."""
    from p3d.model.attention import Attention
    from p3d.pipeline.specs import VocabParallelLoss

    saved = SavedTensors(pipe.module.parameters())
    for module in pipe.module.modules():
        if isinstance(module, Attention):
            module.register_forward_pre_hook(lambda *_: setattr(saved, "inside", True))
            module.register_forward_hook(lambda *_: setattr(saved, "inside", False))
    loss_fn = VocabParallelLoss(pipe.cfg.model, pipe.plan.padded_vocab_size, pipe.mesh)
    with saved:
        loss = loss_fn(pipe.chunks[0](pipe.local_tokens(ids)), pipe.local_tokens(labels))
    loss.backward()  # the cp backward's collectives pair up on both ranks
    pipe.optimizer.zero_grad(set_to_none=True)
    return saved.total, sum(saved.part.values())


def layouts_worker(rank: int, world: int, overrides: list[str], steps: int, out_path: str) -> None:
    import torch

    from p3d.train.executors.torch_schedules import TorchExecutor

    cfg, plan, mesh = start_worker(rank, [*overrides, f"train.steps={steps}"], 1800)
    with tempfile.TemporaryDirectory(prefix=f"p3d-bench-cp-{rank}-") as tmp:
        ex = TorchExecutor(cfg, plan, mesh, rank, torch.device("cpu"), tmp)
        data = replica_batches(cfg, plan.dp, mesh.dp_rank)
        ids, labels = next(data)
        saved = saved_bytes(ex.pipe, ids, labels)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            ex.train_batch(data)
            times.append(slowest(time.perf_counter() - t0))
    if rank == 0:
        from p3d.planner.memory import stage_memory
        from p3d.planner.shapes import layout_of

        planned = stage_memory(cfg, layout_of(cfg))[0].activation_bytes
        tokens = cfg.schedule.global_batch_size * cfg.model.seq_len
        Path(out_path).write_text(json.dumps({"tokens": tokens, "times": times, "saved": saved, "planned": planned}))


# ---- attention
def attention_worker(rank: int, world: int, overrides: list[str], variant: str, out_path: str) -> None:
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


# ---- rss
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


def _libc():
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    return libc


def heap(libc) -> tuple[int, int]:
    """(in use, free) bytes of malloc, all arenas: handed out (heap and own mmaps), and free inside the heaps."""
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd, m.fordblks


def watch_worker(out_prefix: str) -> None:
    """Wrap p3d.train.loop.train in this process: the forked workers run the wrapper, which samples while training
    and writes ``<out_prefix>.<rank>.json``."""
    import p3d.train.loop as loop

    inner = loop.train

    def train(cfg, plan, run_dir, rank):
        libc, seen, stop = _libc(), {"rss": 0, "max_in_use": 0}, threading.Event()

        def sample():
            while not stop.is_set():
                rss = rss_bytes()
                used, free = heap(libc)
                if rss > seen["rss"]:
                    seen.update(rss=rss, in_use=used, free=free)
                if used > seen["max_in_use"]:
                    seen.update(max_in_use=used, rest=rss - used - free)  # rest: libraries, stacks, not malloc's
                time.sleep(0.005)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            return inner(cfg, plan, run_dir, rank)
        finally:
            stop.set()
            thread.join()
            before = rss_bytes()
            libc.malloc_trim(0)
            seen |= {"maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                     "trimmed": before - rss_bytes()}  # fmt: skip
            Path(f"{out_prefix}.{rank}.json").write_text(json.dumps(seen))

    loop.train = train


def watched_run(overrides: list[str]) -> dict:
    """``p3d-train <overrides>`` in this process (one per interpreter: Hydra composes once per process); the rank
    with the highest peak RSS: its sample at that peak."""
    from p3d.launch.compose import run_hydra
    from p3d.launch.train import train_task

    with tempfile.TemporaryDirectory(prefix="p3d-bench-cp-rss-") as tmp:
        watch_worker(f"{tmp}/rank")
        argv = sys.argv
        sys.argv = ["p3d-train", *overrides, f"run.dir={tmp}/run", "logger=none"]
        try:
            status = run_hydra(train_task)
        finally:
            sys.argv = argv
        if status:
            raise SystemExit(f"p3d-train {' '.join(overrides)} exited {status}")
        ranks = [json.loads(p.read_text()) for p in Path(tmp).glob("rank.*.json")]
        return max(ranks, key=lambda r: r["maxrss"])
