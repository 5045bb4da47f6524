"""``p3d-export run.dir=<run> out=<dir> [step=N] [max_shard_gb=5] [overwrite=false] [dtype=fp32|bf16]``: a
checkpoint as a Hugging Face directory of its family's architecture (p3d.hf.export)."""

from __future__ import annotations

import sys

from p3d import exit_codes
from p3d.hf.export import KEYS, USAGE, ExportError, export


def parse_args(argv: list[str]) -> dict:
    """p3d-export's ``key=value`` arguments, typed; ExportError names a bad one."""
    raw: dict[str, str] = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ExportError(f"argument {arg!r} is not key=value; {USAGE}")
        if key not in KEYS:
            raise ExportError(f"unknown argument {arg}; {USAGE}")
        raw[key] = value
    for key in ("run.dir", "out"):
        if not raw.get(key):
            raise ExportError(f"{key}=<dir> is missing; {USAGE}")
    args: dict = {"run_dir": raw["run.dir"], "out": raw["out"]}
    if "step" in raw:
        if not raw["step"].strip().isdigit():
            raise ExportError(
                f"step={raw['step']} is not a step number; leave it out for the newest checkpoint "
                "or give one, e.g. step=200"
            )
        args["step"] = int(raw["step"])
    if "max_shard_gb" in raw:
        try:
            args["max_shard_gb"] = float(raw["max_shard_gb"])
        except ValueError:
            args["max_shard_gb"] = float("nan")
        if not args["max_shard_gb"] > 0 or args["max_shard_gb"] == float("inf"):
            raise ExportError(f"max_shard_gb={raw['max_shard_gb']} must be a positive number of GB; try max_shard_gb=5")
    if "overwrite" in raw:
        flag = raw["overwrite"].lower()
        if flag not in ("true", "false"):
            raise ExportError(f"overwrite={raw['overwrite']} must be true or false")
        args["overwrite"] = flag == "true"
    if "dtype" in raw:
        args["dtype"] = raw["dtype"]
    return args


def main(argv: list[str] | None = None) -> int:
    """Console script ``p3d-export run.dir=<run> out=<dir> [step=N] [max_shard_gb=5] [overwrite=false]
    [dtype=fp32|bf16]``."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(USAGE)
        return exit_codes.OK
    try:
        export(**parse_args(argv))
    except ExportError as exc:
        print(f"p3d-export: {exc}", file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    except OSError as exc:
        print(f"p3d-export: cannot export ({type(exc).__name__}: {exc}); nothing was written", file=sys.stderr)
        return exit_codes.WORKER_FAILED
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
