"""The layer-level steps of ``make gpu-check`` (bench/gpu_check.py, issue 51): the parts of p3d that only the torch
executor runs, each in bf16 on the device against its fp32 twin on the host's CPU.

  fsdp2: a whole ``model=tiny`` chunk under FSDP2 (``fully_shard`` per block, ZeRO-3: reshard after forward) on a
         one-rank device mesh (NCCL on a GPU), bf16 mixed precision: one forward and backward of a batch, the loss
         and every gradient (gathered) against the unsharded chunk in fp32 on the CPU;
  moe:   one ``model=moe_tiny`` MoE feed-forward (router, routed and shared experts, the dispatch) under bf16
         autocast: the output and the input's and weights' gradients against the fp32 layer on the CPU;
  cp:    context-parallel attention, every rank of cp = 2 in turn on the one device (``one_rank_attention``: the
         per-chunk fused kernels and their log-sum-exp merge that each rank runs between its collectives), bf16,
         llama3_2_1b's heads (32 over 8, head dim 64) at 2k tokens: the output and q/k/v gradients against SDPA on
         the whole sequence in fp32 on the CPU, and the attention kernels the device ran;
  mla:   one DeepSeek-V3 block (multi-head latent attention at V3's head dims, 192 for q and k, 128 for v, padded
         for the flash kernel; the grouped sigmoid router) in bf16 against its fp32 twin on the CPU, and the kernels.

Each returns its figures: relative errors ``|got - want| / |want|`` (norms over the whole tensor or model). Without
a GPU (gpu-check's dry mode) the same steps run with the CPU as the device, in bf16 autocast: that checks the code
path, and its figures are the CPU's bf16 error.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator

import torch

BF16_RTOL = 0.05  # relative error of bf16 against fp32, norms over the tensor (the CPU's bf16 measured below 0.02)
SEED = 1234


def typed_run(*overrides: str):
    """(Config, RunPlan) as p3d-train prepares them (Hydra's compose over the shipped groups)."""
    from hydra import compose, initialize_config_dir

    from p3d.config.schema import register_configs
    from p3d.config.shipped import conf_dir
    from p3d.launch.check import prepare

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        node = compose("config", overrides=["run.dir=/tmp/p3d-gpu-layers", *overrides])
    return prepare(node)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[None]:
    """A world of one process (NCCL on a GPU, gloo on CPU), for the parts that want a process group."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=120)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def fsdp2(device: torch.device) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from p3d.config.schema import DType
    from p3d.model.llama import TransformerBlock
    from p3d.parallel.mesh import Mesh
    from p3d.parallel.zero.fsdp import local, mixed_precision, shard_chunk
    from p3d.pipeline.chunks import ChunkModule
    from p3d.pipeline.specs import VocabParallelLoss, layer_specs_of

    cfg, plan = typed_run("model=tiny", "mesh=single", "zero=stage3", "train.dtype=bf16")
    with one_rank_group(device):
        mesh = Mesh.from_plan(plan, 0).with_groups()
        specs = layer_specs_of(cfg, plan, mesh)
        want = ChunkModule(specs, 0, len(specs))  # fp32 on the CPU; the weights come from seeded masters
        got = ChunkModule(specs, 0, len(specs), autocast_dtype=torch.bfloat16).to(device)
        shard_chunk(got, init_device_mesh(device.type, (1,)), 3, TransformerBlock, mixed_precision(DType.bf16))
        loss = VocabParallelLoss(cfg.model, plan.padded_vocab_size, mesh)
        g = torch.Generator().manual_seed(SEED)
        tokens = torch.randint(cfg.model.vocab_size, (2, cfg.model.seq_len + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        want_loss = loss(want(x), y)
        want_loss.backward()
        got_loss = loss(got(x.to(device)), y.to(device))
        got_loss.backward()
        grads = dict(got.named_parameters())
        worst = max(relative(local(grads[n].grad), p.grad) for n, p in want.named_parameters())
        figures = {"loss_rel": relative(got_loss, want_loss), "worst_grad_rel": worst, "layers": len(specs)}
        sharded = all(type(p).__name__ == "DTensor" for p in got.parameters())
    if not sharded:
        raise RuntimeError("fsdp2: the chunk's parameters are not FSDP2's DTensors")
    return figures


def moe(device: torch.device) -> dict:
    from p3d.model.moe import MoEFeedForward
    from p3d.parallel.mesh import Mesh

    cfg, _ = typed_run("model=moe_tiny", "mesh=single")
    layer = cfg.model.moe.first_dense_layers  # the first MoE block
    one = Mesh(tp=1, pp=1, dp=1)
    want = MoEFeedForward(cfg.model, one, layer, SEED)
    got = MoEFeedForward(cfg.model, one, layer, SEED).to(device)
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(2, 64, cfg.model.hidden_size, generator=g)
    dy = torch.randn(2, 64, cfg.model.hidden_size, generator=g)
    x_want = x.clone().requires_grad_()
    y_want = want(x_want)
    (y_want * dy).sum().backward()
    x_got = x.to(device).requires_grad_()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y_got = got(x_got)
    (y_got.float() * dy.to(device)).sum().backward()
    grads = dict(got.named_parameters())
    worst = max(relative(grads[n].grad, p.grad) for n, p in want.named_parameters() if p.grad is not None)
    return {
        "out_rel": relative(y_got, y_want),
        "input_grad_rel": relative(x_got.grad, x_want.grad),
        "worst_weight_grad_rel": worst,
    }


def cp(device: torch.device, cp: int = 2) -> dict:
    import torch.nn.functional as F

    from p3d.parallel.context.attention import one_rank_attention
    from p3d.parallel.context.chunks import take_local, to_global_order

    s = 2048 if device.type == "cuda" else 512  # the dry mode's CPU run checks the path, at a quarter of the length
    g = torch.Generator().manual_seed(SEED)
    q, k, v, up = (torch.randn(1, n, s, 64, generator=g) for n in (32, 8, 8, 32))
    want_q, want_k, want_v = (t.clone().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(want_q, want_k, want_v, is_causal=True, enable_gqa=True)
    want.backward(up)
    outs, dqs = [], []
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    kernels: set[str] = set()
    for rank in range(cp):  # what each cp rank computes between its all-gather and its reduce-scatter
        q_r = take_local(q, cp, rank, dim=2).to(device, torch.bfloat16).requires_grad_()
        k_all, v_all = (t.to(device, torch.bfloat16).requires_grad_() for t in (k, v))
        with torch.profiler.profile() as prof:
            out = one_rank_attention(q_r, k_all, v_all, cp, rank)
            out.backward(take_local(up, cp, rank, dim=2).to(device, torch.bfloat16))
        fused = ("flash", "efficient", "cudnn")
        kernels |= {e.name for e in prof.events() if "attention" in e.name and any(f in e.name for f in fused)}
        outs.append(out.float().cpu())
        dqs.append(q_r.grad.float().cpu())
        dk += k_all.grad.float().cpu()
        dv += v_all.grad.float().cpu()
    return {
        "out_rel": relative(to_global_order(outs, dim=2), want),
        "dq_rel": relative(to_global_order(dqs, dim=2), want_q.grad),
        "dk_rel": relative(dk, want_k.grad),
        "dv_rel": relative(dv, want_v.grad),
        "kernels": ", ".join(sorted(kernels))[:200] or "no fused attention kernel",
    }


def mla(device: torch.device) -> dict:
    """One DeepSeek-V3 block, multi-head latent attention at V3's head dims (d_qk 128 + 64, d_v 128: v padded for
    the flash kernel, p3d.model.mla) and the grouped sigmoid router with its selection biases (8 experts in 4 groups,
    top-2 of the best 2), under bf16 autocast on the device against the same block in fp32 on the CPU: the output,
    the input's and the weights' gradients, and the attention kernels the device ran."""
    from p3d.model.llama import TransformerBlock
    from p3d.parallel.mesh import Mesh

    s = 2048 if device.type == "cuda" else 256  # the dry mode's CPU run checks the path
    v3_heads = ("model.mla.qk_nope_head_dim=128", "model.mla.qk_rope_head_dim=64", "model.mla.v_head_dim=128")
    cfg, _ = typed_run("model=deepseek_v3_tiny", "mesh=single", "model.hidden_size=512", "model.n_heads=8",
                       "model.n_kv_heads=8", "model.mla.q_lora_rank=256", "model.mla.kv_lora_rank=128", *v3_heads,
                       f"model.seq_len={s}")  # fmt: skip
    layer = cfg.model.moe.first_dense_layers  # an MoE block
    one = Mesh(tp=1, pp=1, dp=1)
    want = TransformerBlock(cfg.model, one, layer, SEED)
    got = TransformerBlock(cfg.model, one, layer, SEED).to(device)
    bias = torch.randn(cfg.model.moe.n_experts, generator=torch.Generator().manual_seed(SEED)) * 0.01
    want.mlp.router.expert_bias.copy_(bias), got.mlp.router.expert_bias.copy_(bias.to(device))
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(1, s, cfg.model.hidden_size, generator=g)
    dy = torch.randn(1, s, cfg.model.hidden_size, generator=g)
    x_want = x.clone().requires_grad_()
    y_want = want(x_want)
    (y_want * dy).sum().backward()
    x_got = x.to(device).requires_grad_()
    with torch.profiler.profile() as prof, torch.autocast(device.type, dtype=torch.bfloat16):
        y_got = got(x_got)
        (y_got.float() * dy.to(device)).sum().backward()
    grads = dict(got.named_parameters())
    worst = max(relative(grads[n].grad, p.grad) for n, p in want.named_parameters() if p.grad is not None)
    fused = ("flash", "efficient", "cudnn")
    kernels = {e.name for e in prof.events() if "attention" in e.name and any(f in e.name for f in fused)}
    if device.type == "cuda" and not any("flash" in k for k in kernels):
        raise RuntimeError(f"mla: the attention core did not run a flash kernel: {sorted(kernels)}")
    return {
        "out_rel": relative(y_got, y_want),
        "input_grad_rel": relative(x_got.grad, x_want.grad),
        "worst_weight_grad_rel": worst,
        "kernels": ", ".join(sorted(kernels))[:200] or "no fused attention kernel",
    }


STEPS = {"fsdp2": fsdp2, "moe": moe, "cp": cp, "mla": mla}


def check(name: str, device: torch.device) -> dict:
    """Run step ``name`` on ``device``; its figures, or RuntimeError when a relative error passes ``BF16_RTOL``."""
    figures = STEPS[name](device)
    over = {k: v for k, v in figures.items() if k.endswith("_rel") and v > BF16_RTOL}
    figures = {k: float(f"{v:.3g}") if isinstance(v, float) else v for k, v in figures.items()}
    if over:
        raise RuntimeError(f"{name}: bf16 on {device.type} off the fp32 CPU twin beyond {BF16_RTOL}: {over}")
    return figures
