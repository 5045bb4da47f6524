"""What context parallelism adds to the plan (``mesh.cp``; docs/planner.md, Context parallelism): the tokens of a
sequence on one rank, the keys and values its attention exchanges, the working set it holds, and the figures p3d-plan
prints.

Notation: b micro batch, s sequence, t = tp, kv = n_kv_heads x head dim, c activation bytes, cp the degree. Each
sequence is cut into 2 cp equal chunks and cp rank r holds chunks r and 2 cp - 1 - r (head-tail: every rank gets the
same share of the causal attention), so every per-token tensor of a block is for s / cp tokens, and the block's
activations, its matmuls and the embedding, head and loss are 1/cp of cp = 1's (p3d.planner.memory, step_time).

How the keys and values travel (``context.attention``, p3d.parallel.context), per block and micro batch:

    allgather  forward    all-gather of k and v: each rank's (b, kv/t, s/cp) -> (b, kv/t, s), b s 2 kv / t c bytes
               backward   the same all-gather again (only the local ones are saved), and a reduce-scatter of the fp32
                          dK, dV sums: b s 2 kv / t 4 bytes
               recompute  one more forward all-gather (selective or full: the attention runs forward again)
               (cp - 1) / cp of each leaves the rank; they block, none hidden
    ring       forward    cp - 1 sends of one rank's k and v (b s/cp 2 kv / t c bytes), each while a block computes
               backward   cp - 1 such sends and cp of the fp32 dK, dV partial sums (b s/cp 2 kv / t 4 bytes), every one
                          but the last while a block's backward computes
               recompute  the forward's sends once more

A cp group is cp ranks tp apart, so tp x cp consecutive ranks: the intra-node link while they fit in a node. A ring
step hides its message behind its share of the attention (1/cp of the rank's): ``ring_exposed``.
"""

from __future__ import annotations

from typing import Any

from p3d.config.schema import Config, Recompute
from p3d.layout.geometry import head_dims, is_mla, v_head_dim
from p3d.planner import mla
from p3d.planner.shapes import Layout, dtype_bytes

LONG_SEQUENCE = 16384  # mesh=auto tries cp > 1 from this model.seq_len on (p3d.planner.search); a cp column
BACKWARD_OVER_FORWARD = 2.5  # a flash attention block's backward time over its forward's (step_time's attn_bwd)


def variant(cfg: Config) -> str:
    """``context.attention``: "allgather" or "ring"."""
    return str(cfg.context.attention)


def local_tokens(cfg: Config, layout: Layout) -> float:
    """s / cp: the tokens of each sequence one rank holds (its two chunks of 2 cp)."""
    return cfg.model.seq_len / layout.cp


def kv_bytes(cfg: Config, layout: Layout) -> float:
    """b s 2 kv / t c: the keys and values of a micro batch's whole sequences on one tp rank, what one all-gather
    assembles; (cp - 1) / cp of them leave the rank. A ring message is 1/cp of it."""
    m = cfg.model
    if is_mla(m):  # MLA: the latent travels, the same on every tp rank (p3d.planner.mla)
        return mla.latent_bytes(cfg, layout)
    _, kv = head_dims(m)
    return layout.micro_batch_size * m.seq_len * 2 * kv / layout.tp * dtype_bytes(cfg)


def kv_grad_bytes(cfg: Config, layout: Layout) -> float:
    """The fp32 dK, dV of the same tokens: what a reduce-scatter takes apart (a ring passes 1/cp of it a step)."""
    return kv_bytes(cfg, layout) * 4 / dtype_bytes(cfg)


def kv_collectives(recompute: Recompute) -> tuple[int, int]:
    """allgather: (all-gathers, reduce-scatters) of keys and values per block and micro batch: forward 1 all-gather,
    backward 1 all-gather + 1 reduce-scatter, recompute (selective or full) 1 all-gather more."""
    return (2 if recompute == Recompute.none else 3), 1


