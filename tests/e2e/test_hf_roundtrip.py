"""Hugging Face export and import that cannot mix up weights or tokenizers (issue 22).

One small run, trained as a user would from its own working directory with a relative
``data.tokenizer=tok.json`` made by p3d-tokenizer, is exported and re-imported: into one directory
twice, from another working directory, through a failing checkpoint, and loaded by transformers
(AutoTokenizer, LlamaForCausalLM, generate). A 1-step run with the byte tokenizer checks that its export
carries a tokenizer AutoTokenizer reads with p3d's byte ids (issue 31)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from p3d import exit_codes
from p3d.checkpoint import find as checkpoint
from p3d.layout.run_plan import P3DConfigError
from p3d.train.metrics import read_metrics
from tests.helpers.file_modes import umask, wrong_modes
from tests.helpers.runs import ROOT, p3d_train, typed

EOS = "<|endoftext|>"
VOCAB = 300
# 30 steps, not the usual 2-4: the generate() test needs a model that has learnt to end a document
# ("ok" is always followed by the end-of-text token); a tiny single-process run does it in ~5 s.
TRAIN = (
    "mesh=single",
    "model=tiny",
    "data=files",
    "data.path=corpus.jsonl",
    "data.tokenizer=tok.json",
    f"model.vocab_size={VOCAB}",
    "train.steps=30",
    "train.save_every=15",
    "train.lr=1e-2",
    "train.warmup_steps=2",
    "data.shuffle_buffer=64",
)


def _run(args: list[str], cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def p3d_export(*args: str, cwd) -> subprocess.CompletedProcess:
    return _run(["-m", "p3d.cli.export", *args], cwd, timeout=120)


def one_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A working directory with corpus.jsonl, tok.json (p3d-tokenizer) and run/ (checkpoints 15, 30),
    everything given to the commands as relative paths except run.dir."""
    w = tmp_path_factory.mktemp("user")
    docs = [{"text": "the cat sat on the mat. " * 3 + f"line {i}\n"} for i in range(300)] + [{"text": "ok"}] * 300
    (w / "corpus.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    made = _run(
        [
            "-m",
            "p3d.cli.tokenizer",
            "data=files",
            "data.path=corpus.jsonl",
            f"tokenizer.vocab_size={VOCAB}",
            "tokenizer.out=tok.json",
        ],
        w,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    trained = _run(["-m", "p3d.cli", f"run.dir={w / 'run'}", *TRAIN], w)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    return w


def _hf_loss(path, ids):
    from transformers import LlamaForCausalLM

    with torch.no_grad():
        return LlamaForCausalLM.from_pretrained(path).eval()(ids, labels=ids).loss.item()


def _ids(n=2, length=40):
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(7))


def _leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


