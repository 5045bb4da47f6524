"""What the data stream left out, and why, in words a user can act on.

Every rank that reads data reads the same stream and counts alike; the trainer compares
:meth:`DataStats.counts` across ranks every step. Empty documents (a blank line, an empty file or
record) hold nothing to train on and are counted apart, without a warning. Unreadable ones (bytes
that are not UTF-8, a record with no text) and files that fail part-way are warned about once per
file and summed up, file by file, in :meth:`DataStats.summary` at the end of a run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger("p3d.data")

_MAX_NAMED = 4  # files named in the summary; the rest are counted


@dataclass
class DataStats:
    """Counts over the whole run (every epoch); the per-file details cover one pass over each file."""

    skipped_records: int = 0  # unreadable: bytes that are not UTF-8, no text in the text column, or malformed
    malformed_records: int = 0  # of those: json / csv records that do not parse (p3d.data.records)
    failed_files: int = 0  # files whose rest was skipped after an error part-way
    empty_records: int = 0  # empty or blank documents: nothing to train on, not a problem
    not_utf8: dict[str, list[int]] = field(default_factory=dict)  # file -> [units skipped, first bad byte]
    no_text: dict[str, int] = field(default_factory=dict)  # file or source -> records with no text
    bad_lines: dict[str, list] = field(default_factory=dict)  # file -> [records skipped, first line, why]
    failed: dict[str, str] = field(default_factory=dict)  # file -> why it failed
    unit: str = "record"  # what a document is here (line, paragraph, document, record): the summary's noun
    column: str = "text"
    passed: set[str] = field(default_factory=set)  # files read to their end at least once

    def counts(self) -> list[int]:
        """What every data-reading rank must agree on, step after step."""
        return [self.skipped_records, self.failed_files, self.empty_records]

    def bad_bytes(self, where: str, byte: int, value: int) -> None:
        self.skipped_records += 1
        if where in self.passed:
            return
        seen = self.not_utf8.setdefault(where, [0, byte])
        seen[0] += 1
        if seen[0] == 1:
            log.warning(
                "p3d data: %s: a %s with bytes that are not UTF-8 (0x%02x at byte %d) is skipped; convert "
                "the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)",
                where,
                self.unit,
                value,
                byte,
            )

    def missing_text(self, where: str) -> None:
        self.skipped_records += 1
        if where in self.passed:
            return
        self.no_text[where] = self.no_text.get(where, 0) + 1
        if self.no_text[where] == 1:
            log.warning(
                "p3d data: %s: a record has no text in column '%s' (null or not a string); it is skipped",
                where,
                self.column,
            )

    def malformed(self, where: str, line: int, why: str) -> None:
        """A json / csv record that does not parse (p3d.data.records): that record is skipped, not the file's rest."""
        self.skipped_records += 1
        self.malformed_records += 1
        if where in self.passed:
            return
        seen = self.bad_lines.setdefault(where, [0, line, why])
        seen[0] += 1
        if seen[0] == 1:
            log.warning("p3d data: %s: line %d is %s; that record is skipped", where, line, why)

    def file_failed(self, where: str, after: int, why: str) -> None:
        self.failed_files += 1
        if where in self.failed:
            return
        self.failed[where] = f"after {after} records: {why}"
        log.warning("p3d data: skipped the rest of %s after %d records: %s", where, after, why)

    def summary(self) -> str:
        """One line, or "" when nothing was skipped (empty documents are not "skipped": nothing was lost)."""
        parts = []
        if self.not_utf8:
            n = sum(c for c, _ in self.not_utf8.values())
            if len(self.not_utf8) == 1:
                ((where, (_, byte)),) = self.not_utf8.items()
                parts.append(
                    f"{_plural(n, self.unit)} of {where} with bytes that are not UTF-8 (the first at byte "
                    f"{byte}): convert the file to UTF-8"
                )
            else:
                per_file = [f"{f}: {c} from byte {b}" for f, (c, b) in self.not_utf8.items()]
                parts.append(
                    f"{_plural(n, self.unit)} with bytes that are not UTF-8 ({_named(per_file)}): convert "
                    "those files to UTF-8"
                )
        if self.no_text:
            n = sum(self.no_text.values())
            per_file = [f"{f}: {c}" for f, c in self.no_text.items()]
            parts.append(
                f"{_plural(n, 'record')} with no text in column '{self.column}' (null or not a string; "
                f"{_named(per_file)})"
            )
        if self.bad_lines:
            n = sum(c for c, _, _ in self.bad_lines.values())
            per_file = [
                f"{f}: {c} from line {line} ({why})" if c > 1 else f"{f} line {line}: {why}"
                for f, (c, line, why) in self.bad_lines.items()
            ]
            parts.append(f"{_plural(n, 'malformed record')} ({_named(per_file, '; ')}): fix or remove them")
        if self.failed:
            per_file = [f"{f} {why}" for f, why in self.failed.items()]
            files = _plural(len(self.failed), "file")
            parts.append(f"the rest of {files} that failed part-way ({_named(per_file, '; ')})")
        return "data: skipped " + "; ".join(parts) if parts else ""


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _named(items: list[str], sep: str = ", ") -> str:
    more = len(items) - _MAX_NAMED
    return sep.join(items[:_MAX_NAMED]) + (f"{sep}and {more} more files" if more > 0 else "")
