"""What context parallelism adds to the plan (``mesh.cp``; docs/planner.md, Context parallelism): the tokens of a
sequence on one rank, the keys and values its attention exchanges, and the figures p3d-plan prints.

Notation: b micro batch, s sequence, t = tp, kv = n_kv_heads x head dim, c activation bytes, cp the degree. Each
sequence is cut into 2 cp equal chunks and cp rank r holds chunks r and 2 cp - 1 - r (head-tail: every rank gets the
same share of the causal attention), so every per-token tensor of a block is for s / cp tokens, and the block's
activations, its matmuls and the embedding, head and loss are 1/cp of cp = 1's (p3d.planner.memory, step_time).

Attention gathers the keys and values of the whole sequence over the cp group (Llama 3's all-gather context
parallelism, p3d.parallel.context.attention), per block and micro batch:

    forward    all-gather of k and v      each rank's (b, kv/t, s/cp) -> (b, kv/t, s): b s 2 kv / t c bytes
    backward   all-gather of k and v again (only the local ones are saved) and reduce-scatter of dk, dv
    recompute  one more forward all-gather (selective or full: the attention runs forward again)

of which (cp - 1) / cp leave each rank (a ring's share). A cp group is cp ranks tp apart, so tp x cp consecutive
ranks: the intra-node link while they fit in a node. p3d's collectives block, so none of it hides behind compute
(``HIDDEN``); ring attention (Megatron-Core's) would hide min(1, t_attention_chunk / t_p2p_chunk) of it.
"""

from __future__ import annotations

from typing import Any

from p3d.config.schema import Config, Recompute
from p3d.layout.geometry import head_dims
from p3d.planner.shapes import Layout, dtype_bytes

LONG_SEQUENCE = 16384  # mesh=auto tries cp > 1 from this model.seq_len on (p3d.planner.search); a cp column
HIDDEN = 0.0  # the share of the key/value collectives hidden behind compute: p3d's all-gathers block


def local_tokens(cfg: Config, layout: Layout) -> float:
    """s / cp: the tokens of each sequence one rank holds (its two chunks of 2 cp)."""
    return cfg.model.seq_len / layout.cp


def kv_bytes(cfg: Config, layout: Layout) -> float:
    """b s 2 kv / t c: the keys and values of a micro batch's whole sequences on one tp rank, what one all-gather
    assembles (or one reduce-scatter of dk, dv takes apart); (cp - 1) / cp of them leave the rank."""
    m = cfg.model
    _, kv = head_dims(m)
    return layout.micro_batch_size * m.seq_len * 2 * kv / layout.tp * dtype_bytes(cfg)


def kv_collectives(recompute: Recompute) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) of keys and values per block and micro batch: forward 1 all-gather, backward
    1 all-gather + 1 reduce-scatter, recompute (selective or full) 1 all-gather more."""
    return (2 if recompute == Recompute.none else 3), 1


def kv_bytes_sent(cfg: Config, layout: Layout) -> float:
    """Bytes leaving one rank for keys and values per block and micro batch: each collective's (cp - 1) / cp share."""
    if layout.cp == 1:
        return 0.0
    return sum(kv_collectives(Recompute(layout.recompute))) * kv_bytes(cfg, layout) * (layout.cp - 1) / layout.cp


def kv_span(layout: Layout) -> int:
    """Consecutive global ranks a cp group spans: cp ranks, tp apart (tp varies fastest)."""
    return layout.tp * layout.cp


def summary(cfg: Config, layout: Layout, kv_s: float, link: str) -> dict[str, Any] | None:
    """Context parallelism in p3d-plan's JSON (``context``): None with cp = 1. ``kv_s``: the seconds of one block's
    key/value collectives per micro batch; ``link``: "intra" or "inter"-node."""
    if layout.cp == 1:
        return None
    gathers, scatters = kv_collectives(Recompute(layout.recompute))
    return {
        "cp": layout.cp,
        "tokens_per_rank": local_tokens(cfg, layout),
        "kv_ranks": kv_span(layout),
        "kv_link": link,
        "kv_bytes_per_collective": kv_bytes(cfg, layout),
        "kv_all_gathers_per_layer_per_micro_batch": gathers,
        "kv_reduce_scatters_per_layer_per_micro_batch": scatters,
        "kv_bytes_sent_per_layer_per_micro_batch": kv_bytes_sent(cfg, layout),
        "kv_s_per_layer_per_micro_batch": kv_s,
        "kv_hidden_fraction": HIDDEN,
    }
