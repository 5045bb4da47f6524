"""Pipeline schedules and stages on CPU workers (issue 11): tokens/s and the measured bubble of each schedule, the torch
executor's own cost against DeepSpeed's engine, and stage partitions against the bubble.

    .venv/bin/python bench/schedules.py throughput                 # the bench model, m = 4 and 8, steps alternating
    .venv/bin/python bench/schedules.py throughput --runs --rounds 3   # the same through p3d-train, runs alternating
    .venv/bin/python bench/schedules.py throughput --set           # model=tiny as it is (per-op overhead bound)
    .venv/bin/python bench/schedules.py throughput --pp 4 --m 8 --set model.n_layers=8
    .venv/bin/python bench/schedules.py executor                   # the bench model of throughput
    .venv/bin/python bench/schedules.py executor --model tiny --steps 30  # per-op overhead dominates
    .venv/bin/python bench/schedules.py partition                  # 3 rounds of blocks, uniform, cost; 6 steps each
    .venv/bin/python bench/schedules.py partition --rounds 5 --steps 8

- ``throughput``: every schedule on pp2 (or pp4), tokens/s against DeepSpeed's 1f1b, measured and planned bubble;
- ``executor``: ``TorchExecutor`` over one stage against ``DeepSpeedExecutor``: the same work, the executor's own;
- ``partition``: ``schedule.partition`` blocks, uniform and cost on pp2: the idle share and the stages' balance.
``bench/schedules.py <command> --help`` says how each measures.
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

from bench._common import (  # noqa: E402
    add_command,
    bench_parser,
    compose_spec,
    init_worker,
    load_average,
    p3d_train,
    replica_batches,
    run_command,
    run_workers,
    turns,
)

BENCH_MODEL = ("model.hidden_size=512", "model.ffn_hidden_size=1536", "model.seq_len=128")
SCHEDULES = {  # name -> overrides (v = 2 for all but 1f1b and gpipe)
    "1f1b": (),
    "gpipe": ("schedule.pipeline=gpipe",),
    "interleaved_1f1b": ("schedule.pipeline=interleaved_1f1b", "schedule.virtual_stages=2"),
    "interleaved_zero_bubble": ("schedule.pipeline=interleaved_zero_bubble", "schedule.virtual_stages=2"),
    "zbv": ("schedule.pipeline=zbv", "schedule.virtual_stages=2"),
    "dualpipev": ("schedule.pipeline=dualpipev", "schedule.virtual_stages=2"),
}
PARTITIONS = ("blocks", "uniform", "cost")
PARTITION_RUN = ("model=small", "model.n_layers=4", "model.seq_len=256", "mesh=pp2", "schedule.micro_batch_size=1",
                 "schedule.global_batch_size=8", "train.save_every=0")  # fmt: skip


def overrides(name: str, m: int, args) -> list[str]:
    mbs = args.micro_batch_size
    return [
        f"model={args.model}", f"mesh=pp{args.pp}", "train.save_every=0", f"schedule.micro_batch_size={mbs}",
        f"schedule.global_batch_size={mbs * m}", *SCHEDULES[name], *args.set,
    ]  # fmt: skip


# ---- throughput: whole runs through p3d-train
def one_run(name: str, m: int, args, run_dir: Path) -> tuple[float, float]:
    """(median tokens/s, median measured bubble) of the steps after the warmup."""
    records = p3d_train([f"train.steps={args.steps}", "train.keep_last=1", *overrides(name, m, args)], run_dir,
                        {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, timeout=1800)[args.warmup :]  # fmt: skip
    return statistics.median(r["tokens_per_s"] for r in records), statistics.median(r["bubble"] for r in records)


def by_runs(args) -> dict[tuple[str, int], list[tuple[float, float]]]:
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="p3d-bench-schedules-") as tmp:
        for r in range(args.rounds):
            for m in args.m:
                for name in args.schedules:
                    run_dir = Path(tmp) / f"{name}-m{m}-r{r}"
                    results.setdefault((name, m), []).append(one_run(name, m, args, run_dir))
                    print(f"round {r + 1}: {name} m={m} done", file=sys.stderr, flush=True)
    return results


# ---- throughput: steps alternating inside one set of workers
def _steps_worker(rank: int, world: int, args, out_path: str) -> None:
    import json

    import torch

    from p3d.parallel.mesh import Mesh
    from p3d.train.executors import build_executor
    from p3d.train.loop import Stopper, step_stats
    from tests.helpers.runs import typed

    init_worker(300)  # one thread, freed memory kept: as p3d-train's CPU workers
    device, stopper, mesh = torch.device("cpu"), Stopper(), None
    results: dict[str, list[tuple[float, float, float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix=f"p3d-bench-steps-{rank}-") as tmp:
        for m in args.m:
            executors, data, tokens = {}, {}, 0
            for name in args.schedules:
                cfg, plan = typed(*overrides(name, m, args), f"train.steps={args.rounds + args.warmup}")
                mesh = mesh or Mesh.from_plan(plan, rank).with_groups()
                executors[name] = build_executor(cfg, plan, mesh, rank, device, tmp)
                tokens = cfg.schedule.global_batch_size * cfg.model.seq_len
                data[name] = replica_batches(cfg)
            for r in range(args.warmup + args.rounds):
                for name in args.schedules if r % 2 == 0 else args.schedules[::-1]:
                    ex = executors[name]
                    t0 = time.perf_counter()
                    ex.train_batch(data[name] if ex.reads_data else None)
                    step_time = time.perf_counter() - t0
                    _, bubble, _, compute, _ = step_stats(stopper, ex.timer.take() / step_time,
                                                          ex.timer.take_compute(), ex.timer.take_comm([]),
                                                          device, None)  # fmt: skip
                    if r >= args.warmup:
                        results.setdefault(f"{name}|{m}", []).append((tokens / step_time, bubble, step_time,
                                                                      statistics.mean(compute)))  # fmt: skip
                if rank == 0:
                    print(f"m={m}: round {r + 1} of {args.warmup + args.rounds}", file=sys.stderr, flush=True)
            del executors
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))


def by_steps(args) -> dict[tuple[str, int], list[tuple[float, float]]]:
    raw = run_workers(_steps_worker, args.pp, args, timeout=7200)
    for key, rows in raw.items():  # the step's split: compute (forward, backward, weight passes), waits, the rest
        name, m = key.split("|")
        step, compute = statistics.median(r[2] for r in rows), statistics.median(r[3] for r in rows)
        bubble = statistics.median(r[1] for r in rows)
        print(f"  {name} m={m}: step {step:.3f} s = compute {compute:.3f} + waits {bubble * step:.3f} + other "
              f"{step - compute - bubble * step:.3f} (medians, mean over ranks)", file=sys.stderr)  # fmt: skip
    return {(key.split("|")[0], int(key.split("|")[1])): [(r[0], r[1]) for r in v] for key, v in raw.items()}


def throughput(args) -> int:
    """Tokens/s and measured bubble of each pipeline schedule on pp2 (or pp4), ratio to DeepSpeed's 1f1b (issue 11).

    The bench model is model=tiny widened until compute, not per-operation overhead, sets a step's time on a CPU
    core (h = 512, ffn 1536, s = 128: ~100 ms of forward and backward per block and micro batch of 2, against
    about a millisecond of a schedule's own work per action); its 512-word head costs 0.08 of a block, so the two
    stages are balanced and what differs between schedules is their bubble and their executor.

    Two ways to alternate, both on two worker processes (one per core here, so idle time is lost time):
    - default: the pp workers build every schedule's executor as p3d-train builds it
      (``p3d.train.executors.build_executor``, the same seeded init and data) and alternate *steps*: one step of
      each schedule per round, the order reversed every other round. A step's time is the wall time of
      ``train_batch`` and its bubble the executor's timer over it (``trainer.step_stats``), as in metrics.jsonl. The
      machine's load then hits every schedule within seconds of the others: ratios to 1f1b are steady where whole
      runs minutes apart are not (measured here: rounds of whole runs spread by 10-30%).
    - ``--runs``: one ``p3d-train mesh=pp2 schedule.pipeline=<s>`` run per (schedule, m, round), the schedules
      alternating within each round; per run the median over the steps after ``--warmup`` of ``tokens_per_s`` and
      ``bubble`` from its metrics.jsonl. This is what a user runs, launch included.
    Printed: the median over rounds (and their range), the ratio to ``1f1b`` (DeepSpeed's engine) at the same m:
    of the medians ("vs 1f1b"), and the median of each round's own ratio ("paired": a round's steps of all
    schedules run within seconds, so this one cancels the slower swings of the machine), the measured bubble and
    ``geometry.schedule_bubble`` (the planner's), and the machine's load average. Without ``--runs``, each
    schedule's step split into compute, waits and the rest goes to stderr.
    """
    from p3d.layout.geometry import schedule_bubble

    args.set = list(BENCH_MODEL if args.set is None else args.set)
    args.rounds = args.rounds or (3 if args.runs else 20)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = by_runs(args) if args.runs else by_steps(args)
    how = f"{args.rounds} rounds x {args.steps} steps (first {args.warmup} dropped)" if args.runs else (
        f"{args.rounds} alternating steps of each schedule (after {args.warmup})")  # fmt: skip
    print(f"model={args.model} {' '.join(args.set)} pp{args.pp}, {how}; load average {load_average()}")
    print(f"{'schedule':<24} {'m':>3} {'tokens/s':>10} {'range':>15} {'vs 1f1b':>8} {'paired':>7} {'bubble':>7} "
          f"{'theory':>7}")  # fmt: skip
    for m in args.m:
        base = [t for t, _ in results.get(("1f1b", m), [(float("nan"), 0.0)])]
        for name in args.schedules:
            toks = [t for t, _ in results[(name, m)]]
            tok = statistics.median(toks)
            paired = statistics.median(t / b for t, b in zip(toks, base))  # each round against its own 1f1b
            bub = statistics.median(b for _, b in results[(name, m)])
            theory = schedule_bubble(name, args.pp, m, 1 if name in ("1f1b", "gpipe") else 2)
            spread = f"{min(toks):,.0f}-{max(toks):,.0f}"
            print(f"{name:<24} {m:>3} {tok:>10,.0f} {spread:>15} {tok / statistics.median(base):>7.2f}x "
                  f"{paired:>6.2f}x {bub:>7.3f} {theory:>7.3f}")  # fmt: skip
    return 0


def executor(args) -> int:
    """The torch executor's per-step overhead against DeepSpeed's engine at pp=1-equivalent work (issue 11).

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
    overrides = list(BENCH_MODEL if args.set is None else args.set)
    tmp = Path(tempfile.mkdtemp(prefix="p3d-executor-overhead-"))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", P3D_INIT_METHOD=f"file://{tmp / 'store'}")
    import deepspeed
    import torch

    from p3d.config.schema import Pipeline
    from p3d.parallel.mesh import Mesh
    from p3d.train.executors.ds_engine import DeepSpeedExecutor
    from p3d.train.executors.torch_schedules import TorchExecutor
    from p3d.train.worker import init_process_group

    cfg, plan = compose_spec(["mesh=single", f"model={args.model}", f"train.steps={2 * args.steps}", *overrides], tmp)
    init_process_group(plan, 0, cfg.cluster.timeout_s)
    deepspeed.init_distributed(dist_backend="gloo")
    mesh = Mesh.from_plan(plan, 0).with_groups()
    device = torch.device("cpu")
    one_stage = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, pipeline=Pipeline["gpipe"]))
    executors = {"deepspeed": DeepSpeedExecutor(cfg, plan, mesh, 0, device, tmp),
                 "torch": TorchExecutor(one_stage, plan, mesh, 0, device, tmp)}  # fmt: skip
    data = {name: replica_batches(cfg) for name in executors}
    wall: dict[str, list[float]] = {name: [] for name in executors}
    cpu: dict[str, list[float]] = {name: [] for name in executors}
    losses: dict[str, list[float]] = {name: [] for name in executors}
    shape = f"{plan.micro_batches} micro batches of {cfg.schedule.micro_batch_size} x {cfg.model.seq_len}"
    print(f"{cfg.model.name} {' '.join(overrides)}: {plan.n_params / 1e6:.1f}M params, {shape}; {args.steps} steps")
    for _, name in turns(("deepspeed", "torch"), args.steps):
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
          f"load average {load_average()}")  # fmt: skip
    return 0