# ---- 1. a fresh directory renamed into place; overwrite=true replaces it whole
@pytest.mark.timeout(600)
def test_export_twice_into_one_directory(work, tmp_path):
    from p3d.hf.export import load_sequential
    from p3d.hf.load import SafetensorsDir

    run = work / "run"
    first = p3d_export(f"run.dir={run}", "out=hf", "step=15", "max_shard_gb=0.0002", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    shards = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "model.safetensors.index.json" in shards and "model-00005-of-00005.safetensors" in shards

    refused = p3d_export(f"run.dir={run}", "out=hf", cwd=tmp_path)
    assert refused.returncode == exit_codes.CONFIG_ERROR
    assert "out=hf already holds files; add overwrite=true" in one_line(refused)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == shards  # untouched

    second = p3d_export(f"run.dir={run}", "out=hf", "overwrite=true", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "step 30 of" in second.stdout
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert files == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]  # no stale shard or index
    assert _leftovers(tmp_path) == []
    # transformers and p3d's importer both read step 30, and it is the checkpoint's model
    ids = _ids()
    ours = load_sequential(checkpoint.step_dir(run, 30))
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(ours(ids)[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    assert _hf_loss(tmp_path / "hf", ids) == pytest.approx(want.item(), rel=1e-5)
    src = SafetensorsDir(tmp_path / "hf")
    torch.testing.assert_close(src.whole("lm_head.weight"), ours.state_dict()["layers.6.weight"])  # n_layers + 2


def test_import_refuses_index_and_single_file_together(work, tmp_path):
    shards = p3d_export(
        f"run.dir={work / 'run'}", f"out={tmp_path / 'mixed'}", "step=15", "max_shard_gb=0.0002", cwd=tmp_path
    )
    single = p3d_export(f"run.dir={work / 'run'}", f"out={tmp_path / 'single'}", cwd=tmp_path)
    assert shards.returncode == single.returncode == 0, shards.stderr + single.stderr
    shutil.copy(tmp_path / "single" / "model.safetensors", tmp_path / "mixed")  # what the old export left
    with pytest.raises(
        P3DConfigError,
        match=r"holds both model.safetensors and model.safetensors.index.json "
        r"\(whose shards are model-00001-of-00005.safetensors",
    ):
        typed(f"model.init_from={tmp_path / 'mixed'}")


# ---- 2. the tokenizer files name EOS; generate() stops at it
@pytest.mark.timeout(600)
def test_exported_tokenizer_names_eos_and_generate_stops_there(work, tmp_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    result = p3d_export(f"run.dir={work / 'run'}", "out=hf", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert tok.eos_token == EOS
    assert tok.eos_token_id == model.config.eos_token_id == model.generation_config.eos_token_id
    ids = tok("ok", return_tensors="pt").input_ids
    with torch.no_grad():
        stopped = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :].tolist()
        control = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)[0, ids.shape[1] :]
    assert stopped == [tok.eos_token_id]  # the model ends the document, and generate() knows that token
    assert len(control) == 12  # without the EOS id generate() would have run on
    assert tok.decode(stopped) == EOS


@pytest.mark.timeout(600)
def test_begin_and_padding_tokens_are_named_where_the_tokenizer_defines_them(work, tmp_path):
    """A HF-style tokenizer directory whose tokenizer_config.json declares <s>, </s> and <pad>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([json.loads(line)["text"] for line in (work / "corpus.jsonl").open()], trainer)
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "model_max_length": 64})
    )
    run = p3d_train(
        f"run.dir={tmp_path / 'run'}",
        "mesh=single",
        "data=files",
        f"data.path={work / 'corpus.jsonl'}",
        f"data.tokenizer={tok_dir / 'tokenizer.json'}",
        f"model.vocab_size={VOCAB}",
        "train.steps=2",
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = p3d_export(f"run.dir={tmp_path / 'run'}", "out=hf", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    config = LlamaForCausalLM.from_pretrained(tmp_path / "hf").config
    assert (hf_tok.bos_token, hf_tok.eos_token, hf_tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (1, 2, 0)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 0)


# ---- 3. p3d-export speaks its own language


@pytest.mark.parametrize(
    "args,needle",
    [
        (["step=abc"], "step=abc is not a step number"),
        (["step=3"], "step=3: run.dir=run has no complete checkpoint of that step; it holds steps 15, 30; try step=30"),
        (["max_shard_gb=0"], "max_shard_gb=0 must be a positive number of GB; try max_shard_gb=5"),
        (["max_shard_gb=big"], "max_shard_gb=big must be a positive number of GB"),
        (["overwrite=maybe"], "overwrite=maybe must be true or false"),
        (["stpe=2"], "unknown argument stpe=2; usage: p3d-export run.dir=<run> out=<dir>"),
        (["--out", "x"], "argument '--out' is not key=value"),
    ],
)
def test_export_arguments_are_one_line_errors(work, args, needle, capsys):
    from p3d.cli.export import main

    cwd = os.getcwd()
    os.chdir(work)
    try:
        rc = main(["run.dir=run", "out=hf-never", *args])
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert rc == exit_codes.CONFIG_ERROR and not (work / "hf-never").exists()
    assert err.count("\n") == 1 and err.startswith("p3d-export: ") and needle in err, err
    assert "train." not in err


def test_export_refuses_a_missing_run_or_out(tmp_path, capsys):
    from p3d.cli.export import main

    assert main([f"run.dir={tmp_path / 'nope'}", f"out={tmp_path / 'x'}"]) == exit_codes.CONFIG_ERROR
    assert "run.dir=" in capsys.readouterr().err
    assert main([f"run.dir={tmp_path}"]) == exit_codes.CONFIG_ERROR
    assert "out=<dir> is missing" in capsys.readouterr().err
    (tmp_path / "empty-run").mkdir()
    assert main([f"run.dir={tmp_path / 'empty-run'}", f"out={tmp_path / 'x'}"]) == exit_codes.CONFIG_ERROR
    assert "holds no complete checkpoint" in capsys.readouterr().err


def _copy_run(work, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(work / "run", run)
    return run


@pytest.mark.timeout(600)
def test_a_failed_export_leaves_nothing_and_keeps_the_old_export(work, tmp_path):
    run = _copy_run(work, tmp_path)
    ok = p3d_export(f"run.dir={run}", "out=hf", "step=15", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    before = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    shard = checkpoint.step_dir(run, 30) / "optim" / "pp0_tp0_dp0.safetensors"
    shard.write_bytes(b"\0" * shard.stat().st_size)  # same size: passes verify, fails when read
    for out, extra in (("hf", ["overwrite=true"]), ("new/deeper/hf", [])):
        failed = p3d_export(f"run.dir={run}", f"out={out}", *extra, cwd=tmp_path)
        assert failed.returncode == exit_codes.CONFIG_ERROR, failed.stderr
        line = one_line(failed)
        assert f"checkpoint file {shard} cannot be read" in line and "nothing was written" in line
        assert "it holds steps 15, 30" in line and "train." not in line
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == before  # the old export, intact
    assert not (tmp_path / "new").exists() and _leftovers(tmp_path) == []


def test_a_checkpoint_pruned_during_export_is_named(work, tmp_path, monkeypatch):
    """A live run's keep_last deletes the checkpoint between p3d-export's check and its reads."""
    from p3d.hf.export import ExportError, export

    run = _copy_run(work, tmp_path)
    verify = checkpoint.verify

    def verify_then_prune(path):
        meta = verify(path)
        shutil.rmtree(path)
        return meta

    monkeypatch.setattr(checkpoint, "verify", verify_then_prune)
    with pytest.raises(
        ExportError,
        match=r"step_00000015 was deleted while it was being exported .*nothing was "
        r"written; it holds step 30; try step=30",
    ) as info:
        export(run, tmp_path / "hf", step=15)
    assert "train." not in str(info.value)
    assert not (tmp_path / "hf").exists() and _leftovers(tmp_path) == []


# ---- relative paths: a run trained with data.tokenizer=tok.json, exported from elsewhere
@pytest.mark.timeout(600)
def test_export_from_another_working_directory(work, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_rel = os.path.relpath(work / "run", elsewhere)
    result = p3d_export(f"run.dir={run_rel}", "out=exports/hf", cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    out = elsewhere / "exports" / "hf"
    assert (out / "tokenizer.json").read_bytes() == (work / "tok.json").read_bytes()
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == EOS
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 0
    assert _hf_loss(out, _ids()) > 0


def test_an_older_checkpoint_without_its_tokenizer_names_where_to_export_from(work, tmp_path, capsys):
    """Checkpoints saved before they carried their tokenizer: the run_spec's relative tok.json."""
    from p3d.cli.export import main

    run = _copy_run(work, tmp_path)
    ckpt = checkpoint.step_dir(run, 30)
    (ckpt / "tokenizer.json").unlink()
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["files"]["tokenizer.json"]
    from omegaconf import OmegaConf

    spec = OmegaConf.load(ckpt / "run_spec.yaml")  # older specs kept the path as the user gave it
    spec.data.tokenizer = "tok.json"
    OmegaConf.save(spec, ckpt / "run_spec.yaml")
    meta["files"]["run_spec.yaml"] = (ckpt / "run_spec.yaml").stat().st_size
    (ckpt / "meta.json").write_text(json.dumps(meta))
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert main([f"run.dir={run}", "out=hf"]) == exit_codes.CONFIG_ERROR
        err = capsys.readouterr().err
        assert (
            f"the run's tokenizer tok.json (data.tokenizer in {ckpt}/run_spec.yaml) is not found from {tmp_path}" in err
            and "run p3d-export from the directory the training ran in" in err
            and err.count("\n") == 1
        )
        assert not (tmp_path / "hf").exists() and _leftovers(tmp_path) == []
        os.chdir(work)  # where the training ran: tok.json resolves
        assert main([f"run.dir={run}", f"out={tmp_path / 'hf'}"]) == exit_codes.OK
    finally:
        os.chdir(cwd)
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (work / "tok.json").read_bytes()


# ---- 4. model.init_from uses the directory's tokenizer, or refuses another one


@pytest.fixture(scope="module")
def exported(work, tmp_path_factory):
    out = tmp_path_factory.mktemp("exported") / "hf"
    result = p3d_export(f"run.dir={work / 'run'}", f"out={out}", cwd=work)
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(("mesh=single",), id="single"),
        # the torch executor loads HF weights into each of its chunks; ZeRO-3 into them before FSDP2 shards them
        pytest.param(("mesh=pp2", "schedule.pipeline=interleaved_1f1b", "schedule.virtual_stages=2"), id="interleaved"),
        pytest.param(("mesh=dp2_pp2", "zero=stage3"), id="zero3", marks=pytest.mark.slow),
    ],
)
def test_init_from_trains_with_the_checkpoint_tokenizer(work, exported, tmp_path, layout):
    cfg, _ = typed(f"model.init_from={exported}")
    assert cfg.data.tokenizer == str(exported / "tokenizer.json")
    run = tmp_path / "run"
    result = p3d_train(
        f"run.dir={run}",
        f"model.init_from={exported}",
        *layout,
        "data=files",
        f"data.path={work / 'corpus.jsonl'}",
        "data.shuffle_buffer=64",
        "train.steps=2",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert json.loads((checkpoint.find(run, "auto") / "meta.json").read_text())["tokenizer"] == cfg.data.tokenizer
    # the imported weights read the ids they were trained on: the loss continues the source run's
    # (byte ids would start near ln(300) = 5.7)
    source, imported = read_metrics(work / "run"), read_metrics(run)
    assert imported[0]["loss"] < 1.5 and imported[0]["loss"] < source[0]["loss"] / 3


def test_init_from_accepts_the_same_tokenizer_elsewhere(work, exported):
    cfg, _ = typed(f"model.init_from={exported}", f"data.tokenizer={work / 'tok.json'}")
    assert cfg.data.tokenizer == str(work / "tok.json")


def test_init_from_refuses_another_tokenizer_in_one_line(exported, tmp_path):
    result = p3d_train(f"run.dir={tmp_path / 'run'}", f"model.init_from={exported}", "data.tokenizer=byte", timeout=120)
    assert result.returncode == exit_codes.CONFIG_ERROR, result.stdout[-1000:]
    assert f"data.tokenizer=byte (command line) is not the tokenizer of model.init_from={exported}" in one_line(result)


def test_init_from_checks_the_vocab_against_the_tokenizer(exported, tmp_path):
    """A checkpoint of 256 words (its config.json and its embedding and head) beside a 300-token tokenizer.json."""
    from safetensors.torch import load_file, save_file

    small = tmp_path / "small"
    shutil.copytree(exported, small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 256}))
    tensors = load_file(small / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = tensors[name][:256].contiguous()
    save_file(tensors, small / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        P3DConfigError,
        match=rf"tokenizer.json has {VOCAB} tokens, more than the vocab_size=256 "
        rf"of model.init_from={small}/config.json",
    ):
        typed(f"model.init_from={small}")


# ---- 5. every exported file gets the mode the umask gives, the weights too (issue 31)
@pytest.mark.parametrize(
    "mask", [0o022, pytest.param(0o027, marks=pytest.mark.slow)], ids=["umask022", "umask027"]
)  # slow tier: 027
def test_export_files_get_the_mode_of_the_umask(work, tmp_path, mask):
    """safetensors writes 0600 whatever the umask; on shared storage teammates could not read the export."""
    from p3d.hf.export import export

    with umask(mask):  # shards and their index too; the parent directory is created by the export
        out = export(work / "run", tmp_path / "exports" / "hf", max_shard_gb=0.0002)
    assert "model-00001-of-00005.safetensors" in {p.name for p in out.iterdir()}
    assert wrong_modes(tmp_path / "exports", mask) == {}


# ---- 6. a run with the byte tokenizer exports a tokenizer that AutoTokenizer reads (issue 31)

BYTE_TEXTS = (
    "plain ascii",
    "héllo wörld",
    "日本語",
    "emoji 🙂",
    "  two leading spaces\nand a newline",
    "the text <|endoftext|> is 13 bytes to p3d",
)


@pytest.fixture(scope="module")
def byte_export(tmp_path_factory):
    """A 1-step run with the default (byte) tokenizer, exported."""
    from p3d.hf.export import export

    w = tmp_path_factory.mktemp("byte")
    run = p3d_train(f"run.dir={w / 'run'}", "mesh=single", "train.steps=1", timeout=200)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert checkpoint.verify(checkpoint.find(w / "run", "auto"))["tokenizer"] == "byte"
    return export(w / "run", w / "hf")


def test_a_byte_run_exports_a_tokenizer_with_p3d_ids(byte_export):
    from transformers import AutoTokenizer

    from p3d.data.tokenizer import ByteTokenizer

    ours, theirs = ByteTokenizer(), AutoTokenizer.from_pretrained(byte_export)
    for text in BYTE_TEXTS:
        ids = theirs(text)["input_ids"]
        assert ids == ours.encode(text), text  # no BOS, no prefix space, one id per UTF-8 byte
        assert theirs.decode(ids) == text
    config, generation = (json.loads((byte_export / n).read_text()) for n in ("config.json", "generation_config.json"))
    assert theirs.eos_token_id == ours.eos_id == config["eos_token_id"] == generation["eos_token_id"]
    assert theirs.decode([*ours.encode("end"), ours.eos_id], skip_special_tokens=True) == "end"


def test_a_byte_export_trains_on_with_the_byte_tokenizer(byte_export):
    assert typed(f"model.init_from={byte_export}")[0].data.tokenizer == "byte"
    assert typed(f"model.init_from={byte_export}", "data.tokenizer=byte")[0].data.tokenizer == "byte"
