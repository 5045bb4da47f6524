"""Start tp*pp*dp worker processes on this machine and watch them.

Each worker is ``python -m p3d.cli.worker <run_spec.yaml>`` with RANK/WORLD_SIZE/LOCAL_RANK set and a
file-store rendezvous in the run directory (no fixed port to collide). Worker output is appended to
``<run.dir>/logs/rank<N>.log``, after a header line for this attempt (p3d.rundir.attempts: the logs of every
earlier launch of the run are kept); the logging rank's output is also copied to this console. If one
worker exits with an error, the others are stopped at once and the rank is named; the survivors of a lost node
fail with a lost connection, which the console leaves out: it names the node.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from p3d import exit_codes
from p3d.jobs import forked
from p3d.jobs.follow import follow
from p3d.jobs.stop import StopSignals
from p3d.parallel import hang
from p3d.parallel.mesh import Mesh
from p3d.parallel.rendezvous import MARKER, file_url, store_path
from p3d.rundir.attempts import current_attempt, start_attempt
from p3d.rundir.files import logs as run_logs

POLL_S = 0.1
FOLLOW_S = 0.05  # how often the console shows what the logging rank wrote
GRACE_S = 5.0
HANG_GATHER_S = 10.0  # after the first hang report, how long the other waiting ranks have to write theirs
NODE_SETTLE_S = 1.0  # after a worker died of a signal, how long the rest of its node has to die too (a lost node)
PEER_SETTLE_S = 5.0  # when only peers of a lost connection have died, how long the rank that caused it has to exit


def worker_env(plan, rank: int, store: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(plan.world_size),
        LOCAL_RANK=str(rank % plan.procs_per_node),
        LOCAL_WORLD_SIZE=str(plan.procs_per_node),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="0",
        P3D_INIT_METHOD=file_url(store),
        PYTHONUNBUFFERED="1",
    )
    if plan.backend == "gloo":
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    if sys.stdout.isatty():
        env["P3D_TTY"] = "1"  # the logging rank may draw a progress bar
    return env


class Console:
    """The logging rank's log from ``offset`` (this attempt's start), followed onto the console (p3d.jobs.follow)
    while the workers run; its failure report, if it writes one, is held back until :meth:`drain` decides."""

    def __init__(self, log: Path, console, offset: int = 0):
        self._done = threading.Event()
        self._console = console
        self.held: list[str] = []  # the logging rank's failure report, once it began one
        self._thread = threading.Thread(
            target=follow, args=(log, self._done.is_set, console, FOLLOW_S, offset, self.held), daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def drain(self, show_failure: bool = True) -> bool:
        """Copy the rest of the log (the workers have ended, or are being stopped) and stop following; the logging
        rank's failure report too unless ``show_failure`` is false (it stays in its log). True when it wrote one."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        report, self.held[:] = "".join(self.held), []
        if report and show_failure:
            try:
                self._console.write(report)
                self._console.flush()
            except (OSError, ValueError):  # the console went away: the log keeps it
                pass
        return bool(report)


def _tail(path: Path, n: int = 20) -> str:
    """The last ``n`` lines this attempt wrote to a rank log."""
    try:
        return "\n".join(current_attempt(path.read_text(errors="replace")).splitlines()[-n:])
    except OSError:
        return "(no log)"


def _stop(procs: dict[int, forked.Worker], sig=signal.SIGTERM) -> None:
    for p in procs.values():
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + GRACE_S
    for p in procs.values():
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


# What a worker prints when a peer, not itself, went away first.
_PEER_LOSS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote worker crashing",
    "ProcessGroupGloo",
    "DistNetworkError",
    "Socket Timeout",
    MARKER,
)  # MARKER: it waited for a peer


def _lost_a_peer(rank: int, logs: Path) -> bool:
    tail = _tail(logs / f"rank{rank}.log", 40)
    return any(marker in tail for marker in _PEER_LOSS)


def _only_peers_died(failed: list[tuple[int, int]], logs: Path) -> bool:
    """Every dead worker exited with an error about a lost peer: the rank whose exit closed their connections may
    not have been reaped yet, so it is not among them."""
    return all(rc >= 0 and _lost_a_peer(rank, logs) for rank, rc in failed)


def _first_cause(failed: list[tuple[int, int]], logs: Path) -> tuple[int, int]:
    """Of the workers found dead, the one that failed first: its peers die of the lost connection a moment
    later. A signal death beats an error exit; an error that is not a lost peer beats one that is; then the
    lowest rank."""
    return min(failed, key=lambda f: (f[1] >= 0, _lost_a_peer(f[0], logs), f[0]))


