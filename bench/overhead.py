"""p3d's overhead over a plain PyTorch loop, on one CPU worker (issue 2, "Benchmark").

    .venv/bin/python bench/overhead.py                       # model=small shapes, ~12 min on an idle 2-core box
    .venv/bin/python bench/overhead.py --steps 10 --rounds 3 --set model.n_layers=6 --json out.json

Both sides train the same model (``model=small`` with a short sequence and a small batch by default,
so a step takes a few seconds on one core), from the same seeded init, on the same data (the default
``data=stdlib`` corpus), with the same micro batching, the same optimizer settings and the same
number of torch threads, and each step is timed the same way:

- **p3d**: the real ``p3d-train mesh=single ...`` as a subprocess (run directory in a temp dir); its
  ``metrics.jsonl`` ``step_time_s`` is the wall time of one ``engine.train_batch`` call (fetching
  the micro batches, forward/backward of each, the DeepSpeed gradient reduction, clipping and the
  optimizer + LR scheduler step). Its gloo worker runs one torch thread (p3d/train/worker.py).
- **plain**: a fresh ``python bench/overhead.py --plain-worker`` process that reads the run spec the
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

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from proc_monitor import run_monitored  # bench/ is on sys.path when a bench script runs

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.95


# ----------------------------------------------------------------------------------------------
# plain side (runs in its own process, like a p3d worker)
# ----------------------------------------------------------------------------------------------
def plain_micro_batches(cfg):
    """The (inputs, labels) micro batches p3d's trainer feeds its one dp=1 replica, from the same loader."""
    from p3d.data.loader import micro_batches

    return micro_batches(
        cfg.data,
        cfg.model.seq_len,
        cfg.schedule.global_batch_size,
        cfg.schedule.micro_batch_size,
        1,
        0,
        seed=cfg.train.seed,
    )


def plain_worker(spec_path: str, out_path: str, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    from p3d.layout.geometry import padded_vocab
    from p3d.pipeline.specs import to_sequential
    from p3d.rundir.spec import read_spec
    from p3d.train.optim import build_optimizer

    cfg, plan = read_spec(spec_path)
    torch.manual_seed(cfg.train.seed)
    model = to_sequential(cfg.model, padded_vocab(cfg.model.vocab_size, 1), cfg.train.seed)
    model.train()
    opt, sched = build_optimizer(model, cfg.train)  # torch.optim.AdamW + LambdaLR, same groups and schedule
    data = plain_micro_batches(cfg)
    n_micro = plan.micro_batches
    max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
    params = list(model.parameters())
    with open(out_path, "w", buffering=1) as out:
        for step in range(1, cfg.train.steps + 1):
            lr = opt.param_groups[0]["lr"]
            t0 = time.perf_counter()
            total = None
            for _ in range(n_micro):
                inputs, labels = next(data)
                loss = model.loss(inputs, labels) / n_micro
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step_time = time.perf_counter() - t0
            out.write(
                json.dumps(
                    {
                        "step": step,
                        "loss": float(total),
                        "grad_norm": float(grad_norm),
                        "lr": lr,
                        "step_time_s": step_time,
                        "tokens_per_s": plan.tokens_per_step / step_time,
                    }
                )
                + "\n"
            )
            print(f"plain step {step}/{cfg.train.steps} loss {float(total):.4f} step {step_time:.3f}s", flush=True)


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------
def base_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        DS_ACCELERATOR="cpu",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def compose_spec(overrides: list[str], run_dir: Path):
    """Compose + validate exactly as p3d-train does, and write the run spec the plain side reads."""
    from hydra import compose, initialize_config_dir

    from p3d.config.schema import register_configs
    from p3d.launch.check import prepare
    from p3d.launch.compose import CONFIG_PATH
    from p3d.rundir.spec import write_spec

    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        node = compose("config", overrides=[*overrides, f"run.dir={run_dir}"])
    cfg, plan = prepare(node)
    write_spec(cfg, plan, run_dir)
    return cfg, plan


def run_p3d(overrides: list[str], run_dir: Path, threads: int, timeout: float, keep: bool):
    p3d_train = Path(sys.executable).with_name("p3d-train")
    cmd = [str(p3d_train)] if p3d_train.exists() else [sys.executable, "-m", "p3d.cli"]
    run_dir.mkdir(parents=True)
    records, secs = run_monitored(
        [*cmd, "mesh=single", *overrides, f"run.dir={run_dir}"],
        base_env(threads),
        run_dir.with_suffix(".log"),
        run_dir / "metrics.jsonl",
        timeout,
        worker_marker=str(run_dir),
        cwd=ROOT,
    )
    if not keep:  # p3d saves a checkpoint after its last step (outside the timed steps): ~1.5 GB for model=small
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return records, secs


def run_plain(spec: Path, out: Path, threads: int, timeout: float):
    return run_monitored(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--plain-worker",
            str(spec),
            "--out",
            str(out),
            "--threads",
            str(threads),
        ],
        base_env(threads),
        out.with_suffix(".log"),
        out,
        timeout,
        cwd=ROOT,
    )


