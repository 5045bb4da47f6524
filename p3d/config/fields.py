"""The schema's dotted fields (p3d.config.schema): every one that takes a value, whether a key names one, and the
nearest to a misspelt key, for the one-line refusals of keys p3d does not know (before Hydra composes:
p3d.launch.override_keys; after, a ``+key=`` that got past Hydra: p3d.rundir.spec)."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

from p3d.config.schema import Config


def unwrap(hint: Any) -> Any:
    """``Optional[X]`` (``X | None``) -> X; ``list[str]`` -> list; anything else as it is."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return typing.get_origin(hint) or hint


def schema_options(schema: type = Config, prefix: str = "") -> list[str]:
    """Every dotted field of the schema that takes a value (``train.steps``, ``model.moe.top_k``, ``dry_run``)."""
    found: list[str] = []
    for name, hint in typing.get_type_hints(schema).items():
        inner = unwrap(hint)
        if isinstance(inner, type) and dataclasses.is_dataclass(inner):
            found += schema_options(inner, f"{prefix}{name}.")
        else:
            found.append(f"{prefix}{name}")
    return found


def known_key(key: str) -> bool:
    """Whether the dotted ``key`` names a field of the schema, a section (``model.moe``), or something inside a list
    field (``cluster.groups.0.nodes``: its items are checked when composed)."""
    owner: type = Config
    for part in key.split("."):
        hints = typing.get_type_hints(owner)
        if part not in hints:
            return False
        inner = unwrap(hints[part])
        if inner is list or inner is dict:
            return True
        if not (isinstance(inner, type) and dataclasses.is_dataclass(inner)):
            return part == key.split(".")[-1]
        owner = inner
    return True


def closest_options(key: str, n: int = 1) -> list[str]:
    """The schema's fields nearest ``key``: one of the same name in another section first (``train.seq_len`` ->
    ``model.seq_len``), then by spelling (``trian.steps`` -> ``train.steps``)."""
    options = schema_options()
    name = key.rsplit(".", 1)[-1]
    same_name = [o for o in options if o.rsplit(".", 1)[-1] == name]
    near = difflib.get_close_matches(key, options, n=n + len(same_name), cutoff=0.75)
    return list(dict.fromkeys(same_name + near))[:n]


def unknown_option(key: str, value: str) -> str:
    """'trian.steps=1 is not a p3d option; did you mean train.steps? try train.steps=1' (no source: the caller's)."""
    close = closest_options(key)
    if close:
        return f"{key}={value} is not a p3d option; did you mean {close[0]}? try {close[0]}={value}"
    return f"{key}={value} is not a p3d option; remove it (p3d-train --cfg job lists the options)"
