"""The torch executor's dp gradient reduction of replicated parameters (ZeRO 0 and 1), hidden behind the step's last
backward (docs/overlap.md).

A parameter's gradient is final once the last backward of the step of every chunk holding it has accumulated into
it (one chunk; two for a V placement's tied table, which chunk 0 and chunk p v - 1 share on one rank). The schedule
says which backward is a chunk's last (its ``last_backward=``, ``p3d.compat.pipelining_internals.on_last_backward``);
during it, a gradient hook (``register_post_accumulate_grad_hook``) notes each parameter as final, and when the call
returns every parameter of the chunk is (torch's split weight pass writes ``.grad`` itself, without the hook).

The parameters are cut into buckets of about ``zero.bucket_mb``, in the order their gradients become final (chunks
from the last to the first, each chunk's parameters from its output to its input), the dense ones reduced over
the dp x cp holders and the routed experts' over their edp group (module doc of ``torch_optim``). A bucket's
gradients are copied into one flat fp32 buffer and all-reduced (SUM: gloo has no AVG) asynchronously as soon as all
of them are final; buckets are issued strictly in their order, so every dp rank issues the same collectives in the
same order. Each gradient becomes a view of its bucket at once (the unreduced copy is freed); ``finish`` issues what
is left, waits for every bucket (the step's only wait, before the step gate and the optimizer) and divides by the
replicas. An all-reduce sums each element over the ranks, so the values are today's flat buffer's (with two
replicas bitwise: a + b = b + a).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from p3d.parallel.experts.params import is_expert_param

MB = 1 << 20


@dataclass
class Bucket:
    """Parameters whose gradients are reduced together over ``group`` (``size`` ranks), then divided by ``divisor``."""

    params: list[nn.Parameter]
    group: object
    size: int
    divisor: int
    missing: int = 0  # parameters not yet final in this step
    flat: torch.Tensor | None = None  # (numel,) fp32, being reduced
    work: object = None
    kept: list[tuple[nn.Parameter, torch.Tensor]] = field(default_factory=list)  # non-fp32 gradients, copied back


class GradBuckets:
    """Buckets of this rank's trainable parameters (``chunks``: [(chunk index, module)]), each all-reduced over dp as
    soon as its gradients are final. Wrap each chunk's last backward of the step in ``last_backward(chunk)``; call
    ``finish`` once the schedule is done."""

    def __init__(self, chunks: list[tuple[int, nn.Module]], mesh, bucket_bytes: float):
        self.holders: dict[int, frozenset[int]] = {}  # id(param) -> the chunks holding it on this rank
        of_chunk: dict[int, list[nn.Parameter]] = {}
        for c, chunk in chunks:
            of_chunk[c] = [p for p in chunk.parameters() if p.requires_grad]
            for p in of_chunk[c]:
                self.holders[id(p)] = self.holders.get(id(p), frozenset()) | {c}
        self.chunk_params = of_chunk
        order = []  # when each gradient becomes final: the later chunks' last backwards run first
        for c in sorted(of_chunk, reverse=True):
            order += [p for p in reversed(of_chunk[c]) if min(self.holders[id(p)]) == c]
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[int, Bucket] = {}
        dense = (mesh.dp_cp_group, mesh.dp_cp, mesh.dp_cp)  # group, ranks, divisor: the mean over dp x cp
        experts = (mesh.edp_group, mesh.edp, mesh.dp_cp)  # an expert's mean over all replicas (torch_optim)
        open_bucket: dict[bool, Bucket] = {}
        filled: dict[bool, float] = {}
        for p in order:
            kind = is_expert_param(p)
            b = open_bucket.get(kind)
            if b is None or filled[kind] >= bucket_bytes:
                b = Bucket([], *(experts if kind else dense))
                open_bucket[kind], filled[kind] = b, 0.0
                self.buckets.append(b)
            b.params.append(p)
            filled[kind] += p.numel() * 4
            self.bucket_of[id(p)] = b
        self.final_chunk: int | None = None
        self.done: dict[int, set[int]] = {}
        self.issued = 0
        self._reset()
        self.hooks = [p.register_post_accumulate_grad_hook(self._accumulated) for p in order]

    def _reset(self) -> None:
        for b in self.buckets:
            b.missing, b.flat, b.work, b.kept = len(b.params), None, None, []
        self.done, self.issued, self.final_chunk = {}, 0, None

    def idle(self) -> bool:
        """No bucket issued and no gradient noted final since the last ``finish``: between steps, and after an
        evaluation (which must leave the next step's reduction untouched)."""
        return self.issued == 0 and not self.done and self.final_chunk is None

    @contextlib.contextmanager
    def last_backward(self, chunk: int) -> Iterator[None]:
        """Inside: chunk ``chunk``'s last backward of the step; when it returns, all its parameters are final."""
        self.final_chunk = chunk
        try:
            yield
        finally:
            self.final_chunk = None
            for p in self.chunk_params.get(chunk, []):
                self._final(p, chunk)

    def _accumulated(self, p: torch.Tensor) -> None:
        c = self.final_chunk
        if c is not None and c in self.holders.get(id(p), ()):
            self._final(p, c)

    def _final(self, p: torch.Tensor, chunk: int) -> None:
        seen = self.done.setdefault(id(p), set())
        if chunk in seen:
            return
        seen.add(chunk)
        if seen == self.holders[id(p)]:
            self.bucket_of[id(p)].missing -= 1
            while self.issued < len(self.buckets) and self.buckets[self.issued].missing == 0:
                self._issue(self.buckets[self.issued])
                self.issued += 1

    @torch.no_grad()
    def _issue(self, b: Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
        b.flat = torch.cat([g.reshape(-1).float() for g in grads])  # on the gradients' device
        if b.size > 1:
            b.work = dist.all_reduce(b.flat, group=b.group, async_op=True)
        offset = 0
        for p, g in zip(b.params, grads):
            view = b.flat[offset : offset + g.numel()].view_as(g)
            if g.dtype == torch.float32:
                p.grad = view  # the unreduced copy is freed; nothing reads it before ``finish``
            else:
                b.kept.append((p, view))
            offset += g.numel()

    @torch.no_grad()
    def finish(self) -> None:
        """Issue the buckets not issued yet (in order), wait for all, divide: every gradient is its mean over the
        replicas (module doc)."""
        while self.issued < len(self.buckets):
            self._issue(self.buckets[self.issued])
            self.issued += 1
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()  # type: ignore[attr-defined]
            assert b.flat is not None
            b.flat.div_(b.divisor)
            for p, view in b.kept:
                p.grad = view.to(p.dtype)
        self._reset()


def bucket_bytes(zero_cfg) -> float:
    return float(zero_cfg.bucket_mb) * MB
