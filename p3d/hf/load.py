"""Hugging Face Llama checkpoints: import (``model.init_from=<dir>``) and export (``p3d-export``).

p3d's Llama uses HF's conventions (RoPE rotating halves, RMSNorm, SwiGLU, no biases), so weights map
one to one; only our fused q|k|v and gate|up matrices are split into their HF parts:

    p3d (global name)                        HF
    0.weight | tied_modules.embed.weight     model.embed_tokens.weight
    <i+1>.attn_norm.weight                   model.layers.<i>.input_layernorm.weight
    <i+1>.attn.wqkv.weight  (q | k | v)      model.layers.<i>.self_attn.{q,k,v}_proj.weight
    <i+1>.attn.wo.weight                     model.layers.<i>.self_attn.o_proj.weight
    <i+1>.mlp_norm.weight                    model.layers.<i>.post_attention_layernorm.weight
    <i+1>.mlp.w_gate_up.weight (gate | up)   model.layers.<i>.mlp.{gate,up}_proj.weight
    <i+1>.mlp.w_down.weight                  model.layers.<i>.mlp.down_proj.weight
    <L+1>.weight                             model.norm.weight
    <L+2>.weight (untied)                    lm_head.weight

Import reads, on every rank, only the slices of each tensor that rank holds (safetensors slices), so
a 70B import never needs the whole model on one process. ``transformers`` is not needed for either
direction; ``safetensors`` is (the ``hf`` extra).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where weights are read: the launcher checks HF dirs without it
    import torch


ARCH = "LlamaForCausalLM"
_BLOCK = {
    "attn_norm.weight": ["input_layernorm.weight"],
    "attn.wqkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "attn.wo.weight": ["self_attn.o_proj.weight"],
    "mlp_norm.weight": ["post_attention_layernorm.weight"],
    "mlp.w_gate_up.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.w_down.weight": ["mlp.down_proj.weight"],
}


class HFImportError(ValueError):
    """A HF checkpoint p3d cannot import; the message names the file or field."""


def hf_names(name: str, n_layers: int) -> list[str]:
    """HF tensor names, in block order, of the p3d parameter ``name``."""
    if name == "tied_modules.embed.weight" or name == "0.weight":
        return ["model.embed_tokens.weight"]
    head, rest = name.split(".", 1)
    layer = int(head)
    if layer == n_layers + 1:
        return ["model.norm.weight"]
    if layer == n_layers + 2:
        return ["lm_head.weight"]
    return [f"model.layers.{layer - 1}.{part}" for part in _BLOCK[rest]]


# ---- config.json <-> model group


def read_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir).expanduser() / "config.json"
    if not path.is_file():
        raise HFImportError(
            f"model.init_from={hf_dir}: no config.json there; give a local directory of a Hugging Face Llama "
            "checkpoint (config.json and *.safetensors)"
        )
    return json.loads(path.read_text())


def model_fields(hf: dict, where: str) -> dict:
    """The p3d model fields of a HF Llama config.json; refuses other architectures and features."""
    arch = (hf.get("architectures") or [None])[0]
    if hf.get("model_type") != "llama" or arch not in (None, ARCH):
        raise HFImportError(
            f"model.init_from={where}: config.json describes {arch or hf.get('model_type')} "
            f"(model_type={hf.get('model_type')}); p3d imports {ARCH} checkpoints only"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise HFImportError(f"model.init_from={where}: {flag}=true is not supported (p3d's Llama has no biases)")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or ({} if rope.get("rope_type", "default") == "default" else rope)
    if scaling:
        raise HFImportError(
            f"model.init_from={where}: RoPE scaling {scaling.get('rope_type', scaling)} is not "
            "supported yet (plain RoPE only)"
        )
    heads = hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
        raise HFImportError(f"model.init_from={where}: head_dim={hf['head_dim']} differs from hidden/heads")
    return {
        "n_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "n_heads": heads,
        "n_kv_heads": hf.get("num_key_value_heads") or heads,
        "ffn_hidden_size": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-5)),
    }


def hf_config(m, eos_id: int | None = None) -> dict:
    return {
        "architectures": [ARCH],
        "model_type": "llama",
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.hidden_size // m.n_heads,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "tie_word_embeddings": m.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "eos_token_id": eos_id,
    }


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


def local_from_hf(src: SafetensorsDir, name: str, spec: dict, n_layers: int, tp: int, rank: int) -> torch.Tensor:
    """This rank's shard of p3d parameter ``name``, read slice by slice from the HF tensors."""
    import torch
    import torch.nn.functional as F

    parts = hf_names(name, n_layers)
    if spec["kind"] == "replicated":
        return src.whole(parts[0])
    if spec["kind"] == "cols":
        width = src.shape(parts[0])[1] // tp
        return src.cols(parts[0], rank * width, (rank + 1) * width)
    out = []
    for part, real, padded in zip(parts, spec["blocks"], spec["padded"]):
        per_rank = padded // tp
        start, stop = rank * per_rank, min((rank + 1) * per_rank, real)
        rows = src.rows(part, start, max(start, stop))
        out.append(F.pad(rows, (0, 0, 0, per_rank - rows.shape[0])))  # vocab padding rows are zero
    return torch.cat(out, dim=0)


def load_into(module: torch.nn.Module, hf_dir: str | Path, n_layers: int, mesh) -> int:
    """Copy a HF checkpoint's weights into this rank's pipeline stage; returns the number of tensors."""
    import torch

    from p3d.checkpoint.checkpointer import shard_specs

    with torch.no_grad():
        return _load_into(module, SafetensorsDir(hf_dir), shard_specs(module), hf_dir, n_layers, mesh)


def _load_into(module, src: SafetensorsDir, specs: dict, hf_dir, n_layers: int, mesh) -> int:
    n = 0
    for name, p in module.named_parameters():
        local = local_from_hf(src, name, specs[name], n_layers, mesh.tp, mesh.tp_rank)
        if tuple(local.shape) != tuple(p.shape):
            raise HFImportError(
                f"model.init_from={hf_dir}: {hf_names(name, n_layers)} gives {tuple(local.shape)} "
                f"for {name}, this rank needs {tuple(p.shape)}"
            )
        p.copy_(local.to(p.dtype))
        n += 1
    return n
