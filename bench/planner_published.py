"""The planner against the published runs of tests/unit/planner/test_published.py, as one table (issue 36).

    .venv/bin/python bench/planner_published.py          # the markdown table docs/planner.md shows

No torch, no process: every row's config is composed through Hydra (about 0.2 s a row) and predicted. The error
is on step time, ``t_pred / t_pub - 1``: a source that gives TFLOP/s per GPU or an MFU is turned back into
seconds with its own FLOP count (``t_pub = FLOPs per step / (TFLOP/s x GPUs)``). Beside it, the MFU in the
source's terms, published and predicted (its FLOPs over either step). The footer gives the median
|error| and the worst, over the predicted rows (the two calibration rows are the fit, not predictions).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers.runs import compose_config
from tests.unit.planner import test_published as published


def row(name: str, entry: published.Published, kind: str) -> dict[str, Any]:
    got = published.compare(compose_config, entry)
    cfg = compose_config(*entry.overrides)
    lay = f"tp{cfg.mesh.tp} pp{cfg.mesh.pp} dp{cfg.mesh.dp}"
    value = f"{entry.value:.2f} s" if entry.unit == "step_s" else f"{entry.value:.1f} TFLOP/s"
    return {
        "name": name,
        "kind": kind,
        "source": entry.source,
        "convention": entry.convention,
        "published": value,
        "t_pub": got.step_pub,
        "t_pred": got.step_pred,
        "error": got.error,
        "mfu_pub": got.mfu(got.step_pub),
        "mfu_pred": got.mfu(got.step_pred),
        "layout": f"{got.gpus} x {cfg.cluster.device}, {lay}",
    }


def rows() -> list[dict[str, Any]]:
    out = [row(n, e, "row") for n, e in published.ROWS.items()]
    out += [row(n, e, "miss") for n, e in published.MISSES.items()]
    out += [row(n, e, "calibration") for n, e in published.CALIBRATION.items()]
    return out


def table(found: list[dict[str, Any]]) -> str:
    lines = [
        "| run | layout | source | conv. | published | step pub. (s) | step pred. (s) | error | MFU in the source's "
        "terms, pub. / pred. |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in found:
        name = {"miss": f"*{r['name']}* (miss)", "calibration": f"{r['name']} (calibration)"}.get(r["kind"], r["name"])
        lines.append(
            f"| {name} | {r['layout']} | {r['source']} | {r['convention']} | {r['published']} | {r['t_pub']:.2f} | "
            f"{r['t_pred']:.2f} | {r['error']:+.1%} | {r['mfu_pub']:.1%} / {r['mfu_pred']:.1%} |"
        )
    predicted = [r for r in found if r["kind"] != "calibration"]
    errors = [abs(r["error"]) for r in predicted]
    worst = max(predicted, key=lambda r: abs(r["error"]))
    lines.append("")
    lines.append(
        f"{len(predicted)} predicted rows: median |error| {statistics.median(errors):.1%}, worst {worst['name']} "
        f"{worst['error']:+.1%}; within 10%: {sum(e <= 0.10 for e in errors)}, beyond 25%: "
        f"{sum(e > 0.25 for e in errors)}"
    )
    return "\n".join(lines)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print(table(rows()))


if __name__ == "__main__":
    main()
