"""Optimizer, exact global gradient norm over the mesh, and the learning-rate schedule.

Gradient norm: a parameter's gradient is counted once in the whole model. TP-sharded parameters
(``model_parallel``) count on every TP rank, replicated ones (norms) on tp rank 0 only, and the
copy of a tied embedding on the last stage (``ds_pipe_replicated``) not at all; the sum of squares
is all-reduced over the pp x tp ranks of the replica (dp replicas hold identical gradients).
DeepSpeed's ZeRO and bf16 optimizers count the same way; its plain fp32 path does not (it drops
replicated parameters of every stage but the first), so for fp32 without ZeRO we clip here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from p3d.compat.deepspeed_internals import GRAD_NORM_ATTR, is_pipe_replicated
from p3d.config.schema import LRDecay, TrainConfig
from p3d.parallel.experts.params import is_expert_param
from p3d.parallel.tp.layers import owned_by_tp_rank
from p3d.parallel.zero.fsdp import local


def counts_in_norm(p: torch.nn.Parameter, tp_rank: int) -> bool:
    return not is_pipe_replicated(p) and owned_by_tp_rank(p, tp_rank)


NORM_CHUNK = 1 << 16


def norm_group(mesh, sharded_over_dp: bool):
    """Over which ranks the squares of the counted gradients sum: the pp x tp ranks of a replica (dp and cp
    replicas hold identical gradients), or every rank when ZeRO-2/3 cut each gradient over dp x cp (None: the
    world); ``False`` when there is nothing to sum over."""
    if sharded_over_dp and mesh.dp_cp > 1:
        return None
    return mesh.replica_group if mesh.replica_group is not None and mesh.tp * mesh.pp > 1 else False


@torch.no_grad()
def global_grad_norm(params, mesh, sharded_over_dp: bool = False, replicas: int = 1) -> torch.Tensor:
    """L2 norm of the whole model's gradient. Per-chunk fp32 norms (one fused kernel), their squares
    summed in fp64 (so a sum over 10^11 elements keeps its digits), on the gradients' device.
    ``sharded_over_dp``: the gradients are FSDP2's dp pieces (ZeRO-2/3); each rank counts its own piece, and
    under HSDP each piece is held by ``replicas`` ranks (identical after FSDP2's all-reduce across them)."""
    params = list(params)
    counted = [p for p in params if p.grad is not None and counts_in_norm(p, mesh.tp_rank)]
    device = params[0].device if params else torch.device("cpu")  # a rank holds parameters: their device
    dense, experts = (_squares([p for p in counted if is_expert_param(p) == e], device) for e in (False, True))
    if experts_apart(mesh, sharded_over_dp):
        return (_experts_weighed(dense, experts, mesh) / replicas).sqrt()
    sq = dense + experts
    group = norm_group(mesh, sharded_over_dp)
    if group is not False:
        dist.all_reduce(sq, group=group)
    return (sq / replicas).sqrt()


def _squares(params: list[torch.nn.Parameter], device) -> torch.Tensor:
    chunks = [c for p in params if p.grad is not None for c in local(p.grad).detach().reshape(-1).split(NORM_CHUNK)]
    if not chunks:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(torch._foreach_norm(chunks, 2.0)).double().pow(2).sum()


def experts_apart(mesh, sharded_over_dp: bool) -> bool:
    """Whether routed experts' squares need their own weight in the norm: with ep > 1 and whole (unsharded)
    gradients, dense ones are the same on all dp ranks but an expert's only on its dp / ep edp ranks."""
    return mesh.ep > 1 and not sharded_over_dp


def _experts_weighed(dense: torch.Tensor, experts: torch.Tensor, mesh) -> torch.Tensor:
    """The sum of squares over the whole model from this rank's (dense, experts) squares, each copy counted once:
    summed over the world, dense / (dp cp) (dp x cp copies) and experts / edp (edp copies)."""
    sq = dense / mesh.dp_cp + experts / mesh.edp
    dist.all_reduce(sq)
    return sq


@torch.no_grad()
def norm_once_reduced(
    grads: list[tuple[torch.nn.Parameter, torch.Tensor]],
    tied: list[tuple[torch.nn.Parameter, Any]],
    mesh,
    reduced_over_dp: bool = False,
    replicas: int = 1,
) -> float:
    """The global norm that ``global_grad_norm`` would give once the step's reductions ran, measured on copies of
    this rank's gradients as they stand before them (``grads``: (parameter, its gradient so far, zeros where it
    has none), every trainable parameter of the rank; ``tied``: the tied copies among them and the group of their
    holders). A loss spike's update is discarded by filling
    the gradients with nan (p3d.train.faults): this is the norm its report shows.

    The copies go through the same reductions, one parameter at a time (so the extra memory is one parameter's,
    not the model's): the tied copies summed over their holders, then the mean over dp; the sum of squares
    of the parameters ``counts_in_norm`` counts, over the pp x tp ranks of the replica. Every rank of a dp
    group holds the same parameters in the same order, so the per-parameter all-reduces pair up.
    ``reduced_over_dp``: ZeRO-2/3, whose gradients are already the dp mean, cut over dp (FSDP2's pieces)."""
    grad_of = {id(p): g for p, g in grads}
    tied_sums = {}  # copies in the gradient's dtype, as the step reduces it
    for p, group in tied:  # first, so no rank waits on a tied holder that is busy with its dp reductions
        tied_sums[id(p)] = local(grad_of[id(p)]).detach().clone()
        dist.all_reduce(tied_sums[id(p)], group=group)
    device = grads[0][1].device if grads else torch.device("cpu")  # a rank holds parameters: their device
    sq = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(2)]  # dense, experts
    for p, g in grads:
        c, expert = tied_sums.pop(id(p), None), is_expert_param(p)
        if c is None:
            c = local(g).detach().clone()  # one parameter's copy at a time
        if mesh.dp_cp > 1 and not reduced_over_dp:  # dense: the mean over dp x cp; experts: over their holders
            dist.all_reduce(c, group=mesh.edp_group if expert else mesh.dp_cp_group)
            c.div_(mesh.dp_cp)
        elif expert and mesh.ep > 1:  # ZeRO-2/3: FSDP2's mean over edp, which the step divides by ep
            c.div_(mesh.ep)
        if counts_in_norm(p, mesh.tp_rank):
            sq[expert] += torch.linalg.vector_norm(c.double()) ** 2
    if experts_apart(mesh, reduced_over_dp):
        return float((_experts_weighed(sq[0], sq[1], mesh) / replicas).sqrt())
    total = sq[0] + sq[1]
    group = norm_group(mesh, reduced_over_dp)
    if group is not False:
        dist.all_reduce(total, group=group)
    return float((total / replicas).sqrt())


