"""The token store in-process: the stream it holds is the streaming one, window orders by arithmetic,
mixtures that follow their weights at every prefix, micro batches independent of the mesh and of
resume, and every bad input as one line."""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import replace
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from p3d.config.schema import DataConfig, DataSource, MixSource
from p3d.data.check import check_data
from p3d.data.loader import global_batches, micro_batches, validation_batches
from p3d.data.order import Blend, permute
from p3d.data.prepared import PreparedSamples
from p3d.data.store import TokenStore
from tests.helpers.stores import SEQ, make_store, prepared_config, write_corpus


@pytest.fixture(scope="module")
def files_store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("store")
    corpus = write_corpus(tmp / "corpus", 1500, seed=0)
    out, stream_cfg = make_store(tmp, "s", corpus, "prepare.shard_bytes=5000", "data.val_fraction=0.1")
    return out, stream_cfg


def _rows(t: torch.Tensor) -> list[bytes]:
    return [r.numpy().tobytes() for r in t]


# ---- orders by arithmetic


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097, 100_003])
def test_permutation_is_a_bijection_and_depends_on_seed_and_epoch(n):
    pos = np.arange(n)
    p = permute(pos, n, seed=3, epoch=0)
    assert np.array_equal(np.sort(p), pos)
    if n >= 64:
        assert not np.array_equal(p, pos)
        assert not np.array_equal(p, permute(pos, n, seed=3, epoch=1))
        assert not np.array_equal(p, permute(pos, n, seed=4, epoch=0))
        assert np.array_equal(p[n // 2 :], permute(pos[n // 2 :], n, seed=3, epoch=0))  # any position alone


@pytest.mark.parametrize("weights", [[0.7, 0.2, 0.1], [1, 1], [5, 3, 1, 1], [0.123, 0.456, 0.01, 0.411]])
def test_every_prefix_of_a_blend_is_within_one_sample_of_the_weights(weights):
    blend = Blend(weights)
    source, index = blend.locate(np.arange(10_000))
    share = np.asarray(weights) / sum(weights)
    counts = np.zeros(len(weights))
    for i, s in enumerate(source):
        assert index[i] == counts[s]  # each source's own samples in order, none skipped or repeated
        counts[s] += 1
        assert np.all(np.abs(counts - share * (i + 1)) <= 1.0), (i, counts, share * (i + 1))
    far = np.arange(10**12, 10**12 + 1000)  # sample 10^12 costs what sample 0 does, and follows the weights
    s_far, i_far = blend.locate(far)
    assert np.all(np.abs(np.bincount(s_far, minlength=len(weights)) - share * 1000) <= 2)
    assert np.array_equal(blend.locate(far)[1], i_far)


# ---- the store holds the streaming stream


def test_store_windows_are_the_streaming_windows(files_store):
    out, stream_cfg = files_store
    plain = replace(stream_cfg, shuffle_buffer=0)
    n = TokenStore(out).tokens("train") // (SEQ + 1)
    a = torch.cat(list(islice(global_batches(plain, SEQ, 8, seed=1), n // 8)))
    b = torch.cat(list(islice(global_batches(prepared_config(out, shuffle_buffer=0), SEQ, 8, seed=1), n // 8)))
    assert torch.equal(a, b)  # shuffle off: the same windows in the same order
    va = next(global_batches(plain, SEQ, 8, seed=0, split="val"))
    vb = next(global_batches(prepared_config(out), SEQ, 8, seed=0, split="val"))
    assert torch.equal(va, vb)  # the held-out split: the same documents by the same hash rule
    for x, y in zip(validation_batches(plain, SEQ, 8, 3), validation_batches(prepared_config(out), SEQ, 8, 3)):
        assert torch.equal(x, y)  # what train.eval_every evaluates on


def test_a_shuffled_epoch_is_the_streaming_epoch_as_a_multiset(files_store):
    out, stream_cfg = files_store
    n = TokenStore(out).tokens("train") // (SEQ + 1)
    streamed = Counter(_rows(torch.cat(list(islice(global_batches(stream_cfg, SEQ, n, seed=5), 1)))))
    store = PreparedSamples(prepared_config(out), SEQ, seed=5)
    epoch0, epoch1 = store.read(np.arange(n)), store.read(np.arange(n, 2 * n))
    assert Counter(_rows(epoch0)) == streamed == Counter(_rows(epoch1))
    assert _rows(epoch0) != _rows(epoch1)  # each epoch has its own order
    assert _rows(epoch0) != _rows(PreparedSamples(prepared_config(out), SEQ, seed=6).read(np.arange(n)))  # train.seed


@pytest.fixture(scope="module")
def mix_cfg(tmp_path_factory, files_store) -> DataConfig:
    tmp = tmp_path_factory.mktemp("mix")
    out_b, _ = make_store(tmp, "b", write_corpus(tmp / "cb", 20, seed=9), "prepare.shard_bytes=500")
    mix = [MixSource(str(files_store[0]), 0.75), MixSource(str(out_b), 0.25)]
    return DataConfig(source=DataSource.prepared, mix=mix)


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("start", [0, 40, 10**9])
def test_micro_batches_of_every_dp_make_the_global_batch_from_any_sample(files_store, mix_cfg, start, mixed):
    """The samples of a step do not depend on dp, and a resume at any sample reads what the run would have."""
    cfg = mix_cfg if mixed else prepared_config(files_store[0])
    batch = next(global_batches(cfg, SEQ, 16, seed=2, start_sample=start))
    for dp in (1, 2, 4):
        got = []
        for rank in range(dp):
            for x, y in islice(micro_batches(cfg, SEQ, 16, 2, dp, rank, 2, start), 16 // dp // 2):
                assert torch.equal(x[:, 1:], y[:, :-1])
                got.append(torch.cat([x, y[:, -1:]], dim=1))
        assert torch.equal(torch.cat(got), batch)
    later = list(islice(global_batches(cfg, SEQ, 16, seed=2, start_sample=start), 3))
    assert torch.equal(later[2], next(global_batches(cfg, SEQ, 16, seed=2, start_sample=start + 32)))


def test_a_mixture_reads_each_store_by_its_weight(mix_cfg):
    cfg = mix_cfg
    out_b = Path(cfg.mix[1].path)
    samples = PreparedSamples(cfg, SEQ, seed=1)
    assert samples.tokens_by_source(10_000) == {"s": 7500 * (SEQ + 1), "b": 2500 * (SEQ + 1)}
    assert samples.blend is not None
    for n in (0, 1, 7, 99_999, 100_001, 123_457):
        sources = samples.blend.locate(np.arange(n))[0]
        assert samples.tokens_by_source(n)["b"] == int((sources == 1).sum()) * (SEQ + 1), n
    single_b = PreparedSamples(prepared_config(out_b), SEQ, seed=1 + 7919)
    store, own = samples.blend.locate(np.arange(1000))  # (store, index in that store's own order)
    mine = samples.read(np.arange(1000))[store == 1]
    assert torch.equal(mine, single_b.read(own[store == 1]))  # store b's samples in b's own order, epochs and all
    assert own[store == 1].max() > single_b.sources[0].windows  # b (small) is in its second epoch already
    epochs = samples.epochs_by_source(1000)  # metrics.jsonl's epochs_by_source: per store, its own windows
    for k, name in enumerate(samples.names):
        mine_k = own[store == k]  # the store's own indices 0, 1, ...: how many of its windows it gave
        assert list(mine_k) == list(range(len(mine_k)))
        assert epochs[name] == pytest.approx(len(mine_k) / samples.sources[k].windows, abs=1e-6)
    assert epochs["b"] > 1 > epochs["s"] > 0


def test_a_mixture_validates_on_each_stores_held_out_windows_blended_by_weight(tmp_path, files_store):
    """train.eval_every with data.mix: sample j of the val set is the next held-out window (in the corpus
    order, starting over when a store runs out) of the store the training blend gives sample j."""
    out_c, _ = make_store(tmp_path, "c", write_corpus(tmp_path / "cc", 60, seed=11), "data.val_fraction=0.3")
    cfg = DataConfig(source=DataSource.prepared, mix=[MixSource(str(files_store[0]), 0.6), MixSource(str(out_c), 0.4)])
    val = validation_batches(cfg, SEQ, 10, 8)
    assert len(val) == 8 and all(torch.equal(a, b) for a, b in zip(val, validation_batches(cfg, SEQ, 10, 8)))
    rows = torch.cat(val)
    source, own = Blend([0.6, 0.4]).locate(np.arange(80))
    for k, out in enumerate((files_store[0], out_c)):
        store = TokenStore(out)
        windows = store.tokens("val") // (SEQ + 1)
        want = [store.split("val").read(w * (SEQ + 1), (w + 1) * (SEQ + 1)) for w in own[source == k] % windows]
        assert torch.equal(rows[torch.from_numpy(source == k)], torch.from_numpy(np.stack(want).astype(np.int64)))
    train = {r.numpy().tobytes() for r in next(global_batches(cfg, SEQ, 2000, seed=0))}
    assert not train & set(_rows(rows))  # held out: no val window is a training window


# ---- bad input: one line each


def _bad(cfg: DataConfig, seq: int = SEQ, need_val: bool = False) -> str:
    with pytest.raises(ValueError) as err:
        check_data(cfg, seq, need_val)
    text = str(err.value)
    assert "\n" not in text
    return text


def test_each_bad_store_is_one_line(tmp_path, files_store):
    out, _ = files_store
    assert "no such directory" in _bad(prepared_config(tmp_path / "none"))
    assert f"{out}" in _bad(prepared_config(out), seq=10**8) and "fewer than one window" in _bad(
        prepared_config(out), seq=10**8
    )
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in out.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    (tmp_path / "bare").mkdir()
    assert "has no manifest.json" in _bad(prepared_config(tmp_path / "bare"))
    bin0 = copy / "shard-00000.train.bin"
    os.truncate(bin0, bin0.stat().st_size - 2)
    assert "shard-00000.train.bin holds" in _bad(prepared_config(copy)) and "truncated" in _bad(prepared_config(copy))
    bin0.unlink()
    assert "shard-00000.train.bin is missing" in _bad(prepared_config(copy))
    m = json.loads((out / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**m, "version": 99}))
    assert "version 99" in _bad(prepared_config(copy))
    tok = tmp_path / "tokenizer.json"
    from p3d.data.train_tokenizer import train_bpe

    train_bpe(["some text to learn from " * 20], 300).save(str(tok))
    assert "was tokenized with byte" in _bad(prepared_config(out, tokenizer=str(tok)))
    mix = [MixSource(str(out), 1.0), MixSource(str(out), 0.0)]
    assert "data.mix[1].weight=0.0 must be above 0" in _bad(DataConfig(source=DataSource.prepared, mix=mix))
    assert "data.mix holds one store" in _bad(DataConfig(source=DataSource.prepared, mix=mix[:1]))


def test_a_store_with_no_val_or_no_train_tokens_is_refused_when_used(tmp_path):
    corpus = write_corpus(tmp_path / "c", 50, seed=3)
    no_val, _ = make_store(tmp_path, "nv", corpus, "data.val_fraction=0")
    all_val, _ = make_store(tmp_path, "av", corpus, "data.val_fraction=0.9999999")
    assert "holds 0 val tokens, fewer than one window" in _bad(prepared_config(no_val), need_val=True)
    assert "train.eval_every=0" in _bad(prepared_config(no_val), need_val=True)
    assert "holds no tokens (an empty store)" in _bad(prepared_config(all_val))


def test_prepare_counts_and_skips_bad_and_empty_documents(tmp_path):
    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "a.txt").write_bytes(b"good line one\n\n\nbad \xff line\ngood line two\n   \n")
    out, _ = make_store(tmp_path, "s", corpus / "a.txt", "data.text_unit=line", "data.val_fraction=0")
    m = json.loads((out / "manifest.json").read_text())
    assert m["train"]["documents"] == 2 and m["skipped"]["not_utf8_or_no_text"] == 1 and m["skipped"]["empty"] == 3
    size = (corpus / "a.txt").stat().st_size
    assert m["sources"][0]["path"] == str(corpus / "a.txt") and m["sources"][0]["bytes"] == size


# ---- slices of the input files, merged


def test_slices_merged_give_the_windows_of_one_prepare(tmp_path, capsys):
    from p3d.launch.prepare import prepare_task
    from tests.helpers.runs import compose

    for k in range(5):
        write_corpus(tmp_path / "c" / f"f{k}", 120, seed=k)
    glob_ = f"data.path={tmp_path}/c/*/docs.jsonl"
    args = ("data=files", glob_, "prepare.workers=1", "prepare.shard_bytes=3000")
    assert prepare_task(compose(*args, f"prepare.out={tmp_path / 'whole'}")) == 0
    for i in range(3):
        assert prepare_task(compose(*args, f"prepare.out={tmp_path / 'parts'}", f"prepare.shard={i}/3")) == 0
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == [f"part-0000{i}-of-00003" for i in range(3)]
    assert prepare_task(compose(*args, f"prepare.out={tmp_path / 'parts'}", "prepare.merge=true")) == 0
    whole, parts = TokenStore(tmp_path / "whole"), TokenStore(tmp_path / "parts")
    parts.check_files()
    assert parts.manifest["sources"] == whole.manifest["sources"] and parts.manifest["train"] == whole.manifest["train"]
    n = whole.tokens("train") // (SEQ + 1)
    for shuffle in (0, 1):
        a = PreparedSamples(prepared_config(tmp_path / "whole", shuffle_buffer=shuffle), SEQ, seed=3).read(np.arange(n))
        b = PreparedSamples(prepared_config(tmp_path / "parts", shuffle_buffer=shuffle), SEQ, seed=3).read(np.arange(n))
        assert torch.equal(a, b)
    capsys.readouterr()
    assert prepare_task(compose(*args, f"prepare.out={tmp_path / 'p2'}", "prepare.shard=1/3")) == 0
    assert prepare_task(compose(*args, f"prepare.out={tmp_path / 'p2'}", "prepare.merge=true")) == 2
    assert "missing [0, 2]" in capsys.readouterr().err
    assert prepare_task(compose(*args, f"prepare.out={tmp_path / 'p3'}", "prepare.shard=3/3")) == 2
    assert (
        "prepare.shard=3/3 is past the last slice: i counts from 0 to n-1 (0 to 2 for 3 slices); "
        "try prepare.shard=2/3, the last of 3 slices" in capsys.readouterr().err
    )
    assert prepare_task(compose(*args, f"prepare.out={tmp_path / 'p4'}", "prepare.shard=0/6")) == 2
    assert "gets no file (5 input files in 6 slices)" in capsys.readouterr().err
    assert not (tmp_path / "p3").exists() and not (tmp_path / "p4").exists()


@pytest.mark.parametrize(
    "spec,says",
    [
        ("3/3", "past the last slice: i counts from 0 to n-1 (0 to 2 for 3 slices); try prepare.shard=2/3, the last"),
        ("8/4", "(0 to 3 for 4 slices); try prepare.shard=3/4, the last of 4 slices"),
        ("1/0", "has 0 slices; n is at least 1, try prepare.shard=0/1"),
        ("third", "is not i/n (slice i of n, i counting from 0 to n-1); try prepare.shard=0/4"),
    ],
)
def test_a_shard_out_of_range_says_slices_count_from_0(spec, says):
    """Issue 31, item 8b: one line naming the value, that i counts from 0, and a value to try."""
    from p3d.data.store_parts import parse_shard
    from p3d.layout.run_plan import P3DConfigError

    with pytest.raises(P3DConfigError) as err:
        parse_shard(spec)
    assert str(err.value).startswith(f"prepare.shard={spec} ") and says in str(err.value), err.value
    assert parse_shard("2/3") == (2, 3) and parse_shard("0/1") == (0, 1)


def test_slices_on_slurm_are_checked_before_anything_is_submitted(tmp_path, capsys):
    """prepare.slices=n cluster=slurm: each bad input is one line and nothing is written or submitted
    (these are refused before Slurm is asked anything; tests/cluster/slurm/test_prepare_slurm.py submits)."""
    from p3d.jobs.slurm.prepare import job_overrides
    from p3d.launch.prepare import prepare_task
    from tests.helpers.runs import compose

    for k in range(2):
        write_corpus(tmp_path / "c" / f"f{k}", 10, seed=k)
    files = ("data=files", f"data.path={tmp_path}/c/*/docs.jsonl", f"prepare.out={tmp_path / 'out'}")
    cases = [
        ((*files, "prepare.slices=2"), "prepare.slices=2 submits a Slurm array job; add cluster=slurm"),
        ((*files, "cluster=slurm"), "set prepare.slices"),
        ((*files, "cluster=slurm", "prepare.slices=3"), "prepare.slices=3 is more than the 2 input files"),
        ((*files, "cluster=slurm", "prepare.slices=2", "prepare.merge=true"), "drop prepare.shard and prepare.merge"),
        ((*files, "cluster=slurm", "prepare.slices=0"), "prepare.slices=0"),
        (("data=stdlib", f"prepare.out={tmp_path / 'out'}", "cluster=slurm", "prepare.slices=2"), "has none"),
    ]
    for args, message in cases:
        assert prepare_task(compose(*args)) == 2, args
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, (args, err)
    assert not (tmp_path / "out").exists()
    (tmp_path / "out" / "part-00000-of-00005").mkdir(parents=True)
    assert prepare_task(compose(*files, "cluster=slurm", "prepare.slices=2")) == 2
    assert "holds the parts of a prepare in 5 slices" in capsys.readouterr().err
    given = ["data=files", "cluster=slurm", "cluster.time=5", "+cluster.x=1", "prepare.slices=2", "prepare.out=s"]
    assert job_overrides(given) == ["data=files", "prepare.out=s"]


def test_a_bpe_store_holds_the_streaming_windows_of_that_tokenizer(tmp_path):
    from p3d.data.train_tokenizer import train_bpe

    corpus = write_corpus(tmp_path / "c", 300, seed=4)
    tok = tmp_path / "tok.json"
    train_bpe((json.loads(line)["text"] for line in corpus.read_text().splitlines()), 300, 1).save(str(tok))
    out, stream_cfg = make_store(tmp_path, "s", corpus, f"data.tokenizer={tok}", "model.vocab_size=300")
    m = json.loads((out / "manifest.json").read_text())
    assert m["dtype"] == "uint16" and m["tokenizer"]["spec"] == str(tok) and 257 < m["vocab_size"] <= 300
    plain = replace(stream_cfg, shuffle_buffer=0)
    a = next(global_batches(plain, SEQ, 16, seed=0))
    b = next(global_batches(prepared_config(out, shuffle_buffer=0, tokenizer=str(tok)), SEQ, 16, seed=0))
    assert torch.equal(a, b) and int(a.max()) > 256  # merged tokens, not bytes


def test_a_prepared_run_with_data_tokenizer_auto_takes_the_stores_tokenizer(tmp_path, capsys):
    """Issue 64, item 15: p3d-prepare's closing line says ``train with data=prepared data.path=<store>``; with a
    tokenizer.json store that line was refused (this run's data.tokenizer=byte). ``auto`` (data=prepared's default)
    is the stores' own tokenizer; stores of two tokenizers in one mixture, or a tokenizer file gone or edited since,
    are one line each. And data.path beside data.mix (item 16) is refused, not ignored."""
    from p3d.data.train_tokenizer import train_bpe
    from p3d.launch.check import prepare
    from p3d.layout.run_plan import P3DConfigError
    from tests.helpers.runs import compose

    corpus = write_corpus(tmp_path / "c", 300, seed=4)
    tok = tmp_path / "tok.json"
    train_bpe((json.loads(line)["text"] for line in corpus.read_text().splitlines()), 300, 1).save(str(tok))
    bpe, _ = make_store(tmp_path, "bpe", corpus, f"data.tokenizer={tok}", "model.vocab_size=300")
    byte, _ = make_store(tmp_path, "byte", corpus)

    def prepared(*overrides: str):
        line = ["data=prepared", "mesh=single", *overrides]
        return prepare(compose(*line), line)[0]

    assert prepared(f"data.path={bpe}").data.tokenizer == str(tok)
    assert prepared(f"data.path={byte}").data.tokenizer == "byte"
    mix = f"data.mix=[{{path: {bpe}, weight: 1}}, {{path: {byte}, weight: 1}}]"
    refusals = {
        (mix,): "the stores of data.mix were tokenized differently",
        (f"data.path={bpe}", f"data.mix=[{{path: {bpe}, weight: 1}}, {{path: {bpe}, weight: 2}}]"): (
            f"data.path={bpe} is set beside data.mix"
        ),
    }
    for overrides, needle in refusals.items():
        with pytest.raises(P3DConfigError) as err:
            prepared(*overrides)
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
    tok.write_text(tok.read_text().replace('"<|endoftext|>"', '"<|end|>"'))  # edited since the prepare
    with pytest.raises(P3DConfigError, match=f"was tokenized with {tok}, which is no longer there or has changed"):
        prepared(f"data.path={bpe}")


@pytest.mark.parametrize("command", ["prepare", "tokenizer"])
def test_prepare_and_tokenizer_refuse_a_file_with_no_text_without_speaking_of_training(tmp_path, capsys, command):
    """Issue 64, item 15: an empty file was refused with 'fewer than one window of model.seq_len+1=2; ... or lower
    model.seq_len': a store and a tokenizer have no seq_len."""
    from p3d.launch.prepare import prepare_task
    from p3d.launch.tokenizer import tokenizer_task
    from tests.helpers.runs import compose

    (tmp_path / "empty.jsonl").write_text("")
    out = "prepare.out" if command == "prepare" else "tokenizer.out"
    task = prepare_task if command == "prepare" else tokenizer_task
    assert task(compose("data=files", f"data.path={tmp_path / 'empty.jsonl'}", f"{out}={tmp_path / 'out'}")) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"data.path={tmp_path / 'empty.jsonl'} holds no text; point data.path at files with text")
    assert "seq_len" not in err and len(err.splitlines()) == 1 and not (tmp_path / "out").exists()
