"""Documents streamed through HF ``datasets`` (``streaming=True``): nothing is materialised in full.

``stdlib``: Python's standard library English documentation (pydoc topics) and its ``.py`` sources,
present on every machine with Python, in a fixed order. ``files``: local text, json/jsonl, parquet or
csv files, globs and directories, one file after another, each read by the format of its suffix (a
directory may mix them), or all by ``data.format`` when it is set. ``hub``: a hub dataset by name
(``data.path``, ``data.subset``, ``data.split``); same code path.

What a document is: a json/jsonl record, a parquet or csv row, a hub row: its ``data.text_column``;
a text file: the whole file, cut by ``data.text_unit`` (paragraph, line; see
:mod:`p3d.data.text_units`, which also cuts record texts when the unit is not ``document``).

A document goes to the validation split when a hash of its text falls below ``data.val_fraction``,
so the split is the same on every machine and needs no index. Empty documents are counted apart;
a document that cannot be read (bytes that are not UTF-8, no text, a json or csv record that does not
parse: :mod:`p3d.data.records`) is skipped, counted and reported with its file; a file that fails
mid-way (a parquet file's reader) is skipped from there (:mod:`p3d.data.stats`).
"""

from __future__ import annotations

import glob
import os
import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path

from p3d.config.schema import DataConfig, DataSource
from p3d.data.records import csv_records, json_records
from p3d.data.stats import DataStats
from p3d.data.text_units import decode_unit, file_units, split_text

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}


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


def resolve_files(path: str, fmt: str = "auto") -> list[str]:
    """The files of ``data.path``: paths, globs and directories, comma-separated. A directory gives
    its files of the known formats (of ``data.format`` when set), recursively, sorted by path,
    hidden files and folders left out; a glob gives every file it matches, sorted by path."""
    files: list[str] = []
    for part in path.split(","):
        part = os.path.expanduser(part.strip())
        if os.path.isdir(part):
            files.extend(_dir_files(part, fmt))
            continue
        matches = sorted(glob.glob(part, recursive=True))
        files.extend(m for m in matches if os.path.isfile(m))
    return files


def _dir_files(root: str, fmt: str) -> list[str]:
    wanted = {suffix for suffix, f in _FORMATS.items() if fmt in ("auto", f)}
    found = []
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if not d.startswith(".")]
        found += [os.path.join(folder, n) for n in names if not n.startswith(".") and Path(n).suffix.lower() in wanted]
    return sorted(found)


def no_files_error(cfg: DataConfig) -> FileNotFoundError:
    """What to say when ``data.path`` gives no file."""
    dirs = [p.strip() for p in (cfg.path or "").split(",") if os.path.isdir(os.path.expanduser(p.strip()))]
    if dirs:
        kinds = sorted(s for s, f in _FORMATS.items() if cfg.format in ("auto", f))
        example = f"{dirs[0].rstrip('/')}/**/*.txt"
        return FileNotFoundError(
            f"data.path={cfg.path} is a directory with no {'/'.join(kinds)} file in it; point "
            f"data.path at the files with a glob (e.g. data.path='{example}')"
        )
    return FileNotFoundError(f"data.path={cfg.path} matches no file; check the path or glob")


def file_formats(cfg: DataConfig, files: list[str]) -> list[str]:
    """The format of each file: ``data.format`` when set, else the one of its suffix, so a directory or
    glob may mix text, json, parquet and csv files; ValueError names the suffixes no format is known of."""
    if cfg.format != "auto":
        if cfg.format not in set(_FORMATS.values()):
            raise ValueError(
                f"data.format={cfg.format} is not one of auto, {', '.join(sorted(set(_FORMATS.values())))}; "
                "try data.format=auto"
            )
        return [cfg.format] * len(files)
    unknown = sorted({Path(f).suffix.lower() for f in files} - set(_FORMATS))
    if unknown:
        raise ValueError(
            f"data.format=auto cannot tell the format of {unknown} (data.path={cfg.path}); "
            "set data.format=text|json|parquet|csv, or narrow data.path with a glob"
        )
    return [_FORMATS[Path(f).suffix.lower()] for f in files]


