"""What multi-head latent attention adds to the plan (``model.attention=mla``; docs/planner.md, "MLA"): its GEMMs, its
activations, its memory-bound bytes, and under context parallelism the latent it exchanges and the keys and values
every rank expands.

Notation (p3d.layout.geometry): b micro batch, s a rank's tokens of a sequence (s / cp), t = tp (sp = t with sequence
parallelism), a heads (H = a / t per rank), r_q and r = r_kv the latents, d_n, d_r, d_v the heads' widths (d_qk =
d_n + d_r), c activation bytes. The flash kernels take one head dim: v runs padded to d_qk (p3d.model.mla), so the
kernel's v and output are d_qk wide.

What an MLA block's attention keeps for backward per token on one tp rank (what p3d/model/mla.py saves; measured in
tests/unit/planner/test_activations.py):

    q latent    r_q: its RMSNorm as a block's norm over r_q (fp32: x, 1/rms, x_hat, x_hat w; bf16: x, 1/rms, the
                output), / sp                                                   (none without q compression)
    kv latent   r + d_r: W_kva's output (the norm's x is a view of it), 1/rms, and in fp32 x_hat, and the norm's
                output W_kvb reads (r), / sp
    core        4 H d_qk + H d_v (c) + 4 H: the rotated q, k (the shared rotated key assembled into every head), v
                padded and the kernel's output, then the output cut to d_v that W_o reads; the log-sum-exp (fp32)
    rope        2 s d_r c per block and micro batch: the tables
    selective   (recompute=selective: RoPE and the core recomputed) the core's inputs instead: q (H d_qk), W_kvb's
                output (H (d_n + d_v), of which k_n and v are views) and the output W_o reads (H d_v); no tables
    cp > 1      the cp core (p3d.parallel.context.latent) saves the rotated q, the latent [c | rope(k_r)] (r + d_r, not
                / t), the output (H d_v: W_o reads a view of it) and the log-sum-exp; the kv norm's output is not
                kept (the latent is a new tensor)

Under context parallelism the latent crosses the cp group instead of the heads' keys and values: b s (r + d_r) c bytes
per all-gather (every tp rank gathers the same: not / t), its gradient in fp32; and every rank expands the whole
sequence's latent with its W_kvb in forward and again in backward (the all-gather; the ring a step's worth each
step), with W_kvb's two backward GEMMs over the whole sequence too (``projections``).
"""

from __future__ import annotations

from p3d.config.schema import Config
from p3d.layout.geometry import qk_head_dim, v_head_dim
from p3d.planner.shapes import Layout, dtype_bytes


def widths(cfg: Config) -> tuple[int, int, int, int, int, int]:
    """(r_q or 0, r, d_n, d_r, d_v, d_qk)."""
    x = cfg.model.mla
    assert x.kv_lora_rank is not None and x.qk_nope_head_dim is not None and x.qk_rope_head_dim is not None
    return x.q_lora_rank or 0, x.kv_lora_rank, x.qk_nope_head_dim, x.qk_rope_head_dim, v_head_dim(cfg.model), \
        qk_head_dim(cfg.model)  # fmt: skip


def _norm_kept(c: int, width: int, output: bool) -> float:
    """Bytes per token an RMSNorm over ``width`` keeps beside its input: 1/rms, in fp32 x_hat, and (``output``) the
    output the next matmul reads."""
    return 4 + (c * width if c == 4 else 0) + (c * width if output else 0)


def attention_bytes_per_token(cfg: Config, layout: Layout, selective: bool) -> float:
    """Activation bytes one MLA block's attention keeps per token (the rank's s / cp tokens) on one tp rank, the
    rope tables aside (module doc)."""
    c, t, cp = dtype_bytes(cfg), layout.tp, layout.cp
    sp = t if cfg.schedule.sequence_parallel else 1
    r_q, r, d_n, d_r, d_v, d_qk = widths(cfg)
    heads = cfg.model.n_heads / t
    q_latent = (c * r_q + _norm_kept(c, r_q, True)) / sp if r_q else 0.0
    kv_latent = (c * (r + d_r) + _norm_kept(c, r, cp == 1 or selective)) / sp
    if cp > 1 and selective:  # the checkpointed core's inputs: q, the latent c (above), k_r (a view of W_kva's output)
        core = c * (heads * d_qk + heads * d_v)
    elif cp > 1:
        core = c * (heads * d_qk + (r + d_r) + heads * d_v) + 4 * heads
    elif selective:
        core = c * (heads * d_qk + heads * (d_n + d_v) + heads * d_v)
    else:
        core = c * (4 * heads * d_qk + heads * d_v) + 4 * heads
    return q_latent + kv_latent + core


