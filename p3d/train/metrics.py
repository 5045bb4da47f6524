"""Per-step metrics: ``<run.dir>/metrics.jsonl`` (one JSON object per optimizer step), the console
(a progress bar with ETA on a terminal, else a line per step) and, with ``logger=wandb``, W&B: its mode is
``logger.mode`` when set, else ``WANDB_MODE``, else online with an API key and offline without; a W&B
failure (at start, while logging, at the end) is reported once and training goes on without it.

Written by one rank only (last stage, dp 0, tp 0), where the loss is known. Figures:
- tokens_per_s: global batch tokens / step wall time.
- tflops_per_device: model FLOPs per step (p3d.layout.geometry: 6 x matmul parameters + attention, no
  recompute) / step time / devices; mfu: that over cluster.peak_tflops.
- peak_mem_gb: the largest, over all ranks, of CUDA max-allocated (GPU) or peak RSS (CPU), in GB. The CPU figure
  holds the heap's freed blocks under train.host_memory=keep (the default); =release makes it the live peak
  (p3d.train.host_memory).
- bubble: measured share of the step the stages spend blocked on pipeline neighbours (mean over
  ranks, p3d.train.timing); bubble_theory: the same idle share in theory, (p-1)/(m+p-1)
  (p3d.layout.geometry.pipeline_bubble, the number p3d-plan reports as bubble).
- dp_comm_s / dp_comm_exposed_s: the data-parallel collectives' own seconds in the step (the union of their
  issue-to-completion intervals) and the seconds the step was blocked in them, compute not hiding them (mean over
  ranks, p3d.train.comm_clocks): the dp reduction, and ZeRO's gathers and reduce-scatters. The same pair for tp,
  pp (its p2p waits), cp and ep where they run (docs/overlap.md); 1 - exposed / own is the overlap ratio.
- stage_compute_s: forward + backward seconds of the step per pipeline stage (mean over its ranks): a
  measured bubble above theory with unequal stage figures is imbalance, not fill and drain.
- MoE models: moe_aux_loss, moe_aux_loss_layers, moe_load_imbalance, moe_dropped (p3d.parallel.experts.balance);
  loss stays the language-model loss. tflops_per_device and mfu count the active parameters.
- layout_change (an elastic run, on the first step after a re-fit: p3d.jobs.elastic): the old and new layout, the
  nodes lost, the step resumed, steps_redone, and time_lost_s from the last step logged before the loss to the end
  of this step.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import sys
import time
from pathlib import Path
from typing import TextIO

from p3d.layout.geometry import model_flops_per_token
from p3d.rundir.files import METRICS, read_metrics
from p3d.rundir.spec import pending_layout_change


def peak_memory_gb() -> float:
    """Peak memory of this process in GB (1e9 bytes): CUDA max-allocated, else peak RSS."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is KiB on Linux


WANDB_MODES = {"online": "online", "offline": "offline", "disabled": "disabled", "dryrun": "offline", "run": "online"}


def wandb_mode(logger_mode: str, env=None) -> tuple[str, str]:
    """(mode, why): ``logger.mode`` when set (online, offline, disabled); with ``auto``, the ``WANDB_MODE``
    environment variable; without it online when an API key is known (WANDB_API_KEY, ~/.netrc), else offline."""
    env = os.environ if env is None else env
    if logger_mode != "auto":
        return str(logger_mode), f"logger.mode={logger_mode}"  # a plain str for wandb, not the Enum
    given = env.get("WANDB_MODE", "").strip().lower()
    if given in WANDB_MODES:
        return WANDB_MODES[given], f"WANDB_MODE={given}"
    if env.get("WANDB_API_KEY") or _netrc_has_wandb():
        return "online", "an API key"
    return "offline", "no API key"


