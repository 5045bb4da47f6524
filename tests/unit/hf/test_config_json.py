"""config.json <-> the model group for every architecture (p3d.hf.config_json), without transformers (its own
configs are the oracle in tests/e2e/test_hf_families.py): each preset round-trips, the RoPE and window keys of
every vintage read alike, and every key p3d would ignore is refused in one line."""

from __future__ import annotations

import dataclasses

import pytest

from p3d.config.options import RopeType
from p3d.config.schema import ModelConfig
from p3d.hf.architectures import ARCHITECTURES, BY_FAMILY
from p3d.hf.config_json import check_keys, export_problem, hf_config, model_fields
from p3d.hf.names import HFImportError
from tests.helpers.runs import compose_config

PRESETS = ["llama3_1_8b", "llama3_2_1b", "mistral_7b", "qwen2_5_7b", "qwen3_8b", "qwen3_30b_a3b", "mixtral_8x7b",
           "deepseek_v3"]  # fmt: skip


@pytest.mark.parametrize("preset", PRESETS)
def test_a_presets_config_json_imports_back_to_the_preset(preset):
    m = compose_config(f"model={preset}").model
    assert export_problem(m) is None
    config = hf_config(m, eos_id=2)
    assert config["architectures"] == [BY_FAMILY[m.family].name]
    check_keys(config, "hf")  # what p3d writes, it reads whole
    imported = dataclasses.replace(m, **model_fields(config, "hf"))
    if m.moe is not None:  # how the selection biases move is the run's (DeepSeek-V3's 0.001), no config.json key's
        imported.moe = dataclasses.replace(imported.moe, bias_update_rate=m.moe.bias_update_rate)
    assert imported == m


def test_every_architecture_has_a_preset_and_a_distinct_model_type():
    families = {compose_config(f"model={p}").model.family for p in PRESETS}
    assert families == set(BY_FAMILY) and len(BY_FAMILY) == len(ARCHITECTURES)


LLAMA31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA31}},  # transformers 5
        {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **LLAMA31}},  # the Hub's Llama 3.1 files
        {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", **LLAMA31}},  # older still
    ],
    ids=["rope_parameters", "rope_scaling", "type"],
)
def test_rope_scaling_reads_from_either_key(rope):
    base = {k: v for k, v in hf_config(compose_config("model=llama3_1_8b").model).items() if "rope" not in k}
    m = model_fields(base | rope, "hf")
    assert m["rope_theta"] == 5e5 and m["rope_scaling"].rope_type == RopeType.llama3
    assert (m["rope_scaling"].factor, m["rope_scaling"].original_max_position_embeddings) == (8.0, 8192)


def test_yarn_without_its_original_context_takes_transformers_defaults():
    base = hf_config(ModelConfig(seq_len=64, max_position_embeddings=4096, family="qwen3", qk_norm=True))
    m = model_fields(base | {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": None}}, "hf")
    # original_max_position_embeddings: max_position_embeddings; factor: their ratio (transformers' yarn)
    assert (m["rope_scaling"].original_max_position_embeddings, m["rope_scaling"].factor) == (4096, 1.0)


@pytest.mark.parametrize(
    "family,keys,window",
    [
        ("mistral", {"sliding_window": 4096}, 4096),
        ("mistral", {"sliding_window": None}, None),
        ("qwen2", {"sliding_window": 4096, "use_sliding_window": False}, None),  # Qwen2.5's files: off
        ("qwen2", {"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 2}, 4096),
        ("qwen2", {"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 99}, None),  # no layer
        ("qwen3", {"sliding_window": 512, "use_sliding_window": True, "layer_types": ["full_attention"] * 4}, None),
        ("qwen3_moe", {"sliding_window": 512, "use_sliding_window": True, "max_window_layers": 99}, 512),  # all
    ],
)
def test_the_window_is_the_one_transformers_applies(family, keys, window):
    m = ModelConfig(family=family, qkv_bias=family == "qwen2", qk_norm=family.startswith("qwen3"))
    if family == "qwen3_moe":
        m = compose_config("model=moe_tiny", "model.family=qwen3_moe", "model.qk_norm=true",
                           "model.moe.n_shared_experts=0").model  # fmt: skip
    assert model_fields(hf_config(m) | keys, "hf")["sliding_window"] == window


LLAMA = hf_config(ModelConfig())


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"hidden_act": "gelu"}, "hidden_act=gelu is not supported (p3d's LlamaForCausalLM has hidden_act=silu"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
        ({"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
        (
            {"hidden_activation": "gelu_pytorch_tanh"},
            "config.json's hidden_activation=gelu_pytorch_tanh is not a field",
        ),
        ({"sliding_window": 4096}, "config.json's sliding_window=4096 is not a field of LlamaForCausalLM"),
        ({"quantization_config": {"quant_method": "fp8"}}, "config.json's quantization_config="),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type=dynamic is not supported"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "long_factor": [1]}}, "with long_factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
        ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, "config.json describes Gemma2ForCausalLM"),
        ({"architectures": ["Qwen3ForCausalLM"]}, "describes Qwen3ForCausalLM (model_type=llama)"),
    ],
)
def test_what_p3d_would_ignore_is_refused_in_one_line(change, needle):
    with pytest.raises(HFImportError) as err:
        model_fields(LLAMA | change, "hf")
    assert needle in str(err.value) and "\n" not in str(err.value), err.value


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"mlp_only_layers": [1]}, "mlp_only_layers=[1]: p3d's dense blocks are the first"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2 is not supported"),
    ],
)
def test_qwen3_moe_sparse_layers_p3d_cannot_place_are_refused(change, needle):
    config = hf_config(compose_config("model=qwen3_30b_a3b").model)
    assert model_fields(config | {"mlp_only_layers": [0, 1]}, "hf")["moe"].first_dense_layers == 2
    with pytest.raises(HFImportError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        model_fields(config | change, "hf")


@pytest.mark.parametrize(
    "model,needle",
    [
        (ModelConfig(qk_norm=True), "model.qk_norm=true: p3d-export writes a dense model as LlamaForCausalLM, and "
         "it has no q/k norms; try model.family=qwen3"),
        (ModelConfig(family="qwen2"), "model.qkv_bias=false: p3d-export writes model.family=qwen2 as "
         "Qwen2ForCausalLM, and Qwen2's q, k and v have biases; try model.family=llama"),
        (ModelConfig(family="qwen3_moe"), "model.family=qwen3_moe is written as Qwen3MoeForCausalLM, which needs"),
        (ModelConfig(family="gemma"), "model.family=gemma is not one p3d-export writes"),
    ],
)  # fmt: skip
def test_export_refuses_a_model_its_architecture_cannot_hold(model, needle):
    problem = export_problem(model)
    assert problem is not None and problem.startswith(needle) and "\n" not in problem, problem
