"""Context parallelism on CPU workers (issues 35 and 52): its speed and saved activations against one process, one
attention layer's memory as the sequence doubles, whole runs' peak memory against p3d-plan, where a run's RSS goes,
and when the ring beats the all-gather (the planner's formulas).

    .venv/bin/python bench/cp.py layouts                               # model=small, seq_len 2048
    .venv/bin/python bench/cp.py layouts --steps 4 --passes 2 --set model=small model.seq_len=1024
    .venv/bin/python bench/cp.py attention                             # model=small's attention, s 2048..16384
    .venv/bin/python bench/cp.py attention --seq 2048 4096 --layouts cp1 cp2 cp2-ring cp4
    .venv/bin/python bench/cp.py runs                                  # the issue's command (model=tiny), cp 1, 2, 4
    .venv/bin/python bench/cp.py runs --cp 1 2 --extra model=small
    .venv/bin/python bench/cp.py runs --host-memory keep release       # both CPU heap policies, run by run
    .venv/bin/python bench/cp.py runs --host-memory release --added-over 256   # what s=4096 adds over s=256, per cp
    .venv/bin/python bench/cp.py rss                                   # model=tiny, cp 1
    .venv/bin/python bench/cp.py rss --cp 1 2 4 --extra model=small
    .venv/bin/python bench/cp.py variants                              # the planner only: seconds on any machine
    .venv/bin/python bench/cp.py variants --model llama3_1_405b --tp 8 --cp 16

- ``layouts``: single, dp2 and cp2 of one run: tokens/s, the bytes autograd saves per rank and the planner's figure;
- ``attention``: one ``Attention`` layer's forward + backward peak per rank, and its core's beside the planner's;
- ``runs``: ``p3d-train`` at 4,096 tokens on cp 1, 2 and 4: each run's peak_mem_gb beside p3d-plan's per-rank figure;
- ``rss``: the same runs, each worker's RSS and glibc's heap sampled: in use, free inside the heap, trimmed;
- ``variants``: the exposed seconds of one block's key/value traffic, all-gather against ring, as the sequence grows.
``bench/cp.py <command> --help`` says how each measures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import (  # noqa: E402
    add_command,
    bench_parser,
    load_average,
    p3d_train,
    run_command,
    run_workers,
    turns,
)
from bench._cp_probes import attention_worker, layouts_worker, watched_run  # noqa: E402

LAYOUTS_RUN = ("model=small", "model.seq_len=2048", "schedule.micro_batch_size=1", "schedule.global_batch_size=2")
LAYOUTS = {"single": (1, ["mesh=single"]), "dp2": (2, ["mesh=dp2"]), "cp2": (2, ["mesh=single", "mesh.cp=2"])}
ATTENTION = {"cp1": (1, "allgather"), "cp2": (2, "allgather"), "cp2-ring": (2, "ring"), "cp4": (4, "allgather"),
             "cp4-ring": (4, "ring")}  # fmt: skip
COMMAND = ("model.seq_len=4096", "mesh=single", "schedule.global_batch_size=2", "schedule.micro_batch_size=1",
           "train.steps=2")  # fmt: skip  # the issue's command (issue 52), of runs and rss


# ---- layouts
def layouts(args) -> int:
    """Context parallelism on CPU: tokens/s and saved activation bytes per rank, cp1 against cp2 (issue 35).

    Three layouts of the same run (micro batch 1, global batch 2, fp32), each in its own gloo worker processes (one
    thread each), built as p3d-train builds them and all on the torch executor (torch's Schedule1F1B, which cp needs),
    on the same seeded init and data:
    - ``single``: cp1 on one process, the whole 2048-token sequences;
    - ``dp2``: cp1 on two processes, one sequence each (what two processes do without cp: the throughput ceiling);
    - ``cp2``: two processes splitting every sequence, 1024 tokens each (chunks r and 3 - r of 4).
    Per layout:
    - tokens/s: the global batch's tokens over the slowest rank's ``train_batch`` wall time, median of the steps after
      the first of each pass (the layouts take turns, every other pass reversed, so a slow spell of the machine does
      not fall on one layout only);
    - saved MB/rank: every tensor autograd saves for backward during one micro batch's forward and loss on a rank
      (``torch.autograd.graph.saved_tensors_hooks``, once per storage, parameters left out), beside the planner's
      figure for it (``p3d.planner.memory.stage_memory``: ``activation_bytes`` of the stage, which holds every layer);
    - attention MB: the same count over the attention modules only.
    """
    args.set = list(LAYOUTS_RUN if args.set is None else args.set)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results: dict[str, list[dict]] = {}
    for n, layout in turns(args.layouts, args.passes):
        world, mesh = LAYOUTS[layout]
        overrides = [*mesh, "train.save_every=0", *args.set]
        results.setdefault(layout, []).append(run_workers(layouts_worker, world, overrides, args.steps, timeout=7200))
        print(f"{layout}: pass {n + 1} done", file=sys.stderr, flush=True)
    print(f"{' '.join(args.set)}; {args.passes} passes x {args.steps} steps (first dropped); "
          f"load average {load_average()}")  # fmt: skip
    print(f"{'layout':<7} {'procs':>5} {'tokens/s':>9} {'vs single':>9} {'step s':>7} {'saved MB/rank':>13} "
          f"{'planned MB':>10} {'attention MB':>12}")  # fmt: skip
    base = None
    for layout in args.layouts:
        runs = results[layout]
        step = statistics.median(t for r in runs for t in r["times"][1:])
        tok = runs[0]["tokens"] / step
        base = base or (tok if layout == "single" else None)
        ratio = f"{tok / base:>8.2f}x" if base else f"{'':>9}"
        whole, attention = runs[0]["saved"]
        print(f"{layout:<7} {LAYOUTS[layout][0]:>5} {tok:>9,.0f} {ratio} {step:>7.2f} {whole / 1e6:>13.1f} "
              f"{runs[0]['planned'] / 1e6:>10.1f} {attention / 1e6:>12.1f}")  # fmt: skip
    return 0


# ---- attention
def attention(args) -> int:
    """Context parallelism's memory: one attention layer's forward + backward peak per rank as the sequence doubles
    (issue 52).

    One ``Attention`` module of the model's shape (q|k|v projection, RoPE, the attention core, output projection), fp32,
    micro batch 1, on gloo worker processes of one thread each: ``cp1`` is one process on the whole sequence (torch's
    SDPA), ``cpN`` and ``cpN-ring`` are N processes splitting it (context.attention=allgather or ring). Per layout and
    sequence, rank 0's peak of tensor memory during the layer's forward and backward, beyond its input and weights
    (tests/helpers/memory.py: the running sum of torch's allocations, exact, no timing) and its growth per doubling of
    s; then the same for the attention core alone (rotated q, k, v in: the cp attention, or SDPA at cp1) beside the
    planner's figure for it (``p3d.planner.context.attention_core_bytes``: the output and log-sum-exp it saves, its
    working set at its peak and the q, k, v gradients it returns).
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"model={args.model}, fp32, micro batch 1: rank 0's forward + backward peak of one attention layer and")
    print("of its core (q, k, v in), MB; the planner's core figure")
    print(f"{'layout':<9} {'seq':>6} {'layer MB':>9} {'x/doubling':>10} {'core MB':>9} {'planned':>9} {'plan/core':>9}")
    for layout in args.layouts:
        world, variant = ATTENTION[layout]
        last = None
        for seq in args.seq:
            overrides = [f"model={args.model}", f"model.seq_len={seq}", "mesh=single", "schedule.micro_batch_size=1"]
            r = run_workers(attention_worker, world, overrides, variant, timeout=3600)
            growth = f"{r['layer'] / last:>9.2f}x" if last else f"{'':>10}"
            print(f"{layout:<9} {seq:>6} {r['layer'] / 1e6:>9.1f} {growth} {r['core'] / 1e6:>9.1f} "
                  f"{r['planned'] / 1e6:>9.1f} {r['planned'] / r['core']:>9.2f}", flush=True)  # fmt: skip
            last = r["layer"]
    return 0


