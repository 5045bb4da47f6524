"""The token store ``p3d-prepare`` writes and ``data=prepared`` reads: a directory of memory-mappable shards.

    store/
      manifest.json                 written last: its presence means the store is finished
      shard-00000.train.bin         token ids of the shard's training documents, each followed by the
      shard-00000.train.idx         end-of-document id; raw little-endian ``dtype`` (numpy ``memmap``);
      shard-00000.val.bin           .idx: int64 start offset of each document in .bin, plus its end
      shard-00000.val.idx           (documents + 1 entries): the document index
      shard-00000.json              the shard's counts, written after its files: the shard is complete

A shard holds the documents of a fixed run of the corpus (``prepare.shard_bytes`` of text), so the shards
and their bytes depend on the input and the tokenizer only, never on how many workers wrote them. The
training stream is the ``train`` files of every shard in order: exactly the token stream that streaming
packs (documents in the corpus order, each followed by end-of-document), so window k is its tokens
``[k (seq_len+1), (k+1) (seq_len+1))``. The split is the streaming one: a document is held out when the
crc32 of its text falls below ``val_fraction`` (recorded in the manifest as ``split``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from p3d.layout.geometry import token_bytes

FORMAT = "p3d-token-store"
VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
SPLIT_RULE = "crc32(utf-8 text) / 2**32 < val_fraction: held out (val)"


class StoreError(ValueError):
    """A store that cannot be read as asked: one line naming the file or field and the fix."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer dtype that holds every id of the vocabulary (p3d.layout.geometry.token_bytes)."""
    return np.dtype(f"uint{8 * token_bytes(vocab_size)}")


def tokenizer_identity(spec: str) -> dict:
    """{spec, sha256}: the hash covers the files that define the tokenizer (``byte``: its name), so two
    copies of one tokenizer.json agree and an edited one does not."""
    from p3d.data.tokenizer import AUTO, tokenizer_files

    spec = "byte" if spec == AUTO else spec  # auto without model.init_from is byte, as load_tokenizer reads it
    h = hashlib.sha256()
    files = tokenizer_files(spec)
    if not files:
        h.update(b"byte")
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return {"spec": spec, "sha256": h.hexdigest()}


def shard_name(i: int) -> str:
    return f"shard-{i:05d}"


def write_atomic(path: Path, data: bytes) -> None:
    """Write under a temporary name, then rename: a killed writer leaves no half file under ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_json(path: Path, body: dict) -> None:
    write_atomic(path, (json.dumps(body, indent=1, sort_keys=True) + "\n").encode())


@dataclass
class SplitTokens:
    """One split's token stream over every shard, memory-mapped: ``read(a, b)`` is tokens [a, b)."""

    maps: list[np.ndarray]
    starts: np.ndarray  # (shards + 1,) int64: where each shard's tokens start in the stream, then the total

    @property
    def tokens(self) -> int:
        return int(self.starts[-1])

    def read(self, a: int, b: int) -> np.ndarray:
        """Tokens [a, b) as int64, across shard borders."""
        i = int(np.searchsorted(self.starts, a, side="right")) - 1
        parts = []
        while a < b:
            stop = min(b, int(self.starts[i + 1]))
            if stop > a:
                off = int(self.starts[i])
                parts.append(self.maps[i][a - off : stop - off])
            a = stop
            i += 1
        return np.concatenate(parts).astype(np.int64) if len(parts) != 1 else parts[0].astype(np.int64)


