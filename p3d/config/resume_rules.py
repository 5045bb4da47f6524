"""What a resumed run may change: one rule per config field, as data.

A run resumed from the checkpoint of step N continues the run that checkpoint belongs to. Each field of
the config (``p3d.config.schema.Config``, flattened to ``group.field``) follows one rule here:

- ``CHANGES``: may change; takes effect from step N+1 exactly, and the launcher prints one line per field
  ("train.lr: 0.003 -> 0.01 from step 7"). The LR schedule is the new config's formula evaluated at the
  absolute step; the data position is the number of samples consumed, whatever the new batch size or mesh.
- ``UNUSED``: may change, but a resumed run does not use it (it only initialises a fresh run); printed so.
- ``QUIET``: names this launch (which checkpoint, where, planner and p3d-tokenizer options), not the
  training; may change and is not printed.
- ``REFUSED``: may not change; a resume that changes it is refused before any worker starts, naming the
  value the checkpoint was trained with.

``RULES`` maps a field, or a whole group as ``group.*``, to its rule and the reason; a field's own entry
wins over its group's. ``tests/unit/config/test_resume_rules.py`` checks that every field of the schema has a rule.
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any


class Rule(Enum):
    CHANGES = "may change, from the resumed step"
    UNUSED = "may change, not used by a resumed run"
    QUIET = "may change, not printed"
    REFUSED = "may not change"


_SHAPE = "the model's shape: the checkpoint's tensors have it"
_DATA = "the data source: the data position counts samples of this stream"
_FAULTS = "fault handling of the steps to come"
_SCHEDULE = "the LR schedule: the new formula is evaluated at the absolute step"
_ADAMW = "AdamW's settings; its moments are kept"

RULES: dict[str, tuple[Rule, str]] = {
    "model.*": (Rule.REFUSED, _SHAPE),
    "model.compile": (Rule.CHANGES, "how the blocks run, not what they compute"),
    "train.adamw_impl": (Rule.CHANGES, "which kernels run AdamW; its moments are kept"),
    "train.host_memory": (Rule.CHANGES, "how a CPU worker's heap hands freed memory back, not what it computes"),
    "train.tf32": (Rule.CHANGES, "the precision of fp32 matmuls of the steps to come (GPUs)"),
    "model.name": (Rule.QUIET, "a label; the shape fields decide what the model is"),
    "model.seq_len": (Rule.REFUSED, "the data position counts windows of model.seq_len + 1 tokens"),
    "model.init_std": (Rule.UNUSED, "only initialises a fresh run"),
    "model.init_from": (Rule.UNUSED, "only initialises a fresh run"),
    "model.drop_mtp": (Rule.UNUSED, "only says how a fresh run imports its checkpoint"),
    "model.moe.bias_update_rate": (
        Rule.CHANGES,
        "how the selection biases move in the steps to come; they keep their values (DeepSeek-V3 stopped moving "
        "them for its last 500B tokens)",
    ),
    "model.family": (Rule.CHANGES, "only the architecture p3d-export writes"),
    "model.max_position_embeddings": (Rule.CHANGES, "only the context length p3d-export writes"),
    "mesh.*": (Rule.CHANGES, "the checkpoint is re-cut for the new layout"),
    "schedule.*": (Rule.CHANGES, "micro batches, recompute and stage cuts of the steps to come"),
    "schedule.global_batch_size": (Rule.CHANGES, "the next step reads the samples after the last one trained"),
    "schedule.pipeline": (Rule.CHANGES, "the executor of the steps to come; checkpoints are cut by layer name"),
    "context.*": (Rule.CHANGES, "how the attention of the steps to come reaches the other cp ranks' keys"),
    "zero.*": (Rule.CHANGES, "optimizer states are saved whole and re-partitioned"),
    "cluster.*": (Rule.CHANGES, "where and how the workers run"),
    "data.*": (Rule.REFUSED, _DATA),
    "data.name": (Rule.QUIET, "a label; the fields below decide the data"),
    "data.tokenizer": (Rule.REFUSED, "the token ids the model was trained on"),
    "data.shuffle_buffer": (Rule.REFUSED, "the sample order the data position counts in"),
    "data.val_fraction": (Rule.REFUSED, "which documents are training data"),
    "logger.*": (Rule.CHANGES, "console, metrics.jsonl and W&B of the steps to come"),
    "train.steps": (Rule.CHANGES, "must stay above the checkpoint's step"),
    "train.lr": (Rule.CHANGES, _SCHEDULE),
    "train.min_lr_ratio": (Rule.CHANGES, _SCHEDULE),
    "train.warmup_steps": (Rule.CHANGES, _SCHEDULE),
    "train.decay": (Rule.CHANGES, _SCHEDULE),
    "train.weight_decay": (Rule.CHANGES, _ADAMW),
    "train.beta1": (Rule.CHANGES, _ADAMW),
    "train.beta2": (Rule.CHANGES, _ADAMW),
    "train.eps": (Rule.CHANGES, _ADAMW),
    "train.grad_clip": (Rule.CHANGES, "clipping of the steps to come"),
    "train.seed": (Rule.REFUSED, "it orders the data (the shuffle), which the data position counts in"),
    "train.dtype": (Rule.CHANGES, "checkpoints hold fp32 master weights and moments"),
    "train.fp8": (Rule.CHANGES, "checkpoints hold fp32 master weights and moments; float8 casts are made each step"),
    "train.eval_every": (Rule.CHANGES, "validation of the steps to come"),
    "train.eval_batches": (Rule.CHANGES, "validation of the steps to come"),
    "train.save_every": (Rule.CHANGES, "checkpoints of the steps to come"),
    "train.keep_last": (Rule.CHANGES, "checkpoints of the steps to come"),
    "train.async_save": (Rule.CHANGES, "how the checkpoints of the steps to come are written"),
    "train.resume": (Rule.QUIET, "which checkpoint this launch continues"),
    "train.on_nonfinite": (Rule.CHANGES, _FAULTS),
    "train.max_skipped": (Rule.CHANGES, _FAULTS),
    "train.spike_factor": (Rule.CHANGES, _FAULTS),
    "train.spike_window": (Rule.CHANGES, _FAULTS),
    "train.on_spike": (Rule.CHANGES, _FAULTS),
    "train.straggler_factor": (Rule.CHANGES, _FAULTS),
    "train.straggler_steps": (Rule.CHANGES, _FAULTS),
    "train.max_restarts": (Rule.CHANGES, "restarts of this launch"),
    "train.trace_steps": (Rule.CHANGES, "which of the steps to come are traced"),
    "run.*": (Rule.QUIET, "where this launch writes"),
    "plan.*": (Rule.QUIET, "options of the pre-launch memory check"),
    "tokenizer.*": (Rule.QUIET, "options of p3d-tokenizer"),
    "prepare.*": (Rule.QUIET, "options of p3d-prepare"),
    "dry_run": (Rule.QUIET, "a dry run trains nothing"),
    "format": (Rule.QUIET, "p3d-plan's output format"),
    "calibration": (Rule.QUIET, "the planner's measured machine"),
}


def rule(field: str) -> tuple[Rule, str]:
    """The rule of a flattened field (``train.lr``); KeyError for a field no entry covers."""
    if field in RULES:
        return RULES[field]
    return RULES[field.split(".", 1)[0] + ".*"]


def refuses(field: str) -> bool:
    """Whether a resume refuses a change of ``field`` (``model.seq_len``: yes; a field no rule covers: no)."""
    try:
        return rule(field)[0] == Rule.REFUSED
    except KeyError:
        return False


def flatten(body: dict, prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 0.01}} -> {"train.lr": 0.01}; lists are values."""
    out: dict[str, Any] = {}
    for key, value in body.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


