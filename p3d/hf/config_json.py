"""config.json <-> the model group, for every architecture of p3d.hf.architectures, read from its description.

Import (``model_fields``): the architecture from ``model_type`` / ``architectures``; each field the description
maps; RoPE from ``rope_parameters`` (transformers 5), the older ``rope_scaling`` (``type`` or ``rope_type``), or a
bare ``rope_theta``; the attention window (``sliding_window``, and Qwen's ``use_sliding_window`` /
``max_window_layers`` / ``layer_types``); the fields the architecture fixes. ``check_keys`` then refuses, in one
line, every key p3d would ignore: one the architecture does not have, or a value p3d's model cannot hold.
Export (``hf_config``, after ``export_problem``): the same description backwards. No torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from p3d.config.options import RopeType
from p3d.config.schema import MLAConfig, MoEConfig, RopeScaling
from p3d.hf.architectures import ARCHITECTURES, BY_FAMILY, Architecture, Field, of_model
from p3d.hf.architectures.base import REQUIRED
from p3d.hf.names import HFImportError
from p3d.layout.geometry import expert_ffn_size, head_dim

ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta")
_ROPE_FIELDS = {f.name for f in dataclasses.fields(RopeScaling)} - {"rope_type"}
_ROPE_META = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
COMMON_WRITTEN = {"hidden_act": "silu", "attention_dropout": 0.0}


def _families() -> str:
    return ", ".join(a.name for a in ARCHITECTURES)


def architecture_of(hf: dict, where: str) -> Architecture:
    """The description of config.json ``hf``'s architecture, or a one-line refusal naming the ones p3d imports."""
    model_type = hf.get("model_type")
    name = (hf.get("architectures") or [None])[0]
    arch = BY_FAMILY.get(model_type) if isinstance(model_type, str) else None
    if arch is None or name not in (None, arch.name):
        raise HFImportError(
            f"model.init_from={where}: config.json describes {name or model_type} (model_type={model_type}); "
            f"p3d imports {_families()} checkpoints (docs/models.md)"
        )
    return arch


def _key(spec: str | Field) -> str:
    return spec if isinstance(spec, str) else spec.key


def _raw(hf: dict, key: str, arch: Architecture, where: str) -> Any:
    for name in (key, *arch.aliases.get(key, ())):
        if name in hf:
            return hf[name]
    if key in REQUIRED:
        raise HFImportError(f"model.init_from={where}: config.json has no {key}, which {arch.name} needs")
    return arch.defaults.get(key)


def model_fields(hf: dict, where: str, keys: bool = True) -> dict:
    """Every shape field of the model group for config.json ``hf`` (model.family included), so that an import
    replaces a preset's whole shape. ``keys``: also refuse the keys p3d would ignore (``check_keys``; the launcher
    checks the tensors first, whose refusal says more about a mislabelled checkpoint)."""
    arch = architecture_of(hf, where)
    values: dict[str, Any] = {}
    for field, spec in arch.fields.items():
        raw = _raw(hf, _key(spec), arch, where)
        try:
            values[field] = spec.read(raw) if isinstance(spec, Field) and spec.read else raw
        except ValueError as exc:
            raise HFImportError(f"model.init_from={where}: {exc}") from None
    values["n_kv_heads"] = values["n_kv_heads"] or values["n_heads"]
    values.setdefault("head_dim", None)  # an architecture without one (DeepSeek-V3's MLA): not the preset's
    if (
        values.get("head_dim") == values["hidden_size"] // values["n_heads"]
        and not values["hidden_size"] % values["n_heads"]
    ):
        values["head_dim"] = None  # the derived width: the same model as a preset that leaves it null
    values["tie_embeddings"] = bool(values["tie_embeddings"])
    values["norm_eps"] = float(values["norm_eps"])
    values["rope_theta"], values["rope_scaling"] = read_rope(hf, arch, where)
    values["sliding_window"] = read_window(hf, arch, values["n_layers"])
    for field, fixed in arch.fixed.items():
        values[field] = fixed.value
    moe = {k.removeprefix("moe."): values.pop(k) for k in list(values) if k.startswith("moe.")}
    values["moe"] = MoEConfig(**moe) if arch.moe else None
    mla = {k.removeprefix("mla."): values.pop(k) for k in list(values) if k.startswith("mla.")}
    values["mla"] = MLAConfig(**mla)
    if values["moe"] is not None:
        values["moe"].aux_loss_coef = float(values["moe"].aux_loss_coef)
    values["family"] = arch.model_type
    if keys:
        check_keys(hf, where)
    return values


