"""``p3d-prepare``: tokenize the ``data`` group's documents once into a token store (:mod:`p3d.data.store`).

    p3d-prepare data=files data.path='corpus/*.jsonl' data.tokenizer=tok.json prepare.out=store/web
    p3d-train data=prepared data.path=store/web data.tokenizer=tok.json model.vocab_size=8192

The main process reads the documents in the corpus order and cuts them into shards of
``prepare.shard_bytes`` of text; ``prepare.workers`` processes tokenize the shards and write their files.
A shard whose ``shard-N.json`` exists is complete and skipped, so an interrupted prepare continues where
it stopped; the manifest is written last, and a finished store is left as it is unless
``prepare.overwrite=true``. Documents that are empty or not UTF-8 are counted and skipped, as streaming does.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

from p3d.data.store import (
    FORMAT,
    MANIFEST,
    SPLIT_RULE,
    SPLITS,
    VERSION,
    shard_name,
    token_dtype,
    tokenizer_identity,
    write_atomic,
    write_json,
)

HEADER = "prepare.json"  # the store's header while it is being written: what a continued prepare must match
_TOKENIZERS: dict = {}  # per worker process: tokenizer spec -> loaded tokenizer


def tokenize_shard(out: str, index: int, docs: list[str], spec: str, val_fraction: float, dtype: str) -> dict:
    """Tokenize one shard's documents and write its files; its ``.json`` last. Runs in a worker."""
    from p3d.data.corpus import in_split
    from p3d.data.tokenizer import ByteTokenizer, load_tokenizer

    tok = _TOKENIZERS.get(spec) or _TOKENIZERS.setdefault(spec, load_tokenizer(spec))
    eos = np.asarray([tok.eos_id], dtype=dtype)
    parts: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    starts: dict[str, list[int]] = {s: [0] for s in SPLITS}
    for text in docs:
        split = "val" if in_split(text, val_fraction, "val") else "train"
        if isinstance(tok, ByteTokenizer):
            ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(dtype)
        else:
            ids = np.asarray(tok.encode(text), dtype=dtype)
        parts[split] += [ids, eos]
        starts[split].append(starts[split][-1] + len(ids) + 1)
    folder, name = Path(out), shard_name(index)
    counts: dict = {"name": name}
    for split in SPLITS:
        tokens = np.concatenate(parts[split]) if parts[split] else np.zeros(0, dtype=dtype)
        write_atomic(folder / f"{name}.{split}.bin", tokens.astype(np.dtype(dtype).newbyteorder("<")).tobytes())
        write_atomic(folder / f"{name}.{split}.idx", np.asarray(starts[split], dtype="<i8").tobytes())
        counts[split] = {"documents": len(starts[split]) - 1, "tokens": int(tokens.size)}
    write_json(folder / f"{name}.json", counts)
    return counts


