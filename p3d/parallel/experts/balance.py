"""A step's routing figures over the whole mesh, what they give to metrics, and aux-loss-free balancing.

Each MoE feed-forward (p3d.model.moe.MoEFeedForward, its ``moe_index`` among the MoE layers) sums per step
[balancing loss, micro batches, dropped (token, slot) pairs, tokens per expert (E)] over its micro batches,
each divided by tp where every tp rank holds the same, so the sum over the world is the step's whole: one
all-reduce of (MoE layers, 3 + E) figures per step, on every rank (a layer lives on one pp stage; the dp
replicas' micro batches add up, and the cp ranks' counts of their parts of the sequences; each cp rank's balancing
loss is the whole sequence's, p3d.parallel.context.routing, with one micro batch each: their mean is the same).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

AUX, CALLS, DROPPED, COUNTS = 0, 1, 2, 3  # the columns of a layer's figures (tokens per expert from COUNTS on)


def step_figures(blocks: list, n_layers: int, n_experts: int, device=None) -> torch.Tensor:
    """(n_layers, 3 + E) on the host: every MoE layer's figures of the step, summed over the world (this rank's
    ``blocks`` hold some of them); each block's are then reset. Gathered on ``device`` (where the blocks computed
    them), all-reduced there, and copied to the host once: one reduction and one copy per step, none per block."""
    out = torch.zeros(n_layers, 3 + n_experts, dtype=torch.float64, device=device)  # summed on the device
    for block in blocks:
        out[block.moe_index] += block.take_stats().to(out.device, torch.float64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out)
    return out.cpu()  # the step's one host copy of the figures


def update_expert_bias(blocks: list, figures: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3, Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing"): after each
    step every expert's selection bias moves by ``rate`` toward the mean load: up when it got fewer tokens than
    the mean, down when more (sign of the difference; the same update on every rank, from the world's counts)."""
    if rate <= 0:
        return
    for block in blocks:
        counts = figures[block.moe_index, COUNTS:]
        step = rate * torch.sign(counts.mean() - counts)
        bias = block.router.expert_bias
        bias.add_(step.to(bias.device, bias.dtype))


def metrics(figures: torch.Tensor) -> dict:
    """What metrics.jsonl and W&B record of a step's routing (docs/moe.md):
    - moe_aux_loss: the balancing loss summed over the MoE layers, each the mean over the step's micro batches
      (what aux_loss_coef multiplies; 1 per layer when balanced);
    - moe_aux_loss_layers, moe_load_imbalance: per MoE layer, that loss and max / mean tokens per expert
      (1 when balanced, E / k when every token goes to the same k experts);
    - moe_dropped: the share of (token, slot) pairs an expert's capacity dropped (0 when dropless)."""
    calls = figures[:, CALLS].clamp(min=1)
    aux = figures[:, AUX] / calls
    counts = figures[:, COUNTS:]
    mean = counts.mean(1).clamp(min=1e-12)
    imbalance = counts.max(1).values / mean
    routed = counts.sum(1).clamp(min=1)
    return {
        "moe_aux_loss": float(aux.sum()),
        "moe_aux_loss_layers": [float(a) for a in aux],
        "moe_load_imbalance": [float(x) for x in imbalance],
        "moe_dropped": float(figures[:, DROPPED].sum() / routed.sum()),
    }
