"""p3d's overhead over a plain PyTorch loop on one CPU worker (issue 2, "Benchmark"): whole runs, and where it goes.

    .venv/bin/python bench/overhead.py                 # = plain (make bench): model=small shapes, ~12 min, 2 idle cores
    .venv/bin/python bench/overhead.py plain --steps 10 --rounds 3 --set model.n_layers=6 --json out.json
    .venv/bin/python bench/overhead.py breakdown       # the same two trainers in one process, time per phase

- ``plain`` (the default: what ``make bench`` runs): the real ``p3d-train mesh=single`` against the plain PyTorch loop
  of bench/_plain_loop.py (same model, data, micro batches and optimizer), ABBA rounds, tokens/s and worker CPU
  seconds per step; target p3d / plain >= 0.95;
- ``breakdown``: both trainers in one process, alternating steps, every DeepSpeed pipeline instruction and the plain
  loop's matching phases timed.
``bench/overhead.py <command> --help`` says how each measures.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import (  # noqa: E402
    add_command,
    base_env,
    bench_parser,
    compose_spec,
    replica_batches,
    run_command,
    run_monitored,
    run_p3d_monitored,
    summarize,
    turns,
    usage_error,
)
from bench._plain_loop import PlainLoop, plain_worker  # noqa: E402

COMMANDS = ("plain", "breakdown")
TARGET = 0.95


def run_plain(spec: Path, out: Path, threads: int, timeout: float):
    cmd = [sys.executable, str(Path(__file__).resolve()), "plain", "--plain-worker", str(spec), "--out", str(out),
           "--threads", str(threads)]  # fmt: skip
    return run_monitored(cmd, base_env(threads), out.with_suffix(".log"), out, timeout, cwd=ROOT)


def spec_diff(a: Path, b: Path) -> list[str]:
    """Top-level sections that differ between two run specs (run.dir aside), read as plain YAML."""
    from omegaconf import OmegaConf

    da, db = (OmegaConf.to_container(OmegaConf.load(p / "run_spec.yaml")) for p in (a, b))
    return sorted(k for k in set(da) | set(db) if k != "run" and da.get(k) != db.get(k))


def plain(args) -> int:
    """p3d's overhead over a plain PyTorch loop, on one CPU worker (issue 2, "Benchmark").

    Both sides train the same model (``model=small`` with a short sequence and a small batch by default,
    so a step takes a few seconds on one core), from the same seeded init, on the same data (the default
    ``data=stdlib`` corpus), with the same micro batching, the same optimizer settings and the same
    number of torch threads, and each step is timed the same way:

    - **p3d**: the real ``p3d-train mesh=single ...`` as a subprocess (run directory in a temp dir); its
      ``metrics.jsonl`` ``step_time_s`` is the wall time of one ``engine.train_batch`` call (fetching
      the micro batches, forward/backward of each, the DeepSpeed gradient reduction, clipping and the
      optimizer + LR scheduler step). Its gloo worker runs one torch thread (p3d/train/worker.py).
    - **plain**: a fresh ``python bench/overhead.py plain --plain-worker`` process that reads the run spec the
      bench composed through p3d's own Hydra path, builds the model with ``p3d.pipeline.specs.to_sequential``
      (the pipeline's single-process twin, same seeded master weights), pulls the micro batches from the
      same ``p3d.data.loader.micro_batches`` iterator, and times: fetch every micro batch of the step,
      forward/backward each (loss / micro batches), ``clip_grad_norm_``, ``torch.optim.AdamW.step``,
      ``zero_grad``, LR scheduler step. (``p3d.train.reference.reference_run`` is not reused for timing:
      it fetches the batch outside its timer and syncs ``loss.item()`` per micro batch.)

    Noise: the two sides alternate in rounds (ABBA order: p3d, plain, plain, p3d, ...), each run drops
    its first ``--warmup`` steps, and the table reports medians over all kept steps (and per round).
    Besides wall time, the bench reads each worker's CPU time (/proc/<pid>/stat) whenever the worker
    appends a step record (p3d's metrics.jsonl, the plain worker's jsonl alike); the CPU seconds between
    two records move far less than wall time when other processes compete for the cores, so their ratio
    is the steadier estimate of the overhead on a shared machine. The per-step losses of the two sides are compared as
    a check that they train the same thing. Target (issue 2): p3d tokens/s >= 0.95 of the plain loop.
    """
    if args.plain_worker:
        plain_worker(args.plain_worker, args.out, args.threads)
        return 0
    if args.warmup < 1 or args.steps <= args.warmup:
        usage_error(
            args,
            f"need 1 <= --warmup < --steps (got --warmup={args.warmup} --steps={args.steps}): the first step "
            f"of a run allocates everything, and its CPU time cannot be split from the start-up",
        )
    if "mesh" in {e.split("=", 1)[0] for e in args.extra}:
        usage_error(args, "the benchmark is mesh=single by definition")

    os.environ.update(DS_ACCELERATOR="cpu", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    overrides = [f"model={args.model}", f"model.seq_len={args.seq_len}",
                 f"schedule.global_batch_size={args.global_batch}", f"schedule.micro_batch_size={args.micro_batch}",
                 f"train.steps={args.steps}", *args.extra]  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="p3d-overhead-"))
    try:
        spec_dir = tmp / "spec"
        cfg, plan = compose_spec(["mesh=single", *overrides], spec_dir)
        m = cfg.model
        print(
            f"bench: {m.name} shapes (L={m.n_layers} h={m.hidden_size} heads={m.n_heads}/{m.n_kv_heads} "
            f"ffn={m.ffn_hidden_size} V={m.vocab_size} s={m.seq_len}, {plan.n_params / 1e6:.1f}M params), "
            f"{plan.micro_batches} micro batches of {cfg.schedule.micro_batch_size} = {plan.tokens_per_step} "
            f"tokens/step, {args.steps} steps x {args.rounds} rounds per side, {args.threads} thread(s); "
            f"work dir {tmp}",
            flush=True,
        )
        if args.threads != 1:
            print(f"bench: warning: p3d's gloo worker always runs 1 torch thread; the plain side runs {args.threads}: "
                  f"not like with like", flush=True)  # fmt: skip
        load_before = os.getloadavg()[0]
        plain_spec = spec_dir / "run_spec.yaml"  # then the latest p3d run's own spec
        runs: dict[str, list[list[dict]]] = {"p3d": [], "plain": []}
        wall: dict[str, list[float]] = {"p3d": [], "plain": []}
        for rnd, side in turns(("p3d", "plain"), args.rounds):
            print(f"bench: round {rnd + 1}/{args.rounds}: {side} ...", end=" ", flush=True)
            if side == "p3d":
                run_dir = tmp / f"p3d-{rnd}"
                recs, secs = run_p3d_monitored(overrides, run_dir, args.threads, args.timeout, args.keep)
                diff = spec_diff(spec_dir, run_dir)
                if diff:  # p3d's code changed since the bench composed its spec: follow p3d's
                    print(f"(warning: p3d's run spec differs from the bench's in {diff}; the plain side now reads "
                          f"p3d's)", end=" ", flush=True)  # fmt: skip
                plain_spec = run_dir / "run_spec.yaml"
            else:
                recs, secs = run_plain(plain_spec, tmp / f"plain-{rnd}.jsonl", args.threads, args.timeout)
            runs[side].append(recs)
            wall[side].append(secs)
            kept = [r["step_time_s"] for r in recs[args.warmup :]]
            cpu = [r["cpu_s"] for r in recs[args.warmup :] if r.get("cpu_s")]
            print(f"{len(recs)} steps, median {statistics.median(kept):.3f} s/step"
                  + (f" ({statistics.median(cpu):.3f} CPU s)" if cpu else "") + f", process wall {secs:.1f} s",
                  flush=True)  # fmt: skip
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return report(args, overrides, plan, runs["p3d"], runs["plain"], wall, load_before)


def report(args, overrides, plan, p3d_runs, plain_runs, wall, load_before) -> int:
    """``plain``'s table, ratios and verdicts (and ``--json``)."""
    load_after = os.getloadavg()[0]
    tps = plan.tokens_per_step
    p3d, plain = summarize(p3d_runs, args.warmup, tps), summarize(plain_runs, args.warmup, tps)
    ratio = p3d["median_tokens_per_s"] / plain["median_tokens_per_s"]
    best_ratio = p3d["best_tokens_per_s"] / plain["best_tokens_per_s"]
    # rounds r of both sides ran back to back (ABBA), so each pair saw about the same machine
    round_ratios = [b / a for a, b in zip(p3d["per_round_median_step_s"], plain["per_round_median_step_s"])]
    cpu_ratio = (plain["median_cpu_s_per_step"] / p3d["median_cpu_s_per_step"]
                 if p3d["median_cpu_s_per_step"] and plain["median_cpu_s_per_step"] else None)  # fmt: skip
    loss_rel = max(abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-12) for a, b in zip(p3d_runs[0], plain_runs[0]))

    def both(fmt) -> tuple[str, str]:
        return fmt(p3d), fmt(plain)

    rows = [
        ("", "p3d (mesh=single)", "plain PyTorch"),
        ("kept steps (all rounds)", *both(lambda x: str(x["kept_steps"]))),
        ("median step time [s]", *both(lambda x: f"{x['median_step_s']:.3f}")),
        ("min / max step time [s]", *both(lambda x: f"{x['min_step_s']:.3f} / {x['max_step_s']:.3f}")),
        ("median per round [s]", *both(lambda x: " ".join(f"{v:.3f}" for v in x["per_round_median_step_s"]))),
        ("median CPU time per step [s]",
         *both(lambda x: f"{x['median_cpu_s_per_step']:.3f}" if x["median_cpu_s_per_step"] else "n/a")),
        ("median tokens/s", *both(lambda x: f"{x['median_tokens_per_s']:.1f}")),
        ("best-step tokens/s", *both(lambda x: f"{x['best_tokens_per_s']:.1f}")),
        ("process wall per run [s]", " ".join(f"{x:.1f}" for x in wall["p3d"]),
         " ".join(f"{x:.1f}" for x in wall["plain"])),
    ]  # fmt: skip
    w0, w1, w2 = (max(len(r[i]) for r in rows) for i in range(3))
    print()
    print(
        f"model={args.model} {' '.join(overrides[1:])} | mesh=single | {plan.micro_batches} micro batches | "
        f"{tps} tokens/step | threads: p3d 1, plain {args.threads} | warm-up steps dropped per run: {args.warmup}"
    )
    for i, (a, b, c) in enumerate(rows):
        print(f"{a:<{w0}}  {b:>{w1}}  {c:>{w2}}")
        if i == 0:
            print("-" * (w0 + w1 + w2 + 4))

    def verdict(r):
        return "PASS" if r >= TARGET else "FAIL"

    # median wall / CPU seconds of a step: 1.0 when the worker had a core to itself the whole step
    waits = {side: statistics.median(r["step_time_s"] / r["cpu_s"] for run in runs for r in run[args.warmup :]
                                     if r.get("cpu_s"))
             for side, runs in (("p3d", p3d_runs), ("plain", plain_runs)) if cpu_ratio}  # fmt: skip
    busy = any(w > 1.05 for w in waits.values())
    print(f"\nratio p3d / plain, median tokens/s (wall time):   {ratio:.3f}   [target >= {TARGET}: {verdict(ratio)}]")
    if cpu_ratio:
        print(f"ratio p3d / plain, median worker CPU s per step:  {cpu_ratio:.3f}   [target >= {TARGET}: "
              f"{verdict(cpu_ratio)}]")  # fmt: skip
    print(f"ratio p3d / plain, best step (wall):              {best_ratio:.3f}")
    print(f"ratio p3d / plain per round (wall medians):       {' '.join(f'{r:.3f}' for r in round_ratios)}")
    print(
        f"load average (1 min) before / after: {load_before:.1f} / {load_after:.1f} on {os.cpu_count() or 1} cores; "
        f"median step wall / CPU time: " + ", ".join(f"{k} {v:.2f}" for k, v in waits.items())
    )
    if busy:
        print(
            "  -> the workers waited for a core (other processes were running): the wall-time figures carry that "
            "noise; the CPU-time ratio is the one to trust. Rerun on an idle machine for a clean wall-time figure."
        )
    print(
        f"max relative per-step loss difference, round 1: {loss_rel:.2e} (same model, same data)"
        + ("   [WARNING: the two sides did not train the same thing]" if loss_rel > 1e-3 else "")
    )
    if args.json:
        result = {
            "model": args.model, "overrides": overrides, "mesh": "single", "threads_p3d": 1,
            "threads_plain": args.threads, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
            "micro_batches": plan.micro_batches, "tokens_per_step": tps, "n_params": plan.n_params, "p3d": p3d,
            "plain": plain, "ratio": ratio, "best_step_ratio": best_ratio, "per_round_ratio": round_ratios,
            "cpu_time_ratio": cpu_ratio, "load_avg_before_after": [load_before, load_after], "wall_over_cpu": waits,
            "busy": busy, "target": TARGET, "pass": ratio >= TARGET,
            "pass_cpu_time": bool(cpu_ratio and cpu_ratio >= TARGET), "max_rel_loss_diff": loss_rel,
            "raw": {"p3d": p3d_runs, "plain": plain_runs},
        }  # fmt: skip
        text = json.dumps(result, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


def breakdown(args) -> int:
    """Where p3d's single-rank overhead goes: one process, both trainers, alternating steps, per phase.

    A diagnostic companion of ``plain`` (which times the real ``p3d-train`` subprocess). Here
    one process builds the p3d DeepSpeed pipeline engine exactly as ``p3d.train.loop.train`` does
    (mesh=single, gloo, one thread) and the plain loop of ``plain``, and alternates their
    optimizer steps (p3d, plain, plain, p3d, ...), so machine noise hits both alike. Every DeepSpeed
    pipeline instruction is timed (wall and process CPU time; CPU time is the steadier figure on a
    shared machine), and the plain loop's matching phases.

    The p3d side is ``p3d.train.executors.ds_engine.build_engine``, the very function a p3d worker calls, so what is
    measured here is what runs (including the two overhead fixes that came out of this diagnostic: the
    chunked fused gradient norm in ``p3d.train.optim`` and, over a single replica, skipping DeepSpeed's
    flatten / all-reduce-over-one-rank / copy-back of every gradient).
    """
    tmp = Path(tempfile.mkdtemp(prefix="p3d-breakdown-"))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                      DS_ACCELERATOR="cpu", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
                      P3D_INIT_METHOD=f"file://{tmp / 'store'}")  # fmt: skip
    import torch
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from p3d.parallel.mesh import Mesh
    from p3d.train import optim
    from p3d.train.executors import ds_engine as trainer
    from p3d.train.worker import init_process_group

    cfg, plan = compose_spec(["mesh=single", f"model={args.model}", f"model.seq_len={args.seq_len}",
                              f"schedule.global_batch_size={args.global_batch}",
                              f"schedule.micro_batch_size={args.micro_batch}", f"train.steps={args.steps}",
                              *args.extra], tmp)  # fmt: skip
    init_process_group(plan, 0, cfg.cluster.timeout_s)  # sets torch threads to 1, as a p3d worker

    acc: dict[str, list[float]] = {}

    def add(key, t, c):
        a = acc.setdefault(key, [0.0, 0.0])
        a[0] += time.perf_counter() - t
        a[1] += time.process_time() - c

    @contextlib.contextmanager
    def phase(key):
        t, c = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            add(key, t, c)

    def timed(fn, key):
        def wrapper(*a, **k):
            with phase(key):
                return fn(*a, **k)

        return wrapper

    for instr in list(PipelineEngine._INSTRUCTION_MAP):
        PipelineEngine._INSTRUCTION_MAP[instr] = timed(PipelineEngine._INSTRUCTION_MAP[instr], f"p3d  {instr.__name__}")
    optim.global_grad_norm = timed(optim.global_grad_norm, "p3d    of which global_grad_norm")
    torch.optim.AdamW.step = timed(torch.optim.AdamW.step, "{side} AdamW.step")

    # p3d: as p3d.train.loop.train builds it
    mesh = Mesh.from_plan(plan, 0).with_groups()
    engine, _, _ = trainer.build_engine(cfg, plan, mesh)
    p3d_data = replica_batches(cfg)  # what p3d's trainer reads at dp=1
    loop = PlainLoop(cfg, plan)  # as the plain worker of ``plain``
    wall, cpu = collections.defaultdict(list), collections.defaultdict(list)
    print(f"{cfg.model.name}: {plan.n_params / 1e6:.1f}M params, {loop.n_micro} micro batches of "
          f"{cfg.schedule.micro_batch_size} x {cfg.model.seq_len}", flush=True)  # fmt: skip
    for step in range(args.steps):
        for side in ("p3d", "plain") if step % 2 == 0 else ("plain", "p3d"):
            acc.clear()
            with phase(f"{side} STEP"):
                loss = float(engine.train_batch(p3d_data)) if side == "p3d" else float(loop.step(phase)[0])
            for key, (w, cc) in acc.items():
                key = key.replace("{side}", side + "  ")
                wall[key].append(w)
                cpu[key].append(cc)
            print(f"step {step + 1} {side:5s} loss {loss:.5f}  wall {acc[f'{side} STEP'][0]:.3f} s  "
                  f"cpu {acc[f'{side} STEP'][1]:.3f} s", flush=True)  # fmt: skip
    keep = slice(args.warmup, None)
    print(f"\nmedian per step over steps {args.warmup + 1}..{args.steps}      wall [s]   cpu [s]")
    for key in sorted(wall, key=lambda k: (k.split()[0], k.endswith("STEP"), k)):
        print(f"  {key:<48s} {statistics.median(wall[key][keep]):8.3f}  {statistics.median(cpu[key][keep]):8.3f}")
    ratio_w = statistics.median(wall["plain STEP"][keep]) / statistics.median(wall["p3d STEP"][keep])
    ratio_c = statistics.median(cpu["plain STEP"][keep]) / statistics.median(cpu["p3d STEP"][keep])
    print(f"p3d / plain throughput: {ratio_w:.3f} by wall time, {ratio_c:.3f} by CPU time")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def parser() -> argparse.ArgumentParser:
    ap, commands = bench_parser(__doc__)
    p = add_command(commands, plain)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of the medians (default 2)")
    p.add_argument("--rounds", type=int, default=4, help="runs per side, alternating ABBA (default 4)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the plain side (default 1: what p3d's gloo worker uses, p3d/train/worker.py)",
    )
    p.add_argument("--model", default="small", help="model preset (default small)")
    p.add_argument("--seq-len", type=int, default=128, help="model.seq_len (default 128)")
    p.add_argument("--global-batch", type=int, default=4, help="schedule.global_batch_size (default 4)")
    p.add_argument("--micro-batch", type=int, default=2, help="schedule.micro_batch_size (default 2)")
    p.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any further p3d override, applied to both sides (repeatable), e.g. --set model.n_layers=6",
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per run (default 900)")
    p.add_argument("--keep", action="store_true", help="keep the temp directory (run dirs and logs)")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="also write the results as JSON (to PATH, or stdout)")  # fmt: skip
    p.add_argument("--plain-worker", metavar="RUN_SPEC", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)

    p = add_command(commands, breakdown)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--model", default="small")
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE")

    return ap


def command_line(argv: list[str]) -> list[str]:
    """``argv`` with ``plain`` in front where it names no command: `make bench` runs the script bare."""
    return argv if argv and argv[0] in (*COMMANDS, "-h", "--help") else ["plain", *argv]


def main(argv: list[str] | None = None) -> int:
    return run_command(parser(), command_line(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
