"""DeepSeek's rotated rows, permuted at import and back at export (no torch).

DeepSeek-V2/V3 rotate the d_r rotated columns of each query head and of the shared key as interleaved pairs
(x0, x1), (x2, x3), ... (transformers' ``apply_rotary_pos_emb_interleave``, ``rope_interleave: true``), and write the
rotated pairs out as [evens | odds]. p3d rotates halves (x_i, x_{i + d_r/2}), as Llama: with the rows that make those
columns reordered evens first, [0, 2, ..., d_r - 2, 1, 3, ..., d_r - 1], p3d's rotate-half gives the same rotated
query and key, so the same scores and logits. The rows are those of W_qb (or W_q), each head's last d_r, and of W_kva,
its last d_r; nothing else changes. ``row_order`` gives, for each row of a p3d tensor, the HF row it is read from.
"""

from __future__ import annotations


def deinterleaved(n: int) -> list[int]:
    """[0, 2, ..., n - 2, 1, 3, ..., n - 1]: the interleaved pairs' evens, then their odds."""
    return list(range(0, n, 2)) + list(range(1, n, 2))


def query_rows(m) -> list[int]:
    """W_qb's (or W_q's) rows: each head's d_n unrotated rows as they are, its d_r rotated rows deinterleaved."""
    x = m.mla
    qk = x.qk_nope_head_dim + x.qk_rope_head_dim
    head = list(range(x.qk_nope_head_dim)) + [x.qk_nope_head_dim + i for i in deinterleaved(x.qk_rope_head_dim)]
    return [h * qk + i for h in range(m.n_heads) for i in head]


def latent_rows(m) -> list[int]:
    """W_kva's rows: the latent's r rows as they are, the shared key's d_r rotated rows deinterleaved."""
    r = m.mla.kv_lora_rank
    return list(range(r)) + [r + i for i in deinterleaved(m.mla.qk_rope_head_dim)]


def inverse(order: list[int]) -> list[int]:
    """The order that undoes ``order``: p3d's rows written back in the HF rows' order."""
    out = [0] * len(order)
    for p3d_row, hf_row in enumerate(order):
        out[hf_row] = p3d_row
    return out