def read_rope(hf: dict, arch: Architecture, where: str) -> tuple[float, RopeScaling]:
    """(rope_theta, rope_scaling) from rope_parameters, else rope_scaling, else a bare rope_theta."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    if any(isinstance(v, dict) for v in params.values()):
        raise HFImportError(f"model.init_from={where}: rope_parameters per layer type are not supported (one RoPE)")
    theta = float(params.get("rope_theta", hf.get("rope_theta", arch.defaults["rope_theta"])))
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFImportError(
            f"model.init_from={where}: partial_rotary_factor={params['partial_rotary_factor']} is not supported "
            "(p3d rotates the whole head)"
        )
    scaling = {k: v for k, v in params.items() if k not in _ROPE_META}
    if kind == "default":
        if scaling:
            raise HFImportError(
                f"model.init_from={where}: rope_type=default with {sorted(scaling)}: p3d would ignore them"
            )
        return theta, RopeScaling()
    if kind not in RopeType.__members__:
        raise HFImportError(
            f"model.init_from={where}: RoPE scaling rope_type={kind} is not supported (p3d: "
            f"{', '.join(RopeType.__members__)})"
        )
    unknown = sorted(set(scaling) - _ROPE_FIELDS)
    if unknown:
        raise HFImportError(f"model.init_from={where}: rope_type={kind} with {unknown[0]}: p3d would ignore it")
    if kind in ("llama3", "yarn") and scaling.get("original_max_position_embeddings") is None:
        scaling["original_max_position_embeddings"] = hf.get("max_position_embeddings")  # transformers does so
    if kind == "yarn" and scaling.get("factor") is None:
        scaling["factor"] = hf["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    return theta, RopeScaling(rope_type=RopeType(kind), **scaling)


def read_window(hf: dict, arch: Architecture, n_layers: int) -> int | None:
    """The attention window of any layer, or None: Qwen's windows are off unless use_sliding_window, and only the
    layers from max_window_layers on (or those layer_types says) have one. p3d refuses any window shorter than
    model.seq_len (p3d.layout.model_rules), so one number stands for them all."""
    if "sliding_window" not in arch.window_keys:
        return None
    window = hf.get("sliding_window", arch.defaults.get("sliding_window"))
    if "use_sliding_window" in arch.window_keys and not hf.get("use_sliding_window", False):
        return None
    types = hf.get("layer_types")
    if types is not None:
        return window if "sliding_attention" in types else None
    if "layer_types" in arch.window_keys and hf.get("max_window_layers", 0) >= n_layers:
        return None  # Qwen2/3: the layers from max_window_layers on have the window
    return window


def check_keys(hf: dict, where: str) -> None:
    """Refuse, in one line, a config.json key p3d would ignore: not one the architecture has, or a value p3d's model
    cannot hold (hidden_act=gelu, attention_bias=true on Llama, a quantization_config, ...)."""
    arch = architecture_of(hf, where)
    read = {_key(s) for s in arch.fields.values()} | {
        a for k in arch.fields.values() for a in arch.aliases.get(_key(k), ())
    }
    known = read | set(ROPE_KEYS) | set(arch.window_keys) | arch.ignored | {arch.mtp_key}
    if arch.fp8_blocks:  # its quantization_config is read where the scales are (p3d.hf.check), refused there if odd
        known.add("quantization_config")
    for key, value in hf.items():
        if key in known:
            continue
        if key in arch.accepted:
            if value not in arch.accepted[key] or isinstance(value, bool) != isinstance(arch.accepted[key][0], bool):
                raise HFImportError(
                    f"model.init_from={where}: {key}={_show(value)} is not supported (p3d's {arch.name} has "
                    f"{key}={_show(arch.accepted[key][0])}; it would ignore this value)"
                )
            continue
        raise HFImportError(
            f"model.init_from={where}: config.json's {key}={_show(value)} is not a field of {arch.name} p3d knows: it "
            "would ignore it; if it changes nothing, delete it from config.json"
        )
    types = set(hf.get("layer_types") or ()) - {"full_attention", "sliding_attention"}
    if types:
        raise HFImportError(
            f"model.init_from={where}: layer_types holds {sorted(types)[0]}, which p3d has no block for"
        )


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if hasattr(value, "value"):
        return str(value.value)
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- model group -> config.json


def model_value(m, field: str) -> Any:
    """The model field ``field`` (``moe.top_k``: of model.moe) of ``m``, with the widths p3d derives filled in."""
    if field == "head_dim":
        return head_dim(m)
    if field == "max_position_embeddings":
        return context_length(m)
    if field == "moe.expert_ffn_size":
        return expert_ffn_size(m)
    group, _, name = field.rpartition(".")
    return getattr(getattr(m, group) if group else m, name)


def context_length(m) -> int:
    """The context the exported model is made for: the imported (or preset) max_position_embeddings, or the
    trained model.seq_len if that is longer."""
    return max(m.max_position_embeddings or 0, m.seq_len)


def export_problem(m) -> str | None:
    """Why the model ``m`` (a ModelConfig) has no Hugging Face architecture p3d writes, or None: its
    ``model.family`` (or Llama / Mixtral) must hold every field of it the architecture fixes."""
    if m.family is not None and m.family not in BY_FAMILY:
        return f"model.family={m.family} is not one p3d-export writes ({', '.join(BY_FAMILY)})"
    arch = of_model(m)
    what = f"model.family={m.family}" if m.family else ("an MoE model" if m.moe else "a dense model")
    if arch.moe != (m.moe is not None):
        return f"{what} is written as {arch.name}, which {'needs' if arch.moe else 'has no'} experts (model.moe)"
    for field, fixed in arch.fixed.items():
        value = model_value(m, field)
        if value != fixed.value:
            fits = [a.model_type for a in ARCHITECTURES if _holds(a, m)]
            fix = f"try model.family={fits[0]}" if fits else "no architecture p3d-export writes holds it"
            return f"model.{field}={_show(value)}: p3d-export writes {what} as {arch.name}, and {fixed.reason}; {fix}"
    return None


def _holds(arch: Architecture, m) -> bool:
    return arch.moe == (m.moe is not None) and all(model_value(m, f) == x.value for f, x in arch.fixed.items())


def hf_config(m, eos_id: int | None = None, dtype: str = "fp32") -> dict:
    """config.json of the model ``m`` (a ModelConfig; see :func:`export_problem` first), its weights in ``dtype``."""
    arch = of_model(m)
    config: dict[str, Any] = {"architectures": [arch.name], "model_type": arch.model_type}
    for field, spec in arch.fields.items():
        value = model_value(m, field)
        config[_key(spec)] = spec.write(value) if isinstance(spec, Field) and spec.write else value
    config |= rope_json(m) | window_json(m, arch) | COMMON_WRITTEN | dict(arch.written)
    return config | {"torch_dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype], "eos_token_id": eos_id}


def rope_json(m) -> dict:
    """rope_theta, and rope_parameters as transformers 5 reads them (the scaling's non-null fields)."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling.rope_type is not None:
        fields = dataclasses.asdict(m.rope_scaling)
        params |= {k: v for k, v in fields.items() if v is not None and k != "rope_type"}
        params["rope_type"] = m.rope_scaling.rope_type.value
    return {"rope_theta": m.rope_theta, "rope_parameters": params}


def window_json(m, arch: Architecture) -> dict:
    """The architecture's window keys for model.sliding_window (Qwen's: on for every layer, or off)."""
    if "use_sliding_window" in arch.window_keys:
        on = m.sliding_window is not None
        return {
            "use_sliding_window": on,
            "sliding_window": m.sliding_window,
            "max_window_layers": 0 if on else m.n_layers,
        }
    return {"sliding_window": m.sliding_window} if "sliding_window" in arch.window_keys else {}
