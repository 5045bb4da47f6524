"""Hugging Face Llama and Mixtral checkpoints as p3d weights: ``model.init_from=<dir>`` (export: p3d.hf.export).

The names and config.json fields map as p3d.hf.names says. Import reads, on every rank, only the slices of
each tensor that rank holds (safetensors slices; of an MoE block, only the experts of its ep rank), so a 70B
import never needs the whole model on one process. ``transformers`` is not needed for either direction;
``safetensors`` is (the ``hf`` extra).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p3d.hf.names import FUSED_EXPERTS, HFImportError, global_name, hf_names, model_fields

if TYPE_CHECKING:  # torch is imported where weights are read: the launcher checks HF dirs without it
    import torch

    from p3d.parallel.pipeline.specs import SequentialModel


def read_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir).expanduser() / "config.json"
    if not path.is_file():
        raise HFImportError(
            f"model.init_from={hf_dir}: no config.json there; give a local directory of a Hugging Face Llama "
            "or Mixtral checkpoint (config.json and *.safetensors)"
        )
    return json.loads(path.read_text())


# ---- reading safetensors slices

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


def _shard_list(index: Path) -> str:
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError):
        return "unreadable"
    return ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


class SafetensorsDir:
    """Tensors of a HF checkpoint directory (one model.safetensors, or shards with an index)."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir).expanduser()
        index, single = self.dir / INDEX, self.dir / SINGLE
        if index.is_file() and single.is_file():
            raise HFImportError(
                f"model.init_from={hf_dir} holds both {SINGLE} and {INDEX} (whose shards are "
                f"{_shard_list(index)}): it is unclear which weights are meant; delete the stale "
                "ones, or export again into a new directory"
            )
        if index.is_file():
            self.where = json.loads(index.read_text())["weight_map"]
        elif (self.dir / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(self.dir / "model.safetensors", framework="pt") as f:
                self.where = {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118 - a safetensors handle, not a dict
        else:
            raise HFImportError(f"model.init_from={hf_dir}: no model.safetensors or model.safetensors.index.json")
        for file in sorted(set(self.where.values())):
            if not (self.dir / file).is_file():
                raise HFImportError(f"model.init_from={hf_dir}: shard {self.dir / file} is missing")
        fused = next((name for name in self.where if name.endswith(FUSED_EXPERTS)), None)
        if fused:
            raise HFImportError(
                f"model.init_from={hf_dir} holds Mixtral's experts fused ({fused}), not per expert as the Hub's "
                "checkpoints (block_sparse_moe.experts.<j>.w1/w2/w3); load it with transformers' "
                "MixtralForCausalLM.from_pretrained and save_pretrained it into a new directory"
            )
        self._open: dict[str, Any] = {}  # file name -> open safetensors handle

    def _file(self, name: str):
        from safetensors import safe_open

        if name not in self.where:
            raise HFImportError(f"model.init_from={self.dir}: tensor {name} is not in the checkpoint")
        file = self.where[name]
        if file not in self._open:
            self._open[file] = safe_open(self.dir / file, framework="pt")
        return self._open[file]

    def shape(self, name: str) -> list[int]:
        return self._file(name).get_slice(name).get_shape()

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._file(name).get_slice(name)[start:stop]

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._file(name).get_slice(name)[:, start:stop]

    def whole(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)


def local_from_hf(
    src: SafetensorsDir, name: str, spec: dict, n_layers: int, tp: int, rank: int, experts: range | None = None
) -> torch.Tensor:
    """This rank's shard of p3d parameter ``name``, read slice by slice from the HF tensors (of a stacked routed
    experts' weight: only the ``experts`` this rank holds, one HF tensor each)."""
    import torch
    import torch.nn.functional as F

    parts = hf_names(name, n_layers, experts)
    if spec["kind"] == "replicated":
        return src.whole(parts[0])
    if spec["kind"] == "cols":
        width = src.shape(parts[0])[1] // tp
        return torch.cat([src.cols(part, rank * width, (rank + 1) * width) for part in parts])
    out = []
    for part, real, padded in zip(parts, spec["blocks"], spec["padded"]):  # an expert's blocks: every expert's
        per_rank = padded // tp
        start, stop = rank * per_rank, min((rank + 1) * per_rank, real)
        rows = src.rows(part, start, max(start, stop))
        out.append(F.pad(rows, (0, 0, 0, per_rank - rows.shape[0])))  # vocab padding rows are zero
    return torch.cat(out, dim=0)


def held_experts(spec: dict, mesh) -> range | None:
    """The global experts a stacked routed experts' weight of this ep rank holds; None for any other weight."""
    if "experts" not in spec:
        return None
    local = spec["experts"] // mesh.ep
    return range(mesh.ep_rank * local, (mesh.ep_rank + 1) * local)


def load_into(module: torch.nn.Module, hf_dir: str | Path, n_layers: int, mesh, twin: bool = False) -> int:
    """Copy a HF checkpoint's weights into this rank's pipeline stage (or chunk; ``twin``: the single-process twin,
    whose names p3d.hf.names.twin_name gives); returns the number of tensors. Buffers (the routers'
    ``expert_bias``) keep their values: zero in a fresh model."""
    import torch

    from p3d.checkpoint.checkpointer import shard_specs

    specs = shard_specs(module)
    src = SafetensorsDir(hf_dir)
    n = 0
    with torch.no_grad():
        for name, p in module.named_parameters():
            gname = global_name(name) if twin else name
            experts = held_experts(specs[name], mesh)
            local = local_from_hf(src, gname, specs[name], n_layers, mesh.tp, mesh.tp_rank, experts)
            if tuple(local.shape) != tuple(p.shape):
                raise HFImportError(
                    f"model.init_from={hf_dir}: {hf_names(gname, n_layers, experts)} gives {tuple(local.shape)} "
                    f"for {gname}, this rank needs {tuple(p.shape)}"
                )
            p.copy_(local.to(p.dtype))
            n += 1
    return n


def sequential_from_hf(hf_dir: str | Path, mesh=None, seed: int = 0) -> SequentialModel:
    """The single-process twin (p3d.parallel.pipeline.specs.to_sequential) of a HF Llama or Mixtral checkpoint,
    with its weights, in eval mode: for comparisons with transformers on one process. ``mesh``: the twin of
    that rank instead (its tp and ep share of every weight), without process groups."""
    from p3d.config.schema import ModelConfig
    from p3d.layout.geometry import padded_vocab
    from p3d.parallel.mesh import Mesh
    from p3d.parallel.pipeline.specs import to_sequential

    mesh = mesh or Mesh(tp=1, pp=1, dp=1)
    cfg = ModelConfig(name=f"hf:{Path(hf_dir).name}", **model_fields(read_config(hf_dir), str(hf_dir)))
    model = to_sequential(cfg, padded_vocab(cfg.vocab_size, mesh.tp), seed, mesh=mesh)
    load_into(model, hf_dir, cfg.n_layers, mesh, twin=True)
    return model.eval()
