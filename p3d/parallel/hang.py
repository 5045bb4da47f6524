"""Hangs that say where: a watchdog thread in every worker, and the launcher's summary of what it wrote.

Worker side (:class:`HangWatch`): every pipeline instruction and the trainer's phases (train_batch, the per-step
all-gather, evaluation, checkpoint save) mark what this rank is doing (step, micro batch, instruction, and the
peers that instruction needs); inside a phase, the stretch between two instructions is a wait of its own (DeepSpeed
all-reduces and broadcasts the loss there, after the schedule). When one of them
lasts longer than ``cluster.timeout_s``, the thread writes one ``p3d-hang:`` JSON line (rank, what, where, on
whom) and the Python stack of every thread (``faulthandler``) to the rank's log, the same JSON to
``logs/rank<N>.hang.json`` (what the local launcher watches for; the next attempt keeps it under another name,
p3d.rundir.attempts), and, if nothing has stopped the process ``EXIT_AFTER_S`` later, ends it with
``exit_codes.HUNG``. It does not exit at once: its peers, waiting on it,
would fail with a lost connection before their own watches speak. The process group's own timeout is set
later than that (``COLLECTIVE_MARGIN_S``), so the report, not a bare gloo/NCCL timeout error, is what a hang
produces. A rank that is stopped (SIGSTOP), or stuck
in its own compute, writes no such line: the others' lines name it as the peer that never arrived.

Launcher side (:func:`summarize`): the waiting ranks, each with its instruction and peers, and the ranks they
waited on that never reported waiting themselves.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from p3d import exit_codes
from p3d.compat.deepspeed_internals import pipeline_instruction_map, set_pipeline_instruction_map
from p3d.parallel.mesh import Mesh
from p3d.rundir.attempts import HANG_SUFFIX, hang_report

MARKER = "p3d-hang:"
COLLECTIVE_MARGIN_S = 30  # the process group times out this much after cluster.timeout_s: the watch speaks first
POLL_S = 0.5
EXIT_AFTER_S = 20.0  # after its report, a hung worker that nobody stopped ends itself (torchrun, srun)
REPORT_SUFFIX = HANG_SUFFIX  # an earlier attempt's reports are set aside under another name (p3d.rundir.attempts)
STOP_ENV = "P3D_TEST_STOP_AT"  # test hook "<rank>:<step>": that rank SIGSTOPs itself after the step's OptimizerStep


def report_path(logs: Path, rank: int) -> Path:
    return hang_report(logs, rank)


@dataclass
class Doing:
    what: str  # a pipeline instruction, or the trainer's phase
    step: int
    micro_batch: int  # forward passes this rank has started in this step
    peers: list[int]
    since: float


def coords_of(mesh: Mesh, rank: int) -> tuple[int, int, int]:
    """(dp, pp, tp) of ``rank`` in ``mesh``'s layout."""
    return dataclasses.replace(mesh, rank=rank).coords


def rank_at(mesh: Mesh, dp: int, pp: int, tp: int) -> int:
    return next(r for r in range(mesh.world_size) if coords_of(mesh, r) == (dp, pp, tp))


def instruction_peers(mesh: Mesh, name: str) -> list[int]:
    """The ranks a pipeline instruction of this rank waits on."""
    dp, pp, tp = mesh.coords
    if name in ("RecvActivation", "SendGrad") and pp > 0:
        return [rank_at(mesh, dp, pp - 1, tp)]
    if name in ("SendActivation", "RecvGrad") and pp < mesh.pp - 1:
        return [rank_at(mesh, dp, pp + 1, tp)]
    if name == "ReduceGrads":
        return [rank_at(mesh, d, pp, tp) for d in range(mesh.dp) if d != dp]
    if name in ("ReduceTiedGrads", "OptimizerStep"):  # tied copies, the mesh-wide norm and the gate's all-gather
        return [r for r in range(mesh.world_size) if r != mesh.rank]
    return []


