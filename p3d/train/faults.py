"""A step's faults, found before its optimizer update: a non-finite loss or gradient, a loss spike.

The gate runs at the pipeline instruction ``ReduceTiedGrads``: the first one after the step's last backward
pass, before any gradient is reduced over dp or tied copies and before the optimizer runs. There every rank
puts (its stage's loss for the step, if it computes one; whether its local gradients hold an inf or a nan)
into one small all-gather, so every rank takes the same decision from the same numbers.

To discard a step's update, every rank fills its gradients with nan: the optimizer's own overflow path
(p3d's ``ClippedAdamW``, DeepSpeed's bf16 and ZeRO wrappers) then skips the update and clears the gradients,
and DeepSpeed's engine leaves the LR schedule where it was and counts the step in ``skipped_steps``. So
parameters, Adam moments, the optimizer's step count and the learning rate stay exactly as before the step.
A step discarded as a loss spike has finite gradients: before they are filled, the gate measures the norm the
optimizer would have seen (``measure_norm``, on copies reduced as the step's own reductions would), so the
metrics report that norm, not the nan of the overflow path.

The spike reference is the median of the last ``train.spike_window`` finite losses seen, discarded steps
included: after a lasting rise of the loss the window follows it, so a run cannot discard every step from
then on. Steps discarded in a row, for either cause, are bounded by ``train.max_skipped``.

Test hook (real faults in real runs): ``P3D_TEST_NONFINITE=<stage>:<step>[,<step>...]`` writes an inf into
one gradient of that pipeline stage at those steps, before the check.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from p3d.compat.deepspeed_internals import local_gradients, pipeline_instruction_map, set_pipeline_instruction_map
from p3d.parallel.mesh import Mesh

INJECT_ENV = "P3D_TEST_NONFINITE"


@dataclass
class StepVerdict:
    """What the gate found at one step; the same on every rank."""

    step: int
    loss: float  # the step's loss, mean over the last stage's ranks (nan or inf when it is not finite)
    loss_stages: list[int] = field(default_factory=list)  # stages whose loss is not finite (the last, if any)
    grad_stages: list[int] = field(default_factory=list)  # stages with an inf or nan in their gradients
    spike_over: float = 0.0  # the median the loss exceeded spike_factor times; 0: no spike
    discarded: bool = False  # the update was not applied
    grad_norm: float | None = None  # a discarded spike's measured global gradient norm (None: the optimizer's)

    @property
    def nonfinite(self) -> bool:
        return bool(self.loss_stages or self.grad_stages)

    @property
    def skip_reason(self) -> str:
        """Why the update was not applied ("" when it was)."""
        return "" if not self.discarded else "non-finite" if self.nonfinite else "loss spike"

    def describe(self) -> str:
        """``step 7: non-finite loss on stage 1 and non-finite gradient norm on stages 0, 1``."""

        def on(stages: list[int]) -> str:
            return ("stage " if len(stages) == 1 else "stages ") + ", ".join(map(str, stages))

        found = []
        if self.loss_stages:
            found.append(f"non-finite loss ({self.loss}) on {on(self.loss_stages)}")
        if self.grad_stages:
            found.append(f"non-finite gradient norm on {on(self.grad_stages)}")
        return f"step {self.step}: " + " and ".join(found)


def _injected_steps(stage: int) -> set[int]:
    text = os.environ.get(INJECT_ENV, "")
    if not text:
        return set()
    where, _, steps = text.partition(":")
    return {int(s) for s in steps.split(",") if s} if int(where) == stage else set()


class SpikeReference:
    """The loss a spike is judged against: the median of the last ``window`` finite losses seen, applied or not."""

    def __init__(self, factor: float, window: int):
        self.factor = factor
        self.recent: deque[float] = deque(maxlen=window)

    def over(self, loss: float) -> float:
        """The median ``loss`` exceeds ``factor`` times, or 0.0 (no spike; factor 0: off; the window not full)."""
        if self.factor <= 0 or len(self.recent) < (self.recent.maxlen or 0):
            return 0.0
        median = statistics.median(self.recent)
        return median if loss > self.factor * median else 0.0

    def seen(self, loss: float) -> None:
        """Every finite loss joins the window, a discarded step's too: were only applied steps counted, a loss
        that rose for good would stay a spike against a window that never moves, and every later update would
        be discarded (the model frozen, the run "done")."""
        if math.isfinite(loss):
            self.recent.append(loss)


class StepGate:
    """Wraps this engine's ``ReduceTiedGrads`` instruction (``engine`` None: the executor calls ``before_update``);
    ``verdict`` is the last step's finding."""

    def __init__(self, engine, module, mesh: Mesh, plan, train_cfg, device: torch.device):
        self.module, self.mesh, self.device = module, mesh, device
        self.stage_of = [Mesh.from_plan(plan, r).coords[1] for r in range(plan.world_size)]
        self.micro_batches = plan.micro_batches
        self.spikes = SpikeReference(float(train_cfg.spike_factor), train_cfg.spike_window)
        self.spike_skips = train_cfg.on_spike.value == "skip"
        self.inject = _injected_steps(mesh.pp_rank)
        self.verdict: StepVerdict | None = None
        # the global norm of this rank's gradients once reduced, on copies (the executor sets it; None: not measured)
        self.measure_norm: Callable[[], float] | None = None
        if engine is None:  # a torch pipeline schedule calls ``before_update`` itself (p3d.train.executors)
            return
        table = dict(pipeline_instruction_map(engine))
        for instr, fn in table.items():
            if instr.__name__ == "ReduceTiedGrads":
                table[instr] = self._wrap(fn)
        set_pipeline_instruction_map(engine, table)

    def before_update(self, step: int, grads: list[torch.Tensor], loss: float | None) -> None:
        """The gate for an executor without DeepSpeed's instructions: ``grads`` this rank's gradients after the
        step's last backward (before any tied, dp or optimizer work), ``loss`` the replica's mean loss on the rank
        that computes it (else None). A discarded step's gradients are filled with nan, as under DeepSpeed."""
        self.verdict = self._decide(step, self._values(step, grads, loss))
        self._discard(grads)

    def _discard(self, grads: list[torch.Tensor]) -> None:
        """Fill a discarded step's gradients with nan, after measuring a spike's norm (every rank alike)."""
        v = self.verdict
        if v is None or not v.discarded:
            return
        if not v.nonfinite and self.measure_norm is not None:
            v.grad_norm = self.measure_norm()
        for g in grads:
            g.fill_(math.nan)

    def _wrap(self, fn):
        def gated(engine, *args, **kwargs):
            self.verdict = self.judge(engine)
            self._discard(local_gradients(engine, self.module))
            return fn(engine, *args, **kwargs)

        return gated

    def _local(self, engine, step: int) -> torch.Tensor:
        loss = None
        total = getattr(engine, "total_loss", None)  # the sum of this step's micro-batch losses (last stage)
        if engine.is_last_stage():
            loss = float(total.detach().float()) / self.micro_batches if total is not None else math.nan
        return self._values(step, local_gradients(engine, self.module), loss)

    def _values(self, step: int, grads: list[torch.Tensor], loss: float | None) -> torch.Tensor:
        if step in self.inject and grads:
            grads[0].view(-1)[0] = math.inf
        grad_bad = bool(grads) and not bool(torch.stack(torch._foreach_norm(grads, 2.0)).isfinite().all())
        row = [float(loss is not None), math.nan if loss is None else loss, float(grad_bad)]
        return torch.tensor(row, dtype=torch.float64, device=self.device)

    def judge(self, engine) -> StepVerdict:
        step = engine.global_steps + 1
        return self._decide(step, self._local(engine, step))

    def _decide(self, step: int, mine: torch.Tensor) -> StepVerdict:
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)
        every = torch.stack(parts).cpu().tolist()
        losses = [row[1] for row in every if row[0] > 0]
        loss = sum(losses) / len(losses) if losses else math.nan
        v = StepVerdict(step, loss)
        v.loss_stages = sorted(
            {self.stage_of[r] for r, row in enumerate(every) if row[0] > 0 and not math.isfinite(row[1])}
        )
        v.grad_stages = sorted({self.stage_of[r] for r, row in enumerate(every) if row[2] > 0})
        if not v.nonfinite:
            v.spike_over = self.spikes.over(loss)
        v.discarded = v.nonfinite or (v.spike_over > 0 and self.spike_skips)
        self.spikes.seen(loss)
        return v


