"""Closed choices of the config: Enums that OmegaConf checks at compose time (a typo on the command line fails in
one line listing the valid values: p3d.launch.override_types) and that compare, hash and print as their values, so
code and YAML keep using plain strings."""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)
