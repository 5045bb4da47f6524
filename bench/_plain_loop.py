"""The plain PyTorch loop p3d's step is measured against (bench/overhead.py plain and breakdown): the same model,
data, micro batching and optimizer as ``p3d-train mesh=single``, with nothing of p3d's executors around them."""

from __future__ import annotations

import contextlib
import json
import time

from bench._common import replica_batches


class PlainLoop:
    """The plain PyTorch side: the model built by ``p3d.pipeline.specs.to_sequential`` (the pipeline's
    single-process twin, same seeded master weights), torch.optim.AdamW + LambdaLR with p3d's groups and schedule,
    the micro batches of the same ``p3d.data.loader.micro_batches`` iterator. A step: fetch every micro batch,
    forward/backward each (loss / micro batches), ``clip_grad_norm_``, ``AdamW.step``, ``zero_grad``, LR step;
    ``phase(name)`` (a context manager) times its parts."""

    def __init__(self, cfg, plan):
        import torch

        from p3d.layout.geometry import padded_vocab
        from p3d.pipeline.specs import to_sequential
        from p3d.train.optim import build_optimizer

        torch.manual_seed(cfg.train.seed)
        self.model = to_sequential(cfg.model, padded_vocab(cfg.model.vocab_size, 1), cfg.train.seed)
        self.model.train()
        self.opt, self.sched = build_optimizer(self.model, cfg.train)
        self.data = replica_batches(cfg)
        self.n_micro = plan.micro_batches
        self.max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
        self.params = list(self.model.parameters())

    def step(self, phase=lambda name: contextlib.nullcontext()):
        """(the step's loss, its gradient norm), both tensors."""
        import torch

        total = None
        for _ in range(self.n_micro):
            with phase("plain LoadMicroBatch"):
                inputs, labels = next(self.data)
            with phase("plain ForwardPass"):
                loss = self.model.loss(inputs, labels) / self.n_micro
            with phase("plain BackwardPass"):
                loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        with phase("plain OptimizerStep (clip+AdamW+zero_grad+sched)"):
            with phase("plain   clip_grad_norm_"):
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.sched.step()
        return total, grad_norm


def plain_worker(spec_path: str, out_path: str, threads: int) -> None:
    """The plain side's process: reads the run spec, trains, writes a record per step as p3d's metrics.jsonl does."""
    import torch

    torch.set_num_threads(threads)
    from p3d.rundir.spec import read_spec

    cfg, plan = read_spec(spec_path)
    loop = PlainLoop(cfg, plan)
    with open(out_path, "w", buffering=1) as out:
        for step in range(1, cfg.train.steps + 1):
            lr = loop.opt.param_groups[0]["lr"]
            t0 = time.perf_counter()
            total, grad_norm = loop.step()
            step_time = time.perf_counter() - t0
            out.write(
                json.dumps(
                    {
                        "step": step,
                        "loss": float(total),
                        "grad_norm": float(grad_norm),
                        "lr": lr,
                        "step_time_s": step_time,
                        "tokens_per_s": plan.tokens_per_step / step_time,
                    }
                )
                + "\n"
            )
            print(f"plain step {step}/{cfg.train.steps} loss {float(total):.4f} step {step_time:.3f}s", flush=True)
