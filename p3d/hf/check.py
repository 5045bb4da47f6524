"""Before any worker starts: a Hugging Face checkpoint holds exactly the tensors its config.json says, each of the
shape p3d will read it at, so that nothing is dropped and nothing missing surfaces in the workers. No torch: the
names, dtypes and shapes come from the safetensors headers (p3d.hf.files), the expected ones from the model's
tensors (p3d.layout.tensors) under the architecture's names (p3d.hf.architectures). Each refusal is one line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

from p3d.config.schema import ModelConfig
from p3d.hf.architectures import ARCHITECTURES, Architecture
from p3d.hf.config_json import architecture_of, check_keys, model_fields
from p3d.hf.files import FLOAT_DTYPES, CheckpointFiles, read_config
from p3d.hf.fp8 import FP8_DTYPE, SCALE, block_size, check_quantized
from p3d.hf.names import EMBED, FINAL_NORM, HEAD, HFImportError, layer_prefix
from p3d.layout.tensors import block_buffers, block_tensors, end_tensors

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")
_EXPERT = re.compile(r"experts\.\d+\.")
FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")  # transformers 5's module tensors, not its files'


def import_fields(hf_dir: str | Path, drop_mtp: bool = False) -> dict:
    """The model fields of the checkpoint in ``hf_dir`` (p3d.hf.config_json.model_fields), once its tensors and
    its config.json keys are checked: what ``model.init_from`` sets, or a one-line HFImportError. ``drop_mtp``
    (``model.drop_mtp``): a DeepSeek-V3 checkpoint's multi-token prediction layers are left out, not refused."""
    where = str(hf_dir)
    hf = read_config(hf_dir)
    fields = model_fields(hf, where, keys=False)
    files = CheckpointFiles(hf_dir)
    arch = architecture_of(hf, where)
    block = block_size(hf, where) if arch.fp8_blocks else None
    mtp = int(hf.get(arch.mtp_key) or 0) if arch.mtp_key else 0
    check_tensors(ModelConfig(**fields), arch, files, where, block, Extra(arch.mtp_key, mtp, drop_mtp))
    check_keys(hf, where)  # after the tensors: a mislabelled checkpoint is named by the tensor p3d would drop
    return fields


class Extra(NamedTuple):
    """Layers after the blocks that a checkpoint may hold: config.json's ``key`` says how many (DeepSeek-V3's
    multi-token prediction, ``num_nextn_predict_layers``); ``drop``: leave them out (``model.drop_mtp``)."""

    key: str | None = None
    layers: int = 0
    drop: bool = False


