"""Issue 64, item 2: one bad line in a json / jsonl or csv file costs that record, not the good records after it.

The cases are the issue's: a jsonl of 24,000 good records and a broken last line (HF datasets' block reader lost
1,575), 400 good lines, a broken one and 3 good (it kept 0 and the store was refused), one latin-1 record in the
middle of a jsonl (the 200 after it were lost), a csv with one latin-1 row after 300 good rows (it kept 0). Each bad
record is skipped, counted and named (file and line, or byte) in the closing line; no stray line of datasets' own.
"""

from __future__ import annotations

import json

import pytest

from p3d.config.schema import DataConfig, DataSource
from p3d.data.corpus import DataStats, iter_documents
from tests.helpers.stores import make_store


def _jsonl(n: int, start: int = 0) -> bytes:
    return b"".join(json.dumps({"text": f"record {i}"}).encode() + b"\n" for i in range(start, start + n))


def _read(path, **kw) -> tuple[list[str], DataStats]:
    stats = DataStats()
    cfg = DataConfig(source=DataSource.files, path=str(path), val_fraction=0, **kw)
    return list(iter_documents(cfg, stats)), stats


def test_a_broken_last_line_costs_one_record_of_24000(tmp_path, capfd):
    path = tmp_path / "big.jsonl"
    path.write_bytes(_jsonl(24_000) + b'{"text": "cut off\n')
    docs, stats = _read(path)
    assert docs == [f"record {i}" for i in range(24_000)]
    assert stats.skipped_records == stats.malformed_records == 1 and stats.failed_files == 0
    assert stats.summary() == (
        f"data: skipped 1 malformed record ({path} line 24001: not JSON (column 18: Invalid control character at)): "
        "fix or remove them"
    )
    assert "Failed to load JSON" not in capfd.readouterr().err  # datasets' own stray line


def test_a_broken_line_in_the_middle_keeps_the_records_after_it(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(_jsonl(400) + b"{not json}\n" + b"[1, 2]\n" + _jsonl(3, start=400))
    docs, stats = _read(path)
    assert docs == [f"record {i}" for i in range(403)]
    assert stats.malformed_records == 3  # the broken line, and a JSON array of two numbers (not objects)
    first = "from line 401 (not JSON (column 2: Expecting property name"
    assert f"3 malformed records ({path}: 3 {first}" in stats.summary()


def test_a_latin1_record_in_a_jsonl_is_skipped_alone(tmp_path):
    path = tmp_path / "a.jsonl"
    bad = json.dumps({"text": "café"}, ensure_ascii=False).encode("latin-1") + b"\n"
    good = _jsonl(100)
    path.write_bytes(good + bad + _jsonl(200, start=100))
    docs, stats = _read(path)
    assert docs == [f"record {i}" for i in range(300)]
    assert stats.skipped_records == 1 and stats.malformed_records == 0
    byte = len(good) + bad.index(b"\xe9")
    assert stats.summary() == (
        f"data: skipped 1 record of {path} with bytes that are not UTF-8 (the first at byte {byte}): convert the "
        "file to UTF-8"
    )


def test_a_latin1_csv_row_after_300_good_rows_is_skipped_alone(tmp_path):
    path = tmp_path / "a.csv"
    rows = [f'{i},"row {i}, with a comma\nand a line break"\n'.encode() for i in range(300)]
    bad = "300,café\n".encode("latin-1")
    tail = [b"301,after\n", b"302,too,many\n", b"303,last\n"]
    path.write_bytes(b"id,text\n" + b"".join(rows) + bad + b"".join(tail))
    docs, stats = _read(path)
    assert docs == [f"row {i}, with a comma\nand a line break" for i in range(300)] + ["after", "last"]
    assert stats.skipped_records == 2 and stats.malformed_records == 1
    line = 1 + 2 * 300 + 1 + 2  # the header, two physical lines a good row, the latin-1 row, "301,after"
    summary = stats.summary()
    assert f"1 record of {path} with bytes that are not UTF-8" in summary
    assert f"1 malformed record ({path} line {line}: 3 fields where the header has 2)" in summary


@pytest.mark.parametrize(
    "body",
    [
        json.dumps([{"text": "one"}, {"text": "two"}], indent=2),  # a JSON array over several lines
        json.dumps([{"text": "one"}, {"text": "two"}]),  # on one line
        '\ufeff{"text": "one"}\n{"text": "two"}\n',  # json lines with a byte-order mark
    ],
    ids=["array-indented", "array-one-line", "bom"],
)
def test_json_arrays_and_byte_order_marks_read_as_before(tmp_path, body):
    path = tmp_path / "a.json"
    path.write_text(body, encoding="utf-8")
    assert _read(path) == (["one", "two"], DataStats(unit="record", passed={str(path)}))


def test_one_object_over_several_lines_is_one_record(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"text": "one", "meta": {"k": 1}}, indent=2))
    docs, stats = _read(path)
    assert docs == ["one"] and stats.skipped_records == 0


def test_prepare_keeps_the_good_records_and_says_what_it_skipped(tmp_path, capfd):
    """p3d-prepare over the issue's second file: 403 documents stored, the malformed one counted in the manifest and
    named in its closing line."""
    path = tmp_path / "c" / "docs.jsonl"
    path.parent.mkdir()
    path.write_bytes(_jsonl(400) + b'{"text": oops}\n' + _jsonl(3, start=400))
    out, _ = make_store(tmp_path, "store", path, "data.val_fraction=0")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["train"]["documents"] == 403
    assert manifest["skipped"] == {"not_utf8_or_no_text": 0, "malformed": 1, "empty": 0, "failed_files": 0}
    err = capfd.readouterr().err
    assert f"p3d-prepare: data: skipped 1 malformed record ({path} line 401: not JSON" in err
    assert "skipped the rest" not in err and "Failed to load JSON" not in err
