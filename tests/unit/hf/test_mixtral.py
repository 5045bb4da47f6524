"""Mixtral's names and config.json fields (p3d.hf.names, p3d.hf.config_json) and the per-rank import of an MoE
block's experts, without transformers: an HF directory written from p3d's own twin by the name table is read back
whole, and on every (tp, ep) rank of dp2_tp2 / ep2 as the slices of the whole (``test_*_matches_unsharded``)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from p3d.config.schema import ModelConfig, MoEConfig, RouterScore
from p3d.hf.architectures import MIXTRAL
from p3d.hf.config_json import export_problem, hf_config, model_fields
from p3d.hf.names import HFImportError, global_name, hf_names, twin_name
from tests.helpers.runs import compose_config

MOE = ModelConfig(ffn_hidden_size=32, moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_size=32, aux_loss_coef=0.02))


def test_an_moe_blocks_tensors_have_mixtrals_names():
    layer = "model.layers.2.block_sparse_moe"
    assert hf_names("3.mlp.router.weight", 4, MIXTRAL) == [f"{layer}.gate.weight"]
    assert hf_names("3.mlp.experts.w_gate_up.weight", 4, MIXTRAL, range(6, 8)) == [
        f"{layer}.experts.6.w1.weight",
        f"{layer}.experts.6.w3.weight",
        f"{layer}.experts.7.w1.weight",
        f"{layer}.experts.7.w3.weight",
    ]
    assert hf_names("3.mlp.experts.w_down.weight", 4, MIXTRAL, [7]) == [f"{layer}.experts.7.w2.weight"]
    with pytest.raises(ValueError, match="needs which experts"):
        hf_names("3.mlp.experts.w_down.weight", 4, MIXTRAL)
    assert hf_names("3.mlp.router.expert_bias", 4, MIXTRAL) == []  # Mixtral has none
    with pytest.raises(HFImportError, match="3.mlp.shared.w_down.weight has no Hugging Face MixtralForCausalLM"):
        hf_names("3.mlp.shared.w_down.weight", 4, MIXTRAL)


def test_twin_names_are_the_global_names_under_the_twins_prefixes():
    for name, twin in [("tied_modules.embed.weight", "tied.embed.weight"), ("2.mlp.experts.w_down.weight", None)]:
        assert global_name(twin_name(name)) == name
        assert twin is None or twin_name(name) == twin
    assert twin_name("2.attn.wo.weight") == "layers.2.attn.wo.weight"


def test_mixtral_8x7b_config_round_trips_through_config_json():
    """The preset's config.json carries mistralai/Mixtral-8x7B-v0.1's fields, and imports back to the preset."""
    m = compose_config("model=mixtral_8x7b").model
    config = hf_config(m, eos_id=2)
    assert config["architectures"] == ["MixtralForCausalLM"] and config["model_type"] == "mixtral"
    hub = {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 14336, "num_key_value_heads": 8}
    hub |= {"router_aux_loss_coef": 0.02, "rope_theta": 1e6, "vocab_size": 32000, "sliding_window": None}
    assert {k: config[k] for k in hub} == hub
    fields = model_fields(config, "hf")
    assert dataclasses.replace(m, **fields) == m


def test_a_dense_import_is_a_dense_model():
    config = hf_config(ModelConfig())
    assert config["architectures"] == ["LlamaForCausalLM"] and "num_local_experts" not in config
    assert model_fields(config, "hf")["moe"] is None


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported"),
        ({"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"]}, "p3d imports LlamaForCausalLM, "),
        ({"hidden_act": "gelu"}, "hidden_act=gelu is not supported"),
    ],
)
def test_mixtral_configs_p3d_cannot_hold_are_refused(change, needle):
    with pytest.raises(HFImportError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        model_fields(hf_config(MOE) | change, "hf")


@pytest.mark.parametrize(
    "moe,needle",
    [
        ({"n_shared_experts": 1}, "model.moe.n_shared_experts=1: p3d-export writes an MoE model as MixtralForCausalLM"),
        ({"first_dense_layers": 1}, "model.moe.first_dense_layers=1: "),
        ({"score": RouterScore.sigmoid}, "model.moe.score=sigmoid: "),
        ({"norm_topk_prob": False}, "model.moe.norm_topk_prob=false: "),
        ({"route_scale": 2.5}, "model.moe.route_scale=2.5: "),
    ],
)
def test_export_names_what_mixtral_cannot_hold(moe, needle):
    m = dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, **moe))
    problem = export_problem(m)
    assert problem is not None and problem.startswith(needle) and "\n" not in problem, problem
    assert export_problem(MOE) is None and export_problem(ModelConfig()) is None


def _hf_dir(tmp_path, m: ModelConfig, seed: int = 5, arch=MIXTRAL, bias: torch.Tensor | None = None):
    """An HF directory written from p3d's twin by the name table (what p3d-export does from a checkpoint); ``bias``:
    the routers' selection biases, written where ``arch`` names a tensor for them."""
    from safetensors.torch import save_file

    from p3d.checkpoint.checkpointer import shard_specs
    from p3d.hf.export import hf_tensors
    from p3d.parallel.pipeline.specs import to_sequential

    twin = to_sequential(m, m.vocab_size, seed)
    specs = shard_specs(twin)
    tensors = {}
    for name, p in twin.named_parameters():
        parts = hf_tensors(global_name(name), p.detach(), specs[name], m.n_layers, arch)
        tensors |= {hf: t.contiguous() for hf, t in parts}
    for name, buf in twin.named_buffers():
        if name.endswith("expert_bias") and bias is not None:
            buf.copy_(bias)
            parts = hf_tensors(global_name(name), buf, {"kind": "replicated"}, m.n_layers, arch)
            tensors |= {hf: t.contiguous() for hf, t in parts}
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(hf_config(m)))
    return twin, tensors