class WandbSink:
    """W&B run on the logging rank, in ``mode`` (see :func:`wandb_mode`); offline files go under run.dir
    (``wandb sync``)."""

    def __init__(self, run_dir: Path, cfg, spec: dict, mode: str):
        import wandb

        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(6)  # resume: same W&B run
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=cfg.logger.project,
            entity=cfg.logger.entity,
            group=cfg.logger.group,
            name=run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            mode=mode,  # type: ignore[arg-type]  # online, offline or disabled (wandb_mode)
            config=spec,
        )
        self.mode = mode

    def log(self, record: dict) -> None:
        flat = {}
        for k, v in record.items():
            if isinstance(v, list):  # per-stage figures: one chart each (stage_compute_s/0, /1, ...)
                flat.update({f"{k}/{i}": x for i, x in enumerate(v)})
            elif k != "step":
                flat[k] = v
        self.run.log(flat, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def _netrc_has_wandb() -> bool:
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class ExpertFigures:
    """A run's MoE routing figures: each step, on every rank, the figures of every MoE layer summed over the world
    (one all-reduce), the selection biases moved (aux-loss-free balancing) unless the step's update was discarded,
    and the metrics they give."""

    def __init__(self, model_cfg, module):
        from p3d.layout.geometry import moe_layers
        from p3d.model.moe import moe_blocks

        self.moe = model_cfg.moe
        self.blocks, self.n_layers = moe_blocks(module), len(moe_layers(model_cfg))

    def after_step(self, device, discarded: bool) -> dict:
        """The step's routing metrics. ``discarded``: the step gate threw the update away (train.on_nonfinite=skip,
        train.on_spike=skip), so the biases stay as they were too: a discarded step changes no state at all."""
        from p3d.parallel.experts.balance import metrics, step_figures, update_expert_bias

        figures = step_figures(self.blocks, self.n_layers, self.moe.n_experts, device)
        if not discarded:
            update_expert_bias(self.blocks, figures, self.moe.bias_update_rate)
        return metrics(figures)


class MetricsLogger:
    def __init__(self, run_dir: str | Path, cfg, plan, start_step: int = 0, spec: dict | None = None, stream=None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS
        self.cfg, self.plan = cfg, plan
        self.stream = stream or sys.stdout
        self.flops_per_step = model_flops_per_token(cfg.model) * plan.tokens_per_step
        kept = (
            [r for r in read_metrics(self.run_dir) if r["step"] <= start_step]
            if start_step and self.path.exists()
            else []
        )  # a resumed run redoes the steps after its checkpoint
        self._kept = kept
        # an elastic run's layout change (p3d.jobs.elastic), recorded with the first step of this launch
        self._layout_change = pending_layout_change(self.run_dir, start_step)
        self._file: TextIO | None = None  # opened at the first step: a run that never logs one leaves no metrics.jsonl
        progress = cfg.logger.progress
        self.bar = None
        if progress == "bar" or (progress == "auto" and os.environ.get("P3D_TTY") == "1"):
            from tqdm import tqdm

            self.bar = tqdm(
                total=cfg.train.steps,
                initial=start_step,
                file=self.stream,
                unit="step",
                dynamic_ncols=True,
                desc="train",
            )
        self.wandb: WandbSink | None = None
        if cfg.logger.name == "wandb":
            self._start_wandb(spec or {})

    def log(self, step: int, loss: float, lr: float, grad_norm: float, step_time_s: float, **extra) -> dict:
        tflops = self.flops_per_step / step_time_s / self.plan.world_size / 1e12
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": self.plan.tokens_per_step / step_time_s,
            "step_time_s": step_time_s,
            "tflops_per_device": tflops,
            "mfu": tflops / self.cfg.cluster.peak_tflops,
            **extra,
        }
        if self._layout_change is not None:
            change, self._layout_change = self._layout_change, None
            since = change.get("since")  # the last step logged before it: the time lost runs to the end of this one
            record["layout_change"] = {**change, "time_lost_s": time.time() - since if since is not None else None}
        if self._file is None:
            self._file = open(self.path, "w", buffering=1)  # noqa: SIM115 - open for the run, closed in close()
            for r in self._kept:
                self._file.write(json.dumps(r) + "\n")
        self._file.write(json.dumps(record) + "\n")
        if self.wandb:
            try:
                self.wandb.log(record)
            except Exception as exc:
                self._wandb_failed(f"log step {step}", exc)
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{loss:.4f}",
                lr=f"{lr:.2e}",
                gnorm=f"{grad_norm:.3f}",
                tok_s=f"{record['tokens_per_s']:,.0f}",
                refresh=False,
            )
            self.bar.update(1)
        elif step % self.cfg.logger.log_every == 0 or step == self.cfg.train.steps:
            self.print(
                f"step {step:>5}/{self.cfg.train.steps} | loss {loss:.4f} | lr {lr:.2e} | grad_norm "
                f"{grad_norm:.3f} | tok/s {record['tokens_per_s']:,.0f} | step {step_time_s:.3f}s"
                + (f" | val_loss {extra['val_loss']:.4f}" if "val_loss" in extra else "")
                + (f" | update discarded ({extra['skip_reason']})" if extra.get("skip_reason") else "")
            )
        return record

    def print(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def _start_wandb(self, spec: dict) -> None:
        mode, why = wandb_mode(self.cfg.logger.mode)
        if mode == "disabled":
            self.print(f"W&B disabled ({why}): logging to the console and {METRICS} only")
            return
        try:
            self.wandb = WandbSink(self.run_dir, self.cfg, spec, mode)
        except Exception as exc:
            self._wandb_failed(f"start in {mode} mode ({why})", exc)

    def _wandb_failed(self, what: str, exc: Exception) -> None:
        """Any W&B failure (CommError, UsageError, OSError, ...): warn once, go on without W&B; training never
        stops for it."""
        self.wandb = None
        first = (str(exc).strip().splitlines() or [""])[0]
        self.print(
            f"warning: W&B failed to {what}: {type(exc).__name__}: {first}; training goes on, logging to "
            f"the console and {self.path}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self._file is not None:
            self._file.close()
        if self.wandb:
            try:
                self.wandb.close()
            except Exception as exc:
                self._wandb_failed("finish", exc)
