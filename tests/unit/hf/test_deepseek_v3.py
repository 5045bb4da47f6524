"""DeepSeek-V3's checkpoints (p3d.hf.architectures.deepseek_v3, p3d.hf.fp8), from a tiny DeepseekV3ForCausalLM that
transformers wrote (tests/helpers/hf_families.py), in process:

- block FP8 in the published format (float8_e4m3fn weights, a ``weight_scale_inv`` per 128 x 128 block,
  ``quantization_config``), written by the test from the checkpoint: every rank of tp2 x ep2 imports exactly the
  dequantized values, as from an fp32 checkpoint of them; also with blocks of 16 x 8 rows and columns, which cut
  through the tp slices (partial blocks, a slice starting inside a block);
- a quantized tensor without its scale, a scale of another shape and another quantization: refused in one line;
- the multi-token prediction layer after the blocks (model.layers.<L>.*): refused in one line naming
  ``model.drop_mtp=true``, which the same command accepts, and which imports the model without it, its logits
  transformers' own;
- the config.json keys of the published checkpoint (DeepSeek's remote-code era: rope_scaling with ``type``,
  scoring_func, topk_method, ep_size, ...) read into the model group;
- a grouped router exported as Mixtral or Qwen3-MoE is refused (its grouping would be lost), and an MLA model is
  exported as DeepSeek-V3 only.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from p3d.hf.names import HFImportError
from tests.helpers.hf_families import VOCAB, logits, write_checkpoint


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_checkpoint("deepseek_v3", tmp_path_factory.mktemp("hf") / "deepseek_v3")


def _quantized(name: str) -> bool:
    """The matrices DeepSeek-V3's release stores in FP8: the blocks' linear layers (not the embedding, the head, the
    norms, the routers or their biases)."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def _blockwise(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, fp32 scale_inv): each block scaled so that its largest magnitude is float8's 448."""
    rows, cols = math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1])
    scale = torch.zeros(rows, cols)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
    full = scale.repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(block[1], 1)[:, : w.shape[1]]
    return (w / full).to(torch.float8_e4m3fn), scale


