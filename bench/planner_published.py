"""The planner against the published runs of tests/unit/planner/test_published.py, as one table (issue 36).

    .venv/bin/python bench/planner_published.py          # the markdown table docs/planner.md shows

No torch, no process: every row's config is composed through Hydra (about 0.2 s a row) and predicted. The error
is on step time, ``t_pred / t_pub - 1``: a source that gives TFLOP/s per GPU or an MFU is turned back into
seconds with its own FLOP count (``t_pub = FLOPs per step / (TFLOP/s x GPUs)``). Beside it, the MFU in the
source's terms (its FLOPs over the predicted step) and p3d's model-FLOPs MFU. The footer gives the median
|error| and the worst, over the predicted rows (the two calibration rows are the fit, not predictions).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p3d.layout.geometry import model_flops_per_token, recompute_flops_per_token
from p3d.planner import evaluate
from tests.helpers.runs import compose_config
from tests.unit.planner import test_published as published

CONVENTION = {"hfu": "eq3", "mfu": "p3d"}  # the test file's names -> the convention's name in docs/planner.md


def source_flops_per_token(cfg: Any, convention: str) -> float:
    extra = recompute_flops_per_token(cfg.model, cfg.schedule.recompute.value) if convention == "hfu" else 0.0
    return model_flops_per_token(cfg.model) + extra


def row(name: str, entry: tuple, kind: str) -> dict[str, Any]:
    overrides, tflops, convention, source = entry
    cfg = compose_config(*overrides)
    pred = evaluate(cfg, check=False)
    gpus, peak = pred.layout.world_size, float(cfg.cluster.peak_tflops)
    flops_step = source_flops_per_token(cfg, convention) * pred.tokens_per_step
    t_pub = flops_step / (tflops * 1e12 * gpus)
    return {
        "name": name,
        "kind": kind,
        "source": source,
        "convention": CONVENTION[convention],
        "published": f"{tflops:.1f} TFLOP/s",
        "t_pub": t_pub,
        "t_pred": pred.step_time_s,
        "error": pred.step_time_s / t_pub - 1,
        "mfu_pub": tflops / peak,
        "mfu_pred": flops_step / pred.step_time_s / gpus / 1e12 / peak,
        "p3d_mfu": pred.mfu,
        "layout": f"{gpus} x {cfg.cluster.device}, tp{pred.layout.tp} pp{pred.layout.pp} dp{pred.layout.dp}",
    }


def rows() -> list[dict[str, Any]]:
    out = [row(n, e, "row") for n, e in published.ROWS.items()]
    out += [row(n, e, "miss") for n, e in published.MISSES.items()]
    out += [row(n, e, "calibration") for n, e in published.CALIBRATION.items()]
    return out


def table(found: list[dict[str, Any]]) -> str:
    lines = [
        "| run | layout | source | conv. | published | step pub. (s) | step pred. (s) | error | MFU (source's terms) "
        "pub. / pred. | p3d MFU pred. |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in found:
        name = {"miss": f"*{r['name']}* (miss)", "calibration": f"{r['name']} (calibration)"}.get(r["kind"], r["name"])
        lines.append(
            f"| {name} | {r['layout']} | {r['source']} | {r['convention']} | {r['published']} | {r['t_pub']:.2f} | "
            f"{r['t_pred']:.2f} | {r['error']:+.1%} | {r['mfu_pub']:.1%} / {r['mfu_pred']:.1%} | {r['p3d_mfu']:.1%} |"
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