class TokenStore:
    """A finished store, checked: manifest of this format and version, every shard file present with
    the size its counts say. Opening reads the manifest only; tokens are memory-mapped."""

    def __init__(self, path: str | Path, field: str = "data.path"):
        self.path = Path(path)
        self.field = field
        manifest = self.path / MANIFEST
        if not self.path.is_dir():
            raise StoreError(f"{field}={path} is not a token store (no such directory); prepare one with p3d-prepare")
        if not manifest.is_file():
            raise StoreError(
                f"{field}={path} has no {MANIFEST}: not a finished token store (an interrupted p3d-prepare "
                "continues when run again); run p3d-prepare with prepare.out=" + str(path)
            )
        try:
            self.manifest = json.loads(manifest.read_text())
        except (OSError, ValueError) as exc:
            raise StoreError(
                f"{field}={path}: {manifest} is not readable JSON ({exc}); prepare the store again"
            ) from None
        m = self.manifest
        if m.get("format") != FORMAT or m.get("version") != VERSION:
            raise StoreError(
                f"{field}={path} is a store of format {m.get('format')} version {m.get('version')}, this p3d reads "
                f"{FORMAT} version {VERSION}; prepare it again with this p3d-prepare (prepare.overwrite=true)"
            )
        self.dtype = np.dtype(m["dtype"])
        self.eos_id = int(m["eos_id"])
        self.vocab_size = int(m["vocab_size"])
        self._splits: dict[str, SplitTokens] = {}

    @property
    def tokenizer(self) -> dict:
        return self.manifest["tokenizer"]

    def tokens(self, split: str) -> int:
        return int(self.manifest[split]["tokens"])

    def check_files(self) -> None:
        """Every shard file there with its size: a missing or truncated one is named."""
        for shard in self.manifest["shards"]:
            for split in SPLITS:
                counts = shard[split]
                for suffix, size in (
                    ("bin", counts["tokens"] * self.dtype.itemsize),
                    ("idx", (counts["documents"] + 1) * 8),
                ):
                    f = self.path / f"{shard['name']}.{split}.{suffix}"
                    if not f.is_file():
                        raise StoreError(f"{self.field}={self.path}: {f.name} is missing; prepare the store again")
                    if f.stat().st_size != size:
                        raise StoreError(
                            f"{self.field}={self.path}: {f.name} holds {f.stat().st_size} bytes, the manifest says "
                            f"{size} (truncated or overwritten); prepare the store again (prepare.overwrite=true)"
                        )

    def split(self, split: str) -> SplitTokens:
        """The split's token stream (memory maps opened on first use)."""
        if split not in self._splits:
            maps: list[np.ndarray] = []
            starts = [0]
            for shard in self.manifest["shards"]:
                n = shard[split]["tokens"]
                if n:
                    f = self.path / f"{shard['name']}.{split}.bin"
                    # a plain ndarray view of the map: slicing it makes no memmap objects (a third of a read)
                    maps.append(np.memmap(f, dtype=self.dtype, mode="r", shape=(n,)).view(np.ndarray))
                    starts.append(starts[-1] + n)
            self._splits[split] = SplitTokens(maps, np.asarray(starts, dtype=np.int64))
        return self._splits[split]

    def documents(self, split: str, shard: int) -> np.ndarray:
        """The document index of one shard's split: start offsets, then the end."""
        f = self.path / f"{self.manifest['shards'][shard]['name']}.{split}.idx"
        return np.fromfile(f, dtype=np.int64)


def store_paths(data_cfg) -> list[tuple[str, float, str]]:
    """(path, weight, the field that names it) of each store of the data config."""
    if data_cfg.mix:
        return [(m.path, float(m.weight), f"data.mix[{i}].path") for i, m in enumerate(data_cfg.mix)]
    if not data_cfg.path:
        raise StoreError("data.path is not set for data=prepared; try data.path=<a store written by p3d-prepare>")
    return [(data_cfg.path, 1.0, "data.path")]


def stores_tokenizer(data_cfg) -> str:
    """``data.tokenizer=auto`` for stores: the tokenizer they were prepared with (its ``spec``, ``byte`` or a
    tokenizer.json), which must still be that file. StoreError, one line, when the stores of a mixture were
    tokenized differently or the file is gone or changed."""
    from p3d.data.tokenizer import AUTO

    found: dict[str, tuple[str, str]] = {}  # sha256 -> (spec, the field of the first store with it)
    for path, _, field in store_paths(data_cfg):
        try:
            tok = TokenStore(path, field).tokenizer
        except StoreError:  # no store there: the data check says so in its own line, before any worker starts
            return AUTO
        found.setdefault(tok["sha256"], (tok["spec"], f"{field}={path}"))
    if len(found) > 1:
        named = "; ".join(f"{where} by {spec}" for spec, where in found.values())
        raise StoreError(
            f"data.tokenizer={AUTO}: the stores of data.mix were tokenized differently ({named}); "
            "mix stores of one tokenizer"
        )
    ((sha, (spec, where)),) = found.items()
    try:
        same = tokenizer_identity(spec)["sha256"] == sha
    except (OSError, ValueError):
        same = False
    if not same:
        raise StoreError(
            f"data.tokenizer={AUTO}: {where} was tokenized with {spec}, which is no longer there or has changed "
            "since; set data.tokenizer=<a copy of that tokenizer.json>"
        )
    return spec
