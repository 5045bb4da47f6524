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

Experts (p3d.model.experts): the routed ones stacked, one weight per projection with the experts leading, and
computed by grouped GEMM over rows sorted by expert; routing, counting and permutation run on the device without a
host sync (p3d.parallel.experts.dispatch); the figures accumulate on the device and reach the host once per step
(p3d.parallel.experts.balance).

Routing: scores = softmax(logits) or sigmoid(logits) (fp32); the top-k by score plus ``expert_bias`` (the
selection bias: aux-loss-free balancing, or an imported ``e_score_correction_bias``) are a token's experts, with
group-limited routing (``n_groups`` > 1, DeepSeek-V3) only among the experts of its ``topk_groups`` best groups;
they are weighted by their scores (without the bias), renormalised to sum 1 when ``norm_topk_prob``, times
``route_scale``. Dropless unless ``capacity_factor``.

Load-balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4; per layer): aux = E sum_i f_i P_i, f_i the
share of the N k (token, slot) pairs routed to expert i, P_i the mean score of expert i over the N tokens
(sigmoid: scores normalised per token). 1 when balanced. It enters the gradient with weight aux_loss_coef / m
per micro batch (as the LM loss's 1 / m) through ``_AuxLoss``, not through the pipeline's loss, so the loss
the console shows stays the language-model loss.

Context parallelism (cp ranks each holding s / cp tokens of the sequences): the balancing loss and a capacity are
the whole sequence's, from per-expert statistics summed over the cp group (p3d.parallel.context.routing).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from p3d.model.experts import RoutedExperts, SwiGLUExpert
from p3d.parallel.context.routing import earlier_elsewhere, sum_over_cp
from p3d.parallel.experts.dispatch import Routed, dispatch_combine, slot_order
from p3d.parallel.tp.layers import master_normal, on_meta
from p3d.parallel.tp.mappings import copy_to_tp, gather_from_sp, gather_seq_values, reduce_from_tp, reduce_scatter_to_sp


class Router(nn.Module):
    """logits = x W_r^T, W_r (E, h) replicated; fp32 scores, the top-k and their weights (module doc).
    ``expert_bias`` (E,): added to the scores for the choice only (DeepSeek-V3's ``e_score_correction_bias``), a
    persistent buffer (checkpoints keep it), moved by ``p3d.parallel.experts.balance.update_expert_bias`` when
    aux-loss-free balancing is on and used for the choice whatever ``bias_update_rate`` (an imported or resumed
    bias routes as it was trained to)."""

    def __init__(self, cfg, prefix: str, seed: int, sp_group=None):
        super().__init__()
        e = cfg.moe
        self.n_experts, self.top_k, self.score = e.n_experts, e.top_k, e.score.value
        self.n_groups, self.topk_groups = e.n_groups, e.topk_groups
        self.norm_topk, self.route_scale, self.sp_group = e.norm_topk_prob, e.route_scale, sp_group
        shape = (e.n_experts, cfg.hidden_size)
        self.weight = nn.Parameter(
            torch.empty(*shape) if on_meta() else master_normal(shape, cfg.init_std, f"{prefix}.router", seed)
        )
        self.expert_bias: torch.Tensor
        self.register_buffer("expert_bias", torch.zeros(e.n_experts), persistent=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (n, h) -> (idx (n, k), weight (n, k), probs (n, E)): probs are what the balancing loss averages."""
        w = self.weight if self.sp_group is None else copy_to_tp(self.weight, self.sp_group)
        with torch.autocast(x.device.type, enabled=False):  # routing in fp32 under bf16 autocast
            logits = F.linear(x.float(), w.float())  # (n, E)
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        idx = self.choose(scores.detach() + self.expert_bias)  # (n, k)
        weight = scores.gather(1, idx)
        if self.norm_topk:  # (+ 1e-20: a token whose sigmoid scores all underflow keeps zero weights, not nan)
            weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
        probs = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        return idx, weight * self.route_scale, probs

    def choose(self, choice: torch.Tensor) -> torch.Tensor:
        """(n, E) bias-corrected scores -> (n, k) each token's experts. Group-limited (DeepSeek-V3): the G groups
        of E / G consecutive experts each scored by the sum of its 2 best, every expert outside the token's
        ``topk_groups`` best groups masked out, then the top-k. All on the device: topk, scatter, masked_fill."""
        if self.n_groups > 1:
            n, g = choice.shape[0], self.n_groups
            per_group = choice.view(n, g, -1)  # (n, G, E/G)
            group_score = per_group.topk(2, dim=-1).values.sum(-1)  # (n, G)
            best = group_score.topk(self.topk_groups, dim=-1).indices  # (n, topk_groups)
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)  # (n, G)
            choice = per_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, -1)  # (n, E)
        return choice.topk(self.top_k, dim=-1).indices


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
        self.cp, self.cp_group = mesh.cp, mesh.cp_group if mesh.cp > 1 else None  # a rank holds s / cp tokens
        self.loss_scale = 1.0  # 1 / micro batches per step: set by the executor (p3d.train.executors)
        self.router = Router(cfg, prefix, seed, self.tp_group if self.sp else None)
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        init = dict(std=cfg.init_std, out_std=out_std, seed=seed, recompute=recompute)
        self.experts = RoutedExperts(h, f, e.n_experts, mesh, f"{prefix}.experts", **init)
        self.shared = None
        if e.n_shared_experts:  # one SwiGLU of S f_e
            self.shared = SwiGLUExpert(h, e.n_shared_experts * f, mesh, f"{prefix}.shared", **init)
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
        n = x2.shape[0]  # this cp rank's tokens; the micro batch's are n cp
        capacity = math.ceil(self.capacity_factor * n * self.cp * k / self.n_experts) if self.capacity_factor else None
        # with cp, each pair's place among its expert's pairs of the whole sequence (the pairs other cp ranks hold)
        earlier = None if capacity is None or self.cp == 1 else earlier_elsewhere(idx, b, self.n_experts, self.cp_group)
        slots = slot_order(idx, self.n_experts, capacity, earlier)  # counted on the device: no host sync
        y = dispatch_combine(
            x2, Routed(idx, weight), slots, self.experts, self.ep_group, capacity, self.shared, self.sent_rows
        )  # (N, h): the routed experts' weighted sum plus the shared experts'
        y = y.view(b, -1, h)
        out = reduce_scatter_to_sp(y, g) if self.sp else reduce_from_tp(y, g)  # (b, s_here, h)
        if not (self.training and torch.is_grad_enabled()):
            return out
        counts = slots.counts
        # SP: probs are this rank's tokens' (its share of the sum over tp); else every tp rank has the whole. cp: the
        # pairs per expert and the score sums of the whole sequence, summed over the cp ranks (differentiably)
        e = self.n_experts
        whole = sum_over_cp(torch.cat([counts.float(), probs.sum(0)]), self.cp_group)  # (2 E,)
        aux = e * (whole[:e].detach() / (n * self.cp * k) * whole[e:] / (n * self.cp)).sum()
        dropped = (counts - slots.kept).sum()
        # [aux, one micro batch, dropped, counts]: each tp rank's share of the sum over tp (under SP aux is already
        # this rank's part; the rest is the same on every tp rank); counts and dropped are this cp rank's, aux the
        # whole sequence's on each cp rank, with one micro batch each: the world's sum over calls is still the mean
        same_on_tp = torch.cat([counts.new_ones(1), dropped.view(1), counts]).double() / self.tp
        aux_share = aux.detach().double().view(1) / (1 if self.sp else self.tp)
        figures = torch.cat([aux_share, same_on_tp])
        return _AuxLoss.apply(out, aux, self.aux_coef * self.loss_scale, functools.partial(self.add_stats, figures))

    def add_stats(self, figures: torch.Tensor) -> None:
        self.stats = figures if self.stats is None else self.stats + figures

    def take_stats(self) -> torch.Tensor:
        """This step's figures, on the device (zeros if no micro batch trained), and a fresh start for the next
        step."""
        stats, self.stats = self.stats, None
        device = self.router.expert_bias.device
        return stats if stats is not None else torch.zeros(3 + self.n_experts, dtype=torch.float64, device=device)


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
