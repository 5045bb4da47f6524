"""json / jsonl and csv files read record by record, so one bad record costs that record, not the file's rest.

HF ``datasets`` parses these files a block at a time (pyarrow for json lines, pandas for csv): one line that is not
JSON, or one row with bytes that are not UTF-8, fails the block and everything after it (a jsonl of 24,000 records
with a broken last line lost 1,575 good ones). Here each record is parsed alone; a bad one is skipped, counted in
:class:`p3d.data.stats.DataStats` with its file and line, and named in the run's closing line.

- json / jsonl: one JSON object per line (blank lines are nothing). A file whose first record line is not JSON on
  its own but whose whole text is (a JSON array, or one object over several lines) is that value: an array's
  elements are its records. A line that is not JSON, or JSON that is not an object, is a malformed record.
- csv: the first row names the columns (RFC 4180 quoting: a quoted field may hold line breaks); a row with another
  number of fields than the header is malformed. Every value is text, as written.
- Either: a record whose bytes are not UTF-8 is skipped as a text file's unit is (its byte offset in the file).
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Iterator

from p3d.data.stats import DataStats

_BOM = "\ufeff"


def _decode(raw: bytes, offset: int, where: str, stats: DataStats) -> str | None:
    """``raw`` as UTF-8, or None (counted) when it holds bytes that are not UTF-8; a byte-order mark at the file's
    start dropped."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        stats.bad_bytes(where, offset + exc.start, raw[exc.start])
        return None
    return text.removeprefix(_BOM) if offset == 0 else text


def _whole_file(path: str) -> object | None:
    """The file's whole text as one JSON value, or None if it is not one (or not UTF-8)."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError):
        return None


def json_records(path: str, stats: DataStats) -> Iterator[dict]:
    """The records of a json / jsonl file, in file order (module doc)."""
    first = True
    with open(path, "rb") as f:
        offset = 0
        for line_no, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            text = _decode(raw, start, path, stats)
            if text is None:
                first = False
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                if first and (whole := _whole_file(path)) is not None:
                    yield from _values(whole, path, 1, stats)
                    return
                first = False
                stats.malformed(path, line_no, f"not JSON (column {exc.colno}: {exc.msg})")
                continue
            first = False
            yield from _values(value, path, line_no, stats)


def _values(value: object, path: str, line_no: int, stats: DataStats) -> Iterator[dict]:
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, dict):
            yield item
        else:
            stats.malformed(path, line_no, f"a JSON {type(item).__name__}, not an object")


def _lines(f, bad: dict[int, tuple[int, int]]) -> Iterator[str]:
    """The file's physical lines decoded for the csv reader; a line that is not UTF-8 goes through with its bad
    bytes escaped and is noted in ``bad`` (line number -> (byte offset, the byte))."""
    offset = 0
    for line_no, raw in enumerate(f, 1):
        start, offset = offset, offset + len(raw)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad[line_no] = (start + exc.start, raw[exc.start])
            text = raw.decode("utf-8", errors="replace")
        yield text.removeprefix(_BOM) if start == 0 else text


def csv_records(path: str, stats: DataStats) -> Iterator[dict]:
    """The rows of a csv file as {column: text}, in file order (module doc)."""
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # a document may be longer than csv's 128 KiB default
    bad: dict[int, tuple[int, int]] = {}
    with open(path, "rb") as f:
        reader = csv.reader(_lines(f, bad))
        header = next(reader, None)
        if header is None:
            return
        done = reader.line_num  # physical lines read so far
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:  # e.g. a NUL byte: this row is lost, the reader goes on with the next line
                stats.malformed(path, reader.line_num, f"not csv ({exc})")
                done = reader.line_num
                continue
            lines = range(done + 1, reader.line_num + 1)  # the physical lines this row spans
            done = reader.line_num
            hit = next((bad[n] for n in lines if n in bad), None)
            if hit is not None:
                stats.bad_bytes(path, *hit)
            elif not row:
                continue  # a blank line
            elif len(row) != len(header):
                stats.malformed(path, lines[0], f"{len(row)} fields where the header has {len(header)}")
            else:
                yield dict(zip(header, row))
