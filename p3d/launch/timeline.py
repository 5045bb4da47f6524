"""The picture of a traced step (``train.trace_steps``), drawn by p3d-report from ``traces/step_<N>.json``
(p3d.rundir.traces) into ``traces/step_<N>_timeline.png``.

One row per rank, sorted by (pp, dp, cp, tp) from the top, time across in milliseconds from the step's start. Each row
has two bands: the upper one is the schedule track (the passes, coloured by kind and labelled with their micro
batch; the waits on pipeline neighbours and the drain in reds: the bubble; data loads; the optimizer step), the lower
one the collectives track, coloured by dimension. A collective under an empty stretch of the upper band is exposed
communication: nothing computed while it ran. White is time in no recorded event (the host's Python between
passes, the step gate's checks). The title names the schedule, the mesh and the step's measured figures.

The figure's height follows the rank count (``figure_height``): a fixed margin plus, per panel, a fixed part and a
fixed height per rank.
"""

from __future__ import annotations

from pathlib import Path

from p3d.rundir.files import timeline_path, trace_path
from p3d.rundir.traces import KINDS, TRACKS, merge_left_over, rank_events, read_trace, traced_steps

COLOURS = {
    "F": "#1f77b4",
    "B": "#2ca02c",
    "I": "#98df8a",
    "W": "#17becf",
    "loss": "#fdd835",
    "data": "#c7c7c7",
    "wait": "#ff9896",
    "drain": "#d62728",
    "optimizer": "#9467bd",
    "dp": "#ff7f0e",
    "tp": "#8c564b",
    "pp": "#e377c2",
    "cp": "#bcbd22",
    "ep": "#7f7f7f",
    "mp": "#c49c94",
    "world": "#393b79",
    "other": "#dbdb8d",
}
LEGEND = {
    "F": "forward",
    "B": "backward",
    "I": "backward, input grads",
    "W": "backward, weight grads",
    "loss": "loss",
    "data": "data load",
    "wait": "p2p wait (bubble)",
    "drain": "drain (bubble)",
    "optimizer": "optimizer step",
    "dp": "dp collective",
    "tp": "tp collective",
    "pp": "pp collective",
    "cp": "cp collective",
    "ep": "ep all-to-all",
    "mp": "pp x tp collective",
    "world": "world collective",
    "other": "other collective",
}
WIDTH_IN, DPI = 12.0, 100
MARGIN_IN = 0.95  # the legend and the time axis below the panels
PANEL_IN, ROW_IN = 0.55, 0.32  # each panel: its title, then a row per rank
SCHEDULE_BAND, COLLECTIVE_BAND = (0.42, -0.02), (-0.04, -0.38)  # (top, bottom) of each band around a row's centre


def figure_height(rank_counts: list[int]) -> float:
    """Inches of a figure with one panel per entry (each with that many ranks)."""
    return MARGIN_IN + sum(PANEL_IN + ROW_IN * n for n in rank_counts)


def title_of(trace: dict) -> str:
    meta = trace.get("otherData", {}).get("p3d", {})
    figures = meta.get("figures", {})
    v = meta.get("virtual_stages") or 1
    schedule = meta.get("schedule", "?") + (f" v={v}" if v > 1 else "")
    parts = [f"step {meta.get('step', '?')}: {schedule} on {meta.get('mesh', '?')} ({meta.get('dims', '')})"]
    if figures.get("bubble") is not None:
        parts.append(f"measured bubble {figures['bubble']:.1%} (theory {figures.get('bubble_theory', 0):.1%})")
    if figures.get("step_time_s") is not None:
        parts.append(f"step {figures['step_time_s'] * 1e3:.0f} ms")
    if meta.get("missing_ranks"):
        parts.append(f"missing ranks {meta['missing_ranks']}")
    return ", ".join(parts)