def ring_messages(layout: Layout) -> tuple[int, int]:
    """ring: (k and v messages, dK and dV messages) a rank sends per block and micro batch (module doc)."""
    forwards = 1 if Recompute(layout.recompute) == Recompute.none else 2
    return (forwards + 1) * (layout.cp - 1), layout.cp


def kv_bytes_sent(cfg: Config, layout: Layout) -> float:
    """Bytes leaving one rank for keys and values per block and micro batch."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    if variant(cfg) == "ring":
        kvs, grads = ring_messages(layout)
        return (kvs * kv_bytes(cfg, layout) + grads * kv_grad_bytes(cfg, layout)) / cp
    gathers, scatters = kv_collectives(Recompute(layout.recompute))
    return (gathers * kv_bytes(cfg, layout) + scatters * kv_grad_bytes(cfg, layout)) * (cp - 1) / cp


def ring_exposed(layout: Layout, kv_s: float, grad_s: float, attention_s: float) -> tuple[float, float]:
    """(exposed, all) seconds of a ring's messages per block and micro batch. ``kv_s``, ``grad_s``: one k and v message,
    one dK and dV message on the cp link; ``attention_s``: the rank's attention forward of the block, of which a step
    computes 1/cp (its backward 2.5 times that). Forward, each pass: cp - 1 steps of max(0, kv_s - step); backward:
    step 0 sends k and v, steps 1..cp-2 k and v and the previous partial sum, step cp - 1 the partial sum, each
    hidden behind its step, and the last sum goes to its owner after the loop, exposed."""
    cp = layout.cp
    step = attention_s / cp
    back = BACKWARD_OVER_FORWARD * step
    passes = 1 if Recompute(layout.recompute) == Recompute.none else 2
    exposed = passes * (cp - 1) * max(0.0, kv_s - step)
    exposed += max(0.0, kv_s - back) + (cp - 2) * max(0.0, kv_s + grad_s - back) + max(0.0, grad_s - back) + grad_s
    kvs, grads = ring_messages(layout)
    return exposed, kvs * kv_s + grads * grad_s


def kv_span(layout: Layout) -> int:
    """Consecutive global ranks a cp group spans: cp ranks, tp apart (tp varies fastest)."""
    return layout.tp * layout.cp


def summary(cfg: Config, layout: Layout, kv_s: float, hidden: float, link: str) -> dict[str, Any] | None:
    """Context parallelism in p3d-plan's JSON (``context``): None with cp = 1. ``kv_s``: the exposed seconds of one
    block's key/value traffic per micro batch; ``hidden``: the share of it hidden; ``link``: "intra" or "inter"."""
    if layout.cp == 1:
        return None
    out: dict[str, Any] = {
        "cp": layout.cp,
        "attention": variant(cfg),
        "tokens_per_rank": local_tokens(cfg, layout),
        "kv_ranks": kv_span(layout),
        "kv_link": link,
    }
    if variant(cfg) == "ring":
        kvs, grads = ring_messages(layout)
        out |= {
            "kv_bytes_per_message": kv_bytes(cfg, layout) / layout.cp,
            "kv_grad_bytes_per_message": kv_grad_bytes(cfg, layout) / layout.cp,
            "kv_messages_per_layer_per_micro_batch": kvs,
            "kv_grad_messages_per_layer_per_micro_batch": grads,
        }
    else:
        gathers, scatters = kv_collectives(Recompute(layout.recompute))
        out |= {
            "kv_bytes_per_collective": kv_bytes(cfg, layout),
            "kv_grad_bytes_per_collective": kv_grad_bytes(cfg, layout),
            "kv_all_gathers_per_layer_per_micro_batch": gathers,
            "kv_reduce_scatters_per_layer_per_micro_batch": scatters,
        }
    return out | {
        "kv_bytes_sent_per_layer_per_micro_batch": kv_bytes_sent(cfg, layout),
        "kv_s_per_layer_per_micro_batch": kv_s,
        "kv_hidden_fraction": hidden,
        "attention_working_bytes": attention_working_bytes(cfg, layout),
    }


