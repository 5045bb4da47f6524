"""The single-process reference: the ``to_sequential`` twin trained by a plain PyTorch loop.

Same init (the seeded master weights), same data (the global sample order), torch's AdamW,
``clip_grad_norm_`` and the same schedule. Every mesh must reproduce its per-step loss and
gradient norm (tests/e2e/test_parity.py), and with ``train.eval_every`` its ``val_loss`` (the same held-out
batches, :func:`p3d.data.loader.validation_batches`); bench/overhead.py times it against p3d.
"""

from __future__ import annotations

import time
from collections.abc import Collection

import torch

from p3d.data.loader import global_batches, validation_batches
from p3d.layout.geometry import moe_layers, padded_vocab
from p3d.model.moe import moe_blocks, set_micro_batches
from p3d.parallel.experts.balance import metrics as moe_metrics
from p3d.parallel.experts.balance import step_figures, update_expert_bias
from p3d.parallel.pipeline.specs import to_sequential
from p3d.train.optim import build_optimizer


def val_loss(model, batches: list[torch.Tensor], micro_batch_size: int) -> float:
    """Mean held-out loss as the pipeline's eval_batch gives it: each batch the mean of its micro batches."""
    model.eval()
    with torch.no_grad():
        per_batch = []
        for batch in batches:
            chunks = batch.split(micro_batch_size)
            per_batch.append(sum(model.loss(c[:, :-1], c[:, 1:]).item() for c in chunks) / len(chunks))
    model.train()
    return sum(per_batch) / len(per_batch)


@torch.no_grad()
def clip_exactly(params, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ (scale by max_norm / (norm + 1e-6) when above max_norm), with the norm's
    squares summed in fp64: torch's fp32 norm of one large tensor loses digits (2e-4 relative on an
    8192 x 64 head's gradient here), more than the 1e-5 the meshes are held to."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt()
    if max_norm > 0:
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return norm


def reference_run(
    cfg,
    steps: int | None = None,
    batches=None,
    discard: Collection[int] = (),
    bias_rate_from: tuple[int, float] | None = None,
) -> list[dict]:
    """Per-step {step, loss, grad_norm, lr, step_time_s} of the unsharded model, with val_loss at the steps
    p3d-train evaluates (``train.eval_every``). The steps in ``discard`` are the ones a run's step gate discarded
    (p3d.train.faults: a skipped non-finite step or loss spike): their loss and gradient norm are computed, and
    nothing changes: no update, no LR step, no move of the routers' selection biases. ``bias_rate_from`` (step,
    rate): from that step on the selection biases move at ``rate``, as in a run resumed there with that
    ``model.moe.bias_update_rate``."""
    torch.manual_seed(cfg.train.seed)
    model = to_sequential(cfg.model, padded_vocab(cfg.model.vocab_size, 1), cfg.train.seed)
    if cfg.model.init_from:  # the HF weights, as the workers load them (p3d.hf.load)
        from p3d.hf.load import load_into
        from p3d.parallel.mesh import Mesh

        load_into(model, cfg.model.init_from, cfg.model, Mesh(tp=1, pp=1, dp=1), twin=True)
    opt, sched = build_optimizer(model, cfg.train)
    batches = batches or global_batches(cfg.data, cfg.model.seq_len, cfg.schedule.global_batch_size, cfg.train.seed)
    mbs = cfg.schedule.micro_batch_size
    gbs = cfg.schedule.global_batch_size
    blocks = moe_blocks(model)
    set_micro_batches(model, gbs // mbs)
    every = cfg.train.eval_every
    val = validation_batches(cfg.data, cfg.model.seq_len, gbs, cfg.train.eval_batches) if every > 0 else []
    out = []
    for step in range(1, (steps or cfg.train.steps) + 1):
        batch = next(batches)
        lr = opt.param_groups[0]["lr"]
        t0 = time.perf_counter()
        chunks = batch.split(mbs)
        total = 0.0
        for chunk in chunks:
            loss = model.loss(chunk[:, :-1], chunk[:, 1:]) / len(chunks)
            loss.backward()
            total += loss.item()
        grad_norm = clip_exactly(model.parameters(), cfg.train.grad_clip)
        if step not in discard:
            opt.step()
            sched.step()
        opt.zero_grad(set_to_none=True)
        out.append(
            {
                "step": step,
                "loss": total,
                "grad_norm": float(grad_norm),
                "lr": lr,
                "step_time_s": time.perf_counter() - t0,
            }
        )
        if blocks:  # the step's routing figures; aux-loss-free balancing moves the selection biases
            assert cfg.model.moe is not None
            figures = step_figures(blocks, len(moe_layers(cfg.model)), cfg.model.moe.n_experts)
            rate = cfg.model.moe.bias_update_rate
            if bias_rate_from is not None and step >= bias_rate_from[0]:
                rate = bias_rate_from[1]
            if step not in discard:
                update_expert_bias(blocks, figures, rate)
            out[-1].update(moe_metrics(figures))
        if val and (step % every == 0 or step == cfg.train.steps):
            out[-1]["val_loss"] = val_loss(model, val, mbs)
    return out
