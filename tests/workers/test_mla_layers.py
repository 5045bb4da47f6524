"""Multi-head latent attention sharded against the unsharded one (p3d.model.mla): tp2 with and without sequence
parallelism (W_qb, W_kvb split by heads, W_o by its input columns; W_qa, W_kva and the latents' norms replicated,
their gradients the same on every rank: summed over tp under SP), cp2 with the latent all-gathered or passed round
the ring (every rank expanding the keys and values it attends to with its W_kvb), and tp2 x cp2 with SP.

Each rank feeds its tokens (its cp chunks, its SP block of them) of the same inputs; its output and input gradient
must be the unsharded attention's at those tokens, and every weight gradient, summed over the cp ranks (dp's
gradient reduction sums them in training), its tp shard of the unsharded one's. The rotated part, DeepSeek's yarn
with mscale and its softmax scale are on; the latents' norm weights and all weights are off their init so that a
misplaced slice shows."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import run_distributed
from tests.helpers.tiers import with_slow
from tests.helpers.tp import SEED, TOL, same_inputs

S, H = 16, 24


def mla_config(q_lora_rank: int | None = 12):
    from p3d.config.options import AttentionType, RopeType
    from p3d.config.schema import MLAConfig, ModelConfig, RopeScaling

    yarn = RopeScaling(rope_type=RopeType.yarn, factor=4.0, original_max_position_embeddings=4, mscale=1.0,
                       mscale_all_dim=0.8)  # fmt: skip
    mla = MLAConfig(q_lora_rank=q_lora_rank, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=4)
    return ModelConfig(hidden_size=H, n_heads=4, n_kv_heads=4, n_layers=2, seq_len=S, attention=AttentionType.mla,
                       mla=mla, rope_scaling=yarn)  # fmt: skip


def _check(rank, world, tp, cp, sp, variant, q_lora_rank):
    from p3d.model.mla import MultiHeadLatentAttention
    from p3d.parallel.context.chunks import take_local
    from p3d.parallel.mesh import Mesh

    cfg = mla_config(q_lora_rank)
    mesh = Mesh(tp=tp, pp=1, dp=1, cp=cp, rank=rank).with_groups()
    full = MultiHeadLatentAttention(cfg, Mesh(tp=1, pp=1, dp=1), "block1.attn", SEED)
    shard = MultiHeadLatentAttention(cfg, mesh, "block1.attn", SEED, sequence_parallel=sp, cp_attention=variant)
    with torch.no_grad():  # the norms off their init, the same on both
        for name in ("q_a_norm", "kv_a_norm"):
            norm = getattr(full, name)
            if norm is not None:
                w = 1 + 0.3 * same_inputs(*norm.weight.shape) * (2 if name == "kv_a_norm" else 1)
                norm.weight.copy_(w), getattr(shard, name).weight.copy_(w)

    def mine(t):  # this rank's tokens: its cp chunks, its SP block of them
        t = take_local(t, cp, mesh.cp_rank)
        return t.chunk(tp, dim=1)[mesh.tp_rank].contiguous() if sp else t

    x_full = same_inputs(2, S, H).requires_grad_()
    g = torch.randn(2, S, H, generator=torch.Generator().manual_seed(5))
    y_full = full(x_full)
    (y_full * g).sum().backward()
    x = mine(x_full.detach()).requires_grad_()
    y = shard(x)
    torch.testing.assert_close(y, mine(y_full.detach()), **TOL)
    (y * mine(g)).sum().backward()
    torch.testing.assert_close(x.grad, mine(x_full.grad), **TOL)
    full_params = dict(full.named_parameters())
    for name, p in shard.named_parameters():
        grad = p.grad.clone()
        if cp > 1:
            dist.all_reduce(grad, group=mesh.cp_group)
        fg = full_params[name].grad
        if name in ("wq_b.weight", "wq.weight", "wkv_b.weight"):  # split by heads: whole heads' rows
            expected = fg.chunk(tp, dim=0)[mesh.tp_rank]
        elif name == "wo.weight":
            expected = fg.chunk(tp, dim=1)[mesh.tp_rank]
        else:  # replicated: W_qa, W_kva, the latents' norms
            expected = fg
        torch.testing.assert_close(grad, expected, **TOL, msg=lambda m: f"{name}: {m}")  # noqa: B023
    assert {n for n, _ in shard.named_parameters()} == set(full_params)


CASES = {
    "tp2": (2, 1, False, "allgather", 12),
    "tp2-sp": (2, 1, True, "allgather", 12),
    "tp2-sp-no-q-compression": (2, 1, True, "allgather", None),
    "cp2-allgather": (1, 2, False, "allgather", 12),
    "cp2-ring": (1, 2, False, "ring", 12),
    "cp4-ring": (1, 4, False, "ring", 12),
    "tp2-cp2-sp": (2, 2, True, "allgather", 12),
    "tp2-cp2-ring": (2, 2, False, "ring", None),
}
# make test: tp2 with SP and the all-gathered latent on cp2; the rest the slow tier's
SLOW = ("tp2", "tp2-sp-no-q-compression", "cp2-ring", "cp4-ring", "tp2-cp2-sp", "tp2-cp2-ring")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", with_slow(CASES, SLOW))
def test_mla_matches_unsharded(case):
    tp, cp, sp, variant, q_lora_rank = CASES[case]
    run_distributed(_check, tp * cp, tp, cp, sp, variant, q_lora_rank, timeout=150)
