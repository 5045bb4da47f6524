"""Where p3d's single-rank overhead goes: one process, both trainers, alternating steps, per phase.

    .venv/bin/python bench/overhead_breakdown.py                 # p3d as it is

A diagnostic companion of bench/overhead.py (which times the real ``p3d-train`` subprocess). Here
one process builds the p3d DeepSpeed pipeline engine exactly as ``p3d.train.loop.train`` does
(mesh=single, gloo, one thread) and the plain loop of bench/overhead.py, and alternates their
optimizer steps (p3d, plain, plain, p3d, ...), so machine noise hits both alike. Every DeepSpeed
pipeline instruction is timed (wall and process CPU time; CPU time is the steadier figure on a
shared machine), and the plain loop's matching phases.

The p3d side is ``p3d.train.executors.ds_engine.build_engine``, the very function a p3d worker calls, so what is
measured here is what runs (including the two overhead fixes that came out of this diagnostic: the
chunked fused gradient norm in ``p3d.train.optim`` and, over a single replica, skipping DeepSpeed's
flatten / all-reduce-over-one-rank / copy-back of every gradient).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--model", default="small")
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="p3d-breakdown-"))
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        P3D_INIT_METHOD=f"file://{tmp / 'store'}",
    )
    import torch
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from overhead import compose_spec, plain_micro_batches

    from p3d.layout.geometry import padded_vocab
    from p3d.parallel.mesh import Mesh
    from p3d.pipeline.specs import to_sequential
    from p3d.train import optim
    from p3d.train.executors import ds_engine as trainer
    from p3d.train.worker import init_process_group

    cfg, plan = compose_spec(
        [
            "mesh=single",
            f"model={args.model}",
            f"model.seq_len={args.seq_len}",
            f"schedule.global_batch_size={args.global_batch}",
            f"schedule.micro_batch_size={args.micro_batch}",
            f"train.steps={args.steps}",
            *args.extra,
        ],
        tmp,
    )
    init_process_group(plan, 0, cfg.cluster.timeout_s)  # sets torch threads to 1, as a p3d worker

    acc: dict[str, list[float]] = {}

    def add(key, t, c):
        a = acc.setdefault(key, [0.0, 0.0])
        a[0] += time.perf_counter() - t
        a[1] += time.process_time() - c

    def timed(fn, key):
        def wrapper(*a, **k):
            t, c = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **k)
            finally:
                add(key, t, c)

        return wrapper

    for instr in list(PipelineEngine._INSTRUCTION_MAP):
        PipelineEngine._INSTRUCTION_MAP[instr] = timed(PipelineEngine._INSTRUCTION_MAP[instr], f"p3d  {instr.__name__}")
    optim.global_grad_norm = timed(optim.global_grad_norm, "p3d    of which global_grad_norm")
    torch.optim.AdamW.step = timed(torch.optim.AdamW.step, "{side} AdamW.step")

    # p3d: as p3d.train.loop.train builds it
    mesh = Mesh.from_plan(plan, 0).with_groups()
    engine, _, _ = trainer.build_engine(cfg, plan, mesh)
    p3d_data = plain_micro_batches(cfg)  # what p3d's trainer reads at dp=1
    # plain: as bench/overhead.py's plain worker
    torch.manual_seed(cfg.train.seed)
    model = to_sequential(cfg.model, padded_vocab(cfg.model.vocab_size, 1), cfg.train.seed)
    popt, psched = optim.build_optimizer(model, cfg.train)
    plain_data = plain_micro_batches(cfg)
    params, n = list(model.parameters()), plan.micro_batches
    max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")

    def plain_step() -> float:
        total = None
        for _ in range(n):
            t, c = time.perf_counter(), time.process_time()
            inputs, labels = next(plain_data)
            add("plain LoadMicroBatch", t, c)
            t, c = time.perf_counter(), time.process_time()
            loss = model.loss(inputs, labels) / n
            add("plain ForwardPass", t, c)
            t, c = time.perf_counter(), time.process_time()
            loss.backward()
            add("plain BackwardPass", t, c)
            total = loss.detach() if total is None else total + loss.detach()
        t, c = time.perf_counter(), time.process_time()
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        add("plain   clip_grad_norm_", t, c)
        popt.step()
        popt.zero_grad(set_to_none=True)
        psched.step()
        add("plain OptimizerStep (clip+AdamW+zero_grad+sched)", t, c)
        return float(total)

    wall, cpu = collections.defaultdict(list), collections.defaultdict(list)
    print(
        f"{cfg.model.name}: {plan.n_params / 1e6:.1f}M params, {n} micro batches of {cfg.schedule.micro_batch_size} x "
        f"{cfg.model.seq_len}",
        flush=True,
    )
    for step in range(args.steps):
        for side in ("p3d", "plain") if step % 2 == 0 else ("plain", "p3d"):
            acc.clear()
            t, c = time.perf_counter(), time.process_time()
            loss = float(engine.train_batch(p3d_data)) if side == "p3d" else plain_step()
            add(f"{side} STEP", t, c)
            for key, (w, cc) in acc.items():
                key = key.replace("{side}", side + "  ")
                wall[key].append(w)
                cpu[key].append(cc)
            print(
                f"step {step + 1} {side:5s} loss {loss:.5f}  wall {acc[f'{side} STEP'][0]:.3f} s  "
                f"cpu {acc[f'{side} STEP'][1]:.3f} s",
                flush=True,
            )
    keep = slice(args.warmup, None)
    print(f"\nmedian per step over steps {args.warmup + 1}..{args.steps}      wall [s]   cpu [s]")
    for key in sorted(wall, key=lambda k: (k.split()[0], k.endswith("STEP"), k)):
        print(f"  {key:<48s} {statistics.median(wall[key][keep]):8.3f}  {statistics.median(cpu[key][keep]):8.3f}")
    ratio_w = statistics.median(wall["plain STEP"][keep]) / statistics.median(wall["p3d STEP"][keep])
    ratio_c = statistics.median(cpu["plain STEP"][keep]) / statistics.median(cpu["p3d STEP"][keep])
    print(f"p3d / plain throughput: {ratio_w:.3f} by wall time, {ratio_c:.3f} by CPU time")
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
