"""Per-step metrics: one JSON object per optimizer step in ``<run.dir>/metrics.jsonl`` and a console line.

Written by one rank only (last stage, dp 0, tp 0), where the loss is known.
"""
from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

from p3d.flops import model_flops_per_token

METRICS_NAME = "metrics.jsonl"


def peak_rss_gb() -> float:
    """Peak resident memory of this process in GB (1e9 bytes; ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


class MetricsLogger:
    def __init__(self, run_dir: str | Path, cfg, plan, stream=None):
        self.path = Path(run_dir) / METRICS_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w", buffering=1)  # resume (durable runs) will append
        self.cfg, self.plan = cfg, plan
        self.stream = stream or sys.stdout
        self.flops_per_step = model_flops_per_token(cfg.model) * plan.tokens_per_step

    def log(self, step: int, loss: float, lr: float, grad_norm: float, step_time_s: float, **extra) -> dict:
        tokens_per_s = self.plan.tokens_per_step / step_time_s
        tflops_per_device = self.flops_per_step / step_time_s / self.plan.world_size / 1e12
        record = {
            "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s, "step_time_s": step_time_s,
            "tflops_per_device": tflops_per_device, "mfu": tflops_per_device / self.cfg.cluster.peak_tflops,
            "peak_mem_gb": peak_rss_gb(), **extra,
        }
        self._file.write(json.dumps(record) + "\n")
        if step % self.cfg.logger.log_every == 0 or step == self.cfg.train.steps:
            print(f"step {step:>5}/{self.cfg.train.steps} | loss {loss:.4f} | lr {lr:.2e} | grad_norm {grad_norm:.3f} "
                  f"| tok/s {tokens_per_s:,.0f} | step {step_time_s:.3f}s", file=self.stream, flush=True)
        return record

    def close(self):
        self._file.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / METRICS_NAME
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
