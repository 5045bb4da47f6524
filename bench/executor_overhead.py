"""The torch executor's per-step overhead against DeepSpeed's engine at pp=1-equivalent work (issue 11).

    .venv/bin/python bench/executor_overhead.py                        # the bench model of bench/schedules.py
    .venv/bin/python bench/executor_overhead.py --model tiny --steps 30 # per-op overhead dominates

One process (gloo, one thread, as a p3d worker) builds both executors exactly as ``p3d.train.loop.train``
builds them (``p3d.train.executors``): ``DeepSpeedExecutor`` (schedule.pipeline=1f1b) and ``TorchExecutor``
running torch's ``ScheduleGPipe`` over one stage that holds the whole model (p3d-train refuses a torch schedule
with mesh.pp=1, so the bench sets it after validation). With one stage there is no pipeline, no p2p and no
bubble: the two do the same forward and backward of the same micro batches, then the step gate, the exact
gradient norm, clipping, AdamW and the LR step, and what differs is the executor's own work per step. Same
seeded init, same data: the losses of the two must agree (printed). Steps alternate in ABBA order so that the
machine's load hits both alike; the first ``--warmup`` steps of each are dropped; printed: median wall and CPU
seconds per step of each and their ratio (target: torch / DeepSpeed <= 1.05).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

BENCH_MODEL = ("model.hidden_size=512", "model.ffn_hidden_size=1536", "model.seq_len=128")  # as bench/schedules.py


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="the model group (default tiny, reshaped by --set)")
    ap.add_argument("--set", nargs="*", default=None, help=f"overrides (default: {' '.join(BENCH_MODEL)})")
    ap.add_argument("--steps", type=int, default=12, help="steps of each executor")
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    overrides = list(BENCH_MODEL if args.set is None else args.set)

    tmp = Path(tempfile.mkdtemp(prefix="p3d-executor-overhead-"))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", P3D_INIT_METHOD=f"file://{tmp / 'store'}")
    import torch
    from overhead import compose_spec

    from p3d.config.schema import Pipeline
    from p3d.data.loader import micro_batches
    from p3d.parallel.mesh import Mesh
    from p3d.train.executors.ds_engine import DeepSpeedExecutor
    from p3d.train.executors.torch_schedules import TorchExecutor
    from p3d.train.worker import init_process_group

    cfg, plan = compose_spec(["mesh=single", f"model={args.model}", f"train.steps={2 * args.steps}", *overrides], tmp)
    init_process_group(plan, 0, cfg.cluster.timeout_s)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    mesh = Mesh.from_plan(plan, 0).with_groups()
    device = torch.device("cpu")
    one_stage = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, pipeline=Pipeline["gpipe"]))
    executors = {
        "deepspeed": DeepSpeedExecutor(cfg, plan, mesh, 0, device, tmp),
        "torch": TorchExecutor(one_stage, plan, mesh, 0, device, tmp),
    }
    s = cfg.schedule
    data = {
        name: micro_batches(
            cfg.data, cfg.model.seq_len, s.global_batch_size, s.micro_batch_size, 1, 0, cfg.train.seed, 0, None
        )  # fmt: skip
        for name in executors
    }
    wall: dict[str, list[float]] = {name: [] for name in executors}
    cpu: dict[str, list[float]] = {name: [] for name in executors}
    losses: dict[str, list[float]] = {name: [] for name in executors}
    shape = f"{plan.micro_batches} micro batches of {s.micro_batch_size} x {cfg.model.seq_len}"
    print(f"{cfg.model.name} {' '.join(overrides)}: {plan.n_params / 1e6:.1f}M params, {shape}; {args.steps} steps")
    for step in range(args.steps):
        order = ("deepspeed", "torch") if step % 2 == 0 else ("torch", "deepspeed")
        for name in order:
            t, c = time.perf_counter(), time.process_time()
            losses[name].append(executors[name].train_batch(data[name]))
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
            executors[name].timer.take(), executors[name].timer.take_compute()
    diff = max(abs(a - b) / abs(a) for a, b in zip(losses["deepspeed"], losses["torch"]))
    print(f"losses: max relative difference {diff:.1e} over {args.steps} steps (the same model, data and init)")
    print(f"{'executor':<10} {'wall s/step':>12} {'cpu s/step':>11}")
    med = {}
    for name in executors:
        med[name] = (statistics.median(wall[name][args.warmup :]), statistics.median(cpu[name][args.warmup :]))
        print(f"{name:<10} {med[name][0]:>12.4f} {med[name][1]:>11.4f}")
    ratio_wall = med["torch"][0] / med["deepspeed"][0]
    ratio_cpu = med["torch"][1] / med["deepspeed"][1]
    print(f"torch / deepspeed: wall {ratio_wall:.3f}x, cpu {ratio_cpu:.3f}x (target <= 1.05); "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
