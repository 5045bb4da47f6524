"""What one document is in plain text (``data.text_unit``), one rule for every reader.

``document``: a whole text file, or a record's whole text; ``paragraph``: a run of non-blank lines, its
line breaks kept, the blank (empty or whitespace-only) lines between paragraphs dropped; ``line``: one
line without its line break. Line breaks inside a document are kept; the end-of-document token that
packing puts after each document stands where a unit ends. Text files read ``\\r\\n`` as ``\\n`` and
drop a UTF-8 byte-order mark.

A text file is read as bytes, cut into units and each unit decoded strictly, so bytes that are not
UTF-8 are found where they are decoded (file and byte offset) and only their unit is left out; valid
text that contains U+FFFD, the replacement character, is text like any other.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import AnyStr, BinaryIO

from p3d.config.schema import TextUnit

_BOM = b"\xef\xbb\xbf"


def _group(lines: Iterable[tuple[int, AnyStr]], unit: TextUnit, nl: AnyStr) -> Iterator[tuple[int, AnyStr]]:
    """(offset, unit) from (offset, line without its line break), for ``line`` and ``paragraph``."""
    if unit == TextUnit.line:
        yield from lines
        return
    start, block = 0, list[AnyStr]()
    for offset, line in lines:
        if line.strip():
            if not block:
                start = offset
            block.append(line)
        elif block:
            yield start, nl.join(block)
            block = []
    if block:
        yield start, nl.join(block)


def _strip_eol(line: AnyStr) -> AnyStr:
    if line[-1:] in ("\n", b"\n"):
        line = line[:-1]
    if line[-1:] in ("\r", b"\r"):
        line = line[:-1]
    return line


def split_text(text: str, unit: TextUnit) -> list[str]:
    """A record's text cut into units (the text itself for ``document``)."""
    if unit == TextUnit.document:
        return [text]
    lines = text.split("\n")
    if lines[-1] == "":  # a final line break ends the last line; it does not start an empty one
        lines.pop()
    return [u for _, u in _group(((0, _strip_eol(line)) for line in lines), unit, "\n")]


def _file_lines(f: BinaryIO) -> Iterator[tuple[int, bytes]]:
    offset = 0
    for line in f:
        start = offset
        offset += len(line)
        if start == 0 and line.startswith(_BOM):
            line, start = line[len(_BOM) :], len(_BOM)
        yield start, _strip_eol(line)


def file_units(path: str, unit: TextUnit) -> Iterator[tuple[int, bytes]]:
    """(byte offset, undecoded bytes) of each unit of a text file, streamed (``document``: the whole file)."""
    with open(path, "rb") as f:
        if unit != TextUnit.document:
            yield from _group(_file_lines(f), unit, b"\n")
            return
        data = f.read()
        start = len(_BOM) if data.startswith(_BOM) else 0
        yield start, data[start:]


def decode_unit(raw: bytes) -> str:
    """Strict UTF-8 (UnicodeDecodeError names the first bad byte), ``\\r\\n`` read as ``\\n``."""
    return raw.decode("utf-8").replace("\r\n", "\n")
