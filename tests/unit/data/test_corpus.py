"""Plain-text corpora (issue 19; items 8 and 9 of issue 23), in-process: what a document is (``data.text_unit``),
line breaks kept, bytes that are not UTF-8 skipped and named, a directory of mixed formats."""

from __future__ import annotations

import json
from dataclasses import replace
from itertools import islice

import pytest

from p3d.config.schema import DataConfig, DataSource, TextUnit
from p3d.data.check import check_data
from p3d.data.corpus import DataStats, iter_texts
from p3d.data.loader import global_batches
from p3d.data.prepare_store import prepare_store
from p3d.data.store import TokenStore
from p3d.data.tokenizer import ByteTokenizer
from tests.helpers.corpora import write_files
from tests.helpers.runs import typed

EOD = ByteTokenizer.eos_id

# Two files whose documents are known by construction, for each data.text_unit. b.txt has Windows line
# ends (read as \n), a whitespace-only line and no final line break; c.txt holds blank lines only.
FILES = {
    "a.txt": 'def f():\n    return 1\n\n\nclass A:\n    """Doc."""\n\n    pass\n',
    "b.txt": "naïve café ✓\r\nsecond line\r\n\r\n   \r\nlast paragraph, no final line break",
    "c.txt": "\n\n\n",
}

DOCUMENTS = {
    TextUnit.document: [FILES["a.txt"], "naïve café ✓\nsecond line\n\n   \nlast paragraph, no final line break"],
    TextUnit.paragraph: [
        "def f():\n    return 1",
        'class A:\n    """Doc."""',
        "    pass",
        "naïve café ✓\nsecond line",
        "last paragraph, no final line break",
    ],
    TextUnit.line: [
        "def f():",
        "    return 1",
        "class A:",
        '    """Doc."""',
        "    pass",
        "naïve café ✓",
        "second line",
        "last paragraph, no final line break",
    ],
}


@pytest.mark.parametrize("unit", list(TextUnit), ids=lambda u: u.value)
def test_tokens_decode_to_the_documents_joined_by_end_of_document(tmp_path, unit):
    """The training stream of a .txt corpus, decoded with the byte tokenizer, is each document's exact
    text (line breaks inside kept) followed by the end-of-document token: no token between the lines of a
    document, none lost."""
    corpus = write_files(tmp_path / "corpus", FILES)
    cfg, _ = typed(
        "mesh=single",
        "data=files",
        f"data.path={corpus}/*.txt",
        f"data.text_unit={unit.value}",
        "data.val_fraction=0",
        "data.shuffle_buffer=0",
        "model.seq_len=15",
    )
    expected = [t for doc in DOCUMENTS[unit] for t in (*doc.encode(), EOD)]
    window = cfg.model.seq_len + 1
    n = len(expected) // window
    stats = DataStats()
    batches = global_batches(cfg.data, cfg.model.seq_len, 1, cfg.train.seed, stats=stats)
    got = [t for batch in islice(batches, n) for t in batch[0].tolist()]
    next(batches)  # the first window of the next epoch: the first one has been read to its end
    assert got == expected[: n * window] and len(expected) - n * window < window  # only the tail of an epoch
    docs = bytes(t if t != EOD else 0 for t in got).decode().split("\0")
    assert docs[:-1] == DOCUMENTS[unit][: len(docs) - 1]
    if unit == TextUnit.document:  # the files' texts, joined by end-of-document only between files
        assert "".join(DOCUMENTS[unit]) == (FILES["a.txt"] + FILES["b.txt"]).replace("\r\n", "\n")
    assert stats.skipped_records == 0 and stats.failed_files == 0 and stats.summary() == ""
    assert stats.empty_records == {TextUnit.document: 1, TextUnit.paragraph: 0, TextUnit.line: 8}[unit]


@pytest.mark.parametrize("unit", list(TextUnit), ids=lambda u: u.value)
def test_validation_holds_out_whole_documents(tmp_path, unit):
    corpus = write_files(tmp_path / "corpus", FILES)
    cfg = DataConfig(source=DataSource.files, path=str(corpus), text_unit=unit, val_fraction=0.5)
    train, val = list(iter_texts(cfg, "train")), list(iter_texts(cfg, "val"))
    assert sorted(train + val) == sorted(DOCUMENTS[unit]) and not set(train) & set(val)


