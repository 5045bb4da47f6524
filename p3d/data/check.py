"""Open the data before any worker starts, so that bad input is one clear error, not a traceback
from deep inside a worker: the path matches files, the format is known, the text column exists,
and the train (and, with evaluation, the validation) split holds at least one window of tokens."""

from __future__ import annotations

import logging
from itertools import islice

from p3d.config.schema import DataConfig, DataSource, TextUnit
from p3d.data.corpus import DataStats, file_formats, iter_texts, no_files_error, resolve_files
from p3d.data.tokenizer import load_tokenizer

MAX_DOCS = 20000  # how far to look for a first validation window before giving up


def check_data(cfg: DataConfig, seq_len: int | None, need_val: bool = False) -> None:
    """Raises FileNotFoundError / KeyError / ValueError with one line naming the field and the fix.
    Warnings about single records are left to the workers, which count them. ``seq_len``: a training run's (its
    splits must hold a window of seq_len + 1 tokens); None: p3d-prepare's and p3d-tokenizer's, which have no
    windows and need some text."""
    quiet = logging.getLogger("p3d.data")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        _check(cfg, seq_len, need_val)
    finally:
        quiet.setLevel(level)


def _check(cfg: DataConfig, seq_len: int | None, need_val: bool) -> None:
    if cfg.source == DataSource.prepared:
        assert seq_len is not None, "a store is read by a training run only"
        from p3d.data.prepared import open_stores

        for split in ("train", "val") if need_val else ("train",):
            open_stores(cfg, seq_len, split, check=True)
        return
    if cfg.source == DataSource.files:
        files = resolve_files(cfg.path or "", cfg.format)
        if not files:
            raise no_files_error(cfg)
        file_formats(cfg, files)
    elif cfg.source == DataSource.hub and not cfg.path:
        raise ValueError("data.path is not set for data.source=hub; try data.path=HuggingFaceFW/fineweb-edu")
    tok = load_tokenizer(cfg.tokenizer)
    for split in ("train", "val") if need_val else ("train",):
        stats = DataStats()
        try:
            tokens = 0
            for text in islice(iter_texts(cfg, split, stats), MAX_DOCS):
                tokens += len(tok.encode(text)) + 1
                if tokens > (seq_len or 0):
                    break
        except (KeyError, FileNotFoundError, ValueError):
            raise
        except Exception as exc:
            raise ValueError(
                f"cannot read data.path={cfg.path} ({cfg.source.value}): "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None
        where = f"data.path={cfg.path}" if cfg.path else f"data.source={cfg.source.value}"
        skipped = f" ({stats.summary()})" if stats.summary() else ""
        if seq_len is None and tokens == 0:
            raise ValueError(f"{where} holds no text{skipped}; point data.path at files with text")
        if seq_len is not None and tokens <= seq_len:
            more_docs = (
                " (or split text files into more documents: data.text_unit=paragraph)"
                if cfg.source == DataSource.files and cfg.text_unit == TextUnit.document
                else ""
            )
            fix = (
                f"raise data.val_fraction{more_docs} or set train.eval_every=0"
                if split == "val"
                else "point data.path at more text or lower model.seq_len"
            )
            raise ValueError(
                f"the {split} split of {where} holds {tokens} tokens, fewer than one window of "
                f"model.seq_len+1={seq_len + 1}{skipped}; {fix}"
            )
