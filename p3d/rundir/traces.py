"""The timeline of a traced step (``train.trace_steps``) as a file: Chrome's trace-event format, which Perfetto
(ui.perfetto.dev) and chrome://tracing open (docs/timeline.md). The recording is p3d.train.trace's.

Each rank writes its own part, ``traces/step_<N>/rank<R>.json`` (``write_part``), once the step's figures are
taken; the logging rank merges the parts into ``traces/step_<N>.json`` (``merge``) in the background, and p3d-report
merges any a run left behind. Why parts and a merge, not a gather to one rank: a traced step then costs each rank
one small file write and no collective, nobody waits on anybody, and the parts of a run that died are still there.

The merged file::

    {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {"p3d": {...}}}

- one process per rank (pid = the rank), named ``rank R (pp P, dp D, cp C, tp T)`` and sorted by (pp, dp, cp, tp);
- two threads in each: tid 0 ``schedule`` (the passes F, B, I, W of each micro batch and chunk, the loss, the data
  loads, the waits on pipeline neighbours and the drain, the optimizer step), tid 1 ``collectives`` (each
  collective, its dimension in ``cat``: ``DIMS``); the events of one thread follow each other, none overlaps
  another (Perfetto shows overlapping complete events wrongly);
- complete events (``"ph": "X"``): ``ts`` and ``dur`` in microseconds from the rank's step start (every rank starts
  a step as the previous step's all-gather releases it, so the ranks line up at 0), ``cat`` the kind (a colour of
  the picture: ``KINDS``), ``args`` its micro batch and chunk;
- ``otherData.p3d``: the step, schedule, mesh, the step's figures (``step_time_s``, ``bubble``, ``bubble_theory``,
  ``dp_comm_s`` as metrics.jsonl has them), and per rank its coordinates, its step's seconds and the order of
  passes its schedule planned (torch's notation: ``1F3`` is chunk 1's forward of micro batch 3); missing ranks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from p3d.rundir.files import trace_part_path, trace_path, traces

PASSES = ("F", "B", "I", "W")  # forward, full backward, input-gradient and weight-gradient passes
# A collective's dimension, the group it runs over; mp: the pp x tp ranks of one replica (the norm's sum)
DIMS = ("dp", "tp", "pp", "cp", "ep", "mp", "world", "other")
# Every kind of event, in the picture's legend order: compute, host work, time blocked on pipeline neighbours (the
# bubble), the optimizer, then the collectives by dimension.
KINDS = (*PASSES, "loss", "data", "wait", "drain", "optimizer", *DIMS)
TRACKS = ("schedule", "collectives")  # tid 0, tid 1
_STEP = re.compile(r"step_(\d+)$")


def _write_json(path: Path, body: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(body, separators=(",", ":")) + "\n")
    os.replace(tmp, path)  # a reader never sees half a file


def write_part(run_dir: str | Path, part: dict) -> Path:
    """One rank's part of a traced step: ``{"step", "rank", "world_size", "coords": {pp, dp, cp, tp}, "step_s",
    "events": [[track, kind, name, ts_us, dur_us, args], ...], "planned": [...], "run": {...}, "figures": {...}}``."""
    path = trace_part_path(run_dir, part["step"], part["rank"])
    _write_json(path, part)
    return path


def label(coords: dict) -> str:
    return f"pp {coords['pp']}, dp {coords['dp']}, cp {coords['cp']}, tp {coords['tp']}"


def chrome_trace(parts: list[dict]) -> dict:
    """The merged trace of one step from its ranks' parts (see the module's docstring)."""
    parts = sorted(parts, key=lambda p: (p["coords"]["pp"], p["coords"]["dp"], p["coords"]["cp"], p["coords"]["tp"]))
    events: list[dict[str, Any]] = []
    for order, part in enumerate(parts):
        pid = part["rank"]
        events.append(
            {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {pid} ({label(part['coords'])})"}}
        )
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": order}})
        for tid, track in enumerate(TRACKS):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": track}})
        for track, kind, name, ts, dur, args in part["events"]:
            events.append(
                {
                    "ph": "X",
                    "name": name,
                    "cat": kind,
                    "ts": ts,
                    "dur": dur,
                    "pid": pid,
                    "tid": TRACKS.index(track),
                    "args": args,
                }
            )
    first = parts[0] if parts else {}
    world = first.get("world_size", len(parts))
    logging = [p for p in parts if p.get("figures")]
    meta = {
        "step": first.get("step"),
        **first.get("run", {}),
        "figures": logging[0]["figures"] if logging else {},
        "ranks": {
            str(p["rank"]): {"coords": p["coords"], "step_s": p["step_s"], "planned": p.get("planned", [])}
            for p in parts
        },
        "missing_ranks": sorted(set(range(world)) - {p["rank"] for p in parts}),
    }
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"p3d": meta}}


def merge(run_dir: str | Path, step: int, world_size: int | None = None, wait_s: float = 0.0) -> Path | None:
    """Merge the parts of ``step`` into ``traces/step_<N>.json`` and remove them; None when there are none.
    ``wait_s``: how long to wait for all ``world_size`` parts (a shared file system may show another node's file
    late); after it, the ranks whose part is missing are named in the trace."""
    folder = trace_part_path(run_dir, step, 0).parent
    deadline = time.monotonic() + wait_s
    while world_size and len(list(folder.glob("rank*.json"))) < world_size and time.monotonic() < deadline:
        time.sleep(0.05)
    files = sorted(folder.glob("rank*.json"))
    if not files:
        return None
    path = trace_path(run_dir, step)
    _write_json(path, chrome_trace([json.loads(f.read_text()) for f in files]))
    shutil.rmtree(folder, ignore_errors=True)
    return path


def merge_left_over(run_dir: str | Path) -> list[Path]:
    """Merge the parts a run left unmerged (it stopped before the logging rank merged them)."""
    folders = [d for d in traces(run_dir).glob("step_*") if d.is_dir() and _STEP.search(d.name)]
    merged = [merge(run_dir, int(_STEP.search(d.name).group(1))) for d in folders]  # type: ignore[union-attr]
    return [p for p in merged if p is not None]


def traced_steps(run_dir: str | Path) -> list[int]:
    """The steps with a merged trace in the run directory, in order."""
    found = [_STEP.search(p.stem) for p in traces(run_dir).glob("step_*.json")]
    return sorted(int(m.group(1)) for m in found if m)


def read_trace(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def rank_events(trace: dict) -> dict[int, list[dict]]:
    """Each rank's complete events, in time order."""
    out: dict[int, list[dict]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            out.setdefault(e["pid"], []).append(e)
    return {pid: sorted(evs, key=lambda e: (e["ts"], e["tid"])) for pid, evs in out.items()}