def source_identity(data_cfg) -> list[dict]:
    """What the store was made from: the files with their sizes and mtimes, or the stdlib / hub source."""
    import sysconfig

    from p3d.config.schema import DataSource
    from p3d.data.corpus import resolve_files

    if data_cfg.source == DataSource.stdlib:
        return [{"stdlib": sysconfig.get_paths()["stdlib"], "python": sys.version.split()[0]}]
    if data_cfg.source == DataSource.hub:
        return [{"hub": data_cfg.path, "subset": data_cfg.subset, "split": data_cfg.split}]
    out = []
    for f in resolve_files(data_cfg.path or "", data_cfg.format):
        st = os.stat(f)
        out.append({"path": f, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def store_header(cfg) -> dict:
    from p3d.data.tokenizer import load_tokenizer

    d = cfg.data
    tok = load_tokenizer(d.tokenizer)
    return {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": {**tokenizer_identity(d.tokenizer), "vocab_size": tok.vocab_size},
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "dtype": token_dtype(tok.vocab_size).name,
        "sources": source_identity(d),
        "source": d.source.value,
        "text_unit": d.text_unit.value,
        "text_column": d.text_column,
        "split": {"rule": SPLIT_RULE, "val_fraction": d.val_fraction},
        "shard_bytes": cfg.prepare.shard_bytes,
    }


def our_files(out: Path) -> list[Path]:
    return [p for p in out.glob("*") if p.name in (MANIFEST, HEADER) or p.name.startswith("shard-")]


def shards_of(docs, shard_bytes: int):
    """(index, documents) runs of at least ``shard_bytes`` of UTF-8 text (the last may be shorter)."""
    batch: list[str] = []
    size = index = 0
    for text in docs:
        batch.append(text)
        size += len(text.encode("utf-8"))
        if size >= shard_bytes:
            yield index, batch
            batch, size, index = [], 0, index + 1
    if batch:
        yield index, batch


def done_shard(out: Path, index: int) -> dict | None:
    """The counts of a shard a previous prepare completed, or None."""
    import json

    f = out / f"{shard_name(index)}.json"
    if not f.is_file():
        return None
    return json.loads(f.read_text())


class Progress:
    """One line per second or so (a rewritten line on a terminal): shards, documents, tokens, tokens/s."""

    def __init__(self):
        self.t0 = self.last = time.perf_counter()
        self.shards = self.docs = self.tokens = self.made = 0
        self.tty = sys.stderr.isatty()

    def add(self, counts: dict, made: bool) -> None:
        self.shards += 1
        self.docs += sum(counts[s]["documents"] for s in SPLITS)
        n = sum(counts[s]["tokens"] for s in SPLITS)
        self.tokens += n
        self.made += n if made else 0
        if time.perf_counter() - self.last >= 1.0:
            self.show()

    def rate(self) -> float:
        return self.made / max(time.perf_counter() - self.t0, 1e-9)

    def show(self, end: str = "") -> None:
        self.last = time.perf_counter()
        line = (
            f"p3d-prepare: {self.shards} shards, {self.docs} documents, {self.tokens / 1e6:.2f}M tokens, "
            f"{self.rate() / 1e6:.2f}M tokens/s"
        )
        print(("\r" + line + end) if self.tty else line, file=sys.stderr, end="" if self.tty and not end else "\n")


def prepare_store(cfg, out: Path) -> dict:
    """Write (or finish) the store at ``out``; returns its manifest."""
    import json
    from multiprocessing import get_context

    from p3d.data.corpus import DataStats, iter_documents

    header = store_header(cfg)
    out.mkdir(parents=True, exist_ok=True)
    for tmp in out.glob("shard-*.tmp"):  # half-written files of a killed prepare
        tmp.unlink()
    write_json(out / HEADER, header)
    workers = cfg.prepare.workers or len(os.sched_getaffinity(0))
    stats = DataStats()
    progress = Progress()
    shards: list[dict] = []
    args = (str(out), header["tokenizer"]["spec"], cfg.data.val_fraction, header["dtype"])
    pool = get_context("spawn").Pool(workers) if workers > 1 else None
    pending: deque = deque()  # (made by a previous prepare, counts or the worker's AsyncResult), in shard order

    def take(entry) -> None:
        was_done, item = entry
        shards.append(item if isinstance(item, dict) else item.get())
        progress.add(shards[-1], made=not was_done)

    try:
        for index, docs in shards_of(iter_documents(cfg.data, stats), cfg.prepare.shard_bytes):
            found = done_shard(out, index)
            if found is not None:
                pending.append((True, found))
            elif pool is None:
                pending.append((False, tokenize_shard(args[0], index, docs, *args[1:])))
            else:
                pending.append((False, pool.apply_async(tokenize_shard, (args[0], index, docs, *args[1:]))))
            while pending and (len(pending) > 2 * workers or isinstance(pending[0][1], dict)):
                take(pending.popleft())
        while pending:
            take(pending.popleft())
    finally:
        if pool is not None:
            pool.terminate()
    progress.show(end="\n")
    totals = {s: {k: sum(sh[s][k] for sh in shards) for k in ("documents", "tokens")} for s in SPLITS}
    skipped = {
        "not_utf8_or_no_text": stats.skipped_records - stats.malformed_records,
        "malformed": stats.malformed_records,
        "empty": stats.empty_records,
        "failed_files": stats.failed_files,
    }
    manifest = {**header, "shards": shards, **totals, "skipped": skipped}
    write_json(out / MANIFEST, manifest)
    (out / HEADER).unlink()
    if stats.summary():
        print(f"p3d-prepare: {stats.summary()}", file=sys.stderr, flush=True)
    return json.loads((out / MANIFEST).read_text())


def check_prepare(cfg, out: Path) -> str | None:
    """Raises P3DConfigError for a bad input; returns a message when the store is already finished."""
    import json

    from p3d.config.schema import DataSource
    from p3d.data.check import check_data
    from p3d.layout.run_plan import P3DConfigError

    if cfg.data.source == DataSource.prepared:
        raise P3DConfigError(
            "data.source=prepared is a store already; p3d-prepare reads data=stdlib, data=files or data.source=hub"
        )
    if out.exists() and not out.is_dir():
        raise P3DConfigError(f"prepare.out={out} is a file; choose a directory for the store")
    if (out / MANIFEST).is_file() and not cfg.prepare.overwrite:
        m = json.loads((out / MANIFEST).read_text())
        return (
            f"p3d-prepare: {out} is a finished store ({m['train']['tokens']} train + {m['val']['tokens']} val "
            "tokens); left as it is (prepare.overwrite=true rebuilds it)"
        )
    try:
        check_data(cfg.data, seq_len=None)
    except (OSError, ValueError, KeyError) as exc:
        raise P3DConfigError(str(exc).strip("'\"")) from None
    if (out / HEADER).is_file() and not cfg.prepare.overwrite:
        before = json.loads((out / HEADER).read_text())
        now = store_header(cfg)
        differ = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
        if differ:
            raise P3DConfigError(
                f"prepare.out={out} holds an unfinished store of other inputs ({', '.join(differ)} differ); "
                "prepare.overwrite=true starts it over, or choose another prepare.out"
            )
    return None
