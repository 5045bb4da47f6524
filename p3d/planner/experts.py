"""What a mixture of experts adds to the plan (``model.moe``; docs/planner.md, Mixture of experts): an MoE block's
feed-forward activations and memory-bound bytes, the rows its token dispatch moves, and the figures p3d-plan prints.

Notation: b micro batch, s a rank's tokens of a sequence (s / cp with context parallelism), h hidden, c activation
bytes, t = tp (sp = t with sequence parallelism, else 1), E routed experts, k = top_k, S shared experts, f_e an
expert's inner size, ep the expert-parallel degree (an ep group is ep consecutive dp ranks of one cp coordinate, so
it spans ep x cp x t consecutive global ranks), r the rows per token, the (token, slot)
pairs sent to experts: k when dropless, k min(1, capacity_factor) under balanced routing with a capacity.

What an MoE block's feed-forward keeps for backward, per token of a micro batch on one tp rank (what
p3d/model/moe.py and p3d/parallel/experts/dispatch.py save; measured in tests/unit/planner/test_moe.py):

    routed   r (2 c h + 4 c f_e / t + c + 16 [+ 8 with ep > 1])   each row as the grouped GEMM reads it (grouped
             by expert, after the dispatch all-to-all) and as it comes back in (token, slot) order (the weighted sum
             keeps it); its expert's gate|up, silu(gate) and product; its routing weight; the int64 sort order and
             its inverse (and the regrouping's by local expert); per micro batch the int32 group ends (4 E / ep)
    shared   4 c S f_e / t    a dense SwiGLU of S f_e (+ c h under sequence parallelism: the gathered tokens it reads)
    router   ((4 h if c < 4) + 4 E + 8 k + (4 k + 4 when the top-k weights are renormalised) (+ 4 with sigmoid
             scores)) / sp: the fp32 copy of its input, the fp32 scores, the top-k indices and weights, (the scores'
             sum) on this rank's s / sp tokens; per micro batch, the fp32 copy of its weight (4 E h, if c < 4) and
             the balancing loss's counts (4 E)

Selective recompute with ``recompute_swiglu`` recomputes silu(gate): r c f_e / t and c S f_e / t less. The norm's
output, which the block's count of its norms includes (c h / sp), is kept by the router in fp32 (it reads it) and by
the shared experts without sequence parallelism; otherwise (c < 4, and S = 0 or sp > 1) by nothing: c h / sp less.

Token dispatch, per MoE block and micro batch: one all-to-all sends the rows to their experts' ranks and one brings
the outputs back, in forward; backward runs the same two (full recompute: the forward's two once more). Each moves
the b s r h c bytes of a rank's rows, of which (ep - 1) / ep leave it under uniform routing; each forward's dispatch
starts with a small all-to-all of the E row counts.
"""

from __future__ import annotations

from typing import Any

from p3d.config.schema import Config, Recompute
from p3d.layout.geometry import active_params, expert_ffn_size, moe_layers, total_params
from p3d.planner.context import local_tokens
from p3d.planner.shapes import Layout, StageParams, dtype_bytes


def rows_per_token(cfg: Config) -> float:
    """r: (token, slot) rows per token that reach an expert: k, or k min(1, capacity_factor) (balanced routing)."""
    moe = cfg.model.moe
    assert moe is not None
    cf = moe.capacity_factor
    return moe.top_k * (min(1.0, cf) if cf is not None else 1.0)


