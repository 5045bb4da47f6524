"""When the ring beats the all-gather (issue 52), from the planner's formulas (p3d.planner.step_time.kv_traffic):
the exposed seconds of one block's key/value traffic per micro batch, all-gather against ring, as the sequence
grows, for a cp group inside one node (NVLink) and one across nodes (a node per tp group: every message on the
NIC).
No run: the planner only, seconds on any machine.

    .venv/bin/python bench/cp_variants.py
    .venv/bin/python bench/cp_variants.py --model llama3_1_405b --tp 8 --cp 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3_8b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument("--seq", nargs="+", type=int, default=[4096, 8192, 16384, 32768, 65536, 131072])
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
