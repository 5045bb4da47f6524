"""The torch executor's optimizer and its data-parallel gradient reduction, with routed experts in mind.

Dense parameters are the same on every dp x cp rank of a (pp, tp) coordinate (cp: context parallelism, whose
ranks read other tokens of the same sequences); a routed expert's weights only on the dp / ep ranks of its
expert-data-parallel (edp) group, the dp / ep ranks with its ep rank times cp (p3d.layout.dims). So:
- gradients (p3d.train.executors.grad_buckets): the dense ones are summed over dp x cp and divided by it (each rank's
  is the gradient of its own tokens' mean loss: their mean is the whole batch's), the experts' summed over edp and
  divided by dp x cp (the mean over all replicas: every replica's tokens reach every expert through the all-to-all,
  p3d.parallel.experts.dispatch);
- ZeRO-1: torch's ``ZeroRedundancyOptimizer`` over dp x cp for the dense parameters, and a second one over edp for
  the experts' (:class:`ExpertZero1` steps both as one optimizer).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping

import torch
import torch.nn as nn

from p3d.parallel.experts.params import is_expert_param
from p3d.train.optim import build_optimizer, lr_factor, param_groups


def split_experts(params: list[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense, routed experts' weights), each in the given order."""
    return [p for p in params if not is_expert_param(p)], [p for p in params if is_expert_param(p)]


class _JointState(MutableMapping):
    """The Adam states of two optimizers, looked up by parameter (the checkpointer reads and writes them)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self._parts = [({id(p) for g in o.param_groups for p in g["params"]}, o.state) for o in optimizers]

    def _of(self, p):
        return next((state for ids, state in self._parts if id(p) in ids), self._parts[0][1])

    def __getitem__(self, p):
        return self._of(p)[p]

    def __setitem__(self, p, value) -> None:
        self._of(p)[p] = value

    def __delitem__(self, p) -> None:
        del self._of(p)[p]

    def __iter__(self) -> Iterator:
        return (p for _, state in self._parts for p in state)

    def __len__(self) -> int:
        return sum(len(state) for _, state in self._parts)


class ExpertZero1(torch.optim.Optimizer):
    """ZeRO-1 of a model with routed experts: two ``ZeroRedundancyOptimizer``s, the dense parameters' over dp x cp
    and the experts' over edp, stepped as one (the LR schedule sets the lr of both through ``param_groups``)."""

    def __init__(self, dense, experts):
        self.parts = (dense, experts)
        self.defaults = dense.defaults
        self.param_groups = [*dense.param_groups, *experts.param_groups]
        self.optim = _Inner([dense.optim, experts.optim])

    def step(self, closure=None):
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)


class _Inner:
    """What the checkpointer sees of :class:`ExpertZero1`: the local optimizers' parameters and states."""

    def __init__(self, optimizers):
        self.param_groups = [g for o in optimizers for g in o.param_groups]
        self.state = _JointState(optimizers)


def _zero1(params_or_groups, group, t):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    kwargs = {} if t.adamw_impl.value == "default" else {t.adamw_impl.value: True}
    return ZeroRedundancyOptimizer(
        params_or_groups,
        optimizer_class=torch.optim.AdamW,
        process_group=group,
        parameters_as_bucket_view=True,  # each rank's updated parameters broadcast as one flat bucket
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
        **kwargs,
    )


def build_torch_optimizer(module: nn.Module, cfg, mesh):
    """AdamW and its LambdaLR schedule. ``zero.stage=1`` with dp > 1: torch's ``ZeroRedundancyOptimizer`` over
    the dp group (each dp rank keeps the Adam states of the whole parameters it owns and broadcasts them, one flat
    bucket per rank, after its step; the gradients are all-reduced in full before, as DeepSpeed's stage 1 does),
    the experts' over edp (:class:`ExpertZero1`). Stages 2 and 3: a plain AdamW over the FSDP2-sharded parameters
    (p3d.parallel.zero.fsdp), whose moments are sharded with them."""
    t = cfg.train
    if cfg.zero.stage == 0 or cfg.zero.stage >= 2 or mesh.dp_cp == 1:
        return build_optimizer(module, t)
    groups = param_groups(module, t.weight_decay)
    dense = [{**g, "params": split_experts(g["params"])[0]} for g in groups]
    experts = [{**g, "params": split_experts(g["params"])[1]} for g in groups]
    experts = [g for g in experts if g["params"]]
    opt = (
        _zero1(groups, mesh.dp_cp_group, t)
        if not experts
        else ExpertZero1(
            _zero1([g for g in dense if g["params"]], mesh.dp_cp_group, t), _zero1(experts, mesh.edp_group, t)
        )
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, t))
