"""Documents streamed through HF ``datasets`` (``streaming=True``): nothing is materialised in full.

``stdlib``: Python's standard library English documentation (pydoc topics) and its ``.py`` sources,
present on every machine with Python, in a fixed order. ``files``: local text, json/jsonl or
parquet files and globs through the matching ``datasets`` builder, one file after another.
``hub``: a hub dataset by name (``data.path``, ``data.subset``, ``data.split``); same code path.

A document goes to the validation split when a hash of its text falls below ``data.val_fraction``,
so the split is the same on every machine and needs no index. A record that cannot be read (bad
bytes, no text) is skipped, counted and reported; a file that fails mid-way is skipped from there.
"""
from __future__ import annotations

import glob
import logging
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from p3d.config.schema import DataConfig, DataSource

log = logging.getLogger("p3d.data")

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
            ".parquet": "parquet", ".csv": "csv"}


@dataclass
class DataStats:
    """Records skipped while streaming (bad bytes, missing or empty text, a file that failed)."""

    skipped_records: int = 0
    failed_files: int = 0


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
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a handful of stdlib test fixtures are not UTF-8 on purpose
        if text.strip():  # many __init__.py files are empty
            yield {"text": text}


def resolve_files(path: str) -> list[str]:
    files: list[str] = []
    for part in path.split(","):
        matches = sorted(glob.glob(os.path.expanduser(part.strip()), recursive=True))
        files.extend(m for m in matches if os.path.isfile(m))
    return files


def file_format(cfg: DataConfig, files: list[str]) -> str:
    if cfg.format != "auto":
        if cfg.format not in set(_FORMATS.values()):
            raise ValueError(f"data.format={cfg.format} is not one of auto, {', '.join(sorted(set(_FORMATS.values())))}; "
                             "try data.format=auto")
        return cfg.format
    suffixes = {Path(f).suffix.lower() for f in files}
    fmts = {_FORMATS.get(s) for s in suffixes}
    if len(fmts) != 1 or None in fmts:
        raise ValueError(f"data.format=auto cannot tell the format of {sorted(suffixes)}; "
                         "set data.format=text|json|parquet|csv")
    return fmts.pop()


def _datasets(cfg: DataConfig):
    if cfg.source != DataSource.hub:  # local data: no DNS look-ups for the hub
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.logging.disable_progress_bar()
    datasets.logging.set_verbosity_error()
    return datasets


def iter_records(cfg: DataConfig, stats: DataStats | None = None) -> Iterator[dict]:
    """Raw records of the whole corpus, in its fixed order."""
    datasets = _datasets(cfg)
    stats = stats if stats is not None else DataStats()
    if cfg.source == DataSource.stdlib:
        yield from datasets.IterableDataset.from_generator(stdlib_documents)
        return
    if cfg.source == DataSource.hub:
        yield from datasets.load_dataset(cfg.path, cfg.subset, split=cfg.split, streaming=True)
        return
    files = resolve_files(cfg.path or "")
    if not files:
        raise FileNotFoundError(f"data.path={cfg.path} matches no file")
    fmt = file_format(cfg, files)
    extra = {"encoding_errors": "replace"} if fmt == "text" else {}
    for f in files:
        n = 0
        try:
            for record in datasets.load_dataset(fmt, data_files=[f], split="train", streaming=True, **extra):
                n += 1
                if extra and "\ufffd" in record.get("text", ""):  # a line whose bytes were not UTF-8
                    _skip(stats)
                    continue
                yield record
        except StopIteration:  # datasets raises it for an empty json file: no records, not an error
            continue
        except Exception as exc:  # noqa: BLE001 - a broken file must not end the run; it is counted and named
            stats.failed_files += 1
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.warning("p3d data: skipped the rest of %s after %d records: %s", f, n, why)


def _skip(stats: DataStats) -> None:
    stats.skipped_records += 1
    if stats.skipped_records in (1, 10, 100, 1000, 10000):
        log.warning("p3d data: skipped %d records so far (empty, not text, or not UTF-8)", stats.skipped_records)


def in_split(text: str, val_fraction: float, split: str) -> bool:
    is_val = val_fraction > 0 and zlib.crc32(text.encode("utf-8", "replace")) / 2**32 < val_fraction
    return is_val == (split == "val")


def iter_texts(cfg: DataConfig, split: str = "train", stats: DataStats | None = None) -> Iterator[str]:
    """Texts of one split. A missing text column is an error; an unreadable record is skipped."""
    stats = stats if stats is not None else DataStats()
    column = "text" if cfg.source == DataSource.stdlib else cfg.text_column
    for record in iter_records(cfg, stats):
        if column not in record:
            raise KeyError(f"data.text_column={column} is not a column of the data (columns: {sorted(record)}); "
                           f"try data.text_column={sorted(record)[0] if record else 'text'}")
        text = record[column]
        if not isinstance(text, str) or not text:
            _skip(stats)
            continue
        if in_split(text, cfg.val_fraction, split):
            yield text