# ---- runs and rss: the command as a user runs it
def measured(overrides: list[str]) -> tuple[float, float]:
    """The run's peak_mem_gb (the largest over its records and ranks, peak RSS on cpu) and its median step seconds
    after the first step (all steps if it ran one)."""
    with tempfile.TemporaryDirectory(prefix="p3d-bench-cp-runs-") as tmp:
        records = p3d_train([*overrides, "logger=none"], Path(tmp))
    steps = [r["step_time_s"] for r in records if isinstance(r.get("step_time_s"), (int, float))]
    peak = max(r["peak_mem_gb"] for r in records if isinstance(r.get("peak_mem_gb"), (int, float)))
    return peak, statistics.median(steps[1:] or steps)


def planned(overrides: list[str]) -> tuple[float, float, float]:
    """p3d-plan's per-rank (total, activations with the loss and the cp attention's working set, that working set),
    in GB."""
    from p3d.planner import predict
    from tests.helpers.runs import typed

    cfg, _ = typed(*overrides)
    w = predict(cfg).worst
    return w.total / 1e9, w.activations_total / 1e9, w.attention_bytes / 1e9


def runs(args) -> int:
    """Context parallelism's memory in a whole run, as a user meets it (issue 52): p3d-train at 4,096 tokens on one
    process, then split over 2 and 4 cp ranks, each run's peak_mem_gb (the largest peak RSS of its ranks) against
    cp1's, and p3d-plan's per-rank figure for the same command beside it.

    ``train.host_memory`` (p3d.train.host_memory) decides what the CPU peak RSS holds: ``keep`` (the default, fast)
    leaves freed memory resident in the heap, so the peak holds the heap's reach, holes included; ``release`` hands
    freed blocks back, so the peak is the live bytes' (CUDA's ``max_memory_allocated`` counterpart, which is what
    p3d-plan predicts). With several policies each cp's runs are taken in turn, and the step column is the median
    step time of the run's steps after the first (its cost). ``--added-over S``: per cp, the peak at the command's
    seq_len less the peak at S tokens (the floor cancels: the process, the weights and their states), and that against
    cp1's; ideal: 1 / cp of it.

    What a rank holds beside its share of the activations is the floor cp cannot divide: the worker process itself
    (torch's and the data readers' resident memory, ``p3d.planner.memory.host_bytes``), the weights, their gradients
    and Adam's states (every cp rank holds the whole model), and the embedding and head's vocab-sized tensors. The
    floor printed is the planner's count of those at cp = 1 less its activations and loss.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    base = [*COMMAND, *args.extra]
    if args.added_over is not None:
        return added_by_the_sequence(base, args.cp, args.added_over, args.host_memory[-1])
    print(f"p3d-train {' '.join(base)} mesh.cp=N train.host_memory=H: peak_mem_gb (max over ranks), p3d-plan's "
          "per-rank GB")  # fmt: skip
    print(f"{'cp':>3} {'heap':>7} {'measured GB':>11} {'vs cp1':>7} {'planned GB':>10} {'plan/meas':>9} "
          f"{'act+loss':>9} {'attn ws':>8} {'step s':>7}")  # fmt: skip
    first: dict[str, float] = {}
    for cp in args.cp:
        total, act, attn = planned([*base, f"mesh.cp={cp}"])
        for heap in args.host_memory:
            peak, step = measured([*base, f"mesh.cp={cp}", f"train.host_memory={heap}"])
            first.setdefault(heap, peak)
            print(f"{cp:>3} {heap:>7} {peak:>11.3f} {peak / first[heap]:>6.2f}x {total:>10.3f} {total / peak:>9.2f} "
                  f"{act:>9.3f} {attn:>8.3f} {step:>7.2f}", flush=True)  # fmt: skip
        if cp == 1:
            print(f"    floor (planned total less activations and loss at cp1): {total - act:.3f} GB")
    return 0


def added_by_the_sequence(base: list[str], cps: list[int], short: int, heap: str) -> int:
    """Per cp: the peak at the command's seq_len less the peak at ``short`` tokens, and that against cp1's."""
    print(f"p3d-train {' '.join(base)} mesh.cp=N train.host_memory={heap}: peak_mem_gb less the same at "
          f"model.seq_len={short}")  # fmt: skip
    print(f"{'cp':>3} {'long GB':>8} {'short GB':>8} {'added GB':>8} {'vs cp1':>7} {'ideal':>6}")
    first = None
    for cp in cps:
        long_peak, _ = measured([*base, f"mesh.cp={cp}", f"train.host_memory={heap}"])
        short_peak, _ = measured([*base, f"model.seq_len={short}", f"mesh.cp={cp}", f"train.host_memory={heap}"])
        added = long_peak - short_peak
        first = first or added
        print(f"{cp:>3} {long_peak:>8.3f} {short_peak:>8.3f} {added:>8.3f} {added / first:>6.2f}x {1 / cp:>5.2f}x",
              flush=True)  # fmt: skip
    return 0


def rss(args) -> int:
    """Where a CPU run's peak RSS goes (issue 52): the command of ``runs``, run in this process (its workers forked
    from it, as p3d-train forks them), each worker watched by a thread that reads its RSS and glibc's ``mallinfo2``
    every 5 ms (bench/_cp_probes.py). At the highest RSS seen it prints the bytes malloc has handed out and not got back
    (in use: tensors, Python objects) and the bytes free inside malloc's heap (freed, still resident: what CUDA's
    caching allocator would call reserved but not allocated, which ``max_memory_allocated`` does not count); at the end
    of the run, what ``malloc_trim(0)`` hands back to the kernel. Beside them p3d-plan's per-rank figure.

    The most in use is the largest of the samples, and a sample every 5 ms can miss the exact peak by a few ms of
    allocations: the figures are a reading, not a count. glibc only (mallinfo2, malloc_trim).
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.one:  # one p3d-train per interpreter: Hydra composes once per process
        print(json.dumps(watched_run([*COMMAND, *args.extra, f"mesh.cp={args.cp[0]}"])))
        return 0
    print("GB per rank (the rank of the highest peak RSS): peak RSS; at it, malloc's bytes in use and free in its")
    print("heap; the most malloc had in use at once and the rest of the RSS then (libraries, stacks); malloc_trim's")
    print("release at the end; p3d-plan's total against the RSS and against the peak in use + the rest")
    print(f"{'cp':>3} {'peak RSS':>9} {'in use':>7} {'free':>6} {'max in use':>10} {'rest':>6} {'trimmed':>8} "
          f"{'planned':>8} {'plan/RSS':>8} {'plan/used':>9}")  # fmt: skip
    for cp in args.cp:
        overrides = [*COMMAND, *args.extra, f"mesh.cp={cp}"]
        child = [sys.executable, __file__, "rss", "--one", "--cp", str(cp), "--extra", *args.extra]
        done = subprocess.run(child, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        if done.returncode:
            raise SystemExit(f"{' '.join(child)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        r = json.loads(done.stdout.strip().splitlines()[-1])
        total = planned(overrides)[0]
        peak, used, free = r["maxrss"] / 1e9, r["in_use"] / 1e9, r["free"] / 1e9
        most, rest = r["max_in_use"] / 1e9, r["rest"] / 1e9
        print(f"{cp:>3} {peak:>9.3f} {used:>7.3f} {free:>6.3f} {most:>10.3f} {rest:>6.3f} {r['trimmed'] / 1e9:>8.3f} "
              f"{total:>8.3f} {total / peak:>8.2f} {total / (most + rest):>9.2f}", flush=True)  # fmt: skip
    return 0


# ---- variants: the planner's formulas
def exposed_ms(overrides: list[str]) -> tuple[float, float, float]:
    """(all-gather exposed, ring exposed, ring all) ms of one block's key/value traffic per micro batch."""
    from p3d.planner.shapes import layout_of
    from p3d.planner.step_time import kv_traffic
    from tests.helpers.runs import typed

    out = []
    for variant in ("allgather", "ring"):
        cfg, _ = typed(*overrides, f"context.attention={variant}")
        out.append(kv_traffic(cfg, layout_of(cfg)))
    return out[0][0] * 1e3, out[1][0] * 1e3, out[1][1] * 1e3


def variants(args) -> int:
    """When the ring beats the all-gather (issue 52), from the planner's formulas (p3d.planner.step_time.kv_traffic):
    the exposed seconds of one block's key/value traffic per micro batch, all-gather against ring, as the sequence
    grows, for a cp group inside one node (NVLink) and one across nodes (a node per tp group: every message on the
    NIC). No run: the planner only, seconds on any machine.
    """
    ranks = args.tp * args.cp
    links = {"intra": [f"cluster.nodes={max(1, ranks // 8)}", "cluster.gpus_per_node=8"] if ranks >= 8 else
             ["cluster.nodes=1", f"cluster.gpus_per_node={ranks}"],
             "inter": [f"cluster.nodes={args.cp}", f"cluster.gpus_per_node={args.tp}"]}  # fmt: skip
    print(f"{args.model} bf16 on h100_sxm, tp={args.tp} cp={args.cp}, micro batch 1, no recompute: one block's "
          "key/value traffic per micro batch, ms exposed")  # fmt: skip
    print(f"{'link':<6} {'seq':>7} {'tokens/rank':>11} {'all-gather':>10} {'ring':>8} {'ring sent':>9} {'winner':>10}")
    for link, cluster in links.items():
        for seq in args.seq:
            overrides = [f"model={args.model}", "cluster=h100_sxm", *cluster, "mesh=single", f"mesh.tp={args.tp}",
                         f"mesh.cp={args.cp}", "mesh.dp=auto", f"model.seq_len={seq}", "train.dtype=bf16",
                         "schedule.micro_batch_size=1", f"schedule.global_batch_size={ranks}"]  # fmt: skip
            ag, ring, ring_all = exposed_ms(overrides)
            winner = "ring" if ring < ag else "all-gather"
            print(f"{link:<6} {seq:>7} {seq // args.cp:>11} {ag:>10.3f} {ring:>8.3f} {ring_all:>9.3f} {winner:>10}")
    return 0


def parser() -> argparse.ArgumentParser:
    ap, commands = bench_parser(__doc__)
    p = add_command(commands, layouts)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--steps", type=int, default=3, help="steps per run; the first is dropped")
    p.add_argument("--passes", type=int, default=2, help="passes over the layouts, every other one reversed")
    p.add_argument("--set", nargs="*", default=None, help=f"overrides (default: {' '.join(LAYOUTS_RUN)})")

    p = add_command(commands, attention)
    p.add_argument("--layouts", nargs="+", default=["cp1", "cp2", "cp2-ring"], choices=list(ATTENTION))
    p.add_argument("--seq", nargs="+", type=int, default=[2048, 4096, 8192, 16384])
    p.add_argument("--model", default="small")

    p = add_command(commands, runs)
    p.add_argument("--cp", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--extra", nargs="*", default=[], help="overrides added to the issue's command")
    p.add_argument("--host-memory", nargs="+", default=["keep"], choices=["keep", "release"],
                   help="train.host_memory policies, each a run per cp")  # fmt: skip
    p.add_argument("--added-over", type=int, default=None, metavar="S",
                   help="what the sequence adds to a rank: each peak less the same run's at seq_len=S")  # fmt: skip

    p = add_command(commands, rss)
    p.add_argument("--cp", nargs="+", type=int, default=[1])
    p.add_argument("--extra", nargs="*", default=[], help="overrides added to the issue's command")
    p.add_argument("--one", action="store_true", help="run the first --cp here and print its sample as JSON")

    p = add_command(commands, variants)
    p.add_argument("--model", default="llama3_8b")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp", type=int, default=8)
    p.add_argument("--seq", nargs="+", type=int, default=[4096, 8192, 16384, 32768, 65536, 131072])
    return ap


if __name__ == "__main__":
    sys.exit(run_command(parser()))
