"""The planner against the published runs of tests/helpers/published.py, as one table (issues 36 and 50).

    .venv/bin/python bench/planner_published.py          # the markdown table docs/planner.md shows
    .venv/bin/python bench/planner_published.py --fit    # and the GEMM constants fitted again (about 20 s)

No torch, no process: every row's config is composed through Hydra (about 0.2 s a row) and predicted at the device
presets' stored constants. The error is on step time, ``t_pred / t_pub - 1``: a source that gives TFLOP/s per GPU or
an MFU is turned back into seconds with its own FLOP count (``t_pub = FLOPs per step / (TFLOP/s x GPUs)``). Beside
it, the MFU in the source's terms, published and predicted (its FLOPs over either step), and the row's half of the
split: ``fit`` rows set the two GEMM constants of their device generation, ``held out`` rows are predictions of runs
the constants were not fitted on. The footer gives the median |error| and the worst of each half, and the constants.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers import published, published_fit


def row(name: str) -> dict[str, Any]:
    entry, cfg = published.ROWS[name], published_fit.config(name)
    got = published_fit.compared(name)
    lay = f"tp{cfg.mesh.tp} pp{cfg.mesh.pp} dp{cfg.mesh.dp}" + (f" cp{cfg.mesh.cp}" if cfg.mesh.cp > 1 else "")
    value = f"{entry.value:.2f} s" if entry.unit == "step_s" else f"{entry.value:.1f} TFLOP/s"
    return {
        "name": name,
        "miss": name in published_fit.MISSES,
        "half": "held out" if name in published.HELD_OUT else "fit",
        "source": entry.source,
        "convention": entry.convention,
        "published": value,
        "t_pub": got.step_pub,
        "t_pred": got.step_pred,
        "error": got.error,
        "mfu_pub": got.mfu(got.step_pub),
        "mfu_pred": got.mfu(got.step_pred),
        "layout": f"{got.gpus} x {cfg.cluster.device}, {lay}, zero {cfg.zero.stage}",
    }


def footer(found: list[dict[str, Any]], what: str) -> str:
    errors = [abs(r["error"]) for r in found]
    worst = max(found, key=lambda r: abs(r["error"]))
    return (
        f"{what} ({len(found)} runs): median |error| {statistics.median(errors):.1%}, worst {worst['name']} "
        f"{worst['error']:+.1%}; within 10%: {sum(e <= 0.10 for e in errors)}, beyond 25%: "
        f"{sum(e > 0.25 for e in errors)}"
    )


def constants() -> str:
    return ", ".join(
        f"{gen} e {e:.3f} k0 {k0:g}"
        for gen, (e, k0) in ((g, published_fit.stored(g)) for g in published_fit.GENERATIONS)
    )


def table(found: list[dict[str, Any]]) -> str:
    lines = [
        "| run | layout | source | conv. | published | step pub. (s) | step pred. (s) | error | half | "
        "MFU in the source's terms, pub. / pred. |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in found:
        name = f"*{r['name']}* (miss)" if r["miss"] else r["name"]
        lines.append(
            f"| {name} | {r['layout']} | {r['source']} | {r['convention']} | {r['published']} | {r['t_pub']:.2f} | "
            f"{r['t_pred']:.2f} | {r['error']:+.1%} | {r['half']} | {r['mfu_pub']:.1%} / {r['mfu_pred']:.1%} |"
        )
    lines += [
        "",
        footer([r for r in found if r["half"] == "held out"], "held out"),
        footer([r for r in found if r["half"] == "fit"], "fit"),
        footer(found, "all"),
        f"stored GEMM constants (e, k0): {constants()}",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fit", action="store_true", help="fit the GEMM constants again on the fit half and print them"
    )
    args = parser.parse_args()
    print(table([row(name) for name in published.ROWS]))
    if args.fit:
        for gen in published_fit.GENERATIONS:
            e, k0 = published_fit.fit(gen)
            loss = published_fit.fit_loss(gen, e, k0)
            print(f"fitted {gen}: e {e:.3f} k0 {k0:g} (mean |ln error| of its fit rows {loss:.4f})")


if __name__ == "__main__":
    main()
