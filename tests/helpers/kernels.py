"""Counting, on CPU, what a GPU would pay for: the matmul kernels a piece of code launches and the points where the
host waits for the device (docs/moe.md, "Counted on CPU").

``KernelCounter`` is a ``TorchDispatchMode`` (it sees every aten op that reaches the dispatcher, forward and the
autograd engine's backward alike) that also wraps the few ``torch.Tensor`` methods that read values on the host
without dispatching an op there (``tolist``, ``cpu``, ``to``, ``numpy``). Every tensor is treated as if it lived on
a device, except those that came back through an explicit copy to the host (``.to("cpu", ...)``, ``.cpu()``),
whose values the host may read freely. It counts:
- ``matmuls``: aten matmul ops (mm, bmm, addmm, baddbmm, addbmm, _grouped_mm): one kernel each on a GPU;
- ``syncs``: ops whose result the host needs before it can go on, on a device tensor: ``_local_scalar_dense``
  (``.item()``, ``int(t)``, ``float(t)``, ``bool(t)``), ``tolist``, ``nonzero`` (and boolean-mask indexing, which is
  built on it), ``bincount``, ``repeat_interleave`` with tensor repeats and no ``output_size``, ``unique`` and its
  variants, ``masked_select``; each listed in ``sync_ops`` with where it happened;
- ``host_copies``: explicit copies of a tensor to the host (``.to("cpu")``, ``.cpu()``, ``.numpy()``): on a GPU one
  device-to-host transfer each.
On CPU none of these stalls anything; counting them is the proxy, and it fails on code that would stall a GPU.
"""

from __future__ import annotations

import traceback
from collections import Counter
from contextlib import ExitStack
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
MATMULS = {aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.addbmm, aten._grouped_mm}
ALWAYS_SYNC = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.bincount,
    aten.masked_select,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.is_nonzero,
    aten.equal,
}


def _where() -> str:
    """The first frame of p3d's own code on the stack (what asked for the op)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/p3d/" in frame.filename and "/tests/" not in frame.filename:
            return f"{frame.filename.rsplit('/p3d/', 1)[1]}:{frame.lineno}"
    return "?"


def _to_cpu(args, kwargs) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` names the host as its device."""
    for a in (*args, kwargs.get("device")):
        if isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu":
            return True
    return False


class KernelCounter(TorchDispatchMode):
    """``with KernelCounter() as c: ...``; then ``c.matmuls``, ``c.syncs``, ``c.host_copies`` (module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.matmuls = self.syncs = self.host_copies = 0
        self.sync_ops: list[str] = []
        self._host: set[int] = set()  # storages of tensors copied to the host on purpose
        self._stack = ExitStack()

    def _on_host(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._host

    def _sync(self, what: str) -> None:
        self.syncs += 1
        self.sync_ops.append(f"{what} at {_where()}")

    def _copied(self, t: torch.Tensor) -> torch.Tensor:
        self.host_copies += 1
        self._host.add(t.untyped_storage().data_ptr())
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        self.ops[str(packet)] += 1
        if packet in MATMULS:
            self.matmuls += 1
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        host_input = bool(tensors) and all(self._on_host(t) for t in tensors)
        if not host_input:
            if packet in ALWAYS_SYNC:
                self._sync(str(packet))
            elif packet is aten.repeat_interleave and isinstance(args[0], torch.Tensor):
                if kwargs.get("output_size") is None and (len(args) < 3 or args[-1] is None):
                    self._sync("repeat_interleave with tensor repeats")
            elif packet is aten.index and any(
                i is not None and i.dtype in (torch.bool, torch.uint8) for i in (args[1] if len(args) > 1 else [])
            ):
                self._sync("boolean-mask indexing")
        return func(*args, **kwargs)

    def __enter__(self):
        real_to, real_cpu, real_numpy, real_tolist = (
            torch.Tensor.to,
            torch.Tensor.cpu,
            torch.Tensor.numpy,
            torch.Tensor.tolist,
        )
        counter = self

        def to(t, *args, **kwargs):
            out = real_to(t, *args, **kwargs)
            return counter._copied(out) if _to_cpu(args, kwargs) else out

        def cpu(t, *args, **kwargs):
            return counter._copied(real_cpu(t, *args, **kwargs))

        def numpy(t, *args, **kwargs):
            counter._copied(t)
            return real_numpy(t, *args, **kwargs)

        def tolist(t):
            if not counter._on_host(t):
                counter._sync("tolist")
            return real_tolist(t)

        for name, fn in (("to", to), ("cpu", cpu), ("numpy", numpy), ("tolist", tolist)):
            self._stack.enter_context(mock.patch.object(torch.Tensor, name, fn))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._stack.close()
