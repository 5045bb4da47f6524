"""A command-line key p3d does not know, a group option that does not exist, or a sweep given to a single run, refused
in one line before Hydra composes (Hydra reports each in six or seven lines, and for a misspelt key suggests the
``+key=`` form, which p3d's schema refuses too):

    trian.steps=1 (command line) is not a p3d option; did you mean train.steps? try train.steps=1
    mesh=tp2_pp3 (command line) is not an option of the mesh group; did you mean tp2_pp4? try mesh=tp2_pp4
    data.path=a.jsonl,b.jsonl (command line) has a comma outside quotes, which Hydra reads as a sweep; ...

The nearest fields come from the schema (p3d.config.fields); the group options from the files
of ``conf/``. Overrides of Hydra's own (``hydra.*``, ``hydra/launcher=...``) are left to Hydra.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from p3d.config.fields import known_key, unknown_option


def group_options(conf: Path, group: str) -> list[str]:
    return sorted(p.stem for p in (conf / group).glob("*.yaml"))


def refused_key(argv: list[str], conf: Path, groups: set[str]) -> str | None:
    """The one-line refusal of the first override of ``argv`` whose key p3d does not know, whose group option does
    not exist, or that sweeps without ``-m``; None when there is none."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    multirun = any(a in ("-m", "--multirun") for a in argv)
    try:
        lines = [a for a in argv if ("=" in a or a.startswith("~")) and not a.startswith("-")]
        overrides = OverridesParser.create().parse_overrides(lines)
    except HydraException:  # not Hydra's override grammar: Hydra says so itself
        return None
    for o in overrides:
        key = o.key_or_group
        if o.is_hydra_override() or o.package or key.startswith("hydra"):
            continue
        given = str(o.input_line).split("=", 1)[1] if "=" in str(o.input_line) else ""
        if o.is_sweep_override() and not multirun:
            if key in groups:
                return f"{key}={given} (command line) sweeps over several options; add -m to run one run per option"
            return (
                f"{key}={given} (command line) has a comma outside quotes, which Hydra reads as a sweep; to give one "
                f"value that holds commas, quote it for Hydra: '{key}=\"{given}\"' (or add -m to sweep)"
            )
        if key in groups:
            if o.type == OverrideType.DEL:
                continue
            options = group_options(conf, key)
            values = [str(v) for v in o.sweep_iterator()] if o.is_sweep_override() else [str(o.value())]
            for value in values:
                if value not in options:
                    near = difflib.get_close_matches(value, options, n=1, cutoff=0.6)
                    fix = f"did you mean {near[0]}? try {key}={near[0]}" if near else f"one of: {', '.join(options)}"
                    return f"{key}={value} (command line) is not an option of the {key} group; {fix}"
            continue
        if not known_key(key):
            if o.type == OverrideType.DEL:
                return f"~{key} (command line) is not a p3d option; remove it (p3d-train --cfg job lists the options)"
            return unknown_option(key, given).replace(" is not", " (command line) is not", 1)
    return None