class StepPolicy:
    """train.on_nonfinite / max_skipped / on_spike applied to each step's verdict: console lines, metrics
    fields, and whether the run must stop."""

    def __init__(self, train_cfg):
        self.stop_on_nonfinite = train_cfg.on_nonfinite.value == "stop"
        self.max_skipped = train_cfg.max_skipped
        self.spike_factor, self.window = train_cfg.spike_factor, train_cfg.spike_window
        self.in_row = 0  # steps discarded in a row
        self.total = 0  # steps discarded in this run (this process)

    def apply(self, v: StepVerdict) -> tuple[bool, str, dict]:
        """(stop the run, a console line or "", metrics fields) for this step."""
        fields: dict[str, float | str] = {"skipped": int(v.discarded), "loss_spike": int(v.spike_over > 0)}
        if v.discarded:
            fields["skip_reason"] = v.skip_reason
        self.in_row = self.in_row + 1 if v.discarded else 0
        self.total += int(v.discarded)
        fields["skipped_steps"] = self.total
        if v.nonfinite and self.stop_on_nonfinite:
            return (
                True,
                f"error: {v.describe()}; stopped without applying its update (train.on_nonfinite=stop); lower "
                "train.lr or train.grad_clip, or set train.on_nonfinite=skip",
                fields,
            )
        if v.discarded and self.in_row > self.max_skipped:
            what = v.describe() if v.nonfinite else self._spike(v)
            return (
                True,
                f"error: {what}; {self.in_row} steps in a row discarded, more than train.max_skipped="
                f"{self.max_skipped}: stopped; lower train.lr, or resume an earlier checkpoint"
                + ("" if v.nonfinite else ", or raise train.spike_factor"),
                fields,
            )
        line = ""
        if v.nonfinite:
            line = f"warning: {v.describe()}; update discarded ({self.in_row} in a row, train.max_skipped="
            line += f"{self.max_skipped})"
        elif v.spike_over > 0:
            line = f"warning: {self._spike(v)}; "
            if v.discarded:
                norm = "" if v.grad_norm is None else f", its gradient norm {v.grad_norm:.4g} finite"
                line += f"update discarded ({self.in_row} in a row, train.max_skipped={self.max_skipped}{norm})"
            else:
                line += "update applied"
        return False, line, fields

    def _spike(self, v: StepVerdict) -> str:
        return f"step {v.step}: loss spike {v.loss:.4f} > {self.spike_factor:g} x {v.spike_over:.4f} (" + (
            f"median of the last {self.window} losses)" if self.window > 1 else "the loss before)"
        )


def fault_state(gate: StepGate, policy: StepPolicy) -> dict:
    """What a resumed run needs to judge and count its steps as the uninterrupted run would, for meta.json
    (plain numbers: no layout, no code)."""
    return {"skipped_steps": policy.total, "skipped_in_row": policy.in_row, "recent_losses": list(gate.spikes.recent)}


def restore_fault_state(meta: dict, gate: StepGate, policy: StepPolicy) -> None:
    """The counts and spike window of a checkpoint's ``faults`` (absent in older checkpoints: a fresh start)."""
    state = meta.get("faults", {})
    policy.total, policy.in_row = state.get("skipped_steps", 0), state.get("skipped_in_row", 0)
    gate.spikes.recent.extend(state.get("recent_losses", []))
