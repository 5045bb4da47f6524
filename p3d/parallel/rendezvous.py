"""How the workers of a run find each other, and what they say when they cannot.

The local launcher gives its workers a file store in the run directory (``P3D_INIT_METHOD=file://<an
absolute path>``: no port to collide); torchrun and srun give ``env://`` (MASTER_ADDR, MASTER_PORT).
``cluster.timeout_s`` bounds the rendezvous as it bounds every collective. A store that cannot be
reached at all (its directory missing or not writable) fails at once, before torch's file store
would wait out its own 300 s; a worker that cannot join exits with ``exit_codes.RENDEZVOUS_FAILED`` after one
line naming the store path, or the host and port, and the cause, and the launcher reports it so.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

MARKER = "rendezvous failed:"  # the worker's one line in its log starts with "[rank N] " and this
# Test hook (tests/e2e/test_relative_paths.py): the local launcher puts its file store in this directory
# instead of the run directory, so that a test can make the store unreachable. Not for users.
STORE_DIR_ENV = "P3D_TEST_RENDEZVOUS_DIR"


class RendezvousError(RuntimeError):
    """This worker cannot join the others; the message names the store or host:port and the cause."""


def store_path(run_dir: Path, name: str) -> Path:
    """The local launcher's file store: ``<run dir>/<name>``, absolute (or under the test hook's dir)."""
    from p3d.rundir.paths import absolute

    return absolute(Path(os.environ.get(STORE_DIR_ENV) or run_dir) / name)


def file_url(path: Path) -> str:
    """``file://`` + an absolute path. Not percent-encoded: torch reads the URL's path as it stands, so
    spaces must stay spaces; a relative path would have its first part read as a host name."""
    if not Path(path).is_absolute():
        raise ValueError(f"a file rendezvous needs an absolute path, not {path}")
    return f"file://{path}"


def check_reachable() -> None:
    """Fail at once (before the worker imports torch and DeepSpeed) when the launcher's file store
    cannot be reached: torch's FileStore would wait out its own 300 s on a missing directory."""
    url = os.environ.get("P3D_INIT_METHOD", "env://")
    if not url.startswith("file://"):
        return
    path = Path(url[len("file://") :])
    if not path.is_absolute():
        raise RendezvousError(f"cannot use the file store {url}: its path is relative (a host name to torch)")
    if not path.parent.is_dir():
        raise RendezvousError(f"cannot reach the file store {path}: the directory {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise RendezvousError(f"cannot reach the file store {path}: the directory {path.parent} is not writable")


def _file_store(url: str, world_size: int, timeout: datetime.timedelta):
    import torch.distributed as dist

    check_reachable()
    store = dist.FileStore(url[len("file://") :], world_size)
    store.set_timeout(timeout)
    return store


def join(backend: str, rank: int, world_size: int, timeout_s: int, margin_s: int = 0) -> None:
    """``torch.distributed.init_process_group`` through the store the launcher gave, every wait bounded
    by ``timeout_s`` (collectives by ``timeout_s + margin_s``: p3d.parallel.hang reports a hang first).
    Raises RendezvousError naming the cause."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    url = os.environ.get("P3D_INIT_METHOD", "env://")
    if url.startswith("file://"):
        where = f"the file store {url[len('file://') :]}"
        kwargs = {"store": _file_store(url, world_size, timeout)}
    else:
        where = (
            (
                f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')} ({url}, from "
                "MASTER_ADDR:MASTER_PORT)"
            )
            if url == "env://"
            else url
        )
        kwargs = {"init_method": url}
    try:
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=timeout + datetime.timedelta(seconds=margin_s),
            **kwargs,
        )
    except (RuntimeError, ValueError) as exc:  # DistError, DistStoreError, gloo's "Wait timeout", a bad URL
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RendezvousError(
            f"cannot join the other {world_size - 1} workers through {where} within "
            f"cluster.timeout_s={timeout_s}: {cause}"
        ) from None
    bound_later_groups(timeout + datetime.timedelta(seconds=margin_s))


def bound_later_groups(timeout: datetime.timedelta) -> None:
    """Every group made after this (p3d's mesh groups, DeepSpeed's pipe and data groups, which pass no
    timeout) times out like the world group: torch's ``new_group(timeout=None)`` takes the module default
    (30 min for gloo and, in torch's constants, 10 min for NCCL), so a wait on a subgroup would outlive the
    hang report and the launcher's patience by far. torch private API: the module-level defaults."""
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout
