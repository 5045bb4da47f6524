"""The calibration file: this machine's measured rates, written by ``p3d-plan calibrate``, read by the planner.

One JSON file (``FORMAT``), written atomically. It holds what identifies the machine and the software (refused
when they differ from this host's: ``check_identity``), the probed block and head times at the shapes of the run
it was made for, the GEMM and memory rates for every other shape, one fit ``t = latency + s_per_byte x bytes``
per (collective, group size), and the optimizer's seconds per parameter (docs/planner.md, Calibration).

No torch here (the planner never imports it): versions come from the installed packages' metadata.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import socket
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from p3d.config.errors import P3DConfigError

KIND = "p3d-calibration"
FORMAT = 1
AGAIN = "run p3d-plan calibrate <the run's overrides> calibration=<file> on this machine"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def software_fingerprint() -> dict[str, str]:
    return {
        "p3d": _version("p3d"),
        "torch": _version("torch"),
        "deepspeed": _version("deepspeed"),
        "python": platform.python_version(),
    }


def cpu_model() -> str:
    """``model name`` of /proc/cpuinfo (else ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cores() -> int:
    """The cores this process may run on (a cgroup or taskset limit counts, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def host_fingerprint(device: str) -> dict[str, Any]:
    """What identifies this machine; the hostname is recorded, never compared (a Slurm job lands on any node of a
    partition, a container renames its host)."""
    return {"device": device, "hostname": socket.gethostname(), "cpu_model": cpu_model(), "cores": cores()}


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check_identity(raw: Any, device: str, path: str, elsewhere: bool = False) -> None:
    """P3DConfigError, one line naming ``calibration=`` and the fix, unless ``raw`` was made on this kind of
    machine with this software: format, p3d's version, torch's major.minor, the device, and on cpu the cpu model and
    the cores this process may use. ``elsewhere``: the run trains on other machines than this one (a Slurm
    cluster, planned from its login node), whose cpu model and cores this host cannot vouch for: not compared."""
    where = f"calibration={path}"
    if not isinstance(raw, dict) or raw.get("kind") != KIND or raw.get("format") != FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else None
        raise P3DConfigError(f"{where} is not a p3d calibration file of format {FORMAT} (format {got}); {AGAIN}")
    made, now = raw.get("software", {}), software_fingerprint()
    if made.get("p3d") != now["p3d"] or _major_minor(str(made.get("torch"))) != _major_minor(now["torch"]):
        raise P3DConfigError(
            f"{where} was made with p3d {made.get('p3d')} / torch {made.get('torch')}; this is p3d {now['p3d']} / "
            f"torch {now['torch']}; {AGAIN}"
        )
    machine = raw.get("machine", {})
    if machine.get("device") != device:
        raise P3DConfigError(
            f"{where} was made on cluster.device={machine.get('device')}, this config plans cluster.device={device}; "
            f"{AGAIN} with cluster.device={device}, or drop calibration="
        )
    if device == "cpu" and not elsewhere:
        here = host_fingerprint(device)
        for key in ("cpu_model", "cores"):
            if machine.get(key) != here[key]:
                raise P3DConfigError(
                    f"{where} was made on a machine with {key}={machine.get(key)!r}, this one has {here[key]!r}; "
                    f"{AGAIN}"
                )


def read(path: str) -> dict[str, Any]:
    """The file's JSON, or P3DConfigError in one line (missing, unreadable, not JSON)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise P3DConfigError(f"calibration={path} cannot be read ({exc.strerror or exc}); {AGAIN}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise P3DConfigError(f"calibration={path} is not JSON ({exc.msg}, line {exc.lineno}); {AGAIN}") from None


def check_file(cfg) -> None:
    """Read, check and parse ``cfg.calibration`` (typed_config runs this before anything starts)."""
    raw = read(cfg.calibration)
    check_identity(raw, str(cfg.cluster.device), cfg.calibration, elsewhere=cfg.cluster.launcher.value == "slurm")
    parse(raw, cfg.calibration)


def dump(raw: dict[str, Any], path: str | Path) -> None:
    """Write ``raw`` atomically: a temporary name beside the target, then a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(raw, indent=1) + "\n")
    os.replace(tmp, path)


def created() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ---- the file as the planner reads it


BlockKey = tuple[str, bool, int, int, str, str]  # arch, moe, tp, s (the rank's tokens), recompute, dtype
# The probe mode of full recompute under DeepSpeed's engine: its PipelineModule checkpoints each block with
# DeepSpeed's own reentrant ``checkpointing.checkpoint``, whose backward took 5-8 % longer than torch's
# non-reentrant checkpoint (which the torch executors use, the mode "full") for model=small's block here.
FULL_DEEPSPEED = "full_deepspeed"


def probe_mode(recompute: str, torch_executor: bool) -> str:
    """The probe mode that times a layout's recompute: ``FULL_DEEPSPEED`` for full recompute on DeepSpeed's engine."""
    return FULL_DEEPSPEED if recompute == "full" and not torch_executor else recompute


@dataclass(frozen=True)
class Probed:
    """Seconds of one probed piece (a block, or the head with its loss) for one micro batch of ``b`` sequences;
    ``loaded_*``: the same while ``cores`` copies ran at once."""

    b: int
    fwd_s: float
    bwd_s: float
    loaded_fwd_s: float
    loaded_bwd_s: float

    def times(self, b: int, loaded: bool) -> tuple[float, float]:
        """(fwd, bwd) seconds at micro batch ``b`` (other b scale linearly by rows)."""
        scale = b / self.b
        if loaded:
            return self.loaded_fwd_s * scale, self.loaded_bwd_s * scale
        return self.fwd_s * scale, self.bwd_s * scale


@dataclass(frozen=True)
class Fit:
    """Seconds of one collective over n ranks against its bytes (as the planner's ``ring`` counts them: the whole
    tensor of an all-reduce, the gathered one of an all-gather, the message of a send): piecewise linear through
    the measured points, extended beyond them by the end segments (gloo's time is not one line from 256 KiB to
    32 MiB), or ``latency_s + s_per_byte x bytes`` where fewer than two points were kept."""

    latency_s: float
    s_per_byte: float
    points: tuple[tuple[float, float], ...] = ()

    def seconds(self, nbytes: float) -> float:
        pts = self.points
        if len(pts) < 2:
            return self.latency_s + self.s_per_byte * nbytes
        i = next((k for k in range(1, len(pts) - 1) if nbytes < pts[k][0]), len(pts) - 1)
        (x0, t0), (x1, t1) = pts[i - 1], pts[i]
        slope = max(0.0, (t1 - t0) / (x1 - x0)) if x1 > x0 else 0.0
        return max(0.0, t0 + slope * (nbytes - x0))


@dataclass(frozen=True)
class Calibration:
    path: str
    raw: dict[str, Any]
    cores: int
    cores_effective: float
    blocks: dict[BlockKey, Probed]
    tp_blocks: dict[BlockKey, Probed]  # on tp real ranks, their all-reduces in (1 < tp <= cores)
    heads: dict[tuple[int, int, int], Probed]  # tp, s, vocab_padded
    embeddings: dict[tuple[int, int, int], Probed]  # tp, s, vocab_padded
    gemm_tflops: float
    loaded_gemm_tflops: float
    memory_gbps: float
    loaded_memory_gbps: float
    optimizer_s_per_param: tuple[float, float]  # (alone, loaded)
    engine_copy_s_per_param: tuple[float, float] | None  # (alone, loaded); None: not probed (no dp in the plan)
    fits: dict[tuple[str, int], Fit]
    overhead: dict[str, tuple[float, float]]  # executor -> (per micro batch, per step) seconds

    def describe(self) -> str:
        """``cpu AMD EPYC x2, 2026-12-05T10:00:00Z, 6 probed blocks``."""
        m = self.raw["machine"]
        return f"{m['device']} {m.get('cpu_model', '')} x{m.get('cores')}, {self.raw.get('created')}, " + (
            f"{len(self.blocks)} probed blocks, cores_effective {self.cores_effective:.2f}"
        )


def _probed(row: dict[str, Any]) -> Probed:
    return Probed(
        int(row["b"]),
        float(row["fwd_s"]),
        float(row["bwd_s"]),
        float(row.get("loaded_fwd_s", row["fwd_s"])),
        float(row.get("loaded_bwd_s", row["bwd_s"])),
    )


def parse(raw: dict[str, Any], path: str) -> Calibration:
    """The planner's view of a checked file; P3DConfigError in one line when a section is missing or malformed."""
    try:
        comp, machine = raw["compute"], raw["machine"]
        blocks, tp_blocks = (
            {
                (r["arch"], bool(r["moe"]), int(r["tp"]), int(r["s"]), r["recompute"], r["dtype"]): _probed(r)
                for r in comp.get(kind, [])
            }
            for kind in ("blocks", "tp_blocks")
        )
        heads, embeddings = (
            {(int(r["tp"]), int(r["s"]), int(r["vocab_padded"])): _probed(r) for r in comp.get(kind, [])}
            for kind in ("head", "embedding")
        )
        fits = {
            (f["op"], int(f["n"])): Fit(
                float(f["latency_s"]),
                float(f["s_per_byte"]),
                tuple(sorted((float(x), float(t)) for x, t in f.get("points", []))),
            )
            for f in raw.get("collectives", {}).get("fits", [])
        }
        overhead = {
            name: (float(v.get("per_micro_batch_s", 0.0)), float(v.get("per_step_s", 0.0)))
            for name, v in raw.get("overhead", {}).items()
        }
        return Calibration(
            path=path,
            raw=raw,
            cores=int(machine["cores"]),
            cores_effective=float(comp["cores_effective"]),
            blocks=blocks,
            tp_blocks=tp_blocks,
            heads=heads,
            embeddings=embeddings,
            gemm_tflops=float(comp["gemm_tflops"]),
            loaded_gemm_tflops=float(comp.get("loaded_gemm_tflops", comp["gemm_tflops"])),
            memory_gbps=float(comp["memory_gbps"]),
            loaded_memory_gbps=float(comp.get("loaded_memory_gbps", comp["memory_gbps"])),
            optimizer_s_per_param=(
                float(comp["optimizer_s_per_param"]),
                float(comp.get("loaded_optimizer_s_per_param", comp["optimizer_s_per_param"])),
            ),
            engine_copy_s_per_param=(
                (float(comp["engine_copy_s_per_param"]), float(comp["loaded_engine_copy_s_per_param"]))
                if comp.get("engine_copy_s_per_param")
                else None
            ),
            fits=fits,
            overhead=overhead,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise P3DConfigError(f"calibration={path} lacks or garbles {exc}; {AGAIN}") from None


def load(path: str) -> Calibration:
    """The parsed file (read once per path and modification time: mesh=auto evaluates thousands of layouts)."""
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError:
        mtime = 0
    return _load(path, mtime)


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime: int) -> Calibration:
    return parse(read(path), path)