def _report_hang(procs: dict[int, forked.Worker], plan, logs: Path, console, shown: Console, failure: dict) -> int:
    """A rank's hang watch fired (p3d.parallel.hang): give the other waiting ranks a moment to report too, stop
    the job, and say who waited on whom and who never arrived."""
    deadline = time.monotonic() + HANG_GATHER_S
    while time.monotonic() < deadline:
        reports = hang.read_reports(logs)
        if all(r in reports or p.poll() is not None for r, p in procs.items()):
            break
        time.sleep(POLL_S)
    reports = hang.read_reports(logs)
    running = [r for r, p in procs.items() if p.poll() is None and r not in reports]
    _stop(procs)
    shown.drain()
    mesh = Mesh.from_plan(plan, 0)
    print(hang.summarize(reports, running, mesh), file=console, flush=True)
    absent = sorted({p for r in reports.values() for p in r["peers"]} - set(reports))
    failure.update(restartable=True, cause=f"a hang (ranks {', '.join(map(str, absent)) or '?'} never arrived)")
    return exit_codes.HUNG


def _lost_nodes(procs: dict[int, forked.Worker], plan) -> dict[int, list[int]]:
    """Node -> its ranks, for every (simulated) node whose workers all ended by a signal: a lost worker group, as
    when a machine dies. Only with several nodes (an elastic run, p3d.layout.elastic_rules); the rest of a node
    whose first worker died by a signal gets ``NODE_SETTLE_S`` to die too."""
    nodes = plan.world_size // plan.procs_per_node
    if nodes < 2 or not any((p.poll() or 0) < 0 for p in procs.values()):
        return {}
    deadline = time.monotonic() + NODE_SETTLE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
        time.sleep(POLL_S)
    groups = {n: [r for r in procs if plan.dims.node_of(r) == n] for n in range(nodes)}
    return {n: ranks for n, ranks in groups.items() if all((procs[r].poll() or 0) < 0 for r in ranks)}


def _report_lost_nodes(procs, plan, lost: dict[int, list[int]], console, shown: Console, failure: dict) -> int:
    """Stop the others and say in one line which nodes were lost (the elastic decision follows: p3d.jobs.restart).
    The survivors' errors, their lost connections to the nodes lost, stay in their logs: the logging rank's is not
    shown."""
    others = sum(1 for p in procs.values() if p.poll() is None)
    on_lost = {r for ranks in lost.values() for r in ranks}
    survivors_failed = sorted(r for r, p in procs.items() if r not in on_lost and p.poll() not in (None, 0))
    _stop(procs)
    shown.drain(show_failure=False)
    names = [str(n) for n in lost]
    killed = "; ".join(
        f"{'rank' if len(ranks) == 1 else 'ranks'} {'-'.join(map(str, sorted({ranks[0], ranks[-1]})))} killed by "
        f"{signal.Signals(-procs[ranks[0]].returncode).name}"
        for ranks in lost.values()
    )
    cause = f"{'node' if len(lost) == 1 else 'nodes'} {', '.join(names)} lost ({killed})"
    alive = plan.world_size // plan.procs_per_node - len(lost)
    failure.update(restartable=True, cause=cause, lost_nodes=names, alive_nodes=alive)
    stopped = f"; stopped the other {others} running workers" if others else ""
    many = len(survivors_failed) > 1
    with_it = (
        f"; rank{'s' * many} {', '.join(map(str, survivors_failed))} lost {'their' if many else 'its'} connection"
        f"{'s' * many} to it (in {'their logs' if many else 'its log'})"
        if survivors_failed
        else ""
    )
    print(f"p3d: {cause}{with_it}{stopped}", file=console, flush=True)
    return exit_codes.WORKER_FAILED


def describe_exit(rc: int) -> str:
    if rc < 0:
        return f"was killed by {signal.Signals(-rc).name}"
    return f"exited with status {rc}"


