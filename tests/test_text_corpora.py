"""Plain-text corpora (issue 19; items 8 and 9 of issue 23): what a document is (``data.text_unit``),
line breaks kept, blank lines that are not "unreadable", bytes that are not UTF-8 named with their
file, a directory as ``data.path``, text with U+FFFD kept; parity and exact resume on such a corpus.

End-to-end cases run the user's command (``p3d-train data=files data.path=corpus.txt`` ...) from
another working directory with relative paths, shrunk to a tiny run (``mesh=single train.steps=2``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from dataclasses import replace
from itertools import islice
from pathlib import Path

import pytest
import torch

from p3d.checkpoint import find as checkpoint
from p3d.config.schema import DataConfig, DataSource, TextUnit
from p3d.data.check import check_data
from p3d.data.corpus import DataStats, iter_texts, resolve_files
from p3d.data.loader import global_batches
from p3d.data.prepare_store import prepare_store
from p3d.data.store import TokenStore
from p3d.data.tokenizer import ByteTokenizer
from p3d.train.metrics import read_metrics
from p3d.train.reference import reference_run
from tests.conftest import ROOT, typed

TINY = ("mesh=single", "train.steps=2", "train.warmup_steps=1")
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


def _write(folder: Path, files: dict[str, str | bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, body in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body if isinstance(body, bytes) else body.encode())
    return folder


def _p3d(cwd: Path, module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """A p3d command as a user runs it, from ``cwd`` (this tree first on the path)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    result = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
    )
    assert "Traceback" not in result.stdout + result.stderr, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _stdlib_modules(n: int) -> list[str]:
    """Real Python text: the first n stdlib modules of a fixed list (every machine has them)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names = sorted(p for p in root.glob("*.py") if p.stat().st_size > 2000)[:n]
    return [p.read_text(encoding="utf-8") for p in names]


@pytest.mark.parametrize("unit", list(TextUnit), ids=lambda u: u.value)
def test_tokens_decode_to_the_documents_joined_by_end_of_document(tmp_path, unit):
    """The training stream of a .txt corpus, decoded with the byte tokenizer, is each document's exact
    text (line breaks inside kept) followed by the end-of-document token: no token between the lines of a
    document, none lost."""
    corpus = _write(tmp_path / "corpus", FILES)
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
    corpus = _write(tmp_path / "corpus", FILES)
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


@pytest.mark.procs
def test_a_corpus_with_blank_lines_reports_nothing_skipped(tmp_path):
    """The issue's run: Python modules joined by blank lines, ``p3d-train data=files data.path=corpus.txt``,
    with every text_unit: no "skipped" or "unreadable" line; the blank lines are counted as empty records
    (in the checkpoint), not reported."""
    (tmp_path / "corpus.txt").write_text("\n\n".join(_stdlib_modules(10)))
    for unit in ("document", "line"):
        result = _p3d(
            tmp_path,
            "p3d.cli",
            "data=files",
            "data.path=corpus.txt",
            f"data.text_unit={unit}",
            f"run.dir=run_{unit}",
            *TINY,
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        out = (result.stdout + result.stderr).lower()
        assert "skipped" not in out and "unreadable" not in out and "not utf-8" not in out, out[-2000:]
        meta = json.loads(next((tmp_path / f"run_{unit}" / "checkpoints").glob("step_*/meta.json")).read_text())
        assert meta["skipped_records"] == 0 and (meta["empty_records"] > 0) == (unit == "line")


@pytest.mark.parametrize("unit", list(TextUnit), ids=lambda u: u.value)
def test_bytes_that_are_not_utf8_are_skipped_and_named(tmp_path, unit):
    corpus = _write(
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


@pytest.mark.procs
def test_a_run_names_the_file_with_bytes_that_are_not_utf8(tmp_path):
    modules = _stdlib_modules(3)
    _write(
        tmp_path / "corpus", {"a.txt": modules[0], "b.txt": modules[1].encode() + b"\n\xff\xfe\n", "c.txt": modules[2]}
    )
    result = _p3d(
        tmp_path, "p3d.cli", "data=files", "data.path=corpus/*.txt", "data.text_unit=paragraph", "run.dir=run", *TINY
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    # the file as data.path names it (relative here; absolute if the launcher resolves data.path)
    assert re.search(
        r"data: skipped 1 paragraph of (\S*/)?corpus/b\.txt with bytes that are not UTF-8 \(the first at "
        r"byte \d+\): convert the file to UTF-8",
        result.stdout,
    ), result.stdout[-2000:]


@pytest.mark.procs
def test_a_corpus_with_no_utf8_text_is_refused_naming_the_file(tmp_path):
    (tmp_path / "corpus.txt").write_bytes("Grüße aus Köln\n".encode("latin-1") * 50)
    result = _p3d(tmp_path, "p3d.cli", "data=files", "data.path=corpus.txt", "run.dir=run", *TINY)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "holds 0 tokens" in lines[0], lines[0]
    assert re.search(r"1 document of (\S*/)?corpus\.txt with bytes that are not UTF-8", lines[0]), lines[0]


@pytest.mark.procs
def test_a_directory_as_data_path(tmp_path):
    """Issue 23, item 8: ``p3d-train data=files data.path=corpus`` reads the directory's files of the known
    formats (recursively, sorted; hidden files and other extensions left out)."""
    modules = _stdlib_modules(3)
    _write(
        tmp_path / "corpus",
        {
            "b.txt": modules[1],
            "a.txt": modules[0],
            "sub/c.md": modules[2],
            "notes.pdf": b"%PDF",
            ".hidden.txt": "x",
            ".git/HEAD.txt": "ref",
        },
    )
    corpus = tmp_path / "corpus"
    assert resolve_files(str(corpus)) == [str(corpus / "a.txt"), str(corpus / "b.txt"), str(corpus / "sub/c.md")]
    cfg = DataConfig(source=DataSource.files, path=str(corpus), val_fraction=0)
    assert list(iter_texts(cfg)) == modules
    result = _p3d(tmp_path, "p3d.cli", "data=files", "data.path=corpus", "run.dir=run", *TINY)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "data.bin").write_bytes(b"\0")
    result = _p3d(tmp_path, "p3d.cli", "data=files", "data.path=empty", "run.dir=run2", *TINY, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert re.search(
        r"data\.path=(\S*/)?empty (\(command line\) )?is a directory with no "
        r"\.csv/\.json/\.jsonl/\.md/\.parquet/\.text/\.txt file in it; point data\.path at the files "
        r"with a glob \(e\.g\. data\.path='(\S*/)?empty/\*\*/\*\.txt'\)$",
        lines[0],
    ), lines[0]
    assert not (tmp_path / "run2").exists()


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
    corpus = _write(tmp_path / "corpus", MIXED)
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


@pytest.mark.procs
def test_text_with_the_replacement_character_trains(tmp_path):
    """Issue 23, item 9: every line holds U+FFFD (common in web text); it is valid UTF-8 and is kept, as the
    same lines in a .jsonl are."""
    lines = [f"line {i}: a reply \ufffd from a scraped page, copied as it was" for i in range(200)]
    (tmp_path / "web.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "web.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    cfg = DataConfig(source=DataSource.files, path=str(tmp_path / "web.txt"), val_fraction=0, text_unit=TextUnit.line)
    stats = DataStats()
    as_jsonl = replace(cfg, path=str(tmp_path / "web.jsonl"))
    assert list(iter_texts(cfg, stats=stats)) == lines == list(iter_texts(as_jsonl))
    assert stats.skipped_records == 0
    result = _p3d(tmp_path, "p3d.cli", "data=files", "data.path=web.txt", "run.dir=run", *TINY)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "skipped" not in result.stdout + result.stderr


@pytest.mark.procs
def test_p3d_tokenizer_reads_documents_with_their_line_breaks(tmp_path):
    """p3d-tokenizer follows data.text_unit: trained on whole files it learns tokens that hold a line break
    (Ċ in byte-level BPE); trained on lines it sees none. Bytes that are not UTF-8 are reported by file."""
    _write(tmp_path / "corpus", {"a.txt": "\n\n".join(_stdlib_modules(4)), "bad.txt": b"ok\n\xff\n"})
    merges = {}
    for unit in ("document", "line"):
        result = _p3d(
            tmp_path,
            "p3d.cli.tokenizer",
            "data=files",
            "data.path=corpus",
            f"data.text_unit={unit}",
            "tokenizer.vocab_size=400",
            f"tokenizer.out=tok_{unit}.json",
            timeout=180,
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        assert re.search(rf"skipped 1 {unit} of (\S*/)?corpus/bad\.txt with bytes that are not UTF-8", result.stdout), (
            result.stdout
        )
        vocab = json.loads((tmp_path / f"tok_{unit}.json").read_text())["model"]["vocab"]
        merges[unit] = [t for t in vocab if "Ċ" in t and len(t) > 1]
    assert merges["document"] and not merges["line"]


# ---- parity and exact resume on a data=files text corpus

STEPS = 6
TEXT_RUN = (
    "data=files",
    "data.path={corpus}",
    "data.text_unit=paragraph",
    f"train.steps={STEPS}",
    "train.warmup_steps=2",
    "train.save_every=3",
    "train.keep_last=3",
)


@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory) -> Path:
    modules = {f"m{i}.txt": m for i, m in enumerate(_stdlib_modules(6))}
    return _write(tmp_path_factory.mktemp("text") / "corpus", modules)


@pytest.fixture(scope="module")
def dp2_run(text_corpus, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("dp2") / "run"
    args = [a.format(corpus=text_corpus) for a in TEXT_RUN]
    result = _p3d(ROOT, "p3d.cli", f"run.dir={run}", "mesh=dp2", *args, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run


@pytest.mark.timeout(600)
def test_dp2_matches_the_single_process_reference_on_a_text_corpus(text_corpus, dp2_run):
    cfg, _ = typed("mesh=single", *(a.format(corpus=text_corpus) for a in TEXT_RUN))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers do; on a busy machine several threads make it 8x slower
    try:
        ref, got = reference_run(cfg), read_metrics(dp2_run)
    finally:
        torch.set_num_threads(threads)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for r, g in zip(ref, got):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5), f"step {r['step']} loss"
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5), f"step {r['step']} grad norm"


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_resume_continues_the_same_curve_on_a_text_corpus(text_corpus, dp2_run, tmp_path):
    """Resume the step-3 checkpoint of the dp2 run in a new run.dir: steps 4..6 repeat it exactly."""
    args = [a.format(corpus=text_corpus) for a in TEXT_RUN]
    ckpt = checkpoint.step_dir(dp2_run, 3)
    result = _p3d(
        ROOT, "p3d.cli", f"run.dir={tmp_path / 'resumed'}", "mesh=dp2", *args, f"train.resume={ckpt}", timeout=400
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resumed from step 3" in result.stdout
    straight, resumed = read_metrics(dp2_run), read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for x, y in zip(straight[3:], resumed):
        assert y["samples"] == x["samples"], x["step"]
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-6, abs=0), x["step"]
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-6, abs=0), x["step"]
