"""Hugging Face checkpoints as p3d weights: ``model.init_from=<dir>`` (export: p3d.hf.export), for every
architecture of p3d.hf.architectures (docs/models.md).

The names map as p3d.hf.names says, config.json as p3d.hf.config_json; the launcher has checked every tensor's
name and shape (p3d.hf.check). Import reads, on every rank, only the slices of
each tensor that rank holds (safetensors slices; of an MoE block, only the experts of its ep rank), so a 70B
import never needs the whole model on one process. ``transformers`` is not needed for either direction;
``safetensors`` is (the ``hf`` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from p3d.hf.architectures import Architecture, of_model
from p3d.hf.files import CheckpointFiles, read_config
from p3d.hf.fp8 import FP8_DTYPE, SCALE, block_size, dequantize
from p3d.hf.names import HFImportError, global_name, hf_names, row_order

if TYPE_CHECKING:  # torch is imported where weights are read: the launcher checks HF dirs without it
    import torch

    from p3d.pipeline.specs import SequentialModel


class SafetensorsDir(CheckpointFiles):
    """The tensors of a HF checkpoint directory, read slice by slice (safetensors' lazy slices); a block FP8 tensor
    (p3d.hf.fp8) dequantized to fp32, from its slice and the scales of the blocks that cover it."""

    def __init__(self, hf_dir: str | Path):
        super().__init__(hf_dir)
        self._open: dict[str, Any] = {}  # file name -> open safetensors handle
        config = read_config(hf_dir)
        self.block = block_size(config, str(hf_dir)) if "quantization_config" in config else None

    def _file(self, name: str):
        from safetensors import safe_open

        if name not in self.where:
            raise HFImportError(f"model.init_from={self.dir}: tensor {name} is not in the checkpoint")
        file = self.where[name]
        if file not in self._open:
            self._open[file] = safe_open(self.dir / file, framework="pt")
        return self._open[file]

    def _quantized(self, name: str) -> bool:
        return self.block is not None and self.headers[name][0] == FP8_DTYPE

    def _dequantized(self, name: str, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        weight8 = self._file(name).get_slice(name)[rows[0] : rows[1], cols[0] : cols[1]]
        scale = name + SCALE
        return dequantize(weight8, self._file(scale).get_slice(scale), rows, cols, self.block)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        if self._quantized(name):
            return self._dequantized(name, (start, stop), (0, self.shape(name)[1]))
        return self._file(name).get_slice(name)[start:stop]

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        if self._quantized(name):
            return self._dequantized(name, (0, self.shape(name)[0]), (start, stop))
        return self._file(name).get_slice(name)[:, start:stop]

    def whole(self, name: str) -> torch.Tensor:
        if self._quantized(name):
            return self.rows(name, 0, self.shape(name)[0])
        return self._file(name).get_tensor(name)


def local_from_hf(
    src: SafetensorsDir,
    name: str,
    spec: dict,
    n_layers: int,
    arch: Architecture,
    tp: int,
    rank: int,
    experts: range | None = None,
    order: list[int] | None = None,
) -> torch.Tensor:
    """This rank's shard of p3d parameter ``name``, read slice by slice from the HF tensors (of a stacked routed
    experts' weight: only the ``experts`` this rank holds, one HF tensor each). ``order``: the HF row of each of the
    whole p3d tensor's rows (p3d.hf.names.row_order), a permutation within the rows each tp rank holds."""
    import torch

    from p3d.checkpoint.reshard import pad_rows

    parts = hf_names(name, n_layers, arch, experts)
    if spec["kind"] == "replicated":
        whole = src.whole(parts[0])
        return whole if order is None else whole[order]
    if order is not None:  # one HF tensor split by whole heads: this rank's rows, reordered among themselves
        per_rank = spec["padded"][0] // tp
        start, stop = rank * per_rank, (rank + 1) * per_rank
        local = torch.tensor(order[start:stop]) - start
        if local.min() < 0 or local.max() >= per_rank:
            raise ValueError(f"{name}: its row order crosses the tp ranks' rows")
        return src.rows(parts[0], start, stop)[local]
    if spec["kind"] == "cols":
        width = src.shape(parts[0])[1] // tp
        return torch.cat([src.cols(part, rank * width, (rank + 1) * width) for part in parts])
    out = []
    # a stacked experts' spec lists the blocks of every expert (all alike); ``parts`` are this ep rank's experts' only
    for part, real, padded in zip(parts, spec["blocks"], spec["padded"]):
        per_rank = padded // tp
        start, stop = rank * per_rank, min((rank + 1) * per_rank, real)
        rows = src.rows(part, start, max(start, stop))
        out.append(pad_rows(rows, per_rank - rows.shape[0]))  # vocab padding rows are zero
    return torch.cat(out, dim=0)


def held_experts(spec: dict, mesh) -> range | None:
    """The global experts a stacked routed experts' weight of this ep rank holds; None for any other weight."""
    if "experts" not in spec:
        return None
    local = spec["experts"] // mesh.ep
    return range(mesh.ep_rank * local, (mesh.ep_rank + 1) * local)


def load_into(module: torch.nn.Module, hf_dir: str | Path, model, mesh, twin: bool = False) -> int:
    """Copy a HF checkpoint's weights into this rank's pipeline stage (or chunk; ``twin``: the single-process twin,
    whose names p3d.hf.names.twin_name gives) of ``model`` (the ModelConfig, whose ``family`` names the
    architecture); returns the number of tensors. A persistent buffer (the routers' ``expert_bias``) is read whole
    where the architecture names an HF tensor for it, else keeps its value: zero in a fresh model."""
    import torch

    from p3d.checkpoint.checkpointer import shard_specs

    specs = shard_specs(module)
    src, arch, n_layers = SafetensorsDir(hf_dir), of_model(model), model.n_layers
    n = 0
    with torch.no_grad():
        for name, p in module.named_parameters():
            gname = global_name(name) if twin else name
            experts = held_experts(specs[name], mesh)
            order = row_order(gname, arch, model)
            local = local_from_hf(src, gname, specs[name], n_layers, arch, mesh.tp, mesh.tp_rank, experts, order)
            if tuple(local.shape) != tuple(p.shape):
                raise HFImportError(
                    f"model.init_from={hf_dir}: {hf_names(gname, n_layers, arch, experts)} gives {tuple(local.shape)} "
                    f"for {gname}, this rank needs {tuple(p.shape)}"
                )
            p.copy_(local.to(p.dtype))
            n += 1
        persistent = set(module.state_dict())
        for name, buf in module.named_buffers():
            parts = hf_names(global_name(name) if twin else name, n_layers, arch) if name in persistent else []
            if parts:  # replicated over tp and ep: the whole tensor
                buf.copy_(src.whole(parts[0]).to(buf.dtype))
                n += 1
    return n


def sequential_from_hf(
    hf_dir: str | Path, mesh=None, seed: int = 0, seq_len: int = 64, drop_mtp: bool = False
) -> SequentialModel:
    """The single-process twin (p3d.pipeline.specs.to_sequential) of a HF checkpoint, checked as the
    launcher checks it, with its weights, in eval mode: for comparisons with transformers on one process. ``mesh``:
    the twin of that rank instead (its tp and ep share of every weight), without process groups. ``seq_len``: the
    length of the RoPE tables (longer inputs compute theirs)."""
    from p3d.config.schema import ModelConfig
    from p3d.hf.check import import_fields
    from p3d.layout.geometry import padded_vocab
    from p3d.parallel.mesh import Mesh
    from p3d.pipeline.specs import to_sequential

    mesh = mesh or Mesh(tp=1, pp=1, dp=1)
    cfg = ModelConfig(name=f"hf:{Path(hf_dir).name}", seq_len=seq_len, **import_fields(hf_dir, drop_mtp))
    model = to_sequential(cfg, padded_vocab(cfg.vocab_size, mesh.tp), seed, mesh=mesh)
    load_into(model, hf_dir, cfg, mesh, twin=True)
    return model.eval()
