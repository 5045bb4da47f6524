"""Token stores made in-process for the tests: a jsonl corpus of varied documents, a store prepared from it, and
the data config that reads a store."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from p3d.config.schema import DataConfig, DataSource
from p3d.data.prepare_store import prepare_store
from tests.helpers.runs import typed

SEQ = 31  # windows of 32 tokens


def write_corpus(folder: Path, n: int, seed: int, bad: bool = False) -> Path:
    """``n`` json documents of varied length (some empty; with ``bad``, a text file with a non-UTF-8 line)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    words = ["alpha", "beta", "gamma", "delta", "naïve", "ünïcode", "x", "yy"]
    lines = [
        json.dumps({"text": " ".join(rng.choice(words, int(rng.integers(0, 60)))) if i % 17 else ""}) for i in range(n)
    ]
    (folder / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "docs.jsonl"


def make_store(tmp_path: Path, name: str, corpus: Path, *extra: str) -> tuple[Path, DataConfig]:
    """A store prepared in-process (one worker) from ``corpus``; the streaming config of the same corpus."""
    out = tmp_path / name
    cfg, _ = typed("data=files", f"data.path={corpus}", f"prepare.out={out}", "prepare.workers=1", *extra)
    prepare_store(cfg, out)
    return out, cfg.data


def prepared_config(out: Path, **kw) -> DataConfig:
    return DataConfig(source=DataSource.prepared, path=str(out), **kw)