def _datasets(cfg: DataConfig):
    if cfg.source != DataSource.hub:  # local data: no DNS look-ups for the hub
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.logging.disable_progress_bar()
    datasets.logging.set_verbosity_error()
    return datasets


def _records(cfg: DataConfig, stats: DataStats) -> Iterator[tuple[str, dict | str]]:
    """(where, item) of the whole corpus in its fixed order: a record of a json / parquet / csv / hub /
    stdlib source, or a unit of a text file, already cut by ``data.text_unit`` and decoded."""
    if cfg.source == DataSource.stdlib:  # our own generator: no need of datasets (nor of its second of import)
        for record in stdlib_documents():
            yield "stdlib", record
        return
    if cfg.source == DataSource.hub:
        for record in _datasets(cfg).load_dataset(cfg.path, cfg.subset, split=cfg.split, streaming=True):
            yield cfg.path or "", record
        return
    files = resolve_files(cfg.path or "", cfg.format)
    if not files:
        raise no_files_error(cfg)
    formats = file_formats(cfg, files)
    stats.unit = cfg.text_unit.value if "text" in formats else "record"  # only text files count bad bytes
    for f, fmt in zip(files, formats):
        n = 0
        try:
            if fmt == "text":
                for offset, raw in file_units(f, cfg.text_unit):
                    n += 1
                    try:
                        text = decode_unit(raw)
                    except UnicodeDecodeError as exc:  # found where it is decoded: only this unit is left out
                        stats.bad_bytes(f, offset + exc.start, raw[exc.start])
                        continue
                    yield f, text
            else:
                for record in _file_records(cfg, f, fmt, stats):
                    n += 1
                    yield f, record
        except StopIteration:  # datasets raises it for an empty json file: no records, not an error
            pass
        except Exception as exc:
            stats.file_failed(f, n, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        stats.passed.add(f)


def _file_records(cfg: DataConfig, path: str, fmt: str, stats: DataStats) -> Iterator[dict]:
    """json and csv record by record (p3d.data.records: a bad record costs itself only); parquet by datasets."""
    if fmt == "json":
        return json_records(path, stats)
    if fmt == "csv":
        return csv_records(path, stats)
    return iter(_datasets(cfg).load_dataset(fmt, data_files=[path], split="train", streaming=True))


def in_split(text: str, val_fraction: float, split: str) -> bool:
    is_val = val_fraction > 0 and zlib.crc32(text.encode("utf-8", "replace")) / 2**32 < val_fraction
    return is_val == (split == "val")


def iter_texts(cfg: DataConfig, split: str = "train", stats: DataStats | None = None) -> Iterator[str]:
    """Documents of one split, per ``data.text_unit``. A missing text column is an error; an empty
    document is counted, an unreadable one skipped and counted, both in ``stats``."""
    return (text for text in iter_documents(cfg, stats) if in_split(text, cfg.val_fraction, split))


def iter_documents(cfg: DataConfig, stats: DataStats | None = None) -> Iterator[str]:
    """Every non-empty document of both splits, in the corpus order (what ``p3d-prepare`` stores)."""
    stats = stats if stats is not None else DataStats()
    column = "text" if cfg.source == DataSource.stdlib else cfg.text_column
    stats.column = column
    for where, item in _records(cfg, stats):
        if isinstance(item, str):
            units = [item]
        else:
            if column not in item:
                raise KeyError(
                    f"data.text_column={column} is not a column of the data (columns: {sorted(item)}); "
                    f"try data.text_column={sorted(item)[0] if item else 'text'}"
                )
            value = item[column]
            if not isinstance(value, str):
                stats.missing_text(where)
                continue
            units = split_text(value, cfg.text_unit) or [""]
        for text in units:
            if not text.strip():
                stats.empty_records += 1
            else:
                yield text
