"""Text to windows: packing, global sample order, dp sharding, local files through datasets."""
from __future__ import annotations

import json
from itertools import islice

import pytest
import torch

from p3d.config.schema import DataConfig, DataSource
from p3d.data.corpus import iter_texts
from p3d.data.loader import global_batches, micro_batches, pack
from p3d.data.tokenizer import ByteTokenizer


def test_pack_loses_and_repeats_nothing():
    docs = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
    windows = list(pack(docs, 4, eos_id=0))
    stream = [t for d in docs for t in (*d, 0)]
    flat = [t for w in windows for t in w]
    assert all(len(w) == 4 for w in windows)
    assert flat == stream[:len(flat)] and len(stream) - len(flat) < 4  # only the tail shorter than a window


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
    assert list(iter_texts(DataConfig(source=DataSource.files, path=str(tmp_path / "b.txt")))) == ["one line",
                                                                                                 "another line"]


def test_bad_data_input_is_named(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x"}))
    with pytest.raises(KeyError, match="data.text_column=text is not a column"):
        list(iter_texts(DataConfig(source=DataSource.files, path=str(tmp_path / "a.jsonl"))))
    with pytest.raises(FileNotFoundError, match="matches no file"):
        list(iter_texts(DataConfig(source=DataSource.files, path=str(tmp_path / "missing*.jsonl"))))