def expected_tensors(m, arch: Architecture) -> dict[str, tuple[int, ...]]:
    """{HF name: shape} of every tensor the model ``m`` (a ModelConfig) reads from a checkpoint of ``arch``."""
    ends = end_tensors(m)
    out = {EMBED: ends["embed"].shape, FINAL_NORM: ends["final_norm"].shape}
    if "head" in ends:
        out[HEAD] = ends["head"].shape
    for i in range(m.n_layers):
        prefix = layer_prefix(i)
        for name, tensor in block_tensors(m, i).items():
            if name in arch.expert:
                experts = range(len(tensor.parts) // len(arch.expert[name]))
                names = [prefix + part.format(j=j) for j in experts for part in arch.expert[name]]
            elif name in arch.block:
                names = [prefix + part for part in arch.block[name]]
            else:
                raise HFImportError(f"{arch.name} has no tensor for p3d's {name}: its description is incomplete")
            out |= dict(zip(names, tensor.part_shapes, strict=True))
        for name, tensor in block_buffers(m, i).items():  # read where the architecture names a tensor for them
            out |= {prefix + part: tensor.shape for part in arch.block.get(name, ())}
    return out


def _order(name: str) -> tuple[int, str]:
    match = _LAYER.fullmatch(name)
    return (int(match.group(1)), match.group(2)) if match else (-1, name)


def _owners(name: str, arch: Architecture) -> list[str]:
    """The other architectures that have a block tensor of this name."""
    match = _LAYER.fullmatch(name)
    if not match:
        return []
    suffix = _EXPERT.sub("experts.{j}.", match.group(2))
    return [a.name for a in ARCHITECTURES if a is not arch and suffix in a.hf_block_names()]


def check_tensors(
    m, arch: Architecture, files: CheckpointFiles, where: str | Path, block=None, extra: Extra | None = None
) -> None:
    """Refuse, in one line, a checkpoint with a tensor the model would not use (a mislabelled architecture, more
    layers than config.json says, multi-token prediction layers unless ``extra.drop``), a missing one, one of
    another shape, or a quantized one (but block FP8 with its scales where ``block``, p3d.hf.fp8)."""
    held, expected = dict(files.headers), expected_tensors(m, arch)
    extra = extra or Extra()
    if extra.layers:
        mtp = [n for n in held if m.n_layers <= _order(n)[0] < m.n_layers + extra.layers]
        if mtp and not extra.drop:
            first = min(_order(n)[0] for n in mtp)
            raise HFImportError(
                f"model.init_from={where}: model.layers.{first}.* ({len(mtp)} tensors) is the multi-token "
                f"prediction module ({extra.key}={extra.layers}), which p3d does not train: p3d would drop it; "
                "add model.drop_mtp=true to import the model without it"
            )
        for name in mtp:  # model.drop_mtp=true: left out, as the import then reads none of them
            held.pop(name)
    scales = {name + SCALE for name in expected if name in held and held[name][0] == FP8_DTYPE}
    fused = sorted(n for n in held if n.endswith(FUSED_EXPERTS))
    if fused:
        raise HFImportError(
            f"model.init_from={where} holds the experts fused ({fused[0]}), not per expert as the Hub's checkpoints; "
            f"load it with transformers' {arch.name}.from_pretrained and save_pretrained it into a new directory"
        )
    unused = sorted(set(held) - set(expected) - scales, key=_order)
    deeper = [n for n in unused if _order(n)[0] >= m.n_layers]
    if deeper:
        layers = max(_order(n)[0] for n in deeper) + 1
        raise HFImportError(
            f"model.init_from={where}: config.json says num_hidden_layers={m.n_layers}, but the checkpoint holds "
            f"{layers} layers ({deeper[0]}): p3d would drop the last {layers - m.n_layers}; set "
            f"num_hidden_layers={layers} in config.json"
        )
    if unused:
        others = _owners(unused[0], arch)
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        why = (
            f"; {' and '.join(others)} {'has' if len(others) == 1 else 'have'} it: correct config.json's "
            "model_type and architectures"
            if others
            else "; p3d imports a checkpoint only when it uses every tensor"
        )
        raise HFImportError(
            f"model.init_from={where}: {unused[0]}{more} is in the checkpoint but not in {arch.name} as config.json "
            f"describes it (model_type={arch.model_type}): p3d would drop it{why}"
        )
    missing = sorted(set(expected) - set(held), key=_order)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise HFImportError(
            f"model.init_from={where}: {missing[0]}{more} is missing from the checkpoint; {arch.name} as config.json "
            "describes it needs it"
        )
    for name in sorted(expected, key=_order):
        dtype, shape = held[name]
        if tuple(shape) != expected[name]:
            raise HFImportError(
                f"model.init_from={where}: {name} is {list(shape)} in {files.where[name]}, but config.json's shape "
                f"makes it {list(expected[name])}"
            )
        if dtype == FP8_DTYPE and arch.fp8_blocks:
            check_quantized(name, shape, held, block, where)
        elif dtype not in FLOAT_DTYPES:
            raise HFImportError(
                f"model.init_from={where}: {name} is stored as {dtype}: p3d imports unquantized weights "
                f"({', '.join(FLOAT_DTYPES)}) only"
            )
