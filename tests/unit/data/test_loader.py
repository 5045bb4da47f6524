"""Text to windows (p3d.data.loader): packing, global sample order, dp sharding, local files through datasets, the
validation split, resumed streams, epochs."""

from __future__ import annotations

import json
from dataclasses import replace
from itertools import islice

import numpy as np
import pytest
import torch

from p3d.config.schema import DataConfig, DataSource, TextUnit
from p3d.data.corpus import iter_texts
from p3d.data.loader import global_batches, micro_batches, pack
from p3d.data.tokenizer import ByteTokenizer


def test_pack_loses_and_repeats_nothing():
    docs = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
    windows = list(pack(docs, 4, eos_id=0))
    stream = [t for d in docs for t in (*d, 0)]
    flat = [t for w in windows for t in w]
    assert all(len(w) == 4 for w in windows)
    assert flat == stream[: len(flat)] and len(stream) - len(flat) < 4  # only the tail shorter than a window


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "naïve — ünïcödé\n"
    assert tok.decode(tok.encode(text)) == text and max(tok.encode(text)) < 256 and tok.eos_id == 256


def test_stdlib_corpus_is_real_text():
    texts = list(islice(iter_texts(DataConfig()), 3))
    assert texts[0].startswith('The "assert" statement')  # pydoc topics come first, sorted by name
    assert all(len(t) > 100 for t in texts)


def test_dp_ranks_get_disjoint_slices_of_one_global_batch():
    cfg, seq, gb, mbs = DataConfig(), 32, 8, 2
    batch = next(global_batches(cfg, seq, gb, seed=1))
    assert batch.shape == (gb, seq + 1)
    for dp in (1, 2, 4):
        seen = []
        for rank in range(dp):
            mine = list(islice(micro_batches(cfg, seq, gb, mbs, dp, rank, seed=1), gb // dp // mbs))
            again = list(islice(micro_batches(cfg, seq, gb, mbs, dp, rank, seed=1), gb // dp // mbs))
            for (x, y), (x2, y2) in zip(mine, again):  # tp / pp peers of a replica read the same batch
                assert torch.equal(x, x2) and torch.equal(y, y2)
                assert torch.equal(x[:, 1:], y[:, :-1])  # labels are the inputs shifted by one
            seen += [torch.cat([x, y[:, -1:]], dim=1) for x, y in mine]
        assert torch.equal(torch.cat(seen), batch)  # disjoint, and together the whole global batch


def test_local_jsonl_and_text_files(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"body": f"doc {i}"}) for i in range(3)))
    texts = list(iter_texts(DataConfig(source=DataSource.files, path=str(tmp_path / "*.jsonl"), text_column="body")))
    assert texts == ["doc 0", "doc 1", "doc 2"]
    (tmp_path / "b.txt").write_text("one line\nanother line\n")
    cfg = DataConfig(source=DataSource.files, path=str(tmp_path / "b.txt"), val_fraction=0)
    assert list(iter_texts(cfg)) == ["one line\nanother line\n"]  # data.text_unit=document: the whole file
    assert list(iter_texts(replace(cfg, text_unit=TextUnit.line))) == ["one line", "another line"]


def test_bad_data_input_is_named(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x"}))
    with pytest.raises(KeyError, match="data.text_column=text is not a column"):
        list(iter_texts(DataConfig(source=DataSource.files, path=str(tmp_path / "a.jsonl"))))
    with pytest.raises(FileNotFoundError, match="matches no file"):
        list(iter_texts(DataConfig(source=DataSource.files, path=str(tmp_path / "missing*.jsonl"))))


def test_parquet_streams(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["alpha doc", "beta doc"], "id": [1, 2]}), tmp_path / "p.parquet")
    cfg = DataConfig(source=DataSource.files, path=str(tmp_path / "*.parquet"), text_column="content", val_fraction=0)
    assert list(iter_texts(cfg)) == ["alpha doc", "beta doc"]


def test_undecodable_lines_are_skipped_and_counted(tmp_path):
    from p3d.data.corpus import DataStats

    (tmp_path / "t.txt").write_bytes(b"good line\n\xff\xfe bad bytes\nanother good\n")
    stats = DataStats()
    cfg = DataConfig(source=DataSource.files, path=str(tmp_path / "t.txt"), val_fraction=0, text_unit=TextUnit.line)
    assert list(iter_texts(cfg, stats=stats)) == ["good line", "another good"]
    assert stats.skipped_records == 1


def test_validation_split_is_disjoint_and_stable():
    cfg = DataConfig()
    val = list(islice(iter_texts(cfg, "val"), 5))
    train = set(islice(iter_texts(cfg, "train"), 3000))
    assert val and not set(val) & train
    assert val == list(islice(iter_texts(cfg, "val"), 5))


def test_resumed_stream_continues_with_the_next_samples():
    """The data position is the samples consumed: a stream started at sample 3 B is the tail of one from 0."""
    cfg = DataConfig()
    full = list(islice(global_batches(cfg, 32, 4, seed=5), 6))
    tail = list(islice(global_batches(cfg, 32, 4, seed=5, start_sample=3 * 4), 3))
    assert len(tail) == 3
    for a, b in zip(full[3:], tail):
        assert torch.equal(a, b)
    other_seed = next(global_batches(cfg, 32, 4, seed=6))
    assert not torch.equal(full[0], other_seed)  # the shuffle depends on train.seed


def test_epochs_repeat_a_small_corpus(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": "x" * 40}) for _ in range(3)))
    cfg = DataConfig(source=DataSource.files, path=str(tmp_path / "a.jsonl"), val_fraction=0, shuffle_buffer=0)
    batches = list(islice(global_batches(cfg, 15, 2, seed=0), 6))  # 123 tokens = 7 windows of 16 per epoch
    assert len(batches) == 6 and all(b.shape == (2, 16) for b in batches)


def test_the_shuffle_pool_holds_each_token_in_the_vocabularys_smallest_integer():
    """Issue 64, item 24: the streaming reader's shuffle pool held data.shuffle_buffer windows as Python lists (8
    bytes a token; 36 above id 256), 34 MB a rank at s=4096 that context parallelism never divides. Windows are
    arrays of the smallest dtype (2 bytes for the byte tokenizer's 257 ids) and the samples are unchanged."""
    from p3d.data.loader import sample_stream

    docs = [[1, 2, 300], [4], [5, 6, 7, 8, 9]]
    windows = list(pack(docs, 3, eos_id=0, dtype=np.uint16))
    assert all(isinstance(w, np.ndarray) and w.dtype == np.uint16 for w in windows)
    assert [t for w in windows for t in w.tolist()] == [1, 2, 300, 0, 4, 0, 5, 6, 7, 8, 9, 0]
    cfg = DataConfig(shuffle_buffer=8)
    sample = next(sample_stream(cfg, 64, seed=0))
    assert sample.dtype == torch.int64 and sample.shape == (65,) and int(sample.max()) <= ByteTokenizer.eos_id