class ClippedAdamW(torch.optim.AdamW):
    """AdamW that clips to ``max_norm`` by the exact mesh-wide gradient norm before each step.

    Matches ``torch.nn.utils.clip_grad_norm_``: grads *= min(1, max_norm / (norm + 1e-6)).
    DeepSpeed's engine reads the norm after ``step`` from ``ds_compat.GRAD_NORM_ATTR``. A non-finite norm skips
    the update (parameters and Adam state untouched) and sets ``overflow``, which the engine reads to leave the
    LR schedule where it was and count the step in ``skipped_steps`` (p3d.train.faults discards steps this way).
    """

    def __init__(self, params, mesh, max_norm: float, **kwargs):
        super().__init__(params, **kwargs)
        self.mesh, self.max_norm = mesh, max_norm
        setattr(self, GRAD_NORM_ATTR, 0.0)
        self.overflow = False

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        norm = float(global_grad_norm(params, self.mesh))
        setattr(self, GRAD_NORM_ATTR, norm)
        self.overflow = not math.isfinite(norm)
        if self.overflow:
            return None
        if self.max_norm > 0:
            coef = self.max_norm / (norm + 1e-6)
            if coef < 1.0:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        return super().step(closure)


def param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Matrices decay; vectors (norm weights) do not."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for _, p in module.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def lr_factor(step: int, t: TrainConfig) -> float:
    """Multiplier of train.lr for the optimizer step with 0-based index ``step``."""
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.decay == LRDecay.constant:
        return 1.0
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
    if t.decay == LRDecay.linear:
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return t.min_lr_ratio + (1.0 - t.min_lr_ratio) * shape


def build_optimizer(module: torch.nn.Module, t: TrainConfig, mesh=None, clip_here: bool = False):
    """AdamW (+ our clipping when ``clip_here``) and its LambdaLR schedule."""
    groups = param_groups(module, t.weight_decay)
    kwargs: dict[str, Any] = dict(lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    if t.adamw_impl.value != "default":  # else torch picks (foreach where the tensors allow)
        kwargs[t.adamw_impl.value] = True
    opt: torch.optim.AdamW
    if clip_here:
        opt = ClippedAdamW(groups, mesh, t.grad_clip, **kwargs)
    else:
        opt = torch.optim.AdamW(groups, **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, t))
    return opt, sched


def resume_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Continue ``scheduler`` after ``step`` optimizer steps: the next step's lr is this run's train.lr
    times this run's ``lr_factor(step)``, so a changed lr, warmup, decay or step count takes effect from
    the resumed step exactly (the checkpoint's saved base lr is not restored)."""
    scheduler.last_epoch = step
    lrs = [base * factor(step) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
