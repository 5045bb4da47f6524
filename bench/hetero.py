"""A simulated mixed cluster on this machine (issue 55): the planned split against the uniform split, the ideal and
p3d-plan's prediction.

    flock /tmp/p3d-cpu.lock .venv/bin/python bench/hetero.py

Two simulated nodes on the local launcher, ``cluster.groups=[{device: cpu, nodes: 1}, {device: cpu, nodes: 1,
peak_tflops: 0.05}]``: the second group has half the first's peak, so under ``P3D_TEST_BLOCK_SECONDS`` its ranks
sleep twice as long in each block's forward, input-gradient and weight-gradient pieces (p3d.train.block_seconds).
Each case asks ``p3d-plan ... plan.block_seconds=<s> format=json`` for its split (blocks per stage, micro batches per
replica), its predicted step, the uniform split's and the ideal (the sum of the groups' throughputs), then trains
the planned split and the uniform split with p3d-train and reads each run's median ``step_time_s`` (steps 2 on:
the first builds torch's shapes). Nothing is fitted: the planner sees the block seconds, the groups and the model.

Cases: ``pp2`` (stage 0 on the fast node, stage 1 on the slow one: uneven blocks) and ``dp2`` (replica 0 fast,
replica 1 slow: uneven micro batches).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import p3d_plan, p3d_train  # noqa: E402

GROUPS = "cluster.groups=[{device: cpu, nodes: 1}, {device: cpu, nodes: 1, peak_tflops: 0.05}]"
SAME = "cluster.groups=[{device: cpu, nodes: 1%s}, {device: cpu, nodes: 1%s}]"  # a homogeneous two-node cluster
CASES = {
    "pp2": ("mesh=pp2", "model.n_layers=6", "schedule.micro_batch_size=2", "schedule.global_batch_size=16"),
    "dp2": ("mesh=dp2", "model.n_layers=4", "schedule.micro_batch_size=2", "schedule.global_batch_size=24"),
}


def plan(overrides: tuple[str, ...], block_s: float) -> dict:
    return json.loads(p3d_plan(GROUPS, *overrides, f"plan.block_seconds={block_s}", "format=json"))["heterogeneous"]


def train(
    overrides: tuple[str, ...], split: tuple[str, ...], block_s: float, steps: int, run: Path, groups: str = GROUPS
) -> float:
    """The median step_time_s of steps 2 .. steps of one p3d-train run on ``groups``."""
    env = {"OMP_NUM_THREADS": "1", "P3D_TEST_BLOCK_SECONDS": str(block_s)}
    rest = (f"train.steps={steps}", f"train.eval_every={steps + 1}", "train.save_every=0", "logger=none")
    records = p3d_train([groups, *overrides, *split, *rest], run, env, timeout=None)
    return statistics.median(r["step_time_s"] for r in records if r["step"] >= 2)


def listed(values: list[int]) -> str:
    return "[" + ",".join(map(str, values)) + "]"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-seconds", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="p3d-hetero-"))
    for name in args.cases:
        overrides, s = CASES[name], args.block_seconds
        p = plan(overrides, s)
        planned = (
            f"schedule.stage_blocks={listed(p['stage_blocks'])}",
            f"schedule.replica_micro_batches={listed(p['replica_micro_batches'])}",
        )
        uniform = ("schedule.stage_blocks=[]", "schedule.replica_micro_batches=[]")
        t_planned = train(overrides, planned, s, args.steps, tmp / f"{name}-planned")
        t_uniform = train(overrides, uniform, s, args.steps, tmp / f"{name}-uniform")
        # the ideal, measured: each group's homogeneous throughput (the uniform split on two nodes of that group),
        # weighted by its half of the ranks
        fast = train(overrides, uniform, s, args.steps, tmp / f"{name}-fast", SAME % ("", ""))
        # P3D_TEST_BLOCK_SECONDS is the fastest group's seconds: on two slow nodes the slow group is the fastest, so
        # its blocks take 2 s there, as they do on the mixed cluster's slow node
        slow_groups = SAME % ((", peak_tflops: 0.05",) * 2)
        slow = train(overrides, uniform, 2 * s, args.steps, tmp / f"{name}-slow", slow_groups)
        t_ideal = 1 / (0.5 / fast + 0.5 / slow)
        print(
            f"{name}: planned {planned[0].split('.')[1]} {planned[1].split('.')[1]}: step {t_planned:.3f} s "
            f"(p3d-plan {p['step_time_s']:.3f} s); uniform {t_uniform:.3f} s (p3d-plan {p['uniform_step_time_s']:.3f} "
            f"s); ideal {t_ideal:.3f} s from the fast group's {fast:.3f} s and the slow group's {slow:.3f} s "
            f"(p3d-plan {p['ideal_step_time_s']:.3f} s)"
        )
        print(
            f"  uniform / planned = {t_uniform / t_planned:.2f}x (target >= 1.3); ideal / planned = "
            f"{t_ideal / t_planned:.2f} (>= 0.9); planned / prediction = "
            f"{t_planned / p['step_time_s']:.3f} (within 10%); uniform / its prediction = "
            f"{t_uniform / p['uniform_step_time_s']:.3f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
