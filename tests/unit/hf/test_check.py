"""The launcher's checkpoint check (p3d.hf.check, p3d.hf.files), torch-free: the safetensors headers give what
safetensors itself reads, and a checkpoint with a tensor p3d would drop, a missing one, one of another shape or a
quantized one is refused in one line naming it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from p3d.config.schema import ModelConfig
from p3d.hf.architectures import BY_FAMILY, LLAMA
from p3d.hf.check import expected_tensors, import_fields
from p3d.hf.config_json import hf_config
from p3d.hf.files import CheckpointFiles
from p3d.hf.names import HFImportError

TINY = ModelConfig(n_layers=2, hidden_size=32, n_heads=4, n_kv_heads=2, ffn_hidden_size=48, vocab_size=64)
QWEN3 = dataclasses.replace(TINY, family="qwen3", qk_norm=True, head_dim=16)
QWEN2 = dataclasses.replace(TINY, family="qwen2", qkv_bias=True)


def _write(path, m: ModelConfig, config: dict | None = None, change=None, dtype=torch.float32) -> dict:
    """A checkpoint directory of the model ``m``'s tensors (zeros: only names and shapes count here) and config.json
    (``config``: another one); ``change`` edits {name: tensor} first."""
    from safetensors.torch import save_file

    from p3d.hf.architectures import of_model

    tensors = {n: torch.zeros(s, dtype=dtype) for n, s in expected_tensors(m, of_model(m)).items()}
    if change:
        change(tensors)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config or hf_config(m)))
    return tensors


def _refusal(path) -> str:
    with pytest.raises(HFImportError) as err:
        import_fields(path)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("m", [TINY, QWEN2, QWEN3], ids=["llama", "qwen2", "qwen3"])
def test_the_headers_are_what_safetensors_reads(tmp_path, m):
    from safetensors import safe_open

    tensors = _write(tmp_path, m, dtype=torch.bfloat16)
    files = CheckpointFiles(tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert {n: list(f.get_slice(n).get_shape()) for n in f.keys()} == {  # noqa: SIM118 - not a dict
            n: shape for n, (_, shape) in files.headers.items()
        }
    assert set(files.headers) == set(tensors) and {d for d, _ in files.headers.values()} == {"BF16"}
    assert import_fields(tmp_path)["family"] == m.family or "llama"


@pytest.mark.parametrize(
    "source,owner,tensor",
    [
        (QWEN3, "Qwen3ForCausalLM and Qwen3MoeForCausalLM have it", "model.layers.0.self_attn.k_norm.weight"),
        (QWEN2, "Qwen2ForCausalLM has it", "model.layers.0.self_attn.k_proj.bias"),
    ],
)
def test_a_checkpoint_relabelled_llama_names_the_tensor_llama_would_drop(tmp_path, source, owner, tensor):
    """The Qwen checkpoint's config.json says llama (model_type, architectures), the rest as it was."""
    relabelled = hf_config(source) | {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    _write(tmp_path, source, relabelled)
    line = _refusal(tmp_path)
    assert line.startswith(f"model.init_from={tmp_path}: {tensor} (and ") and "p3d would drop it" in line, line
    assert owner in line and "LlamaForCausalLM as config.json describes it (model_type=llama)" in line, line


def test_fewer_layers_in_config_json_than_in_the_file_is_refused(tmp_path):
    _write(tmp_path, TINY, hf_config(TINY) | {"num_hidden_layers": 1})
    assert "config.json says num_hidden_layers=1, but the checkpoint holds 2 layers (model.layers.1." in _refusal(
        tmp_path
    )


def test_a_missing_tensor_is_refused(tmp_path):
    _write(tmp_path, QWEN2, change=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    assert _refusal(tmp_path) == (
        f"model.init_from={tmp_path}: model.layers.1.mlp.up_proj.weight is missing from the checkpoint; "
        "Qwen2ForCausalLM as config.json describes it needs it"
    )


def test_a_tensor_of_another_shape_is_refused(tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"
    _write(tmp_path, TINY, change=lambda t: t.update({name: torch.zeros(32, 32)}))  # 4 kv heads, config says 2
    assert _refusal(tmp_path) == (
        f"model.init_from={tmp_path}: {name} is [32, 32] in model.safetensors, but config.json's shape makes it "
        "[16, 32]"
    )


def test_a_quantized_tensor_is_refused(tmp_path):
    name = "model.layers.0.mlp.down_proj.weight"
    _write(tmp_path, TINY, change=lambda t: t.update({name: t[name].to(torch.int8)}))
    assert f"{name} is stored as I8: p3d imports unquantized weights" in _refusal(tmp_path)


def test_every_architecture_reads_the_tensors_it_writes():
    """Each description's names cover every tensor a model of its family has (expected_tensors raises otherwise)."""
    from tests.helpers.runs import compose_config

    for preset in ("llama3_2_1b", "mistral_7b", "qwen2_5_7b", "qwen3_8b", "qwen3_30b_a3b", "mixtral_8x7b"):
        m = dataclasses.replace(compose_config(f"model={preset}").model, n_layers=2)
        names = expected_tensors(m, BY_FAMILY[m.family])
        assert "model.layers.1.input_layernorm.weight" in names and len(names) > 10
    assert "lm_head.weight" not in expected_tensors(dataclasses.replace(TINY, tie_embeddings=True), LLAMA)