@dataclasses.dataclass(frozen=True)
class Change:
    field: str
    old: Any
    new: Any
    rule: Rule
    reason: str

    def line(self, first_step: int) -> str:
        """``train.lr: 0.003 -> 0.01 from step 7``."""
        text = f"{self.field}: {_show(self.old)} -> {_show(self.new)}"
        if self.rule == Rule.UNUSED:
            return f"{text} (not used by a resumed run: it {self.reason})"
        return f"{text} from step {first_step}"


def diff(old: dict, new: dict) -> list[Change]:
    """The fields whose value differs between two config bodies (nested dicts as in run_spec.yaml, without
    ``plan`` and ``segments``), in the schema's order. A field only one side has (a spec written before the
    field existed, or after it was removed) is not compared."""
    flat_old, flat_new = flatten(old), flatten(new)
    return [
        Change(field, flat_old[field], now, *rule(field))
        for field, now in flat_new.items()
        if field in flat_old and flat_old[field] != now
    ]


def printed(changes: list[Change]) -> list[Change]:
    """The changes a resume reports (and records as a new segment of the run)."""
    return [c for c in changes if c.rule in (Rule.CHANGES, Rule.UNUSED)]


def refusal(changes: list[Change], ckpt: str, step: int, steps: int) -> str | None:
    """The one-line reason this resume is refused, or None: a field that may not change, or train.steps not
    above the checkpoint's step."""
    for c in changes:
        if c.rule == Rule.REFUSED:
            return (
                f"{c.field}={_show(c.new)} differs from the checkpoint {ckpt} ({_show(c.old)}) and may not change "
                f"on resume ({c.reason}); resume with {c.field}={_show(c.old)} or start a new run.dir"
            )
    if steps <= step:
        return (
            f"train.steps={steps} is not above the step of the checkpoint {ckpt} ({step}): nothing to train; "
            f"set train.steps={step + 1} or more to train on"
        )
    return None
