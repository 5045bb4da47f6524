"""A command-line value the schema's field cannot hold, refused in one line before Hydra composes.

``mesh.cp=1.5``, ``train.lr=abc``, ``mesh.ep=null``, ``logger.mode=bogus``: Hydra reports each in six lines (its
error, OmegaConf's, full_key, reference_type, object_type, the HYDRA_FULL_ERROR hint). Here each override's value
(every value of a sweep) is put into its field's schema dataclass (p3d.config.schema) by OmegaConf itself, the
conversion Hydra's merge does, and the first it refuses becomes one line naming the field, the value, the type
it takes and an override of that type, the field's default:

    mesh.cp=1.5 (command line) must be an integer; try mesh.cp=1

Overrides of Hydra's own (``hydra.*``), deletions, ``+key`` additions, group choices and keys the schema does not
know are left to Hydra and to p3d's later checks.
"""

from __future__ import annotations

import dataclasses
import typing
from enum import Enum
from typing import Any

from p3d.config.fields import unwrap as _unwrap
from p3d.config.schema import Config


def wrong_type(argv: list[str]) -> str | None:
    """The one-line refusal of the first override in ``argv`` whose value its field cannot hold, or None."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    try:
        overrides = OverridesParser.create().parse_overrides([a for a in argv if "=" in a and not a.startswith("-")])
    except HydraException:  # not Hydra's override grammar: Hydra says so itself
        return None
    for o in overrides:
        if o.is_hydra_override() or o.type not in (OverrideType.CHANGE, OverrideType.FORCE_ADD) or o.package:
            continue
        found = schema_field(o.key_or_group)
        if found is None:
            continue
        owner, name, hint = found
        try:
            values = list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()]
        except HydraException:  # an interval sweep has no values to list; its bounds are numbers anyway
            continue
        for value in values:
            problem = merge_problem(owner, name, value)
            if problem is not None:
                given = hydra_text(value) if o.is_sweep_override() else str(o.input_line).split("=", 1)[1]
                if problem:  # an item with a key its type has no field for
                    return (
                        f"{o.key_or_group}={given} (command line): {problem} is not a field of its items "
                        f"({_what(hint)}); drop {problem}"
                    )
                # a list field given one item that fits it (train.trace_steps=2): that item as a list, else the default
                single = _unwrap(hint) is list and not isinstance(value, list) and holds(owner, name, [value])
                fix = f"[{hydra_text(value)}]" if single else hydra_text(getattr(owner(), name))
                return f"{o.key_or_group}={given} (command line) {takes(hint, value)}; try {o.key_or_group}={fix}"
    return None


def schema_field(key: str) -> tuple[type, str, Any] | None:
    """(the schema dataclass that holds ``key``, the field's name, its type) for a dotted key (``mesh.cp``) or a
    top-level option (``dry_run``); None for a group choice (``mesh``) or a key the schema does not know."""
    owner: type = Config
    *path, name = key.split(".")
    for part in path:
        inner = _unwrap(typing.get_type_hints(owner).get(part))
        if not (isinstance(inner, type) and dataclasses.is_dataclass(inner)):
            return None
        owner = inner
    hint = typing.get_type_hints(owner).get(name)
    if hint is None or dataclasses.is_dataclass(_unwrap(hint)):
        return None
    return owner, name, hint


def holds(owner: type, name: str, value: Any) -> bool:
    """Whether OmegaConf puts ``value`` into the field ``name`` of a fresh ``owner``, as Hydra's merge would."""
    return merge_problem(owner, name, value) is None


def merge_problem(owner: type, name: str, value: Any) -> str | None:
    """None when OmegaConf puts ``value`` into the field ``name`` of a fresh ``owner``; else what is wrong: '' for a
    value of the wrong type, or a key that the list's or mapping's items have no field for (``bogus``)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, ConfigTypeError, ValidationError

    node = OmegaConf.structured(owner)
    try:  # a merge, not an assignment: a list of dicts goes into a list of dataclasses only by merging
        OmegaConf.merge(node, {name: value})
    except ConfigKeyError as exc:  # {device: cpu, bogus: 3} into a list of ClusterGroup
        return str(exc).splitlines()[0].split("'")[1] if "'" in str(exc) else ""
    except (ValidationError, ConfigTypeError):  # a mapping where a list goes, 'abc' for a number, ...
        return ""
    return None


def takes(hint: Any, value: Any) -> str:
    """What the field takes, said to a user: ``must be an integer``, ``may not be null (an integer)``."""
    return f"may not be null ({_what(hint)})" if value is None else f"must be {_what(hint)}"


def _what(hint: Any) -> str:
    """``an integer``, ``one of text, json``, ``a list of strings``, ``a list of {path: a string, weight: a
    number}``."""
    inner = _unwrap(hint)
    if isinstance(inner, type) and issubclass(inner, Enum):
        return "one of " + ", ".join(str(m.value) for m in inner)
    if isinstance(inner, type) and dataclasses.is_dataclass(inner):
        fields = typing.get_type_hints(inner)
        return "{" + ", ".join(f"{name}: {_what(t)}" for name, t in fields.items()) + "}"
    if inner is list:
        items = typing.get_args(hint) or typing.get_args(next(iter(typing.get_args(hint)), None))
        plural = {int: "integers", float: "numbers", str: "strings", bool: "true or false values"}
        return f"a list of {plural.get(items[0]) or _what(items[0])}" if items else "a list"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(inner, "another type")


def hydra_text(value: Any) -> str:
    """A value as it is written on Hydra's command line: null, true, 0.003, interleaved_1f1b."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(hydra_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {hydra_text(v)}" for k, v in value.items()) + "}"
    return str(value)