def _dequantized(w8: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    full = scale.repeat_interleave(block[0], 0)[: w8.shape[0]].repeat_interleave(block[1], 1)[:, : w8.shape[1]]
    return w8.float() * full


def _fp8_pair(src, tmp_path, block):
    """(the checkpoint in block FP8, the same dequantized in fp32), both written from ``src``."""
    from safetensors.torch import load_file, save_file

    fp8, plain = tmp_path / "fp8", tmp_path / "dequantized"
    shutil.copytree(src, fp8)
    shutil.copytree(src, plain)
    tensors = load_file(src / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        if _quantized(name):
            w8, scale = _blockwise(t.float(), block)
            quantized |= {name: w8, name + "_scale_inv": scale}
            dequantized[name] = _dequantized(w8, scale, block)
        else:
            quantized[name] = dequantized[name] = t
    save_file(quantized, fp8 / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, plain / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    q = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}
    (fp8 / "config.json").write_text(json.dumps(config | {"quantization_config": q}))
    return fp8, plain


@pytest.mark.parametrize("block", [(128, 128), (16, 8)], ids=["published-128", "blocks-cut-the-slices"])
def test_a_block_fp8_checkpoint_imports_to_its_dequantized_values_on_every_rank(source, tmp_path, block):
    from p3d.hf.load import sequential_from_hf
    from p3d.parallel.mesh import Mesh

    fp8, plain = _fp8_pair(source, tmp_path, block)
    for rank in (None, 0, 1, 2, 3):
        mesh = None if rank is None else Mesh(tp=2, pp=1, dp=2, ep=2, rank=rank)
        got = dict(sequential_from_hf(fp8, mesh=mesh).named_parameters())
        want = dict(sequential_from_hf(plain, mesh=mesh).named_parameters())
        assert got.keys() == want.keys()
        for name, p in got.items():
            torch.testing.assert_close(p, want[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")  # noqa: B023
    # the float8 rounding is there: the dequantized weights are not the source's
    name = "layers.2.attn.wkv_b.weight"
    source_twin, dequantized = (dict(sequential_from_hf(d).named_parameters()) for d in (source, plain))
    assert (source_twin[name] - dequantized[name]).abs().max() > 1e-4


def _edit(src, dst, config_changes=None, tensors=None):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config_changes:
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(config | config_changes))
    if tensors:
        held = tensors(load_file(dst / "model.safetensors"))
        save_file(held, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


FP8 = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
WKV_B = "model.layers.1.self_attn.kv_b_proj.weight"


def _one_fp8(held, scale_shape=(1, 1)):
    held[WKV_B] = held[WKV_B].to(torch.float8_e4m3fn)
    if scale_shape:
        held[WKV_B + "_scale_inv"] = torch.ones(scale_shape)
    return held


@pytest.mark.parametrize(
    "config,tensors,needle",
    [
        (FP8, lambda t: _one_fp8(t, None), f"{WKV_B} is stored as F8_E4M3 without its {WKV_B}_scale_inv"),
        (FP8, lambda t: _one_fp8(t, (2, 1)), f"{WKV_B}_scale_inv is F32 [2, 1]; a [64, 16] weight in [128, 128]"),
        (None, _one_fp8, f"{WKV_B} is stored as F8_E4M3 but config.json has no quantization_config"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, _one_fp8, "quant_method=bitsandbytes"),
    ],
    ids=["no-scale", "scale-shape", "no-quantization-config", "other-quantization"],
)
def test_a_quantized_checkpoint_p3d_cannot_dequantize_is_refused_in_one_line(source, tmp_path, config, tensors, needle):
    from p3d.hf.check import import_fields

    with pytest.raises(HFImportError) as err:
        import_fields(_edit(source, tmp_path / "hf", config, tensors))
    assert "\n" not in str(err.value) and needle in str(err.value), str(err.value)


def _with_mtp(held):
    """A multi-token prediction layer after the 4 blocks, as DeepSeek-V3's model.layers.61.*: a block's tensors and
    its own (enorm, hnorm, eh_proj, shared_head)."""
    layer = {k.replace("model.layers.3.", "model.layers.4."): v.clone() for k, v in held.items() if ".layers.3." in k}
    extra = {"enorm.weight": torch.ones(64), "hnorm.weight": torch.ones(64), "eh_proj.weight": torch.zeros(64, 128),
             "shared_head.norm.weight": torch.ones(64), "shared_head.head.weight": torch.zeros(VOCAB, 64)}  # fmt: skip
    return held | layer | {f"model.layers.4.{k}": v for k, v in extra.items()}


def test_multi_token_prediction_layers_are_refused_or_dropped_when_asked(source, tmp_path):
    from p3d.config.errors import P3DConfigError
    from p3d.hf.load import sequential_from_hf
    from tests.helpers.runs import assert_fixes_accepted, typed

    mtp = _edit(source, tmp_path / "hf", {"num_nextn_predict_layers": 1}, _with_mtp)
    with pytest.raises(P3DConfigError) as err:
        typed(f"model.init_from={mtp}", "mesh=single")
    text = str(err.value)
    assert "\n" not in text and "model.layers.4.* (" in text and "multi-token prediction" in text, text
    assert text.endswith("add model.drop_mtp=true to import the model without it"), text
    assert_fixes_accepted((f"model.init_from={mtp}", "mesh=single"))
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ours = sequential_from_hf(mtp, drop_mtp=True)(ids)[..., :VOCAB]
    assert (ours - logits(source, "deepseek_v3", ids)).abs().max() < 1e-5


PUBLISHED = {  # deepseek-ai/DeepSeek-V3's config.json, the keys beside the shape's (transformers 4.33's era)
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "max_position_embeddings": 163840, "aux_loss_alpha": 0.001, "ep_size": 1, "moe_layer_freq": 1,
    "scoring_func": "sigmoid", "seq_aux": True, "topk_method": "noaux_tc", "num_nextn_predict_layers": 1,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "torch_dtype": "bfloat16",
}  # fmt: skip


def test_the_published_config_json_reads_into_the_model_group(source):
    from p3d.config.options import AttentionType, RopeType, RouterScore
    from p3d.hf.config_json import model_fields

    config = json.loads((source / "config.json").read_text())
    config.pop("rope_parameters")
    fields = model_fields(config | PUBLISHED, "published")
    assert fields["attention"] == AttentionType.mla and fields["family"] == "deepseek_v3"
    assert fields["mla"].q_lora_rank == 32 and fields["mla"].qk_rope_head_dim == 4 and fields["head_dim"] is None
    moe = fields["moe"]
    assert (moe.n_experts, moe.top_k, moe.n_groups, moe.topk_groups, moe.n_shared_experts) == (8, 2, 4, 2, 1)
    assert moe.score == RouterScore.sigmoid and moe.route_scale == 2.5 and moe.first_dense_layers == 1
    assert moe.aux_loss_coef == 0.001
    r = fields["rope_scaling"]
    assert r.rope_type == RopeType.yarn and r.factor == 40 and r.mscale_all_dim == 1.0
    with pytest.raises(HFImportError, match="scoring_func=softmax is not supported"):
        model_fields(config | PUBLISHED | {"scoring_func": "softmax"}, "published")


def test_a_grouped_router_or_mla_is_exported_only_as_deepseek_v3():
    from p3d.hf.config_json import export_problem
    from tests.helpers.runs import compose_config

    mixtral = ("model=moe_tiny", "model.moe.n_shared_experts=0", "model.moe.first_dense_layers=0")
    assert export_problem(compose_config(*mixtral).model) is None
    grouped = compose_config(*mixtral, "model.moe.n_groups=2").model  # all else Mixtral's
    problem = export_problem(grouped)
    assert problem is not None and "model.moe.n_groups=2" in problem and "MixtralForCausalLM" in problem, problem
    qwen = compose_config(*mixtral, "model.family=qwen3_moe", "model.qk_norm=true", "model.moe.n_groups=2").model
    assert "model.moe.n_groups=2" in (export_problem(qwen) or ""), export_problem(qwen)
    tiny = compose_config("model=deepseek_v3_tiny").model
    assert export_problem(tiny) is None
    llama_family = compose_config("model=deepseek_v3_tiny", "model.family=mixtral").model
    assert "model.attention=mla" in (export_problem(llama_family) or ""), export_problem(llama_family)