def launch_local(
    spec_path: Path,
    plan,
    console=None,
    on_started=None,
    failure: dict | None = None,
    imports: tuple[str, ...] = (),
    signals: StopSignals | None = None,
) -> int:
    """Run the workers to completion. Returns 0; NONFINITE when they stopped at a step with an inf/nan loss or
    gradient norm (p3d.train.faults); PREEMPTED when they stopped on SIGTERM / SIGUSR1 / a
    first Ctrl-C (see p3d.jobs.stop) after saving a checkpoint; or 1 naming the first failed rank.
    ``on_started()`` runs once every worker is started (the run lease records their pids then). ``failure``
    receives ``cause`` (one phrase) and ``restartable`` (a worker killed by a signal, or a hang: not an error
    the worker raised) when the run fails (p3d.jobs.restart). ``signals``: how stop signals reach the workers
    (p3d.jobs.stop; one for every launch of a run with restarts, which knows its run dir and train.keep_last)."""
    failure = {} if failure is None else failure
    console = console or sys.stdout
    run_dir = spec_path.parent
    logs = run_logs(run_dir)
    # each rank log gets this attempt's header; the hang reports of the one before are set aside, kept
    start_attempt(logs, plan.world_size, f"{plan.world_size} worker{'s' if plan.world_size != 1 else ''} here")
    store = store_path(run_dir, f".rendezvous-{os.getpid()}-{uuid.uuid4().hex[:16]}")  # absolute, for file://
    procs: dict[int, forked.Worker] = {}
    shown_log = logs / f"rank{plan.logging_rank}.log"
    shown = Console(shown_log, console, offset=shown_log.stat().st_size)
    fork = forked.can_fork(plan.backend)
    if fork:  # ``imports``: what the workers import beyond torch (forked.worker_imports), imported once here
        forked.preload(imports)  # before the signal handlers: a Ctrl-C here is the launcher's KeyboardInterrupt
        fork = forked.can_fork(plan.backend)  # an import that started a thread makes a fork unsafe: exec then
    # SIGTERM/SIGUSR1 forwarded; Ctrl-C: save, twice: abort
    signals = signals or StopSignals({}, console, run_dir)
    signals.procs = procs
    signals.install()
    received = signals.received
    try:
        for rank in range(plan.world_size):
            with open(logs / f"rank{rank}.log", "ab") as log:  # each worker appends to its own log
                if fork:
                    procs[rank] = forked.fork_worker(spec_path, worker_env(plan, rank, store), log.fileno())
                else:
                    procs[rank] = subprocess.Popen(
                        [sys.executable, "-m", "p3d.cli.worker", str(spec_path)],
                        env=worker_env(plan, rank, store),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
        shown.start()  # once every worker is: no fork while this thread writes to the console
        if on_started is not None:
            on_started()
        ok = (exit_codes.OK, exit_codes.PREEMPTED, exit_codes.NONFINITE)  # every rank ends with the same one
        peers_died_at = None
        while True:
            failed = [(r, rc) for r, rc in ((r, p.poll()) for r, p in procs.items()) if rc is not None and rc not in ok]
            if any(rc == exit_codes.HUNG for _, rc in failed) or hang.read_reports(logs):
                return _report_hang(procs, plan, logs, console, shown, failure)
            if failed and len(failed) < len(procs) and _only_peers_died(failed, logs):
                peers_died_at = peers_died_at or time.monotonic()
                if time.monotonic() - peers_died_at < PEER_SETTLE_S:
                    time.sleep(POLL_S)
                    continue
            if failed:
                lost = {} if received else _lost_nodes(procs, plan)
                if lost:
                    return _report_lost_nodes(procs, plan, lost, console, shown, failure)
                rank, rc = _first_cause(failed, logs)
                break
            if all(p.returncode in ok for p in procs.values()):
                shown.drain()
                if signals.aborted:  # the second Ctrl-C's kill came as they exited: say what is on disk
                    print(signals.settled(), file=console, flush=True)
                for status in (exit_codes.NONFINITE, exit_codes.PREEMPTED):
                    if any(p.returncode == status for p in procs.values()):
                        return status  # NONFINITE: the logging rank printed the step, the quantity and the stage
                return exit_codes.OK
            time.sleep(POLL_S)
        others = sum(1 for p in procs.values() if p.poll() is None)
        _stop(procs)
        also = sorted(r for r, _ in failed if r != rank)
        shown.drain()
        failure.update(restartable=rc < 0 and not received, cause=f"rank {rank} {describe_exit(rc)}")
        if received:
            print(f"p3d: stopped by {signal.Signals(received[0]).name}", file=console, flush=True)
            if signals.aborted:  # every worker is reaped (_stop): what the kill left on disk is final
                print(signals.settled(), file=console, flush=True)
            return 128 + received[0]
        dp, pp, tp = plan.dims.coords_of(rank)
        then = f" (ranks {', '.join(map(str, also))} failed with it)" if also else ""
        if rc == exit_codes.RENDEZVOUS_FAILED:  # the worker's own line names the store or host:port and the cause
            why = [ln for ln in _tail(logs / f"rank{rank}.log").splitlines() if MARKER in ln]
            cause = why[-1].split(MARKER, 1)[1].strip() if why else f"see {logs / f'rank{rank}.log'}"
            print(
                f"p3d: the workers could not rendezvous: rank {rank} (dp {dp}, pp {pp}, tp {tp}) {cause}{then}; "
                f"stopped the other {others} running workers",
                file=console,
                flush=True,
            )
            return exit_codes.WORKER_FAILED
        print(
            f"p3d: rank {rank} (dp {dp}, pp {pp}, tp {tp}) {describe_exit(rc)}{then}; stopped the other {others} "
            f"running workers. Last lines of {logs / f'rank{rank}.log'}:\n{_tail(logs / f'rank{rank}.log')}",
            file=console,
            flush=True,
        )
        return exit_codes.WORKER_FAILED
    finally:
        if any(p.poll() is None for p in procs.values()):  # an exception in this function: leave no orphans
            _stop(procs, signal.SIGKILL)
        shown.drain()
        signals.restore()
        store.unlink(missing_ok=True)