def attention_working_bytes(cfg: Config, layout: Layout) -> float:
    """What the cp attention of one layer holds at its peak beside the output and log-sum-exp it saves (the blocks'
    kernels tile their scores: no s x s term), per tp rank; 0 with cp = 1 (SDPA's own). Counted from
    p3d.parallel.context (measured against it: bench/cp.py attention, docs/context.md). With b micro batch, sl = s / cp
    local tokens, c bytes of the run's dtype, kv and q the key/value and query widths over tp, g = heads / kv heads:
    B = b sl kv c one local k (or v), B4 the same in fp32, Q = b sl q c the local q (or out, dq), Q4 in fp32.

    allgather, backward at the tail chunk's prefix block (the larger of forward and backward):
        gathered k, v                      2 cp B
        dK, dV sums, rank order (fp32)     2 cp B4
        dq; the tail chunk's dq so far     Q + Q4 / 2 (Q / 2 in fp32 runs: the kernel's own)
        the prefix block's kernel outputs  (2 cp - 1) B + Q / 2     dK, dV of up to s (1 - 1/(2 cp)) keys; dq
        query rows folded for GQA (g > 1)  3 Q / 2                  grad_out, q, out of the chunk, copied
    forward: gathered k, v and one gather's landing 3 cp B, the output Q, a chunk's merge (fp32) and its block
    output 3 Q4 / 2 + Q / 2.

    ring, backward at its fullest step (step 0, a middle one, the last one):
        k, v held (and arriving)           2 B (4 B)
        dq (fp32)                          Q4
        dK, dV (fp32): this rank's share,  2 B4 (6 B4)
        (and the sum sent, the one arriving)
        a block's kernel outputs           max(Q + B, Q / 2 + 2 B)   both chunks over a head, or the tail over both
        query rows folded for GQA (g > 1)  3 Q (both chunks)
    forward: k, v held and arriving 4 B, the merge (fp32) Q4 and its two temporaries 2 Q4, a block's output Q.
    """
    cp = layout.cp
    if cp == 1:
        return 0.0
    m = cfg.model
    if is_mla(m):
        return mla.working_bytes(cfg, layout)
    q_width, kv_width = head_dims(m)
    t, b, c = layout.tp, layout.micro_batch_size, dtype_bytes(cfg)
    sl = m.seq_len / cp
    kv_b, kv_b4 = b * sl * kv_width / t * c, b * sl * kv_width / t * 4
    q_b, q_b4 = b * sl * q_width / t * c, b * sl * q_width / t * 4
    folded = 3 * q_b if m.n_heads != m.n_kv_heads else 0.0  # per sl query rows
    if str(cfg.context.attention) == "ring":
        block = max(q_b + kv_b + folded, q_b / 2 + 2 * kv_b + folded / 2)
        held = 4 * kv_b if cp > 2 else 2 * kv_b  # a step with three dK, dV buffers still receives k, v when cp > 2
        backward = max(4 * kv_b + 2 * kv_b4, held + 6 * kv_b4) + q_b4 + block
        forward = 4 * kv_b + 3 * q_b4 + q_b
        return max(backward, forward)
    dq_chunk = q_b4 / 2 if c < 4 else q_b / 2
    backward = 2 * cp * kv_b + 2 * cp * kv_b4 + q_b + dq_chunk + (2 * cp - 1) * kv_b + q_b / 2 + folded / 2
    forward = 3 * cp * kv_b + q_b + 3 * q_b4 / 2 + q_b / 2
    return max(backward, forward)


def attention_core_bytes(cfg: Config, layout: Layout) -> float:
    """The cp attention core's peak for one layer's forward and backward, from its q, k, v in (bench/cp.py attention
    measures it): the output (c bytes) and log-sum-exp (fp32) it saves and its working set at the peak."""
    m = cfg.model
    q_width = m.n_heads * v_head_dim(m) if is_mla(m) else head_dims(m)[0]  # the output's width
    t, b, c = layout.tp, layout.micro_batch_size, dtype_bytes(cfg)
    saved = b * local_tokens(cfg, layout) * (q_width / t * c + 4 * m.n_heads / t)
    return saved + attention_working_bytes(cfg, layout)
