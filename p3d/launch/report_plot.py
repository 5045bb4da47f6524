"""The plot of p3d-report (p3d.launch.report): median tokens/s per layout, one bar per point (report_rows.Row)."""

from __future__ import annotations

from pathlib import Path

from p3d.launch.report_rows import Row


def plot(rows: list[Row], path: Path, title: str) -> None:
    """Horizontal bars: median tokens/s per layout; points without a throughput are named, empty."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"#{r.point} {r.mesh}" + (f" (dp{r.dp} pp{r.pp} tp{r.tp}, {r.schedule})" if r.dp is not None else "")
        for r in rows
    ]
    values = [r.tokens_per_s or 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * len(rows)))
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
