"""Corpora beyond one machine: ``prepare.shard=i/n`` prepares slice i (0 to n-1) of the input files into
``<prepare.out>/part-i-of-n/`` (a store of its own), and ``prepare.merge=true`` writes the manifest of
the whole store at ``prepare.out`` over the n finished parts, in slice order.

Slices are contiguous runs of the sorted input files and every part keeps the corpus order, so the
merged store's token stream (and so its windows) is the one a single ``p3d-prepare`` would write; only
where the shards end differs. The merged manifest names each shard by its part (``part-.../shard-N``).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import re
from pathlib import Path

from p3d.data.store import MANIFEST, SPLITS, StoreError, TokenStore, write_json
from p3d.layout.run_plan import P3DConfigError

_PART = re.compile(r"part-(\d{5})-of-(\d{5})")


def part_dir(out: Path, i: int, n: int) -> Path:
    return out / f"part-{i:05d}-of-{n:05d}"


def parse_shard(spec: str) -> tuple[int, int]:
    """(i, n) of ``prepare.shard=i/n``: slice i of n, i counting from 0 to n-1."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec)
    if not m:
        raise P3DConfigError(
            f"prepare.shard={spec} is not i/n (slice i of n, i counting from 0 to n-1); try prepare.shard=0/4"
        )
    i, n = int(m[1]), int(m[2])
    if n == 0:
        raise P3DConfigError(f"prepare.shard={spec} has 0 slices; n is at least 1, try prepare.shard=0/1")
    if i >= n:
        raise P3DConfigError(
            f"prepare.shard={spec} is past the last slice: i counts from 0 to n-1 (0 to {n - 1} for {n} slices); "
            f"try prepare.shard={n - 1}/{n}, the last of {n} slices"
        )
    return i, n


def slice_config(cfg, out: Path):
    """(config reading only slice i of the input files, the part's directory)."""
    from p3d.config.schema import DataSource
    from p3d.data.corpus import no_files_error, resolve_files

    i, n = parse_shard(cfg.prepare.shard)
    if cfg.data.source != DataSource.files:
        raise P3DConfigError(
            f"prepare.shard={cfg.prepare.shard} slices input files; data.source={cfg.data.source.value} has none "
            "(try data=files, or drop prepare.shard)"
        )
    files = resolve_files(cfg.data.path or "", cfg.data.format)
    if not files:
        raise P3DConfigError(str(no_files_error(cfg.data)))
    mine = files[i * len(files) // n : (i + 1) * len(files) // n]
    if not mine:
        raise P3DConfigError(
            f"prepare.shard={cfg.prepare.shard} gets no file ({len(files)} input files in {n} slices); "
            f"try at most {len(files)} slices"
        )
    data = dataclasses.replace(cfg.data, path=",".join(glob.escape(f) for f in mine))
    return dataclasses.replace(cfg, data=data), part_dir(out, i, n)


def merge_parts(out: Path) -> dict:
    """Write ``out/manifest.json`` over the finished parts ``out/part-i-of-n``; P3DConfigError when one is
    missing, unfinished or of another tokenizer or split."""
    parts = sorted((int(m[1]), int(m[2]), p) for p in out.glob("part-*") if (m := _PART.fullmatch(p.name)))
    if not parts:
        raise P3DConfigError(f"prepare.out={out} holds no part-i-of-n directory to merge; prepare the slices first")
    counts = {n for _, n, _ in parts}
    n = parts[0][1]
    have = {i for i, _, _ in parts}
    if len(counts) != 1 or have != set(range(n)):
        missing = sorted(set(range(n)) - have)
        raise P3DConfigError(
            f"prepare.out={out} holds parts of {sorted(counts)} slices, missing {missing}; prepare "
            f"prepare.shard=<i>/{n} for each missing i, then merge"
        )
    manifests = []
    for i, _, path in parts:
        try:
            store = TokenStore(path, f"prepare.shard={i}/{n}: {path.name}")
            store.check_files()
        except StoreError as exc:
            raise P3DConfigError(str(exc)) from None
        manifests.append(store.manifest)
    first = manifests[0]
    for key in ("tokenizer", "dtype", "split", "text_unit", "text_column", "version"):
        odd = [i for i, m in enumerate(manifests) if m[key] != first[key]]
        if odd:
            raise P3DConfigError(
                f"prepare.out={out}: part {odd[0]} has another {key} than part 0 ({manifests[odd[0]][key]} vs "
                f"{first[key]}); prepare every slice with the same data and tokenizer settings"
            )
    shards = [
        {**sh, "name": f"{path.name}/{sh['name']}"} for (_, _, path), m in zip(parts, manifests) for sh in m["shards"]
    ]
    merged = {
        **first,
        "sources": [s for m in manifests for s in m["sources"]],
        "shards": shards,
        **{s: {k: sum(m[s][k] for m in manifests) for k in ("documents", "tokens")} for s in SPLITS},
        "skipped": {k: sum(m["skipped"].get(k, 0) for m in manifests) for k in first["skipped"]},
        "parts": n,
    }
    write_json(out / MANIFEST, merged)
    return json.loads((out / MANIFEST).read_text())
