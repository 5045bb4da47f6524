"""The Llama twin (p3d.model.llama, the sequential twin): its loss, its init (by seed and name, not by mesh), RoPE
tables built once."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from p3d.config.schema import ModelConfig
from p3d.parallel.mesh import Mesh
from p3d.parallel.pipeline.specs import build_layer_specs, to_sequential


def test_sequential_loss_is_plain_cross_entropy():
    cfg = ModelConfig()
    model = to_sequential(cfg, cfg.vocab_size, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    assert logits.shape == (2, 16, cfg.vocab_size)
    expected = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
    torch.testing.assert_close(model.loss(ids, ids), expected, rtol=1e-6, atol=1e-6)


def test_init_depends_on_seed_and_parameter_not_on_mesh():
    cfg = ModelConfig()
    a = dict(to_sequential(cfg, 512, seed=1).named_parameters())
    b = dict(to_sequential(cfg, 512, seed=1).named_parameters())
    c = dict(to_sequential(cfg, 512, seed=2).named_parameters())
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not torch.equal(a["layers.1.attn.wqkv.weight"], c["layers.1.attn.wqkv.weight"])
    assert not torch.equal(a["layers.1.attn.wqkv.weight"], a["layers.2.attn.wqkv.weight"])
    # tp=2 shards (built without any process group) slice the very same master weights
    for rank in range(2):
        specs = build_layer_specs(cfg, 512, Mesh(tp=2, pp=1, dp=1, rank=rank), seed=1)
        down = specs[2].build().mlp.w_down.weight  # block1
        torch.testing.assert_close(down, a["layers.2.mlp.w_down.weight"].chunk(2, dim=1)[rank])
        head = specs[-1].build().weight
        torch.testing.assert_close(head, a["layers.6.weight"].chunk(2, dim=0)[rank])


def test_rope_tables_are_built_once_and_equal_the_per_forward_ones():
    """Each attention holds cos/sin for positions 0..seq_len-1 as non-persistent buffers (issue 16):
    the same numbers the forward used to compute every call, in fp32 and rounded once to bf16, never
    in a state dict; a longer input than model.seq_len gets tables of its own length."""
    from p3d.model.attention import Attention
    from p3d.model.rope import rope_cos_sin

    cfg = ModelConfig()
    model = to_sequential(cfg, cfg.vocab_size, seed=3)
    attn = next(m for m in model.modules() if isinstance(m, Attention))
    cos, sin = rope_cos_sin(cfg.seq_len, attn.head_dim, cfg.rope_theta, None, "cpu", torch.float32)
    assert torch.equal(attn.rope_cos, cos) and torch.equal(attn.rope_sin, sin)
    assert not any("rope" in k for k in model.state_dict())
    assert torch.equal(
        attn.rope_cos.to(torch.bfloat16),
        rope_cos_sin(cfg.seq_len, attn.head_dim, cfg.rope_theta, None, "cpu", torch.bfloat16)[0],
    )
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 8), generator=torch.Generator().manual_seed(0))
    short = model(ids[:, : cfg.seq_len])
    longer = model(ids)  # positions past the table: computed for this call, the first seq_len ones unchanged
    torch.testing.assert_close(longer[:, : cfg.seq_len], short, rtol=0, atol=0)


def test_fp32_gqa_on_cuda_expands_kv_heads_for_the_efficient_kernel():
    """Issue 51: CUDA runs enable_gqa on the flash kernel only (fp16/bf16); fp32 GQA there gets its kv heads expanded
    (the efficient kernel takes fp32) instead of falling to the math kernel. Same attention, same gradients."""
    import torch.nn.functional as F

    from p3d.model.attention import kv_for_fused_kernel

    torch.manual_seed(0)
    q = torch.randn(2, 8, 16, 4, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 4, requires_grad=True) for _ in "kv")
    ek, ev, gqa = kv_for_fused_kernel(q, k, v, True, device_type="cuda")
    assert not gqa and ek.shape == v.shape[:1] + (8,) + v.shape[2:]
    out = F.scaled_dot_product_attention(q, ek, ev, is_causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)
    # bf16 on CUDA keeps enable_gqa (flash); CPU keeps it whatever the dtype
    assert kv_for_fused_kernel(q.bfloat16(), k, v, True, device_type="cuda")[2] is True
    assert kv_for_fused_kernel(q, k, v, True, device_type="cpu")[1] is v


def test_pyprojects_torch_bound_admits_no_torch_older_than_the_apis_read():
    """The lower bound of torch in pyproject.toml follows the newest API p3d relies on (compat.MIN_TORCH)."""
    import re
    from pathlib import Path

    from p3d.compat.pipelining_internals import MIN_TORCH

    text = (Path(__file__).resolve().parents[3] / "pyproject.toml").read_text()
    bound = re.search(r'"torch>=(\d+)\.(\d+)', text)
    assert bound, "pyproject.toml names no lower bound for torch"
    assert (int(bound[1]), int(bound[2])) >= MIN_TORCH
