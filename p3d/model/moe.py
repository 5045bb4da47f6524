"""The mixture-of-experts feed-forward of an MoE block (``model.moe``): router, routed and shared experts, the
load-balancing loss. docs/moe.md has the design and its reasons.

Shapes: b micro batch, s sequence, h hidden, N = b s tokens, E routed experts, k = top_k, f_e an expert's inner
size, t = tp, ep ranks share the experts (E / ep each, p3d.parallel.experts.dispatch).

Tensor parallelism: every expert (routed and shared) is cut over tp as the dense SwiGLU is (gate|up by
columns, down by rows), so each tp rank computes a partial output of every row; the block enters the TP region
once for all experts (``copy_to_tp``, or with sequence parallelism ``gather_from_sp``) and leaves it once
(``reduce_from_tp`` / ``reduce_scatter_to_sp``) after the weighted sum. The router (E x h) is replicated: it
runs on this rank's tokens (the whole sequence, or its block under SP), and its weights enter the TP region
like the tokens, so their gradient, partial over tp through the experts' partial outputs, is summed there.
Every tp rank routes the same tokens identically and sends them within its own ep group.

Routing: scores = softmax(logits) or sigmoid(logits) (fp32); the top-k by score (plus ``expert_bias`` with
aux-loss-free balancing) are a token's experts, weighted by their scores, renormalised to sum 1 when
``norm_topk_prob`` (sigmoid: always), times ``route_scale``. Dropless unless ``capacity_factor``.

Load-balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4; per layer): aux = E sum_i f_i P_i, f_i the
share of the N k (token, slot) pairs routed to expert i, P_i the mean score of expert i over the N tokens
(sigmoid: scores normalised per token). 1 when balanced. It enters the gradient with weight aux_loss_coef / m
per micro batch (as the LM loss's 1 / m) through ``_AuxLoss``, not through the pipeline's loss, so the loss
the console shows stays the language-model loss.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from p3d.parallel.experts.dispatch import Routed, dispatch_combine
from p3d.parallel.experts.params import mark_expert
from p3d.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear, master_normal, on_meta
from p3d.parallel.tp.mappings import copy_to_tp, gather_from_sp, gather_seq_values, reduce_from_tp, reduce_scatter_to_sp


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class Expert(nn.Module):
    """One SwiGLU, cut over tp like the dense one (``w_gate_up`` column-, ``w_down`` row-parallel weights) but
    without their collectives: in (rows, h) replicated over tp, out (rows, h) partial over tp."""

    def __init__(self, h: int, f: int, mesh, prefix: str, std: float, out_std: float, seed: int, recompute: bool):
        super().__init__()
        self.recompute = recompute
        self.w_gate_up = ColumnParallelLinear(h, [f, f], mesh, [f"{prefix}.w_gate", f"{prefix}.w_up"], std, seed)
        self.w_down = RowParallelLinear(f, h, mesh, f"{prefix}.w_down", out_std, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up.split_output(F.linear(x, self.w_gate_up.weight))  # (rows, f/t) each
        if self.recompute and torch.is_grad_enabled():
            return F.linear(checkpoint(_swiglu, gate, up, use_reentrant=False), self.w_down.weight)
        return F.linear(_swiglu(gate, up), self.w_down.weight)  # (rows, h), partial over tp


class RoutedExperts(nn.ModuleDict):
    """This rank's routed experts, keyed by their global index (checkpoints and HF files name expert j alike on
    every mesh). A module with a forward of its own, so that ZeRO-2/3 can make it an FSDP2 unit (over edp)."""

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows grouped by local expert, ``counts[j]`` for the j-th; every expert runs, on zero rows if none came
        (its weights then get a zero gradient, and the reductions over edp pair up on every rank)."""
        outs = [expert(part) for expert, part in zip(self.values(), rows.split(counts))]
        return torch.cat(outs) if outs else rows


