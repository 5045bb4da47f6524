"""``p3d-plan calibrate``: measure this machine at a run's own shapes and write the calibration file.

    p3d-plan calibrate model=small model.seq_len=128 mesh=dp2 calibration=cal.json
    p3d-plan calibrate model=small mesh=auto cluster.gpus_per_node=8 calibration=cal.json   # every candidate's tp

The probes (p3d.train.probes) run as child processes of this one:

1. compute, alone: each (tp, recompute) block and each tp's head at the config's (b, s), in ``rounds`` (each round
   passes all of them in turn, so that a slow stretch of the machine falls on all alike), a GEMM, a copy, AdamW;
2. the same, ``cores`` copies at once (``loaded_*``): what a rank gets while every core is busy, and
   ``cores_effective = cores x median(alone / loaded)``;
3. collectives: ``min(8, 4 x cores)`` gloo ranks time all_reduce / all_gather / reduce_scatter / send_recv for
   n in {2, 4, 8} at three sizes; the planner reads each (op, n) off its points (piecewise linear), and the file
   also gives the least-squares line ``t = latency + s_per_byte x bytes`` (printed).

``P3D_CALIBRATE_QUICK=1`` (tests): one rep, one round, two small sizes, n = 2, a small copy and optimizer, at most 2
loaded copies. The file is written atomically to ``calibration=`` (default ``p3d-calibration-<device>.json`` here).
Executor overheads are not probed yet (``overhead`` is written empty: none is added). Exit status: 0 written,
1 a probe failed, 2 a config error.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from p3d import exit_codes
from p3d.config.schema import Launcher
from p3d.console import say
from p3d.jobs.slurm import calibrate as slurm_calibrate
from p3d.launch.check import typed_config
from p3d.launch.compose import config_error, is_multirun, report_error
from p3d.layout.run_plan import P3DConfigError
from p3d.planner import calibration
from p3d.rundir.paths import absolute
from p3d.rundir.spec import config_dict

QUICK_ENV = "P3D_CALIBRATE_QUICK"
MAX_TP = 4  # distinct tp degrees probed at most (the smallest): bounds mesh=auto's probes
PROBE_TIMEOUT_S = 900
ROUNDS = 5  # the block probes' rounds: a slow stretch in one of them moves no median
DP_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's default allreduce_bucket_size
OPTIMIZER_ELEMENTS = 1 << 27  # the optimizer probe's most: beyond it every state streams from memory, the rate holds


@dataclass(frozen=True)
class ProbePlan:
    blocks: list[tuple[int, str]]  # (tp, recompute), "none" always among each tp's
    heads: list[int]  # tp
    reps: int
    rounds: int  # of the block, head and embedding probes: reps passes each per round
    memory_mb: int
    optimizer_params: int  # the largest stage's parameters (at most OPTIMIZER_ELEMENTS): the optimizer probe's
    dp_elements: int  # the largest dp gradient message's elements (0: no layout reduces over dp)
    world: int  # ranks of the collectives probe
    group_sizes: list[int]
    sizes: list[int]  # bytes


def quick() -> bool:
    return os.environ.get(QUICK_ENV, "") not in ("", "0")


def probe_plan(cfg) -> ProbePlan:
    """The shapes to probe: the layout's (tp, recompute), or with mesh=auto those of every candidate (the smallest
    MAX_TP tp degrees). A model the trainer does not build (gpt, MoE blocks) gets no block probes: the planner uses
    the measured rates for it."""
    from p3d.planner.search import candidates
    from p3d.planner.shapes import layout_of, stage_params

    layouts = candidates(cfg) if cfg.mesh.name == "auto" else [layout_of(cfg)]
    grads = dp_message_sizes(cfg, layouts)
    stage = max(max(st.total for st in stage_params(cfg, lay)) for lay in layouts)
    pairs = {(lay.tp, calibration.probe_mode(lay.recompute, lay.torch_executor)) for lay in layouts}
    tps = sorted({tp for tp, _ in pairs})[:MAX_TP]
    blocks = sorted({(tp, rec) for tp, rec in pairs if tp in tps} | {(tp, "none") for tp in tps})
    if cfg.model.arch.value != "llama" or cfg.model.moe is not None:
        blocks, tps = [], []
    q, cores = quick(), calibration.cores()
    world = 2 if q else min(8, 4 * cores)
    return ProbePlan(
        blocks=blocks,
        heads=tps,
        reps=1 if q else 3,
        rounds=1 if q else ROUNDS,
        memory_mb=16 if q else 128,
        optimizer_params=1 << 18 if q else int(min(OPTIMIZER_ELEMENTS, stage, optimizer_room(cores))),
        dp_elements=max(grads, default=0) // 4,
        world=world,
        group_sizes=[n for n in (2, 4, 8) if n <= world],
        sizes=[1 << 16, 1 << 20] if q else sorted({1 << 18, 1 << 22, 1 << 25, *(g for g in grads if g > 1 << 25)}),
    )


def optimizer_room(copies: int) -> int:
    """The parameters each of ``copies`` optimizer probes at once may step in a quarter of this host's memory (16
    bytes each: the parameter, its gradient and AdamW's two moments)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: 16 GB
        memory = 16 << 30
    return memory // 4 // (16 * max(1, copies))


