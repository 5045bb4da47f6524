"""The planner against the published runs of tests/helpers/published.py, as one table (issue 36).

    .venv/bin/python bench/planner_published.py          # the markdown table docs/planner.md shows

No torch, no process: every row's config is composed through Hydra (about 0.2 s a row) and predicted. The error
is on step time, ``t_pred / t_pub - 1``: a source that gives TFLOP/s per GPU or an MFU is turned back into
seconds with its own FLOP count (``t_pub = FLOPs per step / (TFLOP/s x GPUs)``). Beside it, the MFU in the
source's terms, published and predicted (its FLOPs over either step), the matmul efficiency the run implies (at
which the planner reproduces it), and the error with the efficiency fitted on the other runs of its generation
(leave-one-out: the one that is a prediction; the device presets store the median over all of them). The footer
gives the median |error| and the worst, both ways, and the fitted efficiencies.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers import published


def row(name: str) -> dict[str, Any]:
    entry, cfg = published.ROWS[name], published.config(name)
    got = published.compared(name)
    lay = f"tp{cfg.mesh.tp} pp{cfg.mesh.pp} dp{cfg.mesh.dp}"
    value = f"{entry.value:.2f} s" if entry.unit == "step_s" else f"{entry.value:.1f} TFLOP/s"
    return {
        "name": name,
        "miss": name in published.MISSES,
        "source": entry.source,
        "convention": entry.convention,
        "published": value,
        "t_pub": got.step_pub,
        "t_pred": got.step_pred,
        "error": got.error,
        "loo": published.leave_one_out(name),
        "implied": published.implied_efficiency(name),
        "mfu_pub": got.mfu(got.step_pub),
        "mfu_pred": got.mfu(got.step_pred),
        "layout": f"{got.gpus} x {cfg.cluster.device}, {lay}",
    }


def footer(found: list[dict[str, Any]], key: str, what: str) -> str:
    errors = [abs(r[key]) for r in found]
    worst = max(found, key=lambda r: abs(r[key]))
    return (
        f"{what}: median |error| {statistics.median(errors):.1%}, worst {worst['name']} {worst[key]:+.1%}; "
        f"within 10%: {sum(e <= 0.10 for e in errors)}, beyond 25%: {sum(e > 0.25 for e in errors)}"
    )


def table(found: list[dict[str, Any]]) -> str:
    lines = [
        "| run | layout | source | conv. | published | step pub. (s) | step pred. (s) | error | leave-one-out | "
        "implied eff. | MFU in the source's terms, pub. / pred. |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in found:
        name = f"*{r['name']}* (miss)" if r["miss"] else r["name"]
        lines.append(
            f"| {name} | {r['layout']} | {r['source']} | {r['convention']} | {r['published']} | {r['t_pub']:.2f} | "
            f"{r['t_pred']:.2f} | {r['error']:+.1%} | {r['loo']:+.1%} | {r['implied']:.3f} | "
            f"{r['mfu_pub']:.1%} / {r['mfu_pred']:.1%} |"
        )
    fit = ", ".join(f"{gen} {eff:.3f}" for gen, eff in published.fitted().items())
    lines += [
        "",
        footer(found, "loo", f"{len(found)} runs, leave-one-out"),
        footer(found, "error", f"{len(found)} runs, at the stored efficiencies"),
        f"fitted efficiencies (the median a generation's runs imply): {fit}",
    ]
    return "\n".join(lines)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print(table([row(name) for name in published.ROWS]))


if __name__ == "__main__":
    main()
