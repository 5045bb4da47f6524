"""Documents as a streaming HF ``datasets.IterableDataset``: nothing is materialised in full.

``stdlib``: Python's standard library English documentation (pydoc topics) and its ``.py`` sources,
present on every machine with Python, read in a fixed order. ``files``: local text, json/jsonl or
parquet files and globs through the matching ``datasets`` builder.
"""
from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path
from typing import Iterator

from p3d.config.schema import DataConfig, DataSource

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
            ".parquet": "parquet"}


def stdlib_documents() -> Iterator[dict]:
    """English docs first (pydoc topics, sorted by name), then the stdlib sources (sorted by path)."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield {"text": topics[name]}
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if _SKIP_DIRS.intersection(path.relative_to(root).parts):
            continue
        try:
            yield {"text": path.read_text(encoding="utf-8")}
        except (UnicodeDecodeError, OSError):
            continue  # a handful of stdlib test fixtures are not UTF-8 on purpose


def resolve_files(path: str) -> list[str]:
    files: list[str] = []
    for part in path.split(","):
        matches = sorted(glob.glob(os.path.expanduser(part.strip()), recursive=True))
        files.extend(m for m in matches if os.path.isfile(m))
    return files


def file_format(cfg: DataConfig, files: list[str]) -> str:
    if cfg.format != "auto":
        return cfg.format
    suffixes = {Path(f).suffix.lower() for f in files}
    fmts = {_FORMATS.get(s) for s in suffixes}
    if len(fmts) != 1 or None in fmts:
        raise ValueError(f"data.format=auto cannot tell the format of {sorted(suffixes)}; set data.format=text|json|parquet")
    return fmts.pop()


def open_documents(cfg: DataConfig):
    """A streaming ``datasets.IterableDataset`` of documents with a ``cfg.text_column`` column."""
    import datasets

    datasets.logging.disable_progress_bar()
    if cfg.source == DataSource.stdlib:
        return datasets.IterableDataset.from_generator(stdlib_documents)
    files = resolve_files(cfg.path or "")
    if not files:
        raise FileNotFoundError(f"data.path={cfg.path} matches no file")
    return datasets.load_dataset(file_format(cfg, files), data_files=files, split="train", streaming=True)


def iter_texts(cfg: DataConfig) -> Iterator[str]:
    column = cfg.text_column if cfg.source == DataSource.files else "text"
    for record in open_documents(cfg):
        if column not in record:
            raise KeyError(f"data.text_column={column} is not a column of the data (columns: {sorted(record)})")
        text = record[column]
        if text:
            yield text
