"""The families p3d imports and exports (issue 61; docs/models.md), each from a tiny random checkpoint that
transformers' own classes wrote (tests/helpers/hf_families.py): Llama with Llama 3.1's RoPE scaling, Mistral,
Qwen2 (q|k|v biases), Qwen3 (q/k norms, head_dim 24 of a 64 hidden, yarn), Qwen3-MoE (its first block dense).

- Import: p3d's twin gives transformers' logits (fp32, 1e-5); every tp and ep rank reads its slices of each tensor.
- Refusals, before any worker starts and leaving no run directory, in one line: a Qwen checkpoint relabelled
  llama (the line names a tensor p3d would drop), fewer layers in config.json than in the file, a missing tensor,
  one of another shape.
- Round trip: two steps from the checkpoint, p3d-export, and transformers loads the export under the family's
  own architecture with the trained checkpoint's logits, the context (256) kept in config.json and the tokenizer.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from p3d import exit_codes
from tests.helpers.hf_families import CONTEXT, FAMILIES, VOCAB, logits, write_checkpoint
from tests.helpers.runs import ROOT, p3d_train
from tests.helpers.tiers import with_slow


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """family -> the directory of its tiny checkpoint, written once per module."""
    root = tmp_path_factory.mktemp("hf")
    return {family: write_checkpoint(family, root / family) for family in FAMILIES}


def _ids(seed: int = 7, length: int = 40) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


# make test keeps the two families that hold every new piece (Qwen3: head_dim, q/k norms, yarn; Qwen3-MoE: its
# experts and a dense first block); Llama's scaling, Mistral and Qwen2's biases are in the slow tier, and Qwen2's
# biases in make test's slices test below
@pytest.mark.parametrize("family", with_slow(list(FAMILIES), {"llama", "mistral", "qwen2"}))
def test_the_imported_twin_gives_transformers_logits(hf, family):
    from p3d.hf.load import sequential_from_hf

    ids = _ids()
    with torch.no_grad():
        ours = sequential_from_hf(hf[family])(ids)[..., :VOCAB]
    theirs = logits(hf[family], family, ids)
    assert theirs.abs().max() > 1  # random weights that matter, not a near-constant output
    diff = (ours - theirs).abs().max().item()
    assert diff < 1e-5, diff


@pytest.mark.parametrize("family,ep", [("qwen2", 1), ("qwen3_moe", 2), ("deepseek_v3", 2)])
def test_each_ranks_import_is_its_slice_of_the_whole(hf, family, ep):
    """dp2_tp2 (ep 2 for the experts): every rank's twin holds its tp slice of each weight, the biases cut by heads
    as q|k|v, the q/k norms whole, its ep rank's experts (``test_*_matches_unsharded`` of the import); DeepSeek-V3's
    MLA up-projections by whole heads with their rotated rows reordered within each rank's heads, its latents' down-
    projections and norms whole, its selection biases whole."""
    from p3d.checkpoint.checkpointer import shard_specs
    from p3d.checkpoint.reshard import shard_from_full
    from p3d.hf.load import sequential_from_hf
    from p3d.parallel.mesh import Mesh

    whole = dict(sequential_from_hf(hf[family]).named_parameters())
    assert any(n.endswith(("bqkv.bias", "q_norm.weight", "wq_b.weight")) for n in whole)
    for rank in range(4):
        mesh = Mesh(tp=2, pp=1, dp=2, ep=ep, rank=rank)
        local = sequential_from_hf(hf[family], mesh=mesh)
        specs = shard_specs(local)
        for name, p in local.named_parameters():
            want = shard_from_full(whole[name], specs[name], 2, mesh.tp_rank)
            if ".experts." in name:  # every expert's rows, this ep rank's share of them
                want = want.chunk(mesh.ep, dim=0)[mesh.ep_rank]
            torch.testing.assert_close(p, want, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")  # noqa: B023
        biases = {n: b for n, b in local.named_buffers() if n.endswith("expert_bias")}
        for name, b in biases.items():  # an imported e_score_correction_bias, whole on every rank
            torch.testing.assert_close(b, dict(sequential_from_hf(hf[family]).named_buffers())[name], rtol=0, atol=0)


# ---- refusals: one line, exit 2, before any worker, nothing left behind


def _relabel(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | changes))
    return dst


def _drop_or_reshape(src, dst, name: str, shape: tuple[int, ...] | None):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    if shape is None:
        tensors.pop(name)
    else:
        tensors[name] = torch.zeros(shape)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
REFUSALS = {
    "qwen3-as-llama": (
        lambda hf, d: _relabel(hf["qwen3"], d, **LLAMA),
        "model.layers.0.self_attn.k_norm.weight (and 7 more) is in the checkpoint but not in LlamaForCausalLM",
    ),
    "qwen2-as-llama": (
        lambda hf, d: _relabel(hf["qwen2"], d, **LLAMA),
        "model.layers.0.self_attn.k_proj.bias (and 11 more) is in the checkpoint but not in LlamaForCausalLM",
    ),
    "fewer-layers": (
        lambda hf, d: _relabel(hf["qwen3"], d, num_hidden_layers=3),
        "config.json says num_hidden_layers=3, but the checkpoint holds 4 layers",
    ),
    "missing": (
        lambda hf, d: _drop_or_reshape(hf["qwen3_moe"], d, "model.layers.2.mlp.experts.1.up_proj.weight", None),
        "model.layers.2.mlp.experts.1.up_proj.weight is missing from the checkpoint; Qwen3MoeForCausalLM",
    ),
    "wrong-shape": (
        lambda hf, d: _drop_or_reshape(hf["qwen2"], d, "model.layers.1.self_attn.v_proj.bias", (64,)),
        "model.layers.1.self_attn.v_proj.bias is [64] in model.safetensors, but config.json's shape makes it [32]",
    ),
}


@pytest.mark.parametrize("case", with_slow(list(REFUSALS), {"qwen2-as-llama", "fewer-layers", "wrong-shape"}))
def test_a_checkpoint_p3d_would_not_read_whole_is_refused_before_any_worker(hf, tmp_path, case):
    make, needle = REFUSALS[case]
    checkpoint = make(hf, tmp_path / "hf")
    run = tmp_path / "run"
    result = p3d_train(f"model.init_from={checkpoint}", "mesh=dp2", f"run.dir={run}", "train.steps=1", timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == exit_codes.CONFIG_ERROR and len(lines) == 1, result.stderr[-2000:]
    assert needle in lines[0], lines[0]
    assert not run.exists() and "Traceback" not in result.stdout + result.stderr  # no worker, no run directory


# ---- the round trip


def _export(*args: str):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "p3d.cli.export", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.timeout(400)
# make test exports DeepSeek-V3 (MLA, the grouped router, bf16 routers); the others (15 s each) in the slow tier
@pytest.mark.parametrize("family", with_slow(list(FAMILIES), {"llama", "mistral", "qwen2", "qwen3_moe", "qwen3"}))
def test_an_imported_run_exports_under_its_own_architecture(hf, tmp_path, family):
    from safetensors.torch import load_file

    from p3d.checkpoint import find as checkpoint
    from p3d.hf.export import load_sequential

    run, out = tmp_path / "run", tmp_path / "out"
    mesh = ["mesh=dp2", "mesh.ep=2"] if family == "qwen3_moe" else ["mesh=tp2"]
    trained = p3d_train(f"run.dir={run}", f"model.init_from={hf[family]}", *mesh, "train.steps=2", timeout=300)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    exported = _export(f"run.dir={run}", f"out={out}")
    assert exported.returncode == 0, exported.stderr
    config, source = (json.loads((d / "config.json").read_text()) for d in (out, hf[family]))
    assert config["architectures"] == source["architectures"] and config["model_type"] == source["model_type"]
    assert config["max_position_embeddings"] == CONTEXT  # the checkpoint's context, not model.seq_len (64)
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == CONTEXT
    ids = _ids(11)
    with torch.no_grad():
        ours = load_sequential(checkpoint.find(run, "auto"))(ids)[..., :VOCAB]
    diff = (logits(out, family, ids) - ours).abs().max().item()
    assert diff < 1e-5, diff
    # the source's tensors, each where it was, moved by two steps of Adam only (about lr each; a misplaced one: ~0.1)
    before, after = load_file(hf[family] / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(after) == sorted(before)
    moved = {name: (after[name] - before[name]).abs().max().item() for name in before}
    # (DeepSeek-V3's selection biases move only under aux-loss-free balancing, off here: back as they came)
    fixed = {name for name in moved if name.endswith("e_score_correction_bias")}
    assert all(moved[name] == 0 for name in fixed)
    assert min(v for n, v in moved.items() if n not in fixed) > 0 and max(moved.values()) < 2e-3, moved


def test_a_longer_seq_len_than_the_checkpoints_context_is_said_in_one_warning(hf, tmp_path):
    result = p3d_train(
        f"model.init_from={hf['qwen3']}", f"model.seq_len={2 * CONTEXT}", "mesh=single", "dry_run=true",
        f"run.dir={tmp_path / 'run'}", timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    warnings = [line for line in result.stderr.splitlines() if "warning: model.seq_len=" in line]
    assert len(warnings) == 1 and f"max_position_embeddings={CONTEXT}: positions past {CONTEXT}" in warnings[0]


def test_a_context_extension_sets_the_rope_scaling_beside_init_from_and_nothing_else(hf, monkeypatch):
    """The RoPE scaling and the context are how a run trains an imported model (a longer context): the command
    line's win over config.json's, field by field; a shape field that disagrees is refused."""
    from p3d.launch import check
    from p3d.layout.run_plan import P3DConfigError
    from tests.helpers.runs import typed

    def command_line(*overrides):  # what Hydra gives p3d-train's launcher as this command line
        monkeypatch.setattr(check, "given_overrides", lambda: list(overrides))
        return typed(*overrides)

    extend = ("model.seq_len=128", "model.rope_scaling.factor=16", "model.max_position_embeddings=1024")
    cfg, _ = command_line(f"model.init_from={hf['llama']}", *extend)
    r = cfg.model.rope_scaling
    assert (r.rope_type.value, r.factor, r.original_max_position_embeddings, r.high_freq_factor) == (
        "llama3",
        16,
        16,
        4,
    )
    assert cfg.model.max_position_embeddings == 1024
    with pytest.raises(P3DConfigError, match=r"model.head_dim=8 .*disagrees with .*config.json \(24\)"):
        command_line(f"model.init_from={hf['qwen3']}", "model.head_dim=8")
