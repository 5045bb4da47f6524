"""The device check: a test mode that catches, on a CPU-only machine, a host tensor handed to a device collective.

On a GPU cluster NCCL takes CUDA tensors only: a collective on a tensor that p3d made on the host (a factory call
without ``device=``, such as ``torch.tensor([loss])``) fails at the first step there. On CPU with gloo the same
call works, because the compute device *is* the host, so nothing in a CPU suite could see it. This mode makes the
two kinds of tensor differ on a CPU machine too:

- **host tensors go to the meta device**: while inside ``device_checked``, a tensor factory (``torch.tensor``,
  ``zeros``, ``empty``, ``full``, ``arange``, ...) called by p3d's own code (the caller's module is ``p3d.*``,
  outside ``p3d.data``, whose host batches are moved to the device on purpose) without ``device=`` makes a meta
  tensor, where on a GPU it would have made a CPU one. Tensors made with ``device=``, derived from device tensors
  (``*_like``, arithmetic, views) or made by torch's own code (FSDP2, the pipelining runtime, the optimizers) are
  what they would be;
- **every collective checks its tensors**: ``torch.distributed``'s tensor collectives and p2p calls (looked up on
  the module at call time, as p3d, FSDP2 and the pipelining runtime call them) refuse a tensor whose device type is
  not the compute device's, naming the call and the p3d line that made it.

A meta tensor that meets a real one in arithmetic fails as well, as a host tensor meeting a CUDA one would.
So the mode fails on a host tensor wherever a GPU would, and nowhere else. It is on in the test suite
(``P3D_TEST_DEVICE_CHECK=1``, set by tests/conftest.py, so every worker the tests start runs under it), around
the torch executor's step and evaluation and the step loop's per-step collectives (p3d.train.loop).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from types import FrameType

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

ENV = "P3D_TEST_DEVICE_CHECK"

# Public factories that place their result on the default device when not told otherwise.
FACTORIES = frozenset(
    getattr(torch, name)
    for name in (
        "tensor",
        "as_tensor",
        "scalar_tensor",
        "zeros",
        "ones",
        "empty",
        "full",
        "arange",
        "range",
        "linspace",
        "logspace",
        "eye",
        "rand",
        "randn",
        "randint",
        "randperm",
        "empty_strided",
        "tril_indices",
        "triu_indices",
    )
    if hasattr(torch, name)
)
# torch.distributed's calls that move tensors: collectives, blocking p2p and the batched p2p the pipelining runtime
# issues.
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "batch_isend_irecv",  # its P2POps' tensors (isend / irecv themselves stay: P2POp checks it holds them)
)
EXEMPT = ("p3d.data",)  # host batches by design: the executors move them to the device


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def _p3d_caller(depth: int) -> str | None:
    """The ``p3d.*`` module of the frame ``depth`` above the caller, or None (torch's own code, a test, ...)."""
    name = sys._getframe(depth + 1).f_globals.get("__name__", "")
    if name.startswith("p3d.") and not name.startswith(EXEMPT):
        return name
    return None


class HostTensorsOnMeta(TorchFunctionMode):
    """A tensor factory called by p3d's own code without ``device=`` makes a meta tensor (a host tensor on a GPU)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None and _p3d_caller(1):
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def _tensors(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dist.P2POp):
        yield value.tensor


def _where() -> str:
    """file:line of the innermost p3d frame that led to the call (the collective's caller, or its caller's)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("p3d.") and frame.f_code.co_filename != __file__:
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "outside p3d"


def _checked(name: str, fn, device_type: str):
    def call(*args, **kwargs):
        for t in _tensors([*args, *kwargs.values()]):
            if t.device.type != device_type:
                what = "a host tensor (made by a factory without device=)" if t.device.type == "meta" else t.device
                raise RuntimeError(
                    f"device check: torch.distributed.{name} got {what}, shape {tuple(t.shape)}, where the compute "
                    f"device is {device_type}; NCCL takes device tensors only (called from {_where()})"
                )
        return fn(*args, **kwargs)

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    call.device_checked = True  # type: ignore[attr-defined]
    return call


@contextlib.contextmanager
def device_checked(device: torch.device) -> Iterator[None]:
    """While inside (and the mode is on, ``P3D_TEST_DEVICE_CHECK``): host tensors made by p3d are meta tensors and
    every collective refuses a tensor off ``device``. Re-entrant: an inner use inside an outer one does nothing."""
    if not enabled() or getattr(dist.all_reduce, "device_checked", False):
        yield
        return
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    for name, fn in originals.items():
        setattr(dist, name, _checked(name, fn, device.type))
    try:
        with HostTensorsOnMeta():
            yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