class HangWatch:
    def __init__(self, engine, mesh: Mesh, timeout_s: float, logs: Path, stream=None):
        self.mesh, self.timeout_s, self.logs = mesh, timeout_s, logs
        self.stream = stream or sys.stderr
        self.doing: Doing | None = None
        self._step, self._micro = 0, 0
        self._phases: list[Doing] = []  # the trainer's phases this rank is in, innermost last
        self._engine = engine
        if engine is not None:  # DeepSpeed: every instruction marks its own wait. The torch schedules (engine None)
            # have no instruction table: their whole step is the trainer's "train_batch" phase, on all other ranks
            table = dict(pipeline_instruction_map(engine))
            for instr, fn in table.items():
                table[instr] = self._wrap(instr.__name__, fn)
            set_pipeline_instruction_map(engine, table)
        threading.Thread(target=self._watch, name="p3d-hang-watch", daemon=True).start()

    def _wrap(self, name: str, fn):
        peers = instruction_peers(self.mesh, name)
        stop_after = os.environ.get(STOP_ENV, "") if name == "OptimizerStep" else ""

        def watched(engine, *args, **kwargs):
            step = engine.global_steps + 1
            if step != self._step:
                self._step, self._micro = step, 0
            self._micro += name == "ForwardPass"
            self.doing = Doing(name, step, self._micro, peers, time.monotonic())
            try:
                return fn(engine, *args, **kwargs)
            finally:
                self.doing = self._after(name)
                if stop_after == f"{self.mesh.rank}:{step}":  # test hook: freeze between instructions
                    os.kill(os.getpid(), signal.SIGSTOP)

        return watched

    def _after(self, name: str) -> Doing | None:
        """What this rank does once an instruction returns: the enclosing phase, whose next wait (the next
        instruction, or DeepSpeed's loss all-reduce and broadcast after the schedule) starts its clock now."""
        outer = self._phases[-1] if self._phases else None
        if outer is None:
            return None
        return dataclasses.replace(outer, what=f"{outer.what}, after {name}", micro_batch=self._micro,
                                   since=time.monotonic())  # fmt: skip

    @contextmanager
    def phase(self, what: str, step: int):
        """A stretch of the trainer's own (a whole train_batch, the per-step all-gather, an evaluation, a
        checkpoint save) whose waits are on any other rank. Watched from start to end: instructions inside
        it mark their own waits, and the time between two of them counts as a wait of the phase."""
        others = [r for r in range(self.mesh.world_size) if r != self.mesh.rank]
        mark = Doing(what, step, self._micro, others, time.monotonic())
        self._phases.append(mark)
        self.doing = mark
        try:
            yield
        finally:
            self._phases.pop()
            self.doing = self._after(what)

    def _watch(self) -> None:
        while True:
            time.sleep(POLL_S)
            d = self.doing
            if d is None or time.monotonic() - d.since <= self.timeout_s:
                continue
            dp, pp, tp = self.mesh.coords
            report = {
                "rank": self.mesh.rank,
                "dp": dp,
                "pp": pp,
                "tp": tp,
                "what": d.what,
                "step": d.step,
                "micro_batch": d.micro_batch,
                "peers": d.peers,
                "waited_s": round(time.monotonic() - d.since),
                "timeout_s": self.timeout_s,
            }
            try:
                print(f"{MARKER} {json.dumps(report)}", file=self.stream, flush=True)
                print(
                    f"[rank {self.mesh.rank}] p3d: no progress for {report['waited_s']} s (cluster.timeout_s="
                    f"{self.timeout_s:g}) in {d.what} at step {d.step}, micro batch {d.micro_batch}, waiting on "
                    f"ranks {d.peers}; the stack of every thread:",
                    file=self.stream,
                    flush=True,
                )
                faulthandler.dump_traceback(file=self.stream, all_threads=True)
                self.stream.flush()
                dump_flight_recorder(self.logs, self.mesh.rank, self.stream)
                tmp = report_path(self.logs, self.mesh.rank).with_suffix(".tmp")
                tmp.write_text(json.dumps(report) + "\n")
                tmp.rename(report_path(self.logs, self.mesh.rank))
            finally:
                time.sleep(EXIT_AFTER_S)
                os._exit(exit_codes.HUNG)


FR_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def dump_flight_recorder(logs: Path, rank: int, stream) -> None:
    """With torch's Flight Recorder on (FR_ENV > 0), write its trace of this rank's collectives to
    ``logs/fr_trace_<N>`` for ``python -m torch.distributed.flight_recorder.fr_trace`` (docs/faults.md).
    ``torch._C._distributed_c10d._dump_fr_trace`` is torch's private API; a failure is said and ignored."""
    if not any(os.environ.get(v, "0") not in ("", "0") for v in FR_ENV):
        return
    try:
        import torch._C._distributed_c10d as c10d

        (logs / f"fr_trace_{rank}").write_bytes(c10d._dump_fr_trace())  # type: ignore[attr-defined]
        print(f"[rank {rank}] p3d: Flight Recorder trace in {logs / f'fr_trace_{rank}'}", file=stream, flush=True)
    except Exception as exc:  # an older torch, a recorder that is off: the Python report still stands
        print(f"[rank {rank}] p3d: no Flight Recorder trace ({type(exc).__name__}: {exc})", file=stream, flush=True)


def read_reports(logs: Path) -> dict[int, dict]:
    """rank -> its hang report, for the ranks that wrote one."""
    found = {}
    for f in logs.glob(f"rank*{REPORT_SUFFIX}"):
        try:
            found[int(f.name[4 : -len(REPORT_SUFFIX)])] = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
    return found


def summarize(reports: dict[int, dict], running: list[int] | None, mesh: Mesh) -> str:
    """One paragraph: who waited where on whom, and who never arrived (``running``: the ranks still alive,
    when the caller knows)."""
    waiting = []
    for rank, r in sorted(reports.items()):
        on = f" on rank{'s' if len(r['peers']) != 1 else ''} {', '.join(map(str, r['peers']))}" if r["peers"] else ""
        waiting.append(f"rank {rank} in {r['what']} (step {r['step']}, micro batch {r['micro_batch']}){on}")
    timeout_s = max((r["timeout_s"] for r in reports.values()), default=0)
    absent = sorted({p for r in reports.values() for p in r["peers"]} - set(reports))
    named = []
    for rank in absent:
        dp, pp, tp = coords_of(mesh, rank)
        state = "" if running is None else ", still running: stopped or stuck" if rank in running else ", exited"
        named.append(f"rank {rank} (dp {dp}, pp {pp}, tp {tp}{state})")
    return (
        f"p3d: hang: no progress for cluster.timeout_s={timeout_s:g} s. Waiting: {'; '.join(waiting)}. "
        f"Never arrived: {', '.join(named) if named else 'none named'}. Every waiting rank's log holds its stack; "
        "stopped the job"
    )