class Router(nn.Module):
    """logits = x W_r^T, W_r (E, h) replicated; fp32 scores, the top-k and their weights (module doc).
    ``expert_bias`` (E,): added to the scores for the choice only (aux-loss-free balancing), a persistent
    buffer (checkpoints keep it), moved by ``p3d.parallel.experts.balance.update_expert_bias``."""

    def __init__(self, cfg, prefix: str, seed: int, sp_group=None):
        super().__init__()
        e = cfg.moe
        self.n_experts, self.top_k, self.score = e.n_experts, e.top_k, e.score.value
        self.norm_topk = e.norm_topk_prob or self.score == "sigmoid"
        self.route_scale, self.sp_group = e.route_scale, sp_group
        shape = (e.n_experts, cfg.hidden_size)
        self.weight = nn.Parameter(
            torch.empty(*shape) if on_meta() else master_normal(shape, cfg.init_std, f"{prefix}.router", seed)
        )
        self.expert_bias: torch.Tensor
        self.register_buffer("expert_bias", torch.zeros(e.n_experts), persistent=True)
        self.use_bias = e.bias_update_rate > 0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (n, h) -> (idx (n, k), weight (n, k), probs (n, E)): probs are what the balancing loss averages."""
        w = self.weight if self.sp_group is None else copy_to_tp(self.weight, self.sp_group)
        with torch.autocast(x.device.type, enabled=False):  # routing in fp32 under bf16 autocast
            logits = F.linear(x.float(), w.float())  # (n, E)
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        choice = scores.detach() + self.expert_bias if self.use_bias else scores.detach()
        idx = choice.topk(self.top_k, dim=-1).indices  # (n, k)
        weight = scores.gather(1, idx)
        if self.norm_topk:
            weight = weight / weight.sum(-1, keepdim=True)
        probs = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        return idx, weight * self.route_scale, probs


class _AuxLoss(torch.autograd.Function):
    """forward: ``out`` unchanged (the block's output), and the micro batch's routing figures noted; backward:
    ``out``'s gradient unchanged, the balancing loss ``aux`` the gradient ``scale`` (its weight in the loss), and
    the figures committed: backward runs once per micro batch even when recompute repeats the forward."""

    @staticmethod
    def forward(ctx, out, aux, scale: float, commit):
        ctx.scale, ctx.commit = scale, commit
        return out

    @staticmethod
    def backward(ctx, grad):
        ctx.commit()
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None, None


class MoEFeedForward(nn.Module):
    """The feed-forward of MoE block ``layer`` (module doc). In and out as the dense SwiGLU's input to its
    column-parallel layer and output of its row-parallel one: (b, s, h) replicated over tp, or (b, s/tp, h)."""

    def __init__(self, cfg, mesh, layer: int, seed: int, sequence_parallel: bool = False, recompute: bool = False):
        super().__init__()
        e = cfg.moe
        prefix, h = f"block{layer}.mlp", cfg.hidden_size
        f = e.expert_ffn_size or cfg.ffn_hidden_size
        self.moe_index = layer - e.first_dense_layers  # the MoE layers' metrics are in this order
        self.n_experts, self.top_k, self.capacity_factor = e.n_experts, e.top_k, e.capacity_factor
        self.aux_coef = e.aux_loss_coef
        self.tp_group, self.sp = mesh.tp_group, sequence_parallel and mesh.tp > 1
        self.tp, self.ep_group = mesh.tp, mesh.ep_group if mesh.ep > 1 else None
        self.loss_scale = 1.0  # 1 / micro batches per step: set by the executor (p3d.train.executors)
        self.router = Router(cfg, prefix, seed, self.tp_group if self.sp else None)
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        make = functools.partial(Expert, std=cfg.init_std, out_std=out_std, seed=seed, recompute=recompute)
        local = e.n_experts // mesh.ep
        first = mesh.ep_rank * local
        self.experts = RoutedExperts(
            {str(j): make(h, f, mesh, f"{prefix}.experts.{j}") for j in range(first, first + local)}
        )
        for p in self.experts.parameters():
            mark_expert(p)
        self.shared = make(h, e.n_shared_experts * f, mesh, f"{prefix}.shared") if e.n_shared_experts else None
        # this step's routing figures, summed over its micro batches: [aux, micro batches, dropped, tokens per
        # expert (E)], each divided by tp where every tp rank holds the same (the world's sum is the step's)
        self.stats: torch.Tensor | None = None
        self.sent_rows = None  # a test's counter of the rows this rank sends to other ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s_here, h = x.shape
        k, g = self.top_k, self.tp_group
        idx, weight, probs = self.router(x.reshape(-1, h))  # this rank's tokens: (b s_here, k), .., (b s_here, E)
        if self.sp:  # the whole sequence's tokens and routing, on every tp rank
            x_in = gather_from_sp(x, g)  # (b, s, h); backward: reduce-scatter, the sum of the tp partials
            weight = gather_from_sp(weight.view(b, s_here, k), g)
            idx = gather_seq_values(idx.view(b, s_here, k), g)
        else:
            x_in, weight = copy_to_tp(x, g), copy_to_tp(weight, g)  # backward: all-reduce of the tp partials
        x2, idx, weight = x_in.reshape(-1, h), idx.reshape(-1, k), weight.reshape(-1, k)
        n = x2.shape[0]
        capacity = math.ceil(self.capacity_factor * n * k / self.n_experts) if self.capacity_factor else None
        y = dispatch_combine(
            x2, Routed(idx, weight), self.n_experts, self.experts, self.ep_group, capacity, self.sent_rows
        )
        if self.shared is not None:
            y = y + self.shared(x2)
        y = y.view(b, -1, h)
        out = reduce_scatter_to_sp(y, g) if self.sp else reduce_from_tp(y, g)  # (b, s_here, h)
        if not (self.training and torch.is_grad_enabled()):
            return out
        counts = torch.bincount(idx.reshape(-1), minlength=self.n_experts)
        # SP: probs are this rank's tokens' (its share of the sum over tp); else every tp rank has the whole
        aux = self.n_experts * (counts.float() / (n * k) * probs.sum(0) / n).sum()
        dropped = (counts - capacity).clamp(min=0).sum() if capacity else counts.new_zeros(())
        # [aux, one micro batch, dropped, counts]: each tp rank's share of the sum over tp (under SP aux is already
        # this rank's part; the rest is the same on every tp rank)
        same_on_tp = torch.cat([counts.new_ones(1), dropped.view(1), counts]).double() / self.tp
        aux_share = aux.detach().double().view(1) / (1 if self.sp else self.tp)
        figures = torch.cat([aux_share, same_on_tp])
        return _AuxLoss.apply(out, aux, self.aux_coef * self.loss_scale, functools.partial(self.add_stats, figures))

    def add_stats(self, figures: torch.Tensor) -> None:
        self.stats = figures if self.stats is None else self.stats + figures

    def take_stats(self) -> torch.Tensor:
        """This step's figures (zeros if no micro batch trained), and a fresh start for the next step."""
        stats, self.stats = self.stats, None
        return stats if stats is not None else torch.zeros(3 + self.n_experts, dtype=torch.float64)


def moe_blocks(module: nn.Module) -> list[MoEFeedForward]:
    """The MoE feed-forwards in ``module`` (a stage, a rank's chunks, the sequential twin)."""
    return [m for m in module.modules() if isinstance(m, MoEFeedForward)]


def set_micro_batches(module: nn.Module, m: float) -> None:
    """Each micro batch's balancing loss enters the gradient with weight aux_loss_coef / m, as its LM loss's 1 / m
    (the mean over the step's micro batches, then over dp, as the LM loss); ``m`` the replicas' mean count where
    they run different counts (p3d.layout.run_plan.RunPlan.mean_micro_batches)."""
    for block in moe_blocks(module):
        block.loss_scale = 1.0 / m


def routed_experts(block: nn.Module) -> nn.Module | None:
    """A transformer block's routed experts (one FSDP2 unit over the edp group under ZeRO-2/3), or None."""
    mlp = getattr(block, "mlp", None)
    return mlp.experts if isinstance(mlp, MoEFeedForward) else None