def measure_partition(partition: str, steps: int, where: Path) -> tuple[float, float]:
    """(median idle share, median busier / other stage compute) of one run, step 1 left out."""
    records = p3d_train([*PARTITION_RUN, f"train.steps={steps}", f"schedule.partition={partition}"],
                        where / partition, timeout=900)  # fmt: skip
    records = [r for r in records if "loss" in r][1:]
    ratios = [max(r["stage_compute_s"]) / min(r["stage_compute_s"]) for r in records]
    return statistics.median(r["bubble"] for r in records), statistics.median(ratios)


def partition(args) -> int:
    """Stage partitions against the measured pipeline bubble (issue 11, item 6).

    pp2, ``model=small`` with 4 layers (its 50k-vocabulary head and loss weigh 5.5 blocks), 8 micro batches of
    256 tokens. By count (``blocks``, ``uniform``) the last stage carries the head on top of its blocks and the
    first waits for it; by ``cost`` the head gets the last stage to itself. Per run it reads ``metrics.jsonl``:
    the measured idle share (``bubble``) and the ratio of the busier stage's forward + backward seconds to the
    other's (``stage_compute_s``), medians over the steps after the first. The rounds interleave the partitions
    so the machine's load hits each alike; it prints every run and the medians over rounds, with the theory
    (1F1B with equal stages: (p-1)/(m+p-1)). The FLOPs each stage runs are a test (tests/unit/layout/test_partition.py);
    this is the wall-clock effect, which on shared cores is no test.
    """
    p, m = 2, 8
    print(f"pp{p}, m={m}: theory with equal stages {(p - 1) / (m + p - 1):.3f}; load {os.getloadavg()[0]:.1f}")
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in PARTITIONS}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for name in PARTITIONS:
                idle, ratio = measure_partition(name, args.steps, Path(tmp) / f"round{rnd}")
                results[name].append((idle, ratio))
                print(f"round {rnd} {name:8s} idle share {idle:.3f}  busier/other stage compute {ratio:.2f}")
    print(f"medians over {args.rounds} rounds (load now {os.getloadavg()[0]:.1f}):")
    for name, rows in results.items():
        idle = statistics.median(r[0] for r in rows)
        ratio = statistics.median(r[1] for r in rows)
        print(f"  {name:8s} idle share {idle:.3f}  busier/other stage compute {ratio:.2f}")
    return 0


def parser() -> argparse.ArgumentParser:
    ap, commands = bench_parser(__doc__)
    p = add_command(commands, throughput)
    p.add_argument("--runs", action="store_true", help="whole p3d-train runs instead of alternating steps")
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=8, help="--runs: steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps (rounds) dropped: shapes, warm caches")
    p.add_argument("--rounds", type=int, default=None, help="default 20 alternating steps, 3 with --runs")
    p.add_argument("--pp", type=int, default=2, choices=[2, 4], help="pipeline stages (mesh=pp2 or pp4)")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--m", type=int, nargs="+", default=[4, 8], help="micro batches per step")
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    p.add_argument("--set", nargs="*", default=None, help=f"overrides (default: {' '.join(BENCH_MODEL)})")

    p = add_command(commands, executor)
    p.add_argument("--model", default="tiny", help="the model group (default tiny, reshaped by --set)")
    p.add_argument("--set", nargs="*", default=None, help=f"overrides (default: {' '.join(BENCH_MODEL)})")
    p.add_argument("--steps", type=int, default=12, help="steps of each executor")
    p.add_argument("--warmup", type=int, default=2)

    p = add_command(commands, partition)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    return ap


if __name__ == "__main__":
    sys.exit(run_command(parser()))
