"""Checkpoints written before the routed experts were stacked (p3d.model.experts), read as today's.

Before, expert j of an MoE block was a module of its own and each of its weights a tensor of its own:
``<i>.mlp.experts.<j>.w_gate_up.weight`` (2f/t, h), rows ``[gate_r; up_r]`` (shard spec rows, blocks [f, f]) and
``<i>.mlp.experts.<j>.w_down.weight`` (h, f/t) (spec cols). Today the layer's experts are one tensor per projection,
``<i>.mlp.experts.w_gate_up.weight`` (E 2f/t, h) and ``<i>.mlp.experts.w_down.weight`` (E h, f/t): expert j's
rows follow expert j - 1's. On one tp coordinate the stacked tensor is therefore the per-expert tensors of that
coordinate concatenated along dim 0 in expert order, and its spec the per-expert spec with the blocks repeated
per expert: the conversion is exact, for the parameters and for the optimizer's master weights and moments
alike (they are cut as their parameter). ``stacked`` applies it to what p3d.checkpoint.files reads of one
coordinate, so every reader (loading under any mesh, p3d-export, ``load_sequential``) sees today's names.
"""

from __future__ import annotations

import re

import torch

from p3d.checkpoint.find import CheckpointError

PER_EXPERT = re.compile(r"^(?P<layer>.*\.mlp\.experts)\.(?P<j>\d+)\.(?P<part>w_gate_up|w_down)\.weight$")


def stacked_name(name: str) -> tuple[str, int] | None:
    """(today's name, expert index) of a per-expert tensor's ``name``, or None for any other name."""
    m = PER_EXPERT.match(name)
    return (f"{m['layer']}.{m['part']}.weight", int(m["j"])) if m else None


def stacked_spec(spec: dict, n_experts: int) -> dict:
    """The shard spec of the stacked tensor from one expert's."""
    if spec["kind"] == "rows":
        return {
            **spec,
            "blocks": spec["blocks"] * n_experts,
            "padded": spec["padded"] * n_experts,
            "experts": n_experts,
        }
    return {**spec, "experts": n_experts}


def stacked(values: dict, specs: dict | None = None, where: str = "") -> tuple[dict, dict | None]:
    """(values, specs) of one coordinate with every per-expert tensor replaced by its layer's stacked tensor.
    ``values``: name -> tensor (parameters) or name -> {key: tensor} (optimizer states); ``specs``: name -> shard
    spec, or None. A checkpoint of today's passes through unchanged."""
    layers: dict[str, dict[int, str]] = {}
    for name in values:
        found = stacked_name(name)
        if found is not None:
            layers.setdefault(found[0], {})[found[1]] = name
    if not layers:
        return values, specs
    out = {name: v for name, v in values.items() if stacked_name(name) is None}
    out_specs = None if specs is None else {name: s for name, s in specs.items() if stacked_name(name) is None}
    for name, by_expert in layers.items():
        experts = sorted(by_expert)
        if experts != list(range(len(experts))):
            raise CheckpointError(
                f"checkpoint {where}: {name} has the tensors of experts {experts}, not 0..{len(experts) - 1}"
            )
        parts = [values[by_expert[j]] for j in experts]
        if isinstance(parts[0], dict):
            out[name] = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        else:
            out[name] = torch.cat(parts)
        if out_specs is not None and specs is not None:
            out_specs[name] = stacked_spec(specs[by_expert[0]], len(experts))
    return out, out_specs
