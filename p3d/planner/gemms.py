"""The matrix multiplies of a block and the time of each one from its shape (docs/planner.md, "The GEMM model").

A GEMM ``(m x k) @ (k x n)``, ``count`` of them in one batched call (attention: micro batch x local heads; a causal
mask that skips half the tiles: half the count). On a GPU (a device preset with ``sms``) its time is the longer of
its compute and its memory traffic (the roofline):

    compute   tiles = ceil(m / TM) ceil(n / TN) count           one TM x TN output tile per SM at a time
              waves = ceil(tiles / SMs)                          the last wave takes a whole tile time, however full
              t = waves x SMs x 2 TM TN (k + k0) / (peak x e)    a tile: its k-loop plus k0 steps of fixed cost
    memory    c (m k + k n + m n) count bytes / (HBM x 0.8)      operands read and the output written once

of the tile shapes 256x128, 128x256 and 128x128 the fastest (cuBLAS's heuristics choose among such; a fused attention
kernel sizes its tiles to the head). Two constants per device generation are fitted on published runs
(p3d/config/devices.py): e, the fraction of peak a large, well-shaped GEMM reaches, and k0, a tile's prologue and
epilogue in k-steps, which makes a GEMM with a short reduction (unfused attention's k = head dim, a tp-split
projection) slower per FLOP than a long one. Attention's GEMMs keep their operands on chip or count them elsewhere
(``io=False``): their bytes are the attention's own memory-bound term in p3d.planner.step_time. A flash kernel is
timed as one GEMM whose reduction runs over the keys (``block_gemms``): its fixed cost is paid once per tile of
queries, not once per head dim.

The backward of ``y = x W`` (x: m x k, W: k x n) is two GEMMs: dx = dy W^T (m x n @ n x k) and dW = x^T dy
(k x m @ m x n), ``Gemm.grads``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from p3d.config.schema import Arch, Config
from p3d.layout.geometry import expert_ffn_size, head_dims, is_mla, is_moe_layer, moe_layers, padded_vocab, qk_head_dim
from p3d.planner import context, float8, mla
from p3d.planner.shapes import Layout

# output tiles (rows x columns) a GEMM is cut into; the fastest for each shape is taken
TILES = ((256, 128), (128, 256), (128, 128))


@dataclass(frozen=True, slots=True)
class Gemm:
    m: float
    n: float
    k: float
    count: float = 1.0  # GEMMs of this shape in one call (batched), or the share of their tiles a causal mask keeps
    io: bool = True  # operands streamed through HBM (False: on chip, inside a fused attention kernel)
    fp8: int = 0  # train.fp8 (p3d.planner.float8): 0 bf16, 1 float8 forward and backward, 2 weight gradient in bf16

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count

    def grads(self) -> tuple[Gemm, Gemm]:
        """The backward's two GEMMs: the input gradient dy W^T and the weight gradient x^T dy."""
        wgrad = self.fp8 if self.fp8 == float8.FLOAT8 else float8.BF16
        return (
            Gemm(self.m, self.k, self.n, self.count, self.io, self.fp8 and float8.FLOAT8),
            Gemm(self.k, self.n, self.m, self.count, self.io, wgrad),
        )


@dataclass(frozen=True, slots=True)
class GemmDevice:
    """What the GEMM model needs of a GPU: dense peak (FLOP/s), SMs, the generation's fitted constants, the bytes/s
    memory-bound traffic reaches and the bytes of an element."""

    peak_flops: float
    sms: int
    efficiency: float  # e: fraction of peak of a large, well-shaped GEMM
    k_overhead: float  # k0: a tile's fixed cost, in k-steps
    hbm_bytes_s: float
    element_bytes: float
    float8_peak_flops: float | None = None  # the float8 peak (p3d.config.devices); None: float8 GEMMs at peak_flops


@functools.lru_cache(maxsize=65536)  # mesh=auto times the same few shapes for every candidate
def seconds(g: Gemm, dev: GemmDevice) -> float:
    """Seconds of ``g`` on ``dev``: the slower of its tiled compute and its bytes (module docstring)."""
    if g.count <= 0 or min(g.m, g.n, g.k) <= 0:
        return 0.0
    peak = dev.float8_peak_flops if g.fp8 and dev.float8_peak_flops else dev.peak_flops
    tile_rate = peak * dev.efficiency / dev.sms  # FLOP/s of one SM
    waves = (math.ceil(math.ceil(g.m / tm) * math.ceil(g.n / tn) * g.count / dev.sms) for tm, tn in TILES)
    compute = min(w * 2.0 * tm * tn for w, (tm, tn) in zip(waves, TILES)) * (g.k + dev.k_overhead) / tile_rate
    if not g.io:
        return compute
    operand_bytes = 1.0 if g.fp8 else dev.element_bytes  # float8 operands, the output in the run's dtype
    traffic = (operand_bytes * (g.m * g.k + g.k * g.n) + dev.element_bytes * g.m * g.n) * g.count / dev.hbm_bytes_s
    return max(compute, traffic)


def efficiency_of(gemms: list[Gemm], dev: GemmDevice) -> float:
    """The fraction of peak the GEMMs reach together: their FLOPs over their seconds at the device's peak."""
    total = sum(seconds(g, dev) for g in gemms)
    return sum(g.flops for g in gemms) / (total * dev.peak_flops) if total > 0 else 0.0


