"""Tokens/s before and after the dp reduction moved behind the last backward (issue 54, docs/overlap.md).

    .venv/bin/python bench/overlap.py --before /path/to/older/checkout     # both need their own .venv
    .venv/bin/python bench/overlap.py --before ../main --block-seconds 0 --steps 4   # real compute only

Runs ``p3d-train`` as a user does, from this checkout ("after") and from ``--before`` (a checkout of the code
before the change, with its own ``.venv``), on the issue's two layouts: ``model=small mesh=dp2 zero=stage2`` and
``mesh=dp2_pp2 schedule.pipeline=interleaved_1f1b``. Every block sleeps ``--block-seconds`` in each of its
forward, input-gradient and weight-gradient pieces (``P3D_TEST_BLOCK_SECONDS``): sleeping compute leaves the two
cores to gloo's threads, as a GPU leaves NCCL its own engines, so what the step can hide shows. The two codes take
turns, and a second pass runs them in the reverse order, so that a slow spell of the machine falls on both.

Printed per layout and code: tokens/s (``metrics.jsonl``, median of the steps after the first of both passes), the
dp communication's own seconds and the part the step waited for (after: ``dp_comm_s`` and ``dp_comm_exposed_s``;
before, whose ``dp_comm_s`` was the exposed part only: that one), and after / before's tokens/s ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import median_of, p3d_train  # noqa: E402

MODEL = ("model=small", "model.seq_len=128", "schedule.micro_batch_size=1", "schedule.global_batch_size=8")
LAYOUTS = {
    "dp2 zero2": ("mesh=dp2", "zero=stage2"),
    "dp2_pp2 interleaved": ("mesh=dp2_pp2", "schedule.pipeline=interleaved_1f1b", "schedule.virtual_stages=2"),
}


def run(checkout: Path, layout: tuple[str, ...], steps: int, block_s: float, extra: list[str]) -> list[dict]:
    """One p3d-train run from ``checkout``: its steps' records after the first."""
    with tempfile.TemporaryDirectory(prefix="p3d-overlap-") as tmp:
        env = {"OMP_NUM_THREADS": "1", "P3D_TEST_BLOCK_SECONDS": str(block_s)}
        overrides = [*MODEL, *layout, f"train.steps={steps}", "train.eval_every=0", *extra]
        records = p3d_train(overrides, Path(tmp) / "run", env, timeout=1800, cwd=Path(tmp),
                            program=[str(checkout / ".venv" / "bin" / "p3d-train")], unset=["PYTHONPATH"])  # fmt: skip
        return [r for r in records if "loss" in r][1:]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="a checkout of the code before, with its .venv")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--block-seconds", type=float, default=0.04, help="per block and piece (0: real compute only)")
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--set", nargs="*", default=[], help="more overrides for every run")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    codes = {"before": args.before.resolve(), "after": ROOT}
    print(f"{' '.join(MODEL)}, {args.steps} steps, P3D_TEST_BLOCK_SECONDS={args.block_seconds}; load {os.getloadavg()}")
    for name in args.layouts:
        got: dict[str, list[dict]] = {"before": [], "after": []}
        for order in (("before", "after"), ("after", "before")):
            for code in order:
                got[code] += run(codes[code], LAYOUTS[name], args.steps, args.block_seconds, args.set)
        print(f"\n{name}: {' '.join(LAYOUTS[name])}")
        print(f"  {'code':<7} {'tokens/s':>9} {'dp own s':>9} {'dp exposed s':>13} {'hidden':>7}")
        tokens = {}
        for code, records in got.items():
            tokens[code] = median_of(records, "tokens_per_s")
            exposed = median_of(records, "dp_comm_exposed_s" if code == "after" else "dp_comm_s")
            own = median_of(records, "dp_comm_s") if code == "after" else None
            hidden = f"{1 - exposed / own:.0%}" if own and exposed is not None else "-"
            own_text = f"{own:.3f}" if own is not None else "-"
            print(f"  {code:<7} {tokens[code]:>9.1f} {own_text:>9} {exposed:>13.3f} {hidden:>7}")
        print(f"  after / before tokens/s: {tokens['after'] / tokens['before']:.3f}")
    print(f"\nload {os.getloadavg()}")


if __name__ == "__main__":
    main()