def test_the_imported_twin_is_the_written_one(tmp_path):
    from p3d.hf.load import sequential_from_hf

    twin, tensors = _hf_dir(tmp_path, MOE)
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in tensors
    imported = sequential_from_hf(tmp_path)
    want = dict(twin.named_parameters())
    for name, p in imported.named_parameters():
        torch.testing.assert_close(p, want[name], rtol=0, atol=0)
    assert not any(b.any() for n, b in imported.named_buffers() if n.endswith("expert_bias"))


@pytest.mark.parametrize("rank", range(4))
def test_each_ranks_import_matches_unsharded(tmp_path, rank):
    """dp2_tp2 with ep=2: rank r holds experts 2 (r // 2) .. +1, each cut over tp as the dense SwiGLU."""
    from p3d.checkpoint.checkpointer import shard_specs
    from p3d.checkpoint.reshard import shard_from_full
    from p3d.hf.load import held_experts, sequential_from_hf
    from p3d.parallel.mesh import Mesh

    twin, _ = _hf_dir(tmp_path, MOE)
    mesh = Mesh(tp=2, pp=1, dp=2, ep=2, rank=rank)
    local = sequential_from_hf(tmp_path, mesh=mesh)
    specs, whole = shard_specs(local), dict(twin.named_parameters())
    stacked = [n for n, _ in local.named_parameters() if ".experts." in n]
    mine = range(2 * mesh.ep_rank, 2 * mesh.ep_rank + 2)
    assert stacked and all(held_experts(specs[n], mesh) == mine for n in stacked)
    for name, p in local.named_parameters():
        want = shard_from_full(whole[name], specs[name], 2, mesh.tp_rank)
        if name in stacked:  # every expert's rows, this ep rank's share of them
            want = want.chunk(mesh.ep, dim=0)[mesh.ep_rank]
        torch.testing.assert_close(p, want, rtol=0, atol=0)


def test_fused_experts_are_refused_with_the_conversion(tmp_path):
    from safetensors.torch import save_file

    from p3d.hf.check import import_fields

    save_file({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 64, 32)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(hf_config(MOE)))
    with pytest.raises(HFImportError, match=r"fused \(model.layers.0.mlp.experts.gate_up_proj\).*save_pretrained"):
        import_fields(tmp_path)


def test_an_architecture_that_names_the_selection_biases_reads_and_writes_them(tmp_path, monkeypatch):
    """A router buffer mapped to an HF tensor (as DeepSeek-V3's ``e_score_correction_bias`` will be) is expected by
    the launcher's check, written by the export's name table and read back whole by the import."""
    from p3d.hf.architectures import BY_FAMILY
    from p3d.hf.check import expected_tensors
    from p3d.hf.load import sequential_from_hf

    biased = dataclasses.replace(
        MIXTRAL,
        model_type="biased_mixtral",
        block={**MIXTRAL.block, "mlp.router.expert_bias": ("block_sparse_moe.gate.e_score_correction_bias",)},
    )
    monkeypatch.setitem(BY_FAMILY, "biased_mixtral", biased)
    m = dataclasses.replace(MOE, family="biased_mixtral")
    name = "model.layers.1.block_sparse_moe.gate.e_score_correction_bias"
    assert expected_tensors(m, biased)[name] == (4,) and name not in expected_tensors(MOE, MIXTRAL)
    twin, tensors = _hf_dir(tmp_path, m, arch=biased, bias=torch.arange(4.0))
    assert torch.equal(tensors[name], torch.arange(4.0))
    imported = sequential_from_hf(tmp_path)
    assert torch.equal(dict(imported.named_buffers())["layers.2.mlp.router.expert_bias"], torch.arange(4.0))
