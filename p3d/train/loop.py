"""One worker's training run: mesh, executor (DeepSpeed's engine or a torch schedule: p3d.train.executors), data,
the step loop, validation, checkpoints, and a clean stop on SIGTERM / SIGUSR1 (what Slurm sends before a time
limit or preemption): finish the step, save, exit with p3d.exit_codes.PREEMPTED."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from p3d import exit_codes
from p3d.data.corpus import DataStats
from p3d.data.loader import micro_batches, validation_batches
from p3d.layout.geometry import schedule_bubble
from p3d.layout.hetero import micro_batches_text
from p3d.parallel.device_check import device_checked
from p3d.parallel.mesh import Mesh
from p3d.train.comm_clocks import running_dims
from p3d.train.executors import build_executor
from p3d.train.faults import StepPolicy, fault_state, restore_fault_state
from p3d.train.metrics import ExpertFigures, MetricsLogger, peak_memory_gb
from p3d.train.timing import StragglerWatch
from p3d.train.trace import StepTracer

KILL_ENV = "P3D_TEST_KILL_AT"
SKIPS = 4  # step_stats: the column of the data counts (three), then the communication figures


class Stopper:
    """Remembers a SIGTERM / SIGUSR1 / first SIGINT; the loop stops after the step in flight, on every
    rank at once. A second SIGINT (a worker in a terminal's foreground group under another launcher)
    ends the process at once, without a traceback."""

    def __init__(self):
        self.signum = 0
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            os._exit(128 + signal.SIGINT)
        self.signum = signum


def step_stats(
    stopper: Stopper,
    wait_share: float,
    compute_s: float,
    comm: dict[str, float],
    device,
    stats: DataStats | None,
) -> tuple[bool, float, float, list[float], dict[str, float]]:
    """(stop, mean bubble, max peak memory, every rank's compute seconds, the mean over ranks of each communication
    figure in ``comm``: ``<dim>_comm_s`` and ``<dim>_comm_exposed_s``, p3d.train.comm_clocks) over all ranks: one
    small all-gather per step (every rank passes the same keys).

    Every rank that reads data (``stats`` given: first and last stages) reads the same stream, so its
    skipped records, failed files and empty records agree with every other reader's. If they do not (a
    file failed on some ranks only, say an I/O error), inputs and labels no longer line up: stop the run,
    loudly."""
    skips = stats.counts() if stats is not None else [-1, -1, -1]  # -1: reads no data
    names = list(comm)
    mine = torch.tensor(
        [float(stopper.signum), wait_share, peak_memory_gb(), compute_s, *skips, *(comm[k] for k in names)],
        dtype=torch.float64,
        device=device,
    )
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    every = torch.stack(parts).cpu()
    counts = every[:, SKIPS : SKIPS + 3]
    readers = counts[counts[:, 0] >= 0]
    if len(readers) and not bool((readers == readers[0]).all()):
        per_rank = {r: tuple(int(x) for x in row) for r, row in enumerate(counts.tolist()) if row[0] >= 0}
        raise RuntimeError(
            "the data-reading ranks skipped different records or files of the same stream (rank: "
            f"(unreadable records, failed files, empty records) = {per_rank}; see the 'p3d data' "
            "warnings in the rank logs), so their batches no longer match; fix the input and resume "
            "from the last checkpoint"
        )
    stop, bubble, mem = bool(every[:, 0].max() > 0), float(every[:, 1].mean()), float(every[:, 2].max())
    means = every[:, SKIPS + 3 :].mean(dim=0).tolist()
    return stop, bubble, mem, every[:, 3].tolist(), dict(zip(names, means))


def train(cfg, plan, run_dir: str | Path, rank: int) -> int:
    """Returns p3d.exit_codes.OK, PREEMPTED after a signal-triggered checkpoint, or NONFINITE (p3d.train.faults)."""
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    run_dir = Path(run_dir)
    mesh = Mesh.from_plan(plan, rank).with_groups()
    device = torch.device("cuda", torch.cuda.current_device()) if plan.backend == "nccl" else torch.device("cpu")
    ex = build_executor(cfg, plan, mesh, rank, device, run_dir)  # DeepSpeed's engine or a torch schedule
    timer, gate, hang = ex.timer, ex.gate, ex.hang
    tracer = StepTracer(cfg, plan, mesh, run_dir, timer)  # the timelines of train.trace_steps (p3d.train.trace)
    stragglers = StragglerWatch(cfg.train.straggler_factor, cfg.train.straggler_steps, plan)
    policy = StepPolicy(cfg.train)
    start_step = start_sample = 0  # the data position is the samples consumed, whatever batch size made them
    if cfg.train.resume != "none":
        meta = ex.load(Path(cfg.train.resume))
        start_step, start_sample = meta["step"], meta["samples"]
        restore_fault_state(meta, gate, policy)
        ex.set_position(start_step, start_sample)
    stats = DataStats()
    reads_data = ex.reads_data
    s = cfg.schedule
    data = (
        micro_batches(
            cfg.data,
            cfg.model.seq_len,
            s.global_batch_size,
            s.micro_batch_size,
            plan.dp,
            mesh.dp_rank,
            cfg.train.seed,
            start_sample,
            stats,
            split=plan.replica_micro_batches,
        )
        if reads_data
        else None
    )
    val: list[torch.Tensor] | list[None] = []
    if cfg.train.eval_every > 0:
        val = (
            validation_batches(cfg.data, cfg.model.seq_len, s.global_batch_size, cfg.train.eval_batches)
            if reads_data
            else [None] * cfg.train.eval_batches
        )
    stopper = Stopper()
    experts = ExpertFigures(cfg.model, ex.module) if cfg.model.moe is not None else None
    metrics = None
    if rank == plan.logging_rank:
        from p3d.rundir.spec import spec_dict

        metrics = MetricsLogger(run_dir, cfg, plan, start_step, spec=spec_dict(cfg, plan))
        resumed = f", resumed from step {start_step} after {start_sample} samples" if start_step else ""
        metrics.print(
            f"training {cfg.model.name} ({plan.n_params / 1e6:.2f}M params) on {mesh.describe()}, "
            f"{micro_batches_text(plan)} micro batches of {s.micro_batch_size} x {cfg.model.seq_len} per replica, "
            f"{cfg.train.steps} steps{resumed}"
        )
        if getattr(ex, "precision_line", None):  # train.fp8: what computes in float8 on this stage
            metrics.print(ex.precision_line)
    running = running_dims(plan)  # the dimensions whose communication metrics.jsonl reports
    bubble_theory = schedule_bubble(s.pipeline.value, plan.pp, plan.micro_batches, s.virtual_stages)
    mixture = None
    if metrics and cfg.data.mix:  # the tokens and epochs each store of the mixture gave so far, by arithmetic
        from p3d.data.prepared import PreparedSamples

        mixture = PreparedSamples(cfg.data, cfg.model.seq_len, cfg.train.seed)
    checkpoints = ex.checkpointer
    status = exit_codes.OK
    # test hook "<rank>:<step>[:once]": that rank SIGKILLs itself as the step starts (":once": not in a resumed run);
    # "node<k>:<step>[:once]": every rank of (simulated) node k does, a lost node (p3d.jobs.local)
    kill_at = os.environ.get(KILL_ENV, "")
    if kill_at.endswith(":once"):
        kill_at = kill_at.removesuffix(":once") if start_step == 0 else ""
    mine = (f"{rank}:", f"node{plan.dims.node_of(rank)}:")
    for step in range(start_step + 1, cfg.train.steps + 1):
        if kill_at in (f"{mine[0]}{step}", f"{mine[1]}{step}"):
            os.kill(os.getpid(), signal.SIGKILL)
        lr = ex.get_lr()
        samples = start_sample + (step - start_step) * s.global_batch_size  # consumed once this step is done
        with hang.phase("lining up for a traced step", step), device_checked(device):
            tracer.line_up(step, device)
        t0 = time.perf_counter()
        with hang.phase("train_batch", step), device_checked(device), tracer.recording(step) as trace:
            loss = ex.train_batch(data)  # DeepSpeed's loss all-reduce included
        step_time = time.perf_counter() - t0
        with hang.phase("the per-step all-gather", step), device_checked(device):
            stop, bubble, mem, compute, comm = step_stats(
                stopper,
                timer.take() / step_time,
                timer.take_compute(),
                timer.take_comm(running),  # after take(): pp's figures are its waits
                device,
                stats if reads_data else None,
            )
        tracer.write(trace, step_time_s=step_time, bubble=bubble, bubble_theory=bubble_theory, **comm)
        assert gate.verdict is not None and gate.verdict.step == step, "the step gate did not run"
        failed, fault_line, extra = policy.apply(gate.verdict)
        if experts is not None:  # every rank: the step's routing figures, and aux-loss-free balancing
            with hang.phase("the routing figures' all-reduce", step), device_checked(device):
                extra.update(experts.after_step(device, discarded=gate.verdict.discarded))
        slow_fields, slow_lines = stragglers.update(compute)
        extra.update(slow_fields)
        for line in slow_lines if metrics else []:
            metrics.print(line)  # type: ignore[union-attr]
        if not failed and cfg.train.eval_every > 0 and (step % cfg.train.eval_every == 0 or step == cfg.train.steps):
            with hang.phase("evaluation", step), device_checked(device):
                extra["val_loss"] = ex.evaluate(val)
        if mixture is not None:
            extra["tokens_by_source"] = mixture.tokens_by_source(samples)
            extra["epochs_by_source"] = mixture.epochs_by_source(samples)
        if metrics:
            metrics.log(
                step,
                loss=float(loss),
                lr=float(lr),
                grad_norm=gate.verdict.grad_norm if gate.verdict.grad_norm is not None else ex.grad_norm(),
                step_time_s=step_time,
                samples=samples,
                bubble=bubble,
                bubble_theory=bubble_theory,
                **comm,
                peak_mem_gb=mem,
                **extra,
            )
        if fault_line and metrics:
            metrics.print(f"p3d: {fault_line}")
        elif fault_line:  # every rank's log says it too
            print(f"[rank {rank}] p3d: {fault_line}", file=sys.stderr, flush=True)
        if failed:  # no checkpoint of a failed step: the last complete one stays the newest
            status = exit_codes.NONFINITE
            break
        every = cfg.train.save_every
        if stop or step == cfg.train.steps or (every > 0 and step % every == 0):
            with hang.phase("checkpoint save", step):
                path = checkpoints.save(
                    step,
                    samples,
                    {
                        "skipped_records": stats.skipped_records,
                        "empty_records": stats.empty_records,
                        "faults": fault_state(gate, policy),
                    },
                )
            if metrics:
                saved = "saving checkpoint {} in the background" if checkpoints.asynchronous else "saved checkpoint {}"
                metrics.print(saved.format(path) + (" after a stop signal" if stop else ""))
        if stop:  # a stop at the last step leaves nothing to resume: the run is done
            status = exit_codes.PREEMPTED if step < cfg.train.steps else exit_codes.OK
            break
    tracer.close()  # the logging rank's merges of the traced steps' parts finish
    checkpoints.wait()  # a background write in flight finishes (on every rank) before the run ends or exits 75
    if metrics:
        if stats.summary():
            metrics.print(stats.summary())
        metrics.close()
    return status
