"""The communication of expert parallelism: the rows' all-to-all, issued and waited for apart so that work runs
while it is in flight; the small all-to-all of the row counts; the one copy of the split sizes to the host.

A rows all-to-all over the ep group is two autograd Functions sharing one ``InFlight``:
  ``start_all_to_all``   forward: issues it (``async_op=True``) into a new buffer, returned unfilled;
                         backward: waits for the gradient's all-to-all that ``finish_all_to_all``'s backward issued;
  ``finish_all_to_all``  forward: waits for it, returns the filled buffer;
                         backward: issues the gradient's all-to-all (the splits swapped: each row's gradient returns
                         to the rank that sent the row) into a buffer that ``InFlight`` hands to ``start``'s
                         backward; autograd gets a zero of the arrived rows' shape (an expanded scalar, no memory),
                         since the sent rows (sum(send)) and the arrived ones (sum(recv)) differ in number.
Work placed between the two in forward runs while the rows travel. The autograd engine runs the ready node of the
latest forward first, so the backward of that work also runs between the two backward halves: while the gradient
travels. On NCCL ``wait`` orders the compute stream after the collective without blocking the host; on gloo the
collective runs on gloo's own thread and ``wait`` blocks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class InFlight:
    """One rows all-to-all's works in flight: the forward's and its gradient's, and the tensors they read (kept
    alive until they are done)."""

    __slots__ = ("forward", "backward", "keep", "grad")

    def __init__(self) -> None:
        self.forward: Any = None  # a c10d Work
        self.backward: Any = None
        self.keep: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None  # the sent rows' gradient, filled by the backward all-to-all


def _issue(x: torch.Tensor, send: list[int], recv: list[int], group, flight: InFlight) -> tuple[torch.Tensor, Any]:
    """All-to-all of rows (n, h): rows [sum(send[:r]), sum(send[:r+1])) to rank r; ``recv[r]`` arrive from r."""
    src = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    flight.keep = src
    work = dist.all_to_all_single(out, src, output_split_sizes=recv, input_split_sizes=send, group=group, async_op=True)
    return out, work


class _Start(torch.autograd.Function):
    """forward: the all-to-all of ``x`` issued, its buffer returned unfilled (pass it to ``_Finish``); backward: the
    gradient's all-to-all (issued by ``_Finish.backward``) waited for."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group, flight: InFlight):
        ctx.flight = flight
        out, flight.forward = _issue(x, send, recv, group, flight)
        return out

    @staticmethod
    def backward(ctx, _zero):
        flight = ctx.flight
        flight.backward.wait()
        grad, flight.keep, flight.grad = flight.grad, None, None
        return grad, None, None, None, None


class _Finish(torch.autograd.Function):
    """forward: the all-to-all issued by ``_Start`` waited for, its buffer returned; backward: the gradient's
    all-to-all issued (``send`` and ``recv`` swapped) into a buffer that ``_Start.backward`` returns once filled."""

    @staticmethod
    def forward(ctx, out, send: list[int], recv: list[int], group, flight: InFlight):
        ctx.send, ctx.recv, ctx.group, ctx.flight = send, recv, group, flight
        flight.forward.wait()
        flight.keep = None
        return out

    @staticmethod
    def backward(ctx, grad):
        ctx.flight.grad, ctx.flight.backward = _issue(grad, ctx.recv, ctx.send, ctx.group, ctx.flight)
        zero = grad.new_zeros((1,) * grad.dim()).expand(grad.shape)  # (sum(recv), h): the buffer's gradient
        return zero, None, None, None, None


def start_all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> tuple[torch.Tensor, InFlight]:
    """(buffer, in flight): the rows all-to-all issued (module doc); ``finish_all_to_all`` gives the rows."""
    flight = InFlight()
    return _Start.apply(x, send, recv, group, flight), flight


def finish_all_to_all(buffer: torch.Tensor, flight: InFlight, send: list[int], recv: list[int], group) -> torch.Tensor:
    """The rows that arrived (``sum(recv)``, in source rank order), once the all-to-all started with the same
    ``send``, ``recv`` and ``group`` is done."""
    return _Finish.apply(buffer, send, recv, group, flight)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts`` (E,): this rank's rows per expert of the layer -> (ep, E_l): rows each rank of the ep group
    sends to each of this rank's experts (no gradient; one small all-to-all, on the device)."""
    ep = dist.get_world_size(group)
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts.contiguous(), group=group)  # even splits: E_l counts per rank
    return recv.view(ep, counts.numel() // ep)


class HostCopy:
    """A small tensor copied to the host without waiting for it: issued at construction (non-blocking; from a GPU
    into page-locked memory, which ``.to("cpu", non_blocking=True)`` allocates), read by :meth:`values`, which waits
    for that copy only (a CUDA event recorded behind it), so the work issued in between overlaps it."""

    def __init__(self, t: torch.Tensor):
        self._host = t.detach().to("cpu", non_blocking=True, copy=True)
        self._event = None
        if t.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def values(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