def dp_message_sizes(cfg, layouts) -> set[int]:
    """The largest data-parallel gradient message of these layouts, when beyond the fixed sizes: the biggest stage's
    fp32 gradients (DeepSpeed's ZeRO 0/1 engine reduces a stage's gradients in one bucket of up to 5e8 elements).
    On this machine's loopback gloo the rate at 32 MiB does not carry to the 0.5 GB of a 124M-parameter stage (one
    dp2 all-reduce measured 0.87 s against 0.51 s read off the 32 MiB line), so the plan's own size is probed."""
    from p3d.planner.shapes import stage_params

    sizes = [max(st.total for st in stage_params(cfg, lay)) for lay in layouts if lay.dp_cp > 1]
    biggest = min(DP_BUCKET_ELEMENTS, max(sizes, default=0)) * 4  # sizes between are read off the piecewise line
    return {biggest} if biggest else set()


def _spawn(args: list[list[str]]) -> None:
    """Run these probe processes at once; RuntimeError with the first failure's last lines."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "p3d.train.probes", *a], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
        )
        for a in args
    ]
    failed = None
    for p in procs:
        out, _ = p.communicate(timeout=PROBE_TIMEOUT_S)
        if p.returncode and failed is None:
            failed = out.decode(errors="replace").strip().splitlines()[-3:]
    if failed is not None:
        raise RuntimeError("a probe failed: " + " | ".join(failed))


def run_compute(cfg, plan: ProbePlan, tmp: Path) -> dict[str, Any]:
    """The compute probes alone, then ``cores`` copies at once; the loaded figures are the copies' medians."""
    job = tmp / "compute.json"
    job.write_text(
        json.dumps(
            {
                "config": config_dict(cfg),
                "device": "cpu",
                "blocks": plan.blocks,
                "heads": plan.heads,
                "reps": plan.reps,
                "rounds": plan.rounds,
                "memory_mb": plan.memory_mb,
                "optimizer_params": plan.optimizer_params,
                "dp_elements": plan.dp_elements,
            }
        )
    )
    _spawn([["compute", str(job), str(tmp / "alone.json")]])
    alone = json.loads((tmp / "alone.json").read_text())
    copies = min(2, calibration.cores()) if quick() else calibration.cores()  # a test on a big machine stays small
    # the copies start each probe together (p3d.train.probes.rendezvous): every loaded figure is all of them at once
    (tmp / "barrier").mkdir()
    loaded_job = tmp / "compute-loaded.json"
    loaded_job.write_text(
        json.dumps({**json.loads(job.read_text()), "barrier": {"dir": str(tmp / "barrier"), "parties": copies}})
    )
    _spawn([["compute", str(loaded_job), str(tmp / f"loaded{i}.json")] for i in range(copies)])
    loaded = [json.loads((tmp / f"loaded{i}.json").read_text()) for i in range(copies)]

    def med(values: list[float]) -> float:
        return statistics.median(values)

    grouped = run_tp_blocks(cfg, plan, tmp)
    ratios = []
    for kind in ("blocks", "head", "embedding"):
        for i, row in enumerate(alone[kind]):
            for key in ("fwd_s", "bwd_s"):
                row[f"loaded_{key}"] = med([c[kind][i][key] for c in loaded])
                ratios.append(row[key] / row[f"loaded_{key}"])
    gemm = alone["gemm"][0]
    loaded_gemm = med([c["gemm"][0]["tflops"] for c in loaded])
    ratios.append(loaded_gemm / gemm["tflops"])
    return {
        "loaded_ranks": copies,
        "cores_effective": copies * med(ratios),
        "blocks": alone["blocks"],
        "tp_blocks": grouped,
        "head": alone["head"],
        "embedding": alone["embedding"],
        "gemm": alone["gemm"],
        "gemm_tflops": gemm["tflops"],
        "loaded_gemm_tflops": loaded_gemm,
        "memory_gbps": alone["memory_gbps"],
        "loaded_memory_gbps": med([c["memory_gbps"] for c in loaded]),
        "optimizer_s_per_param": alone["optimizer_s_per_param"],
        "loaded_optimizer_s_per_param": med([c["optimizer_s_per_param"] for c in loaded]),
        "engine_copy_s_per_param": alone["engine_copy_s_per_param"],
        "loaded_engine_copy_s_per_param": med([c["engine_copy_s_per_param"] for c in loaded])
        if alone["engine_copy_s_per_param"]
        else None,
    }


