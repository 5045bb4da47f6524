"""Spike for issue 11: p3d's tiny Llama, cut by p3d's one stage-bounds function into p*v chunks, run by
torch.distributed.pipelining schedules on 2 gloo CPU processes; per-step loss and grad norm compared with
p3d.train.reference.reference_run (single process, same init, same data, AdamW, clipping, LR schedule).

    OMP_NUM_THREADS=1 .venv/bin/python docs/design/schedules_spike.py [schedule] [overrides...]

schedule: interleaved_1f1b (default), interleaved_zero_bubble, zbv, dualpipev, gpipe, looped_bfs.
overrides: extra config overrides, e.g. model.tie_embeddings=true train.grad_clip=0.05.
Not part of the package or the tests: the groundwork of docs/design/pipeline-schedules.md (issue 11).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])  # the checkout
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

PP, V, STEPS = 2, 2, 3
SCHEDULES = {  # name -> (torch class name, placement style, chunks per rank)
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop", V),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", "loop", V),
    "looped_bfs": ("ScheduleLoopedBFS", "loop", V),
    "zbv": ("ScheduleZBVZeroBubble", "v", 2),
    "dualpipev": ("ScheduleDualPipeV", "v", 2),
    "gpipe": ("ScheduleGPipe", "loop", 1),
}


def config(overrides):
    from tests.conftest import typed

    return typed("mesh=single", f"train.steps={STEPS}", *overrides)


class Chunk(torch.nn.Module):
    """Layers [lo, hi) of p3d's flat LayerSpec list, built exactly as SequentialModel builds them.
    A TiedLayerSpec is built once per chunk (its own copy); its forward_fn (the tied head) is honoured."""

    def __init__(self, specs, lo: int, hi: int, tied: dict):
        super().__init__()
        from deepspeed.pipe import TiedLayerSpec

        self.layers = torch.nn.ModuleList()
        self._funcs = []
        for spec in specs[lo:hi]:
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in tied:
                    tied[spec.key] = spec.build()
                module = tied[spec.key]  # V-shape: both ends on one rank share one module
                self._funcs.append(partial(spec.forward_fn, module) if spec.forward_fn else module)
            else:
                module = spec.build()
                self._funcs.append(module)
            self.layers.append(module)

    def forward(self, x):
        for f in self._funcs:
            x = f(x)
        return x


def stage_to_rank(pp: int, n_stages: int, style: str) -> dict[int, int]:
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    return generate_stage_to_rank_mapping(pp, n_stages, style=style)


def worker(rank: int, world: int, store_path: str, name: str, overrides, out_path: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    import torch.distributed.pipelining as pipelining

    from p3d.data.loader import global_batches
    from p3d.layout.geometry import stage_bounds
    from p3d.parallel.mesh import Mesh
    from p3d.parallel.pipeline.specs import VocabParallelLoss, build_layer_specs
    from p3d.train.optim import build_optimizer, global_grad_norm

    cfg, plan = config(overrides)
    cls_name, style, per_rank = SCHEDULES[name]
    n_stages = PP * per_rank
    mesh = Mesh(tp=1, pp=PP, dp=1, rank=rank).with_groups()
    torch.manual_seed(cfg.train.seed)
    specs = build_layer_specs(cfg.model, plan.padded_vocab_size, mesh, cfg.train.seed)
    # the one stage-bounds function
    bounds = stage_bounds(cfg.model.n_layers, n_stages, cfg.schedule.partition, cfg.model)
    mapping = stage_to_rank(PP, n_stages, style)
    mine = [s for s in range(n_stages) if mapping[s] == rank]
    tied: dict = {}
    chunks = {s: Chunk(specs, bounds[s], bounds[s + 1], tied) for s in mine}
    # A tied table whose two ends live on different ranks: the later copy is "pipe replicated" (not counted in
    # the grad norm, as p3d.train.optim counts DeepSpeed's copies) and its grad is summed with the first's.
    tied_cross_rank = cfg.model.tie_embeddings and mapping[0] != mapping[n_stages - 1]
    if tied_cross_rank and (n_stages - 1) in chunks:
        for p in chunks[n_stages - 1].layers[-1].parameters():
            p.ds_pipe_replicated = True
    m = plan.micro_batches
    loss_fn_inner = VocabParallelLoss(cfg.model, plan.padded_vocab_size, mesh)

    def loss_fn(logits, labels):  # sum convention: the schedule does not rescale (scale_grads=False)
        return loss_fn_inner(logits, labels) / m

    stages = [pipelining.PipelineStage(chunks[s], s, n_stages, torch.device("cpu"), group=mesh.pp_group) for s in mine]
    cls = getattr(pipelining, cls_name)
    if per_rank == 1:
        schedule = cls(stages[0], n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = cls(stages, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    holder = torch.nn.ModuleList(chunks[s] for s in mine)  # a tied module shared by two chunks appears once
    opt, sched = build_optimizer(holder, cfg.train)
    params = list(holder.parameters())
    batches = global_batches(cfg.data, cfg.model.seq_len, cfg.schedule.global_batch_size, cfg.train.seed)
    first, last = 0 in chunks, (n_stages - 1) in chunks
    rows = []
    for step in range(1, STEPS + 1):
        batch = next(batches)  # every rank reads the same global batch; only the end stages use it
        lr = opt.param_groups[0]["lr"]
        t0 = time.perf_counter()
        losses: list = []
        args = (batch[:, :-1],) if first else ()
        kwargs = dict(target=batch[:, 1:], losses=losses) if last else {}
        schedule.step(*args, **kwargs)
        if tied_cross_rank:  # the tied table's two copies: sum their grads over the ranks holding them
            # pp2: the pp group is exactly the two holders; for pp > 2 a group of {first, last} pp rank (as
            # DeepSpeed's tied groups) is needed, created on every rank in the same order.
            for s in (0, n_stages - 1):
                if s in chunks:
                    w = chunks[s].layers[0 if s == 0 else -1].weight
                    dist.all_reduce(w.grad, group=mesh.pp_group)
        norm = float(global_grad_norm(params, mesh))  # exact: all-reduced over the pp x tp replica
        max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        loss = torch.tensor([float(sum(float(x.detach()) for x in losses)) if last else 0.0], dtype=torch.float64)
        dist.all_reduce(loss, group=mesh.pp_group)  # only the last stage's holder knows it
        rows.append({"step": step, "loss": float(loss), "grad_norm": norm, "lr": lr, "s": time.perf_counter() - t0})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"bounds": bounds, "stage_to_rank": mapping, "rows": rows, "micro_batches": m}, f)
    dist.destroy_process_group()


def main():
    args = sys.argv[1:]
    name = args[0] if args and "=" not in args[0] else "interleaved_1f1b"
    overrides = [a for a in args if "=" in a]
    from p3d.train.reference import reference_run

    cfg, plan = config(overrides)
    t0 = time.perf_counter()
    ref = reference_run(cfg, steps=STEPS)
    print(f"reference: {time.perf_counter() - t0:.1f}s, micro batches {plan.micro_batches}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(worker, args=(PP, os.path.join(tmp, "store"), name, overrides, out), nprocs=PP, join=True)
        with open(out) as f:
            got = json.load(f)
    print(
        f"schedule {name} ({SCHEDULES[name][0]}), pp={PP}, chunks {got['bounds']}, stage->rank {got['stage_to_rank']}"
    )
    worst = 0.0
    for r, g in zip(ref, got["rows"]):
        dl = abs(g["loss"] - r["loss"]) / abs(r["loss"])
        dn = abs(g["grad_norm"] - r["grad_norm"]) / abs(r["grad_norm"])
        worst = max(worst, dl, dn)
        print(
            f"step {r['step']}: loss ref {r['loss']:.8f} pipe {g['loss']:.8f} (rel {dl:.2e}); "
            f"grad_norm ref {r['grad_norm']:.8f} pipe {g['grad_norm']:.8f} (rel {dn:.2e}); step {g['s']:.3f}s"
        )
    print(f"max relative difference: {worst:.3e}")
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
