"""Communication into and out of the tensor-parallel region, as autograd Functions.

Every function takes its process group explicitly and is the identity for a group of one rank
(or ``None``, the single-process reference), so tp=1 runs no collective at all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce_(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over the group in place (no copy): every caller passes a tensor nothing else reads, the fresh output
    of the matmul (or lookup) before it, or the fresh gradient of the matmul after it."""
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    rank, size = dist.get_rank(group), _size(group)
    return x.chunk(size, dim=-1)[rank].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    """(..., n) on every rank -> (..., size n), rank r's at r n: gathered into one preallocated buffer."""
    size = _size(group)
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))  # the ranks' tensors one after the other along dim 0
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out.unflatten(0, (size, x.shape[0])).movedim(0, -2).reshape(*x.shape[:-1], size * x.shape[-1])


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
        return _all_reduce_(grad.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce (sum) over the TP group, in place on the partial sums (marked dirty); backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        if not x.is_contiguous():
            return _all_reduce_(x.contiguous(), group)
        ctx.mark_dirty(x)
        return _all_reduce_(x, group)

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


class _MaxOverTP(torch.autograd.Function):
    """forward: the elementwise max over the TP group (all-reduce MAX, into a copy); backward: no gradient.

    A float8 cast's amax (p3d.parallel.tp.float8): a scale is a constant of the cast, through which no gradient
    flows (as in torchao); the Function keeps the collective visible to autograd and to torch.compile's tracing."""

    @staticmethod
    def forward(ctx, amax, group):
        out = amax.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _GatherFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _ScatterToTP.apply(x, group)


def max_over_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _MaxOverTP.apply(x, group)


# ---- sequence parallelism: outside the TP regions activations are split along the sequence (dim 1)
# over the same group, (b, s/tp, h); the layers at the borders of a TP region gather or scatter them.


def _split_seq(x: torch.Tensor, group) -> torch.Tensor:
    rank, size = dist.get_rank(group), _size(group)
    if x.shape[1] % size:
        raise ValueError(f"sequence length {x.shape[1]} not divisible by tp={size}")
    return x.chunk(size, dim=1)[rank].contiguous()


def _gather_seq(x: torch.Tensor, group, async_op: bool = False):
    """(b, s/tp, ...) on every rank -> (b, s, ...), rank r's block at r s/tp: one all-gather into a preallocated
    (tp b, s/tp, ...) buffer, then one copy into the sequence order (none when b = 1: a view). ``async_op``:
    (work, finish), ``finish()`` giving the gathered tensor once the work is waited for."""
    size = _size(group)
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))  # (tp b, s/tp, ...): the ranks' blocks one after the other
    work = dist.all_gather_into_tensor(out, x.contiguous(), group=group, async_op=async_op)

    def finish() -> torch.Tensor:
        return out.unflatten(0, (size, x.shape[0])).movedim(0, 1).reshape(x.shape[0], size * x.shape[1], *x.shape[2:])

    return (work, finish) if async_op else finish()


def _reduce_scatter_seq(x: torch.Tensor, group, async_op: bool = False):
    """(b, s, ...) partial sums on every rank -> this rank's (b, s/tp, ...) block of their sum: the blocks laid out
    rank by rank (a view when b = 1, else one copy) and reduce-scattered into a preallocated output.
    ``async_op``: (work, output), the output valid once the work is waited for."""
    size = _size(group)
    if x.shape[1] % size:
        raise ValueError(f"sequence length {x.shape[1]} not divisible by tp={size}")
    blocks = x.unflatten(1, (size, x.shape[1] // size)).movedim(1, 0).contiguous()  # (tp, b, s/tp, ...)
    out = x.new_empty(blocks.shape[1:])
    blocks = blocks.flatten(0, 1)  # (tp b, s/tp, ...): rank r's block at r b
    work = dist.reduce_scatter_tensor(out, blocks, group=group, async_op=async_op)
    return (work, out) if async_op else out


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

    forward: the all-gather of the other ranks' blocks is issued first and runs while this rank's own block is
    multiplied (x W^T, (b, s/tp, out/tp)); then each other block's rows, and the blocks in sequence order. Keeps only
    this rank's (b, s/tp, in) block for backward and all-gathers it again there, so the full-sequence input is
    never held between forward and backward (what makes sequence parallelism divide the norms' activations by tp).
    backward: dx = reduce_scatter(dy W), dW = dy^T gather_seq(x), each collective hidden behind a matmul: the
    all-gather of x runs during dy W, the reduce-scatter of dx during dW.
    Under autocast (bf16 over fp32 weights: the torch executor) the forward's matmul runs in bf16, so the
    backward's do too, in the gradient's dtype, and each gradient returns in its input's dtype.
    """

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.group = group
        ctx.save_for_backward(x, weight)
        size, me = _size(group), dist.get_rank(group)
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))  # (tp b, s/tp, in): rank r's block at r b
        gathering = dist.all_gather_into_tensor(out, x.contiguous(), group=group, async_op=True)
        mine = torch.nn.functional.linear(x, weight)  # (b, s/tp, out/tp), while the other blocks travel
        gathering.wait()
        blocks = out.unflatten(0, (size, x.shape[0]))  # (tp, b, s/tp, in)
        ys = [mine if r == me else torch.nn.functional.linear(blocks[r], weight) for r in range(size)]
        return torch.cat(ys, dim=1)  # (b, s, out/tp), rank r's rows at r s/tp

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gathering, gathered = _gather_seq(x, ctx.group, async_op=True)  # (b, s, in), gathered again
        grad_total = grad.matmul(weight.to(grad.dtype))  # (b, s, in) partial over tp, while x is gathered
        gathering.wait()
        scattering, grad_x = _reduce_scatter_seq(grad_total, ctx.group, async_op=True)  # (b, s/tp, in)
        total = gathered().to(grad.dtype)
        grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(total.reshape(-1, total.shape[-1]))  # while scattering
        scattering.wait()
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


def gathered_linear(x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """F.linear(gather_from_sp(x), weight), saving only the sequence block x for backward."""
    return torch.nn.functional.linear(x, weight) if _size(group) == 1 else _GatheredLinear.apply(x, weight, group)
