"""The plot of p3d-report (p3d.launch.report): median tokens/s per layout, one bar per point (report_rows.Row)."""

from __future__ import annotations

from pathlib import Path

from p3d.launch.report_rows import AXES, Row, has_layout, layout_text, varying_axes


def bar_labels(rows: list[Row]) -> tuple[list[str], str]:
    """(a label per point: '#1 dp2 (4 ranks: cp2)', naming the axes that vary between the points; the axes they
    share, in one phrase for the title)."""
    axes = varying_axes(rows)
    labels = [f"#{r.point} {r.mesh}" + (f" ({layout_text(r, axes)})" if has_layout(r) and axes else "") for r in rows]
    laid_out = [r for r in rows if has_layout(r)]
    shared = [a for a in AXES if a not in axes]
    return labels, layout_text(laid_out[0], shared) if laid_out and shared else ""


def plot(rows: list[Row], path: Path, title: str) -> None:
    """Horizontal bars: median tokens/s per layout; points without a throughput are named, empty (bar_labels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, shared = bar_labels(rows)
    title += f"\n{shared}" if shared else ""
    values = [r.tokens_per_s or 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.45 * len(rows)))
    colors = ["tab:blue" if r.status == "done" else "tab:gray" for r in rows]
    bars = ax.barh(range(len(rows)), values, color=colors)
    for bar, r in zip(bars, rows):
        note = (
            (f" {r.tokens_per_s:,.0f}" + (f", MFU {r.mfu:.1%}" if r.mfu is not None else ""))
            if r.tokens_per_s
            else f" {r.status}"
        )
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, note, va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (median over steps after the first)")
    ax.set_title(title, fontsize=10)
    ax.margins(x=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
