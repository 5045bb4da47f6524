"""Per-step metrics: ``<run.dir>/metrics.jsonl`` (one JSON object per optimizer step), the console
(a progress bar with ETA on a terminal, else a line per step) and, with ``logger=wandb``, W&B.

Written by one rank only (last stage, dp 0, tp 0), where the loss is known. Figures:
- tokens_per_s: global batch tokens / step wall time.
- tflops_per_device: model FLOPs per step (p3d.model.geometry: 6 x matmul parameters + attention, no
  recompute) / step time / devices; mfu: that over cluster.peak_tflops.
- peak_mem_gb: the largest, over all ranks, of CUDA max-allocated (GPU) or peak RSS (CPU), in GB.
- bubble: measured share of the step the stages spend blocked on pipeline neighbours (mean over
  ranks, p3d.train.timing); bubble_theory: the same idle share in theory, (p-1)/(m+p-1)
  (p3d.model.geometry.pipeline_bubble, the number p3d-plan reports as bubble).
"""
from __future__ import annotations

import json
import os
import resource
import secrets
import sys
from pathlib import Path

from p3d.model.geometry import model_flops_per_token

METRICS_NAME = "metrics.jsonl"


def peak_memory_gb() -> float:
    """Peak memory of this process in GB (1e9 bytes): CUDA max-allocated, else peak RSS."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is KiB on Linux


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of a run directory's metrics.jsonl (or of a given .jsonl file)."""
    path = Path(run_dir)
    path = path / METRICS_NAME if path.is_dir() else path
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class WandbSink:
    """W&B run on the logging rank: online with an API key, else offline files under run.dir (``wandb sync``)."""

    def __init__(self, run_dir: Path, cfg, spec: dict):
        import wandb

        mode = cfg.logger.mode
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") or _netrc_has_wandb() else "offline"
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(6)  # resume: same W&B run
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=cfg.logger.project, entity=cfg.logger.entity, group=cfg.logger.group,
                              name=run_dir.name, id=run_id, resume="allow", dir=str(run_dir), mode=mode,
                              config=spec)
        self.mode = mode

    def log(self, record: dict) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def _netrc_has_wandb() -> bool:
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class MetricsLogger:
    def __init__(self, run_dir: str | Path, cfg, plan, start_step: int = 0, spec: dict | None = None, stream=None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_NAME
        self.cfg, self.plan = cfg, plan
        self.stream = stream or sys.stdout
        self.flops_per_step = model_flops_per_token(cfg.model) * plan.tokens_per_step
        kept = [r for r in read_metrics(self.run_dir) if r["step"] <= start_step] if start_step and self.path.exists() \
            else []  # a resumed run redoes the steps after its checkpoint
        self._file = open(self.path, "w", buffering=1)
        for r in kept:
            self._file.write(json.dumps(r) + "\n")
        self.wandb = WandbSink(self.run_dir, cfg, spec or {}) if cfg.logger.name == "wandb" else None
        progress = cfg.logger.progress
        self.bar = None
        if progress == "bar" or (progress == "auto" and os.environ.get("P3D_TTY") == "1"):
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.steps, initial=start_step, file=self.stream, unit="step",
                            dynamic_ncols=True, desc="train")

    def log(self, step: int, loss: float, lr: float, grad_norm: float, step_time_s: float, **extra) -> dict:
        tflops = self.flops_per_step / step_time_s / self.plan.world_size / 1e12
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": self.plan.tokens_per_step / step_time_s, "step_time_s": step_time_s,
                  "tflops_per_device": tflops, "mfu": tflops / self.cfg.cluster.peak_tflops, **extra}
        self._file.write(json.dumps(record) + "\n")
        if self.wandb:
            self.wandb.log(record)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", gnorm=f"{grad_norm:.3f}",
                                 tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
            self.bar.update(1)
        elif step % self.cfg.logger.log_every == 0 or step == self.cfg.train.steps:
            self.print(f"step {step:>5}/{self.cfg.train.steps} | loss {loss:.4f} | lr {lr:.2e} | grad_norm "
                       f"{grad_norm:.3f} | tok/s {record['tokens_per_s']:,.0f} | step {step_time_s:.3f}s"
                       + (f" | val_loss {extra['val_loss']:.4f}" if "val_loss" in extra else ""))
        return record

    def print(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self._file.close()
        if self.wandb:
            self.wandb.close()