def run_tp_blocks(cfg, plan: ProbePlan, tmp: Path) -> list[dict[str, Any]]:
    """The blocks of each 1 < tp <= cores again on tp real ranks, their all-reduces in: on gloo a tp rank waits for
    its slower peer at each of them, which the collectives probe (both ranks idle before it) does not see. On the
    group-less probe plus the collective fits, tp2 with full recompute was predicted 20 % short of its measured step."""
    rows: list[dict[str, Any]] = []
    for tp in sorted({tp for tp, _ in plan.blocks if 1 < tp <= calibration.cores()}):
        job = tmp / f"tp{tp}.json"
        store = tmp / f"tp{tp}-store"
        job.write_text(
            json.dumps(
                {
                    "config": config_dict(cfg),
                    "blocks": plan.blocks,
                    "reps": plan.reps,
                    "rounds": plan.rounds,
                    "store": str(store),
                }
            )
        )
        out = tmp / f"tp{tp}-out.json"
        _spawn([["tp_blocks", str(job), str(out), str(r), str(tp)] for r in range(tp)])
        rows += json.loads(out.read_text())["blocks"]
    return rows


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``t = latency + slope x bytes`` (both kept >= 0)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
    return max(0.0, my - slope * mx), slope


def run_collectives(cfg, plan: ProbePlan, tmp: Path) -> dict[str, Any]:
    job = tmp / "collectives.json"
    job.write_text(
        json.dumps(
            {
                "store": str(tmp / "store"),
                "reps": plan.reps,
                "group_sizes": plan.group_sizes,
                "sizes": plan.sizes,
                # engine_reduce: the model's shapes, on groups of a rank per core at most (as the tp blocks)
                **({"config": config_dict(cfg), "engine_reduce_upto": calibration.cores()} if plan.dp_elements else {}),
            }
        )
    )
    out = tmp / "collectives-out.json"
    _spawn([["collectives", str(job), str(out), str(r), str(plan.world)] for r in range(plan.world)])
    points = json.loads(out.read_text())["points"]
    fits = []
    for op, n in sorted({(p["op"], p["n"]) for p in points}):
        pts = [(float(p["bytes"]), float(p["s"])) for p in points if (p["op"], p["n"]) == (op, n)]
        latency, slope = fit(pts)
        fits.append({"op": op, "n": n, "latency_s": latency, "s_per_byte": slope, "points": pts})
    return {"link": "loopback", "backend": "gloo", "fits": fits}


def calibrate(cfg, out: Path) -> dict[str, Any]:
    plan = probe_plan(cfg)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="p3d-calibrate-") as d:
        tmp = Path(d)
        say(f"calibrate: {len(plan.blocks)} blocks {plan.blocks}, heads at tp {plan.heads}, alone and loaded")
        compute = run_compute(cfg, plan, tmp)
        say(f"calibrate: collectives over {plan.world} gloo ranks, n in {plan.group_sizes}")
        collectives = run_collectives(cfg, plan, tmp)
    m = cfg.model
    raw = {
        "kind": calibration.KIND,
        "format": calibration.FORMAT,
        "created": calibration.created(),
        "seconds": time.perf_counter() - started,
        "software": {**calibration.software_fingerprint(), "backend": "gloo"},
        "machine": {**calibration.host_fingerprint("cpu"), "threads_per_rank": 1, "gpu": None},
        "probed_for": {
            "model": m.name,
            "arch": m.arch.value,
            "dtype": "fp32",
            "seq_len": m.seq_len,
            "micro_batch_size": cfg.schedule.micro_batch_size,
            "tp": plan.heads,
            "recompute": sorted({rec for _, rec in plan.blocks}),
            "quick": quick(),
        },
        "compute": compute,
        "collectives": collectives,
        "overhead": {},  # not probed yet: the planner adds none
    }
    calibration.check_identity(raw, "cpu", str(out))  # what the planner will check, so the file is usable
    calibration.dump(raw, out)
    return raw


