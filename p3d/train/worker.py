"""A worker process: ``python -m p3d.cli.worker <run_spec.yaml>`` with RANK, WORLD_SIZE, LOCAL_RANK set
(by p3d's local launcher, torchrun or srun). Any exception is logged with the rank and ends the
process with status 1, so the launcher can stop the others and name this rank.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
import warnings
from pathlib import Path

from p3d import exit_codes
from p3d.train.host_memory import set_host_memory

PROCESS_NAME = "p3d-rank"  # + the rank (p3d.jobs.forked, tests' worker_pids)


def skip_cpu_shm_build() -> None:
    """No JIT build of DeepSpeed's CPU shared-memory all-reduce (inference only): p3d.compat.deepspeed_internals."""
    from p3d.compat.deepspeed_internals import disable_cpu_shm_comm

    disable_cpu_shm_comm()


def set_up_cpu_worker(host_memory: str = "keep", shown: bool = True) -> None:
    """A CPU (gloo) worker's process settings, before its first step. ``host_memory``: ``train.host_memory``;
    ``shown``: this worker's output is the console's (the logging rank), where a setting that does nothing is said."""
    import torch

    torch.set_num_threads(1)  # tp*pp*dp workers share the cores: one thread each
    # keep: no page faults for the next step's activations (p3d.train.host_memory)
    if not set_host_memory(host_memory) and host_memory == "release" and shown:
        print(
            "p3d: warning: train.host_memory=release has no effect here (the C library is not glibc): "
            "peak_mem_gb is the peak RSS, freed memory the heap keeps included",
            file=sys.stderr,
            flush=True,
        )
    skip_cpu_shm_build()


def init_process_group(plan, rank: int, timeout_s: int, tf32: bool = False, host_memory: str = "keep") -> None:
    """gloo on CPU, nccl on GPUs; a file store when the local launcher gives one, else env://."""
    import torch

    if plan.backend == "gloo":
        set_up_cpu_worker(host_memory, shown=rank == plan.logging_rank)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # train.tf32: fp32 matmuls (and convolutions) on tensor cores, 10-bit mantissa; bf16 runs do not care
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    from p3d.parallel.hang import COLLECTIVE_MARGIN_S
    from p3d.parallel.rendezvous import join

    # RendezvousError: the store / host:port and why. Collectives time out after the hang watch has spoken.
    join(plan.backend, rank, plan.world_size, timeout_s, COLLECTIVE_MARGIN_S)
    timeout = datetime.timedelta(seconds=timeout_s + COLLECTIVE_MARGIN_S)
    import deepspeed

    deepspeed.init_distributed(dist_backend=plan.backend, timeout=timeout)  # adopts the group made above


def rank_env_from_slurm() -> None:
    """Under ``srun`` (one task per device) take RANK, WORLD_SIZE, LOCAL_RANK from SLURM_*; the
    recipe sets MASTER_ADDR / MASTER_PORT."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ.get("SLURM_NTASKS", os.environ.get("SLURM_NPROCS", "1"))
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")


def log_placement(plan, rank: int) -> None:
    """One line per rank: the host it runs on and its mesh coordinates (tests/multinode checks them)."""
    import socket

    from p3d.parallel.mesh import Mesh

    mesh = Mesh.from_plan(plan, rank)
    dp, pp, tp = mesh.coords
    cp = f" cp {mesh.cp_rank}" if mesh.cp > 1 else ""
    local = os.environ.get("LOCAL_RANK", "0")
    print(
        f"[rank {rank}] placement: host {socket.gethostname()} dp {dp} pp {pp}{cp} tp {tp} local {local} "
        f"pid {os.getpid()}",
        flush=True,
    )


def name_process(rank: str) -> None:
    """``p3d-rank<R>`` as this process's name where Linux keeps it (``/proc/<pid>/comm``: what top, ``ps -o comm``
    and ``pgrep p3d-rank`` show), for a worker started as a fresh interpreter or forked (p3d.jobs.forked) alike."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, f"{PROCESS_NAME}{rank}".encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):  # not Linux: the name stays the interpreter's
        pass


def run(spec_path: str | Path, cfg=None, plan=None) -> int:
    from p3d.rundir.spec import read_spec
    from p3d.train.loop import train

    if cfg is None:
        cfg, plan = read_spec(spec_path)
    rank_env_from_slurm()
    rank = int(os.environ["RANK"])
    if int(os.environ.get("WORLD_SIZE", plan.world_size)) != plan.world_size:
        raise RuntimeError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} but the run spec needs {plan.world_size} ranks "
            f"(mesh dp={plan.dp} x pp={plan.pp} x tp={plan.tp})"
        )
    os.environ.setdefault("LOCAL_RANK", "0")
    init_process_group(plan, rank, cfg.cluster.timeout_s, cfg.train.tf32, cfg.train.host_memory.value)
    log_placement(plan, rank)
    import torch.distributed as dist

    try:
        status = train(cfg, plan, Path(spec_path).parent, rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return status


def leave(status: int) -> None:
    """Exit now, without the interpreter's teardown. The process groups are destroyed by then, but their
    C++ objects live on in DeepSpeed's and our own references; freed during finalization, a gloo worker
    thread that drops a tensor wants the GIL, is killed by the interpreter, and the process aborts
    ("terminate called without an active exception", exit 134) after a run that went well."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m p3d.cli.worker <run_dir/run_spec.yaml>", file=sys.stderr)
        return 2
    # DeepSpeed still calls torch.distributed APIs that torch marks deprecated; say it once per run, not per step.
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use.*", category=FutureWarning)
    from p3d.parallel.rendezvous import MARKER, RendezvousError, check_reachable

    name_process(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "")))
    try:
        check_reachable()
        leave(run(argv[0]))
    except RendezvousError as exc:  # one line, no traceback: the launcher reports it as a rendezvous failure
        print(f"[rank {os.environ.get('RANK', '?')}] {MARKER} {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(exit_codes.RENDEZVOUS_FAILED)
    except BaseException as exc:
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            return 0
        rank = os.environ.get("RANK", "?")
        if isinstance(exc, KeyboardInterrupt):  # SIGINT before the training loop listens: one line, no traceback
            print(
                f"[rank {rank}] interrupted (SIGINT) before the first step; nothing saved", file=sys.stderr, flush=True
            )
            os._exit(130)
        sys.stdout.flush()
        print(f"[rank {rank}] worker failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        from p3d.checkpoint.files import CheckpointError

        if not isinstance(exc, CheckpointError):  # a checkpoint problem is one line that names file and fix
            traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # skip atexit hooks that may block on a process group whose peers are gone
    return 0


if __name__ == "__main__":
    sys.exit(main())
