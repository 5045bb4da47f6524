"""Layout-free checkpoints: resume under another mesh, and Hugging Face Llama import / export."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist

from p3d import exit_codes
from p3d.checkpoint import find as checkpoint
from p3d.train.metrics import read_metrics
from tests.helpers.dist import run_distributed
from tests.helpers.runs import p3d_train, typed

STEPS, SPLIT = 8, 4
COMMON = (f"train.steps={STEPS}", "train.warmup_steps=2", f"train.save_every={SPLIT}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "source,target",
    [  # slow tier (45 + 31 s): kept: dp2_pp2_tp2+zero1->single, pp2->dp2, e2e/test_schedule_runs.py's chain
        pytest.param(["mesh=dp2_pp2_tp2"], ["mesh=tp2_pp2"], id="dp2_pp2_tp2->tp2_pp2", marks=pytest.mark.slow),
        pytest.param(["mesh=tp2_pp2"], ["mesh=pp4"], id="tp2_pp2->pp4", marks=pytest.mark.slow),
        pytest.param(["mesh=pp2"], ["mesh=dp2"], id="pp2->dp2"),  # dp changes: the same samples, by sample index
        pytest.param(
            ["mesh=dp2_pp2_tp2", "zero=stage1"], ["mesh=single", "zero=stage0"], id="dp2_pp2_tp2+zero1->single"
        ),
    ],
)
def test_resume_under_another_mesh_continues_the_curve(source, target, tmp_path):
    straight = p3d_train(f"run.dir={tmp_path / 'a'}", *COMMON, *source)
    assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-2000:]
    run = tmp_path / "b"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(checkpoint.step_dir(tmp_path / "a", SPLIT), checkpoint.step_dir(run, SPLIT))
    resumed = p3d_train(f"run.dir={run}", *COMMON, *target, "train.resume=auto")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    a, b = read_metrics(tmp_path / "a"), read_metrics(run)
    assert [r["step"] for r in b] == list(range(SPLIT + 1, STEPS + 1))
    for x, y in zip(a[SPLIT:], b):
        assert y["samples"] == x["samples"]
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), x["step"]
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), x["step"]
        assert y["lr"] == pytest.approx(x["lr"], rel=1e-12)


# ---- Hugging Face round trip


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A random tiny Llama built with transformers, saved locally (no hub)."""
    import transformers  # pinned in requirements-cpu.txt: a missing one is a failure, not a skip

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=301,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
    )
    model = transformers.LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    model.save_pretrained(path)
    return path


def _hf_logits(path, ids):
    from transformers import LlamaForCausalLM

    with torch.no_grad():
        return LlamaForCausalLM.from_pretrained(path).eval()(ids).logits


def _imported_logits_match(rank, world, hf_dir, sp: bool = False):
    """tp2 x pp2: import the HF weights slice by slice, run the pipeline, compare the logits (``sp``: with
    sequence parallelism, which changes no parameter)."""
    import deepspeed

    from p3d.parallel.mesh import Mesh
    from p3d.train.executors.ds_engine import build_engine

    deepspeed.init_distributed("gloo")
    cfg, plan = typed("mesh=tp2_pp2", f"model.init_from={hf_dir}", f"schedule.sequence_parallel={str(sp).lower()}")
    assert cfg.schedule.sequence_parallel == sp
    assert cfg.model.vocab_size == 301 and plan.padded_vocab_size == 302  # one padding row per tp=2
    mesh = Mesh.from_plan(plan, rank).with_groups()
    engine, _, _ = build_engine(cfg, plan, mesh)  # as a training run: HF weights read slice by slice
    ids = torch.randint(0, 257, (cfg.schedule.micro_batch_size, 48), generator=torch.Generator().manual_seed(3))
    _, logits = engine.eval_batch(iter([(ids, ids)] * plan.micro_batches), return_logits=True)
    if mesh.is_last_stage:
        parts = [torch.empty_like(logits) for _ in range(mesh.tp)]
        dist.all_gather(parts, logits.contiguous(), group=mesh.tp_group)
        full = torch.cat(parts, dim=-1)[..., : cfg.model.vocab_size]
        # logits here are ~0.1 (max ~0.6): atol 1e-6 keeps the bound at about 1e-5 relative; measured 3e-7
        torch.testing.assert_close(full, _hf_logits(hf_dir, ids), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_hf_import_on_tp2_pp2_gives_the_same_logits(hf_llama, sp):
    run_distributed(_imported_logits_match, 4, str(hf_llama), sp, timeout=240)


@pytest.mark.timeout(300)
def test_hf_round_trip_import_train_export(hf_llama, tmp_path):
    from p3d.hf.export import export, load_sequential

    result = p3d_train(f"run.dir={tmp_path / 'run'}", "mesh=tp2_pp2", f"model.init_from={hf_llama}", "train.steps=3")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    out = export(tmp_path / "run", tmp_path / "hf-out", max_shard_gb=0.0005)  # force several shards
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (out / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, 257, (2, 40), generator=torch.Generator().manual_seed(5))
    ours = load_sequential(checkpoint.find(tmp_path / "run", "auto"))
    with torch.no_grad():
        torch.testing.assert_close(_hf_logits(out, ids), ours(ids), rtol=1e-5, atol=1e-6)
        trained, start = ours(ids), _hf_logits(hf_llama, ids)
    assert not torch.allclose(trained, start, atol=1e-4)  # three steps did move the weights


def _broken(hf_llama, tmp_path, how):
    path = tmp_path / "hf"
    shutil.copytree(hf_llama, path)
    if how == "architecture":
        config = json.loads((path / "config.json").read_text())
        config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
        (path / "config.json").write_text(json.dumps(config))
    elif how == "shard":
        (path / "model.safetensors").unlink()
    return path


@pytest.mark.parametrize(
    "how,extra,needle",
    [
        ("architecture", [], "describes GPT2LMHeadModel (model_type=gpt2); p3d imports LlamaForCausalLM"),
        ("shard", [], "no model.safetensors"),
        ("ok", ["model.n_layers=6"], "model.n_layers=6 (command line) disagrees with"),
    ],
)
def test_bad_hf_input_is_one_clear_error(hf_llama, tmp_path, how, extra, needle):
    path = _broken(hf_llama, tmp_path, how)
    result = p3d_train(f"run.dir={tmp_path / 'run'}", f"model.init_from={path}", *extra, timeout=60)
    assert result.returncode == exit_codes.CONFIG_ERROR, result.stdout[-1000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.stderr