def test_record_texts_follow_the_same_unit(tmp_path):
    """json/jsonl: a record is a document; data.text_unit cuts its text the same way as a text file's."""
    body = FILES["a.txt"]
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": body}) + "\n" + json.dumps({"text": ""}) + "\n")
    cfg = DataConfig(source=DataSource.files, path=str(tmp_path / "a.jsonl"), val_fraction=0)
    assert list(iter_texts(cfg)) == [body]
    for unit in (TextUnit.paragraph, TextUnit.line):
        stats = DataStats()
        in_a = {TextUnit.paragraph: 3, TextUnit.line: 5}[unit]  # the units of a.txt come first
        assert list(iter_texts(replace(cfg, text_unit=unit), stats=stats)) == DOCUMENTS[unit][:in_a]
        assert stats.skipped_records == 0 and stats.empty_records >= 1


@pytest.mark.parametrize("unit", list(TextUnit), ids=lambda u: u.value)
def test_bytes_that_are_not_utf8_are_skipped_and_named(tmp_path, unit):
    corpus = write_files(
        tmp_path / "corpus",
        {
            "good.txt": "first paragraph\n\nsecond one\n",
            "latin1.txt": "caf\xe9 au lait\n\nfine text\n".encode("latin-1"),
        },
    )
    stats = DataStats()
    texts = list(
        iter_texts(DataConfig(source=DataSource.files, path=str(corpus), text_unit=unit, val_fraction=0), stats=stats)
    )
    kept = {TextUnit.document: 1, TextUnit.paragraph: 3, TextUnit.line: 3}[unit]
    assert len(texts) == kept and stats.skipped_records == 1 and stats.failed_files == 0
    assert stats.summary() == (
        f"data: skipped 1 {unit.value} of {corpus / 'latin1.txt'} with bytes that are not "
        "UTF-8 (the first at byte 3): convert the file to UTF-8"
    )


MIXED = {  # a directory of two formats: each file is read by its own, in path order
    "a.txt": "first paragraph of a\n\nsecond paragraph of a\n",
    "b.jsonl": "".join(json.dumps({"body": f"record {i} of b"}) + "\n" for i in range(2)),
    "c.txt": "only paragraph of c",
    "notes.xyz": "not a known format",
}

MIXED_DOCUMENTS = [
    "first paragraph of a",
    "second paragraph of a",
    "record 0 of b",
    "record 1 of b",
    "only paragraph of c",
]


def test_a_directory_of_mixed_formats_reads_each_file_by_its_format(tmp_path):
    """Issue 31, item 8a: a directory with .txt and .jsonl files trains, checks and prepares its documents in
    path order, text files cut by data.text_unit, records read from data.text_column; a file of an unknown
    suffix is left out of a directory and refused in a glob; data.format keeps only the files of that format."""
    corpus = write_files(tmp_path / "corpus", MIXED)
    overrides = ("data=files", f"data.path={corpus}", "data.text_unit=paragraph", "data.text_column=body")
    cfg, _ = typed(*overrides, "data.val_fraction=0", f"prepare.out={tmp_path / 'store'}", "prepare.workers=1")
    assert list(iter_texts(cfg.data)) == MIXED_DOCUMENTS
    check_data(cfg.data, seq_len=8)
    expected = [t for doc in MIXED_DOCUMENTS for t in (*doc.encode(), EOD)]
    got = next(global_batches(replace(cfg.data, shuffle_buffer=0), len(expected) - 1, 1, cfg.train.seed))
    assert got[0].tolist() == expected  # the training stream: one window holding the whole corpus

    prepare_store(cfg, tmp_path / "store")
    store = TokenStore(tmp_path / "store")
    assert store.split("train").read(0, store.tokens("train")).tolist() == expected
    assert [s["path"] for s in store.manifest["sources"]] == [str(corpus / n) for n in ("a.txt", "b.jsonl", "c.txt")]

    with pytest.raises(ValueError, match=r"data.format=auto cannot tell the format of \['.xyz'\]"):
        check_data(replace(cfg.data, path=f"{corpus}/*"), seq_len=8)
    text_only = replace(cfg.data, format="text")
    assert list(iter_texts(text_only)) == [MIXED_DOCUMENTS[i] for i in (0, 1, 4)]