def rows_of(trace: dict) -> list[tuple[int, str]]:
    """(rank, row label) top to bottom, in the trace's process order (pp, dp, cp, tp)."""
    meta = trace.get("otherData", {}).get("p3d", {}).get("ranks", {})
    order = {e["pid"]: e["args"]["sort_index"] for e in trace["traceEvents"] if e.get("name") == "process_sort_index"}
    rows = []
    for pid in sorted(order, key=lambda p: order[p]):
        c = meta.get(str(pid), {}).get("coords")
        rows.append((pid, f"rank {pid}" + (f"  pp{c['pp']} dp{c['dp']} cp{c['cp']} tp{c['tp']}" if c else "")))
    return rows


def span_ms(trace: dict) -> float:
    return max((e["ts"] + e["dur"] for e in trace["traceEvents"] if e.get("ph") == "X"), default=1.0) / 1e3


def draw_panel(ax, trace: dict, title: str | None = None) -> set[str]:
    """One traced step on ``ax``; returns the kinds drawn. A rank's passes of its second chunk (interleaved and V
    schedules: chunk // pp odd) are lighter than those of its first."""
    rows, events, kinds, span = rows_of(trace), rank_events(trace), set(), span_ms(trace)
    meta = trace.get("otherData", {}).get("p3d", {}).get("ranks", {})
    pp = len({r["coords"]["pp"] for r in meta.values()}) or 1
    for y, (pid, _) in enumerate(rows):
        for e in events.get(pid, []):
            top, bottom = SCHEDULE_BAND if e["tid"] == TRACKS.index("schedule") else COLLECTIVE_BAND
            kind = e["cat"] if e["cat"] in COLOURS else "other"
            kinds.add(kind)
            start, width, middle = e["ts"] / 1e3, e["dur"] / 1e3, y - (top + bottom) / 2
            alpha = 0.55 if e.get("args", {}).get("chunk", 0) // pp % 2 else 1.0
            ax.barh(middle, width, left=start, height=top - bottom, color=COLOURS[kind], alpha=alpha, linewidth=0)
            micro_batch = e.get("args", {}).get("micro_batch")
            if micro_batch is not None and width > span / 60:
                ax.text(start + width / 2, middle, str(micro_batch), ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(rows)), [label for _, label in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, span * 1.01)
    ax.set_title(title or title_of(trace), fontsize=9, loc="left")
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    return kinds


def draw(traces: list[dict], path: str | Path, titles: list[str] | None = None) -> Path:
    """One panel per trace, one above the other on one time axis (ms); the figure is ``figure_height`` tall."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    counts = [len(rows_of(t)) for t in traces]
    height = figure_height(counts)
    fig = plt.figure(figsize=(WIDTH_IN, height), dpi=DPI)
    top, kinds = height, set()
    axes: list = []
    for i, (trace, n) in enumerate(zip(traces, counts)):
        panel = PANEL_IN + ROW_IN * n
        bottom_in = top - panel  # the panel's axes leave 0.35 in above them for its title, 0.05 in below
        box = (0.17, (bottom_in + 0.05) / height, 0.81, (panel - 0.4) / height)
        ax = fig.add_axes(box, sharex=axes[0] if axes else None)
        kinds |= draw_panel(ax, trace, titles[i] if titles else None)
        axes.append(ax)
        top = bottom_in
    axes[0].set_xlim(0, max(span_ms(t) for t in traces) * 1.01)  # shared: the longest step
    for ax in axes[:-1]:
        ax.tick_params(labelbottom=False)
    axes[-1].set_xlabel("ms from the step's start", fontsize=8)
    handles = [Patch(color=COLOURS[k], label=LEGEND[k]) for k in KINDS if k in kinds]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=7, frameon=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def draw_run(run_dir: str | Path) -> list[Path]:
    """The picture of every traced step of a run (merging the parts a stopped run left first)."""
    merge_left_over(run_dir)
    return [
        draw([read_trace(trace_path(run_dir, step))], timeline_path(run_dir, step)) for step in traced_steps(run_dir)
    ]