def rope_table_bytes(cfg: Config, layout: Layout) -> float:
    """The cos and sin tables of the rotated width, per block: 2 s d_r c."""
    return 2 * cfg.model.seq_len / layout.cp * widths(cfg)[3] * dtype_bytes(cfg)


def projections(cfg: Config, layout: Layout, rows: float) -> list[tuple[float, float, float, bool]]:
    """(M, N, K, split by heads) of the forward's projections before the core, per micro batch on one tp rank (rows:
    the rank's tokens): W_qa (M / sp x r_q, K = h) and W_kva (M / sp x (r + d_r)), replicated, run on the rank's
    tokens (the block of them under SP); W_qb (M x H d_qk, K = r_q) or W_q (K = h); W_kvb (M x H (d_n + d_v), K = r),
    whose M under cp is the whole sequence every rank expands: cp M (all-gather; the ring's steps add up to it)."""
    m, t = cfg.model, layout.tp
    sp = t if cfg.schedule.sequence_parallel else 1
    r_q, r, d_n, d_r, d_v, d_qk = widths(cfg)
    h, heads = m.hidden_size, m.n_heads / t
    out = [(rows / sp, r + d_r, h, False), (rows * layout.cp, heads * (d_n + d_v), r, True)]
    if r_q:
        return [(rows / sp, r_q, h, False), (rows, heads * d_qk, r_q, True), *out]
    return [(rows, heads * d_qk, h, True), *out]


def side_elements(cfg: Config, layout: Layout) -> float:
    """Elements per token the MLA attention's memory-bound kernels read and write forward, on one tp rank: the
    latents' norms (5 x width, as a block's norm), RoPE on d_r of q and the shared key, the keys assembled and v
    padded (read and written), the output cut back."""
    t = layout.tp
    sp = t if cfg.schedule.sequence_parallel else 1
    r_q, r, d_n, d_r, d_v, d_qk = widths(cfg)
    heads = cfg.model.n_heads / t
    norms = 5 * (r_q + r) / sp
    rope = 4 * (heads + 1) * d_r
    assemble = 2 * heads * d_qk * 2 + 2 * heads * d_v
    return norms + rope + assemble


def latent_bytes(cfg: Config, layout: Layout) -> float:
    """b s (r + d_r) c: the latents of a micro batch's whole sequences, what one all-gather assembles on every tp rank
    (the heads' keys and values would be b s a (d_qk + d_v) / t c); a ring message is 1/cp of it."""
    r, d_r = widths(cfg)[1], widths(cfg)[3]
    return layout.micro_batch_size * cfg.model.seq_len * (r + d_r) * dtype_bytes(cfg)


def working_bytes(cfg: Config, layout: Layout) -> float:
    """The cp attention's working set of one MLA layer beside what it saves, per tp rank, at its peak (backward,
    all-gather): the gathered latents (cp x a rank's), the whole sequence's expanded keys and values (H (d_qk + d_v)
    per token), their fp32 gradients in rank order, and the latent's fp32 gradient; the ring's: two steps' latents,
    one block's expanded keys and values and their gradients, the latent's partial sums (three, fp32)."""
    c, t, cp, b = dtype_bytes(cfg), layout.tp, layout.cp, layout.micro_batch_size
    r_q, r, d_n, d_r, d_v, d_qk = widths(cfg)
    s, heads = cfg.model.seq_len, cfg.model.n_heads / t
    kv_width = heads * (d_qk + d_v)
    if str(cfg.context.attention) == "ring":
        per_block = b * s / cp
        return per_block * (2 * (r + d_r) * c + kv_width * (c + 4) + 3 * (r + d_r) * 4)
    return b * s * ((r + d_r) * (c + 4) + kv_width * (c + 4))