def summary(raw: dict[str, Any]) -> list[str]:
    c = raw["compute"]
    lines = [
        f"  GEMM {c['gemm_tflops'] * 1e3:.1f} GFLOP/s alone, {c['loaded_gemm_tflops'] * 1e3:.1f} loaded; "
        f"copy {c['memory_gbps']:.1f} GB/s; AdamW {c['optimizer_s_per_param'] * 1e9:.2f} ns/param alone, "
        f"{c.get('loaded_optimizer_s_per_param', c['optimizer_s_per_param']) * 1e9:.2f} loaded; "
        f"cores_effective {c['cores_effective']:.2f} of {c['loaded_ranks']}"
    ]
    for b in c["blocks"]:
        lines.append(
            f"  block tp={b['tp']} {b['recompute']:<14} fwd {b['fwd_s'] * 1e3:7.2f} ms  bwd {b['bwd_s'] * 1e3:7.2f} ms"
            f"  (loaded {b['loaded_fwd_s'] * 1e3:.2f} / {b['loaded_bwd_s'] * 1e3:.2f})"
        )
    for h in c["head"]:
        lines.append(f"  head  tp={h['tp']} fwd {h['fwd_s'] * 1e3:7.2f} ms  bwd {h['bwd_s'] * 1e3:7.2f} ms")
    for f in raw["collectives"]["fits"]:
        if len(f.get("points", [])) == 1:  # engine_reduce: at the plan's dp message only
            (nbytes, seconds), *_ = f["points"]
            lines.append(f"  {f['op']:<14} n={f['n']}  {seconds:.3f} s at {nbytes / 1e6:.0f} MB")
            continue
        gbps = 1 / f["s_per_byte"] / 1e9 if f["s_per_byte"] else float("inf")
        lines.append(f"  {f['op']:<14} n={f['n']}  {f['latency_s'] * 1e6:8.1f} us + bytes at {gbps:.2f} GB/s")
    return lines


def on_a_node(cfg, out: Path) -> int:
    """``cluster=slurm`` outside an allocation: the same command as one srun step on a node of the cluster."""
    from hydra.core.hydra_config import HydraConfig

    from p3d.planner.shapes import layout_of

    world = layout_of(cfg).world_size if cfg.mesh.name != "auto" else (cfg.cluster.gpus_per_node or 1)
    status = slurm_calibrate.calibrate_on_a_node(cfg, world, list(HydraConfig.get().overrides.task), out)
    if status != 0:
        return report_error(f"calibrate: the srun step on the cluster exited {status}; nothing written to {out}", 1)
    return exit_codes.OK


def calibrate_task(cfg_node: DictConfig) -> int:
    """Compose as p3d-plan does, probe, write ``calibration=``; the file named is the output here, not an input."""
    out_name = cfg_node.get("calibration")
    cfg_node.calibration = None  # not read: this command writes it
    try:
        cfg = typed_config(cfg_node, resolve_auto=False)
        if str(cfg.cluster.device) != "cpu":
            raise P3DConfigError(
                f"cluster.device={cfg.cluster.device}: p3d-plan calibrate probes cpu machines only so far; "
                "run it with cluster.device=cpu, or plan without calibration="
            )
        out = absolute(out_name or f"p3d-calibration-{cfg.cluster.device}.json")
        if cfg.cluster.launcher == Launcher.slurm and not slurm_calibrate.inside_allocation():
            return on_a_node(cfg, out)
        raw = calibrate(cfg, out)
    except P3DConfigError as exc:
        return config_error(str(exc), is_multirun())
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return report_error(f"calibrate: {exc}", exit_codes.WORKER_FAILED)
    for line in summary(raw):
        print(line, flush=True)
    say(f"calibrate: wrote {out} in {raw['seconds']:.1f} s; use it: p3d-plan <overrides> calibration={out}")
    return exit_codes.OK