def summarize(runs: list[list[dict]], warmup: int, tokens_per_step: int) -> dict:
    kept = [r["step_time_s"] for run in runs for r in run[warmup:]]
    cpu = [r["cpu_s"] for run in runs for r in run[warmup:] if r.get("cpu_s")]
    med = statistics.median(kept)
    return {
        "kept_steps": len(kept),
        "median_step_s": med,
        "min_step_s": min(kept),
        "max_step_s": max(kept),
        "median_tokens_per_s": tokens_per_step / med,
        "best_tokens_per_s": tokens_per_step / min(kept),
        "per_round_median_step_s": [statistics.median([r["step_time_s"] for r in run[warmup:]]) for run in runs],
        "median_cpu_s_per_step": statistics.median(cpu) if len(cpu) == len(kept) else None,
    }


def spec_diff(a: Path, b: Path) -> list[str]:
    """Top-level sections that differ between two run specs (run.dir aside), read as plain YAML."""
    from omegaconf import OmegaConf

    da, db = (OmegaConf.to_container(OmegaConf.load(p / "run_spec.yaml")) for p in (a, b))
    return sorted(k for k in set(da) | set(db) if k != "run" and da.get(k) != db.get(k))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per run (default 10)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of the medians (default 2)")
    ap.add_argument("--rounds", type=int, default=4, help="runs per side, alternating ABBA (default 4)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the plain side (default 1: what p3d's gloo worker uses, p3d/train/worker.py)",
    )
    ap.add_argument("--model", default="small", help="model preset (default small)")
    ap.add_argument("--seq-len", type=int, default=128, help="model.seq_len (default 128)")
    ap.add_argument("--global-batch", type=int, default=4, help="schedule.global_batch_size (default 4)")
    ap.add_argument("--micro-batch", type=int, default=2, help="schedule.micro_batch_size (default 2)")
    ap.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any further p3d override, applied to both sides (repeatable), e.g. --set model.n_layers=6",
    )
    ap.add_argument("--timeout", type=float, default=900, help="seconds allowed per run (default 900)")
    ap.add_argument("--keep", action="store_true", help="keep the temp directory (run dirs and logs)")
    ap.add_argument(
        "--json", nargs="?", const="-", metavar="PATH", help="also write the results as JSON (to PATH, or stdout)"
    )
    ap.add_argument("--plain-worker", metavar="RUN_SPEC", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.plain_worker:
        plain_worker(args.plain_worker, args.out, args.threads)
        return 0
    if args.warmup < 1 or args.steps <= args.warmup:
        ap.error(
            f"need 1 <= --warmup < --steps (got --warmup={args.warmup} --steps={args.steps}): the first step "
            f"of a run allocates everything, and its CPU time cannot be split from the start-up"
        )
    if "mesh" in {e.split("=", 1)[0] for e in args.extra}:
        ap.error("the benchmark is mesh=single by definition")

    os.environ.update(DS_ACCELERATOR="cpu", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    overrides = [
        f"model={args.model}",
        f"model.seq_len={args.seq_len}",
        f"schedule.global_batch_size={args.global_batch}",
        f"schedule.micro_batch_size={args.micro_batch}",
        f"train.steps={args.steps}",
        *args.extra,
    ]
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
            print(
                f"bench: warning: p3d's gloo worker always runs 1 torch thread; the plain side runs {args.threads}: "
                f"not like with like",
                flush=True,
            )
        load_before = os.getloadavg()[0]
        plain_spec = spec_dir / "run_spec.yaml"  # then the latest p3d run's own spec
        p3d_runs, plain_runs, wall = [], [], {"p3d": [], "plain": []}
        for rnd in range(args.rounds):
            order = ("p3d", "plain") if rnd % 2 == 0 else ("plain", "p3d")
            for side in order:
                print(f"bench: round {rnd + 1}/{args.rounds}: {side} ...", end=" ", flush=True)
                if side == "p3d":
                    run_dir = tmp / f"p3d-{rnd}"
                    recs, secs = run_p3d(overrides, run_dir, args.threads, args.timeout, args.keep)
                    diff = spec_diff(spec_dir, run_dir)
                    if diff:  # p3d's code changed since the bench composed its spec: follow p3d's
                        print(
                            f"(warning: p3d's run spec differs from the bench's in {diff}; the plain side now "
                            f"reads p3d's)",
                            end=" ",
                            flush=True,
                        )
                    plain_spec = run_dir / "run_spec.yaml"
                    p3d_runs.append(recs)
                else:
                    recs, secs = run_plain(plain_spec, tmp / f"plain-{rnd}.jsonl", args.threads, args.timeout)
                    plain_runs.append(recs)
                wall[side].append(secs)
                kept = [r["step_time_s"] for r in recs[args.warmup :]]
                cpu = [r["cpu_s"] for r in recs[args.warmup :] if r.get("cpu_s")]
                print(
                    f"{len(recs)} steps, median {statistics.median(kept):.3f} s/step"
                    + (f" ({statistics.median(cpu):.3f} CPU s)" if cpu else "")
                    + f", process wall {secs:.1f} s",
                    flush=True,
                )
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    load_after = os.getloadavg()[0]
    tps = plan.tokens_per_step
    p3d, plain = summarize(p3d_runs, args.warmup, tps), summarize(plain_runs, args.warmup, tps)
    ratio = p3d["median_tokens_per_s"] / plain["median_tokens_per_s"]
    best_ratio = p3d["best_tokens_per_s"] / plain["best_tokens_per_s"]
    # rounds r of both sides ran back to back (ABBA), so each pair saw about the same machine
    round_ratios = [b / a for a, b in zip(p3d["per_round_median_step_s"], plain["per_round_median_step_s"])]
    cpu_ratio = (
        plain["median_cpu_s_per_step"] / p3d["median_cpu_s_per_step"]
        if p3d["median_cpu_s_per_step"] and plain["median_cpu_s_per_step"]
        else None
    )
    loss_rel = max(abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-12) for a, b in zip(p3d_runs[0], plain_runs[0]))

    rows = [
        ("", "p3d (mesh=single)", "plain PyTorch"),
        ("kept steps (all rounds)", str(p3d["kept_steps"]), str(plain["kept_steps"])),
        ("median step time [s]", f"{p3d['median_step_s']:.3f}", f"{plain['median_step_s']:.3f}"),
        (
            "min / max step time [s]",
            f"{p3d['min_step_s']:.3f} / {p3d['max_step_s']:.3f}",
            f"{plain['min_step_s']:.3f} / {plain['max_step_s']:.3f}",
        ),
        (
            "median per round [s]",
            " ".join(f"{x:.3f}" for x in p3d["per_round_median_step_s"]),
            " ".join(f"{x:.3f}" for x in plain["per_round_median_step_s"]),
        ),
        (
            "median CPU time per step [s]",
            *(f"{x['median_cpu_s_per_step']:.3f}" if x["median_cpu_s_per_step"] else "n/a" for x in (p3d, plain)),
        ),
        ("median tokens/s", f"{p3d['median_tokens_per_s']:.1f}", f"{plain['median_tokens_per_s']:.1f}"),
        ("best-step tokens/s", f"{p3d['best_tokens_per_s']:.1f}", f"{plain['best_tokens_per_s']:.1f}"),
        (
            "process wall per run [s]",
            " ".join(f"{x:.1f}" for x in wall["p3d"]),
            " ".join(f"{x:.1f}" for x in wall["plain"]),
        ),
    ]
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    print()
    print(
        f"model={args.model} {' '.join(overrides[1:])} | mesh=single | {plan.micro_batches} micro batches | "
        f"{tps} tokens/step | threads: p3d 1, plain {args.threads} | warm-up steps dropped per run: {args.warmup}"
    )
    for i, (a, b, c) in enumerate(rows):
        print(f"{a:<{w0}}  {b:>{w1}}  {c:>{max(len(r[2]) for r in rows)}}")
        if i == 0:
            print("-" * (w0 + w1 + max(len(r[2]) for r in rows) + 4))

    def verdict(r):
        return "PASS" if r >= TARGET else "FAIL"

    # median wall / CPU seconds of a step: 1.0 when the worker had a core to itself the whole step
    waits = {
        side: statistics.median(
            r["step_time_s"] / r["cpu_s"] for run in runs for r in run[args.warmup :] if r.get("cpu_s")
        )
        for side, runs in (("p3d", p3d_runs), ("plain", plain_runs))
        if cpu_ratio
    }
    busy = any(w > 1.05 for w in waits.values())
    print(f"\nratio p3d / plain, median tokens/s (wall time):   {ratio:.3f}   [target >= {TARGET}: {verdict(ratio)}]")
    if cpu_ratio:
        print(
            f"ratio p3d / plain, median worker CPU s per step:  {cpu_ratio:.3f}   [target >= {TARGET}: "
            f"{verdict(cpu_ratio)}]"
        )
    print(f"ratio p3d / plain, best step (wall):              {best_ratio:.3f}")
    print(f"ratio p3d / plain per round (wall medians):       {' '.join(f'{r:.3f}' for r in round_ratios)}")
    ncpu = os.cpu_count() or 1
    print(
        f"load average (1 min) before / after: {load_before:.1f} / {load_after:.1f} on {ncpu} cores; "
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
            "model": args.model,
            "overrides": overrides,
            "mesh": "single",
            "threads_p3d": 1,
            "threads_plain": args.threads,
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "micro_batches": plan.micro_batches,
            "tokens_per_step": tps,
            "n_params": plan.n_params,
            "p3d": p3d,
            "plain": plain,
            "ratio": ratio,
            "best_step_ratio": best_ratio,
            "per_round_ratio": round_ratios,
            "cpu_time_ratio": cpu_ratio,
            "load_avg_before_after": [load_before, load_after],
            "wall_over_cpu": waits,
            "busy": busy,
            "target": TARGET,
            "pass": ratio >= TARGET,
            "pass_cpu_time": bool(cpu_ratio and cpu_ratio >= TARGET),
            "max_rel_loss_diff": loss_rel,
            "raw": {"p3d": p3d_runs, "plain": plain_runs},
        }
        text = json.dumps(result, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
