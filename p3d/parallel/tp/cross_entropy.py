"""Cross entropy over logits split by vocab across the TP group, never gathering full-vocab logits.

For logits z split as [z_1 ... z_p] over ranks and a target t:
    loss = log(sum_j exp(z_j - m)) - (z_t - m),   m = max_j z_j
m, the sum of exponentials and z_t are each one all-reduce of a (b, s) tensor.
Columns >= vocab_size are vocab padding: masked to -inf so padding never changes the loss.
Gradient: softmax(z) - onehot(t), each rank on its own columns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """forward: per-token loss (b, s) from local logits (b, s, V/tp); backward: (softmax - onehot) * grad."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size):
        local_v, ctx.in_dtype = logits.shape[-1], logits.dtype
        logits = logits.float()
        n_real = max(0, min(local_v, vocab_size - vocab_start))
        if n_real < local_v:  # vocab padding on this rank
            logits = logits.clone()
            logits[..., n_real:] = float("-inf")
        logits_max = _all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)  # (b, s)
        shifted = logits - logits_max.unsqueeze(-1)  # (b, s, V/tp)

        local_t = target - vocab_start
        here = (local_t >= 0) & (local_t < local_v)  # (b, s): the target's column lives on this rank
        local_t = local_t.clamp(0, local_v - 1)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * here
        target_logit = _all_reduce(target_logit, group)

        exp = shifted.exp_()  # in place: shifted is not needed again
        sum_exp = _all_reduce(exp.sum(dim=-1), group)
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, here)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, here = ctx.saved_tensors
        grad = softmax  # in place: backward runs once, and nothing else reads the saved softmax
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -here.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group, vocab_start: int, vocab_size: int
) -> torch.Tensor:
    """Per-token loss (b, s). ``logits``: (b, s, V_pad/tp) of this rank, columns from ``vocab_start``."""
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start, vocab_size)
