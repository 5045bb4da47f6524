"""A Hugging Face checkpoint directory read without torch: config.json, which file holds which tensor, and every
tensor's dtype and shape from the safetensors headers (an 8-byte little-endian length, then that many bytes of
JSON: ``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": ...}``). The launcher checks a checkpoint with
this before any worker starts; the workers read the tensors' slices through p3d.hf.load."""

from __future__ import annotations

import json
from pathlib import Path

from p3d.hf.names import HFImportError

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # what a weight may be stored as (an FP8 or integer one is quantized)


def read_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir).expanduser() / "config.json"
    if not path.is_file():
        raise HFImportError(
            f"model.init_from={hf_dir}: no config.json there; give a local directory of a Hugging Face checkpoint "
            "(config.json and *.safetensors) of an architecture docs/models.md lists"
        )
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise HFImportError(f"model.init_from={hf_dir}: config.json is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise HFImportError(f"model.init_from={hf_dir}: config.json is not a JSON object")
    return config


def _shard_list(index: Path) -> str:
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError):
        return "unreadable"
    return ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def read_header(path: Path) -> dict[str, tuple[str, list[int]]]:
    """{tensor name: (dtype, shape)} of one safetensors file, from its header alone."""
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length <= 0 or length > path.stat().st_size - 8:
            raise ValueError(f"header length {length} does not fit the file")
        header = json.loads(f.read(length))
    return {name: (v["dtype"], list(v["shape"])) for name, v in header.items() if name != "__metadata__"}


class CheckpointFiles:
    """The tensors of a HF checkpoint directory (one model.safetensors, or shards with an index): ``where`` (tensor
    -> file) and ``headers`` (tensor -> (dtype, shape)), read once without torch."""

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
            try:
                self.where: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError):
                raise HFImportError(f"model.init_from={hf_dir}: {INDEX} has no weight_map") from None
        elif single.is_file():
            self.where = {}
        else:
            raise HFImportError(f"model.init_from={hf_dir}: no model.safetensors or model.safetensors.index.json")
        files = sorted(set(self.where.values())) or [SINGLE]
        for file in files:
            if not (self.dir / file).is_file():
                raise HFImportError(f"model.init_from={hf_dir}: shard {self.dir / file} is missing")
        self.headers: dict[str, tuple[str, list[int]]] = {}
        for file in files:
            try:
                header = read_header(self.dir / file)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise HFImportError(f"model.init_from={hf_dir}: {file} is not a safetensors file ({exc})") from None
            self.headers |= header
            for name in header:
                self.where.setdefault(name, file)
        listed = sorted(set(self.where) - set(self.headers))
        if listed:
            raise HFImportError(
                f"model.init_from={hf_dir}: {INDEX} places {listed[0]} in {self.where[listed[0]]}, which does not hold "
                "it; the index and the shards are of different exports"
            )

    def shape(self, name: str) -> list[int]:
        if name not in self.headers:
            raise HFImportError(f"model.init_from={self.dir}: tensor {name} is not in the checkpoint")
        return self.headers[name][1]
