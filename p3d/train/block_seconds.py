"""Test hook: a fixed compute time per Transformer block, so pipeline bubbles can be measured on shared cores.

``P3D_TEST_BLOCK_SECONDS=<s>`` makes every ``TransformerBlock`` of a worker's model take ``s`` more seconds in
each of the three pieces a pipeline schedule moves around (Qi et al.'s F, B and W): its forward, the gradient
with respect to its input (B, the pass a downstream stage waits for), and its weight gradients (W, which the
zero-bubble schedules defer). Each piece is a sleep, which takes no CPU: four worker processes on two cores
then run the same timeline as four on four, and the idle share that ``metrics.jsonl`` measures (``bubble``) is
the schedule's, not the machine's time-sharing. Under DeepSpeed's 1F1B and the other full-backward schedules
B and W run together (2 s per backward); under ``interleaved_zero_bubble``, ``zbv`` and ``dualpipev`` torch's
W pass runs the W sleep later, on its own.

On a heterogeneous cluster (``cluster.groups``, docs/clusters.md) the value is the fastest group's seconds: a rank
on a group k times slower (by the groups' nominal speeds, ``p3d.layout.hetero.slowdown``) sleeps k times as long in
each piece. The local launcher maps its simulated nodes to the groups in order, so a CPU machine runs the timeline
of a mixed cluster (the tests and bench/hetero.py).

The W piece is a node of the block's graph on the path to one of its weights only (the attention norm's, as
the block's forward sees it: under ZeRO-2/3 FSDP2's unsharded parameter, which its pre-forward hook has just put
in place): a zero added to the block's input whose backward sleeps. Autograd runs that node when it computes the
weight's gradient, which is in torch's weight pass (``stage_backward_weight``) and never in its input pass
(``stage_backward_input``); under a full backward, within it. (A hook on the parameter itself was lost under
FSDP2, which trains other tensors than the ones the model was built with.) Nothing else changes: x + 0 is x, the
weight's gradient gains a zero, and losses, gradients and checkpoints are those of the model without the sleeps.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn as nn

from p3d.model.llama import TransformerBlock

BLOCK_SECONDS_ENV = "P3D_TEST_BLOCK_SECONDS"


class _SleepOnInput(torch.autograd.Function):
    """forward: sleep s, y = x; backward: sleep s, dx = dy (the block's F and B pieces)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.seconds)
        return grad, None


class _SleepOnWeight(torch.autograd.Function):
    """forward: z = 0 (a scalar of w's dtype) from w; backward: sleep s, dw = 0 (the block's W piece)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.seconds)
        return None, None


def block_seconds() -> float:
    """The hook's seconds per piece (0: off)."""
    value = os.environ.get(BLOCK_SECONDS_ENV, "")
    return float(value) if value else 0.0


def rank_block_seconds(cluster, plan, rank: int) -> float:
    """This rank's seconds per piece: ``P3D_TEST_BLOCK_SECONDS`` times its node's group's slowdown (0: off)."""
    from p3d.layout.hetero import slowdown

    base = block_seconds()
    return base * slowdown(cluster, plan.dims.node_of(rank)) if base > 0 else 0.0


def add_block_seconds(module: nn.Module, seconds: float | None = None) -> int:
    """Give every TransformerBlock in ``module`` the fixed F, B and W seconds; returns how many blocks got them.
    ``seconds``: default ``P3D_TEST_BLOCK_SECONDS`` (unset or 0: nothing is changed)."""
    s = block_seconds() if seconds is None else seconds
    if s <= 0:
        return 0
    blocks = [mod for mod in module.modules() if isinstance(mod, TransformerBlock)]
    for block in blocks:

        def before(mod, args, s=s):  # after FSDP2's own pre-forward (it prepends its hook): its weights in place
            x = _SleepOnInput.apply(args[0], s)
            if mod.attn_norm.weight.requires_grad and torch.is_grad_enabled():
                x = x + _SleepOnWeight.apply(mod.attn_norm.weight, s).to(x.dtype)
            return (x, *args[1:])

        block.register_forward_pre_hook(before)
    return len(blocks)