def ffn_activation_bytes(cfg: Config, layout: Layout, recompute: Recompute) -> float:
    """Bytes an MoE block's feed-forward (router, routed and shared experts) keeps for backward, per micro batch on
    one tp rank, under ``recompute`` none or selective (module doc)."""
    m, sched = cfg.model, cfg.schedule
    moe = m.moe
    assert moe is not None
    c, t, b, s, h = dtype_bytes(cfg), layout.tp, layout.micro_batch_size, local_tokens(cfg, layout), m.hidden_size
    f_e, k, shared = expert_ffn_size(m), moe.top_k, moe.n_shared_experts
    sp = t if sched.sequence_parallel else 1
    swiglu = 3 if recompute == Recompute.selective and sched.recompute_swiglu else 4  # of c f_e / t per row
    routed = rows_per_token(cfg) * (2 * c * h + swiglu * c * f_e / t + c + 16 + (8 if layout.ep > 1 else 0))
    per_token = routed + swiglu * c * shared * f_e / t + (c * h if shared and sp > 1 else 0)
    if c < 4 and (not shared or sp > 1):  # the norm's output (c h / sp, in the norms' count): nothing here keeps it
        per_token -= c * h / sp
    sigmoid = moe.score.value == "sigmoid"
    renorm = moe.norm_topk_prob
    router = (4 * h if c < 4 else 0) + 4 * moe.n_experts + 8 * k + (4 * k + 4 if renorm else 0) + (4 if sigmoid else 0)
    # per micro batch: the balancing loss's fp32 counts (E), and with c < 4 the router weight's fp32 copy (E h);
    # the grouped GEMMs' int32 group ends (E / ep)
    once = 4 * moe.n_experts * (1 + (h if c < 4 else 0)) + 4 * moe.n_experts // layout.ep
    return b * s * (per_token + router / sp) + once


def ffn_side_elements(cfg: Config, layout: Layout) -> float:
    """Elements per token the memory-bound kernels of an MoE feed-forward read and write, forward: the SwiGLUs
    (5 r f_e / t + 5 S f_e / t, as the dense one's 5 f / t) and the permutation: rows gathered by expert, outputs
    weighted and added back per token (8 r h), regrouped by local expert and back with ep > 1 (4 r h)."""
    moe = cfg.model.moe
    assert moe is not None
    r, f_e, h, t = rows_per_token(cfg), expert_ffn_size(cfg.model), cfg.model.hidden_size, layout.tp
    return 5 * (r + moe.n_shared_experts) * f_e / t + (8 + (4 if layout.ep > 1 else 0)) * r * h


def dispatch_bytes(cfg: Config, layout: Layout) -> float:
    """b s r h c: one micro batch's rows on a rank (its s / cp tokens), what each all-to-all of its dispatch
    exchanges (the (ep - 1) / ep of them for other ranks leave it; p3d.planner.step_time.ring counts that share)."""
    m = cfg.model
    tokens = layout.micro_batch_size * local_tokens(cfg, layout)
    return tokens * rows_per_token(cfg) * m.hidden_size * dtype_bytes(cfg)


def all_to_alls(recompute: Recompute) -> tuple[int, int]:
    """(all-to-alls of rows, all-to-alls of the E row counts) per MoE block and micro batch: 4 and 1 (dispatch
    and combine in forward, their gradients in backward), 6 and 2 when full recompute runs the forward again."""
    return (6, 2) if recompute == Recompute.full else (4, 1)


def a2a_span(layout: Layout) -> int:
    """Consecutive global ranks an ep group spans: ep dp ranks, each tp ranks wide (tp varies fastest) and tp x cp
    apart (cp varies next)."""
    return layout.ep * layout.tp * layout.cp


def summary(cfg: Config, layout: Layout, stages: list[StageParams], a2a_s: float, link: str) -> dict[str, Any] | None:
    """The mixture of experts in p3d-plan's JSON (``experts``): None for a dense model. ``a2a_s``: the seconds of
    one MoE block's all-to-alls per micro batch; ``link``: "intra" or "inter"-node."""
    m = cfg.model
    moe = m.moe
    if moe is None:
        return None
    return {
        "n_experts": moe.n_experts,
        "top_k": moe.top_k,
        "n_shared_experts": moe.n_shared_experts,
        "moe_layers": len(moe_layers(m)),
        "total_params": total_params(m),
        "active_params": active_params(m),
        "ep": layout.ep,
        "edp": layout.edp,
        "experts_per_rank": moe.n_experts // layout.ep,
        "a2a_ranks": a2a_span(layout),
        "a2a_link": link,
        "a2a_bytes_sent": dispatch_bytes(cfg, layout) * (layout.ep - 1) / layout.ep,
        "a2a_per_layer_per_micro_batch": all_to_alls(Recompute(layout.recompute))[0] if layout.ep > 1 else 0,
        "a2a_s_per_layer_per_micro_batch": a2a_s,
        "params_per_rank": [{"stage": i, "dense": st.dense, "experts": st.experts} for i, st in enumerate(stages)],
    }