def block_gemms(cfg: Config, layout: Layout, moe: bool = False) -> dict[str, list[Gemm]]:
    """The forward GEMMs of one block per micro batch on one tp rank, by the collective ``plan.overlap_tp`` pairs them
    with (qkv, proj, fc1, fc2), and attention's own (``attn``: scores and values; ``attn_bwd``: its backward).

    M = b s / cp tokens (sequence parallelism gathers the b s rows before each column-parallel GEMM). Dense: q|k|v
    (M x (q + 2 kv)/t, k = h), the out-projection (M x h, k = q/t), gate|up or fc1 (M x 2f/t or f/t, k = h), down or
    fc2 (M x h, k = f/t). MoE (``moe``): the router (M x E, k = h), S shared experts as one SwiGLU of S f_e, and the
    E / ep local routed experts as one grouped call of M k ep / E rows each (balanced routing: every rank computes
    M k rows). Attention per (micro batch, local head): with flash attention (and with cp, whose attention is
    flash-like) one fused kernel, its tiles of queries looping over the keys (s/cp x hd, k = 2 s: the scores' and the
    values' products per key step), half the tiles under the causal mask, and a backward whose tiles of keys loop over
    the queries (s x hd, k = 5 s/cp: the scores again, dV, dP, dQ, dK); without, the scores (s/cp x s, k = hd) and
    values (s/cp x hd, k = s) as batched GEMMs, and four of those sizes backward."""
    m = cfg.model
    b, s, t = layout.micro_batch_size, context.local_tokens(cfg, layout), layout.tp
    h, a = m.hidden_size, m.n_heads
    q, kv = head_dims(m)
    rows = b * s
    swiglu = m.arch == Arch.llama
    dense8, experts8 = float8.dense_kind(cfg), float8.experts_kind(cfg)  # train.fp8 (p3d.planner.float8)
    out = {
        "qkv": [Gemm(rows, (q + 2 * kv) / t, h, fp8=float8.fits(dense8, h, (q + 2 * kv) / t))],
        "proj": [Gemm(rows, h, q / t, fp8=float8.fits(dense8, h, q / t))],
    }
    if is_mla(m):  # MLA's projections (p3d.planner.mla): the replicated down-projections stay bf16
        out["qkv"] = [
            Gemm(m_rows, n, k, fp8=float8.fits(dense8, k, n) if split else float8.BF16)
            for m_rows, n, k, split in mla.projections(cfg, layout, rows)
        ]
        width = a / t * mla.widths(cfg)[4]
        out["proj"] = [Gemm(rows, h, width, fp8=float8.fits(dense8, h, width))]
    layer = moe_layers(m)[0] if moe else 0
    if is_moe_layer(m, layer):
        assert m.moe is not None
        f_e, e, shared = expert_ffn_size(m), m.moe.n_experts, m.moe.n_shared_experts
        local, per_expert = e / layout.ep, rows * m.moe.top_k * layout.ep / e
        out["fc1"] = [Gemm(rows, e, h), Gemm(per_expert, 2 * f_e / t, h, local, fp8=experts8)]
        out["fc2"] = [Gemm(per_expert, h, f_e / t, local, fp8=experts8)]
        if shared:
            out["fc1"].append(Gemm(rows, 2 * shared * f_e / t, h))
            out["fc2"].append(Gemm(rows, h, shared * f_e / t))
    else:
        f = m.ffn_hidden_size
        width = (2 if swiglu else 1) * f / t
        out["fc1"] = [Gemm(rows, width, h, fp8=float8.fits(dense8, h, width))]
        out["fc2"] = [Gemm(rows, h, f / t, fp8=float8.fits(dense8, h, f / t))]
    flash = cfg.plan.flash_attention or layout.cp > 1 or is_mla(m)
    hd, heads = (qk_head_dim(m) if is_mla(m) else q / a), b * a / t  # MLA: v padded to d_qk for the flash kernel
    s_q, s_kv = s, m.seq_len
    if flash:  # one kernel: a tile of 128 queries loops over the keys, both products per step; half the tiles causal
        out["attn"] = [Gemm(s_q, hd, 2 * s_kv, heads / 2, io=False)]
        # the backward: a tile of keys loops over the queries: the scores again, dV, dP, dQ and dK
        out["attn_bwd"] = [Gemm(s_kv, hd, 5 * s_q, heads / 2, io=False)]
        return out
    scores, values = Gemm(s_q, s_kv, hd, heads, io=False), Gemm(s_q, hd, s_kv, heads, io=False)
    out["attn"] = [scores, values]
    # dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q
    out["attn_bwd"] = [Gemm(s_kv, hd, s_q, heads, io=False), scores, values, Gemm(s_kv, hd, s_q, heads, io=False)]
    return out


def head_gemm(cfg: Config, layout: Layout) -> Gemm:
    """The output head's forward GEMM per micro batch on one tp rank: b s / cp tokens x V_pad / t, k = h."""
    m = cfg.model
    rows = layout.micro_batch_size * context.local_tokens(cfg, layout)
    return Gemm(rows, padded_vocab(m.vocab_size, layout.tp) / layout.tp, m.hidden_size)
