"""Hugging Face Mixtral import and export (issue 34): a small random ``MixtralForCausalLM`` built locally gives
transformers' logits in p3d (the single-process twin, and a dp2_tp2 / ep2 pipeline reading its slices), trains
from ``model.init_from`` over ep=2, and exports back to a directory that transformers loads with the trained
model's logits. What Mixtral cannot represent (shared experts, dense first blocks, another router, selection
biases) is refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from p3d import exit_codes
from p3d.checkpoint import find as checkpoint
from tests.helpers.dist import run_distributed
from tests.helpers.runs import ROOT, p3d_train, typed

VOCAB = 512
# std 0.1, not transformers' 0.02: logits of a few units, so a misplaced expert shows; the routing margins stay
# far above fp32 noise (the 2nd and 3rd experts' scores differ by >= 1e-4 on these ids)
SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=64,
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    router_aux_loss_coef=0.02,
    initializer_range=0.1,
)


@pytest.fixture(scope="module")
def hf_mixtral(tmp_path_factory):
    """A random small Mixtral built with transformers, saved locally (no hub)."""
    import transformers  # pinned in requirements-cpu.txt: a missing one is a failure, not a skip

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**SHAPE))
    path = tmp_path_factory.mktemp("hf") / "tiny-mixtral"
    model.save_pretrained(path)
    return path


def _hf_logits(path, ids) -> torch.Tensor:
    from transformers import MixtralForCausalLM

    with torch.no_grad():
        return MixtralForCausalLM.from_pretrained(path).eval()(ids).logits


def _ids(seed: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(seed))


def _tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def test_save_pretrained_writes_the_hubs_per_expert_names(hf_mixtral):
    """What p3d reads and writes: the w1/w2/w3 per expert of mistralai/Mixtral-8x7B, not transformers 5's fused
    module tensors (if a transformers release changes what it writes, this says so first)."""
    names = set(_tensors(hf_mixtral))
    assert "model.layers.3.block_sparse_moe.experts.3.w3.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert not any("gate_up_proj" in n or ".mlp." in n for n in names)


def test_init_from_sets_the_moe_shape(hf_mixtral):
    from p3d.config.schema import MoEConfig, RouterScore

    cfg, plan = typed(f"model.init_from={hf_mixtral}", "mesh=dp2", "mesh.ep=2")
    assert (cfg.model.n_layers, cfg.model.ffn_hidden_size, cfg.model.vocab_size) == (4, 64, VOCAB)
    assert cfg.model.moe == MoEConfig(
        n_experts=4, top_k=2, expert_ffn_size=64, score=RouterScore.softmax, norm_topk_prob=True, aux_loss_coef=0.02
    )
    assert plan.ep == 2 and cfg.data.tokenizer == "byte"  # no tokenizer.json in the directory


@pytest.mark.slow  # slow tier (2 runs of mixtral's import, 30-55 s): kept: the import and export tests
def test_init_from_keeps_the_command_lines_training_settings_and_refuses_another_shape(hf_mixtral, tmp_path):
    """Beside model.init_from, model.moe's training settings (balancing, capacity) are the command line's; its
    shape and routing come from config.json, and a command line that disagrees is refused in one line."""
    import yaml

    base = ("model=mixtral_8x7b", f"model.init_from={hf_mixtral}", "mesh=single", "train.steps=1")
    proc = p3d_train(
        *base, f"run.dir={tmp_path / 'a'}", "model.moe.capacity_factor=1.25", "model.moe.aux_loss_coef=0.5"
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    moe = yaml.safe_load((tmp_path / "a" / "run_spec.yaml").read_text())["model"]["moe"]
    assert (moe["capacity_factor"], moe["aux_loss_coef"], moe["n_experts"], moe["top_k"]) == (1.25, 0.5, 4, 2)
    proc = p3d_train(*base, f"run.dir={tmp_path / 'b'}", "model.moe.top_k=1")
    assert proc.returncode == exit_codes.CONFIG_ERROR
    line = proc.stderr.strip().splitlines()[-1]
    assert "model.moe.top_k=1 (command line) disagrees with" in line and "config.json (2)" in line, line


def test_imported_twin_gives_transformers_logits(hf_mixtral):
    from p3d.hf.load import sequential_from_hf

    ids = _ids()
    with torch.no_grad():
        ours = sequential_from_hf(hf_mixtral)(ids)[..., :VOCAB]
    theirs = _hf_logits(hf_mixtral, ids)
    assert theirs.abs().max() > 1  # random weights that matter, not a near-constant output
    diff = (ours - theirs).abs().max().item()
    assert diff < 1e-5, diff  # measured 1.2e-6


def _pipeline_logits_match(rank, world, hf_dir):
    """dp2_tp2 with ep=2 (torch's pipelining executor, which runs expert parallelism): every rank reads its tp
    slice of its ep rank's experts, as TorchExecutor.init_from does; the same ids on both replicas."""
    from p3d.hf.load import load_into
    from p3d.layout.schedule_rules import chunks_per_rank, runs_on_deepspeed
    from p3d.model.experts import RoutedExperts
    from p3d.parallel.mesh import Mesh
    from p3d.train.executors.torch_pipeline import TorchPipeline

    cfg, plan = typed("mesh=dp2_tp2", "mesh.ep=2", f"model.init_from={hf_dir}")
    assert not runs_on_deepspeed(cfg)
    mesh = Mesh.from_plan(plan, rank).with_groups()

    def init_from(chunks):
        for chunk in chunks:
            load_into(chunk, hf_dir, cfg.model, mesh)

    pipe = TorchPipeline(cfg, plan, mesh, cfg.schedule.pipeline.value, chunks_per_rank(cfg), prepare=init_from)
    (chunk,) = pipe.chunks  # pp = 1: the whole model
    first = 2 * mesh.ep_rank
    routed = [m for m in chunk.modules() if isinstance(m, RoutedExperts)]  # each MoE block's stacked experts
    assert routed and all((m.first, m.local) == (first, 2) for m in routed), [(m.first, m.local) for m in routed]
    ids = torch.randint(0, VOCAB, (cfg.schedule.micro_batch_size, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = chunk.eval()(ids)  # (b, s, V/tp)
    parts = [torch.empty_like(logits) for _ in range(mesh.tp)]
    dist.all_gather(parts, logits.contiguous(), group=mesh.tp_group)
    full = torch.cat(parts, dim=-1)[..., :VOCAB]
    diff = (full - _hf_logits(hf_dir, ids)).abs().max().item()
    assert diff < 1e-5, diff


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_import_on_dp2_tp2_ep2_gives_transformers_logits(hf_mixtral):
    run_distributed(_pipeline_logits_match, 4, str(hf_mixtral), timeout=240)


@pytest.fixture(scope="module")
def trained(hf_mixtral, tmp_path_factory):
    """Two steps from the HF weights over dp2 with the experts split over ep=2, then p3d-export."""
    run = tmp_path_factory.mktemp("mixtral") / "run"
    result = p3d_train(f"run.dir={run}", f"model.init_from={hf_mixtral}", "mesh=dp2", "mesh.ep=2", "train.steps=2")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    out = run.parent / "hf"
    exported = _export(f"run.dir={run}", f"out={out}")
    assert exported.returncode == 0, exported.stderr
    return run, out


def test_export_is_a_mixtral_with_the_checkpoints_logits(hf_mixtral, trained):
    from p3d.hf.export import load_sequential

    run, out = trained
    config = json.loads((out / "config.json").read_text())
    source = json.loads((hf_mixtral / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["sliding_window"] is None
    for key in ("num_local_experts", "num_experts_per_tok", "intermediate_size", "router_aux_loss_coef"):
        assert config[key] == source[key], key
    ids = _ids(11)
    with torch.no_grad():
        ours = load_sequential(checkpoint.find(run, "auto"))(ids)[..., :VOCAB]
    diff = (_hf_logits(out, ids) - ours).abs().max().item()
    assert diff < 1e-5, diff  # measured 1.2e-6
    # the same tensors as the source, each where it was (every ep rank read its experts and wrote them back),
    # moved by the two steps only: Adam moves a weight by about lr (3e-4) a step, a misplaced one by ~0.1
    before, after = _tensors(hf_mixtral), _tensors(out)
    assert sorted(after) == sorted(before)
    moved = {name: (after[name] - before[name]).abs().max().item() for name in before}
    assert min(moved.values()) > 0 and max(moved.values()) < 2e-3, moved


def _export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "p3d.cli.export", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def _one_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == exit_codes.CONFIG_ERROR and len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "overrides,needle",
    [
        pytest.param(  # a shared expert and a dense first block
            ["model=moe_tiny"],
            "model.moe.n_shared_experts=1: p3d-export writes an MoE model as MixtralForCausalLM, and it has no "
            "shared experts",
            id="shared",
        ),
        pytest.param(
            ["model=moe_tiny", "model.moe.n_shared_experts=0", "model.moe.first_dense_layers=0"]
            + ["model.moe.bias_update_rate=0.01"],
            "1.mlp.router.expert_bias holds non-zero selection biases (model.moe.bias_update_rate=0.01), which "
            "MixtralForCausalLM cannot represent",
            id="selection-bias",
        ),
    ],
)
def test_export_refuses_what_mixtral_cannot_hold_in_one_line(tmp_path, overrides, needle):
    run = tmp_path / "run"
    result = p3d_train(f"run.dir={run}", *overrides, "mesh=single", "train.steps=1", timeout=200)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    line = _one_line(_export(f"run.dir={run}", f"out={tmp_path / 'hf'}"))
    assert needle in line and "nothing was written" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no out, no temporary directory
