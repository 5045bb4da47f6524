"""Plain-text corpora (issue 19; items 8 and 9 of issue 23) as a user trains on them: blank lines that are not
"unreadable", bytes that are not UTF-8 named with their file, a directory as ``data.path``, text with U+FFFD
kept; parity and exact resume on such a corpus. Each case runs the user's command from another working
directory with relative paths, shrunk to a tiny run (``mesh=single train.steps=2``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from p3d.checkpoint import find as checkpoint
from p3d.config.schema import DataConfig, DataSource, TextUnit
from p3d.data.corpus import DataStats, iter_texts, resolve_files
from p3d.train.metrics import read_metrics
from p3d.train.reference import reference_run
from tests.helpers.corpora import write_files
from tests.helpers.runs import ROOT, typed

TINY = ("mesh=single", "train.steps=2", "train.warmup_steps=1")


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


def test_a_run_names_the_file_with_bytes_that_are_not_utf8(tmp_path):
    modules = _stdlib_modules(3)
    write_files(
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


def test_a_corpus_with_no_utf8_text_is_refused_naming_the_file(tmp_path):
    (tmp_path / "corpus.txt").write_bytes("Grüße aus Köln\n".encode("latin-1") * 50)
    result = _p3d(tmp_path, "p3d.cli", "data=files", "data.path=corpus.txt", "run.dir=run", *TINY)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "holds 0 tokens" in lines[0], lines[0]
    assert re.search(r"1 document of (\S*/)?corpus\.txt with bytes that are not UTF-8", lines[0]), lines[0]


def test_a_directory_as_data_path(tmp_path):
    """Issue 23, item 8: ``p3d-train data=files data.path=corpus`` reads the directory's files of the known
    formats (recursively, sorted; hidden files and other extensions left out)."""
    modules = _stdlib_modules(3)
    write_files(
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


def test_p3d_tokenizer_reads_documents_with_their_line_breaks(tmp_path):
    """p3d-tokenizer follows data.text_unit: trained on whole files it learns tokens that hold a line break
    (Ċ in byte-level BPE); trained on lines it sees none. Bytes that are not UTF-8 are reported by file."""
    write_files(tmp_path / "corpus", {"a.txt": "\n\n".join(_stdlib_modules(4)), "bad.txt": b"ok\n\xff\n"})
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
    return write_files(tmp_path_factory.mktemp("text") / "corpus", modules)


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
