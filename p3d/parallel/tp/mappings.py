"""Communication into and out of the tensor-parallel region, as autograd Functions.

Every function takes its process group explicitly and is the identity for a group of one rank
(or ``None``, the single-process reference), so tp=1 runs no collective at all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    rank, size = dist.get_rank(group), _size(group)
    return x.chunk(size, dim=-1)[rank].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _CopyToTP(torch.autograd.Function):
    """forward: identity; backward: all-reduce (sum) the gradient over the TP group.

    Placed where a replicated activation enters column-parallel layers: each rank's partial
    gradient with respect to the shared input must be summed.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce (sum) over the TP group; backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """forward: all-gather along the last dim; backward: keep this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToTP(torch.autograd.Function):
    """forward: keep this rank's slice of the last dim; backward: all-gather the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _GatherFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _ScatterToTP.apply(x, group)


# ---- sequence parallelism: outside the TP regions activations are split along the sequence (dim 1)
# over the same group, (b, s/tp, h); the layers at the borders of a TP region gather or scatter them.


def _split_seq(x: torch.Tensor, group) -> torch.Tensor:
    rank, size = dist.get_rank(group), _size(group)
    if x.shape[1] % size:
        raise ValueError(f"sequence length {x.shape[1]} not divisible by tp={size}")
    return x.chunk(size, dim=1)[rank].contiguous()


def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(b, s/tp, ...) on every rank -> (b, s, ...), rank r's block at r s/tp."""
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(b, s, ...) partial sums on every rank -> this rank's (b, s/tp, ...) block of their sum."""
    size = _size(group)
    if x.shape[1] % size:
        raise ValueError(f"sequence length {x.shape[1]} not divisible by tp={size}")
    blocks = [c.contiguous() for c in x.chunk(size, dim=1)]
    out = torch.empty_like(blocks[0])
    dist.reduce_scatter(out, blocks, group=group)
    return out


class _GatherFromSP(torch.autograd.Function):
    """forward: all-gather along the sequence; backward: reduce-scatter (sum) the gradient.

    Placed where a sequence-split activation enters column-parallel layers (and the head): every rank
    needs the whole sequence, and each rank's gradient for it is partial over its output columns.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    """forward: reduce-scatter (sum) along the sequence; backward: all-gather the gradient.

    Where a row-parallel layer (or the vocab-parallel embedding) leaves the TP region: instead of an
    all-reduce of (b, s, h), each rank keeps the sum of its (b, s/tp, h) block.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    """forward: keep this rank's block of the sequence; backward: all-gather the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


def gather_from_sp(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _GatherFromSP.apply(x, group)


def reduce_scatter_to_sp(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _ReduceScatterToSP.apply(x, group)


def scatter_to_sp(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _ScatterToSP.apply(x, group)


@torch.no_grad()
def gather_seq_values(x: torch.Tensor, group) -> torch.Tensor:
    """(b, s/tp, ...) -> (b, s, ...) with no gradient (values such as routing decisions)."""
    return x if _size(group) == 1 else _gather_seq(x, group)


class _GatheredLinear(torch.autograd.Function):
    """y = gather_seq(x) W^T for a column-parallel layer under sequence parallelism.

    Keeps only this rank's (b, s/tp, in) block for backward and all-gathers it again there, so the
    full-sequence input is never held between forward and backward (what makes sequence parallelism
    divide the norms' activations by tp). backward: dx = reduce_scatter(dy W), dW = dy^T gather_seq(x).
    Under autocast (bf16 over fp32 weights: the torch executor) the forward's matmul runs in bf16, so the
    backward's do too, in the gradient's dtype, and each gradient returns in its input's dtype.
    """

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.group = group
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(_gather_seq(x, group), weight)  # (b, s, out/tp)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        total = _gather_seq(x, ctx.group).to(grad.dtype)  # (b, s, in), gathered again
        grad_x = _reduce_scatter_seq(grad.matmul(weight.to(grad.dtype)), ctx.group)  # (b, s/tp, in)
        grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(total.reshape(-1, total.shape[-1]))
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


def gathered_linear(x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """F.linear(gather_from_sp(x), weight), saving only the sequence block x for backward."""
    return torch.nn.functional.linear(x, weight) if _size(group) == 1 else _GatheredLinear.apply(x, weight, group)
