"""A checkpoint written before the routed experts were stacked (tests/fixtures/moe_checkpoint_per_expert.tar.gz: 3
steps of moe_tiny on dp2 with ep2, one tensor per expert, experts 0-1 in dp rank 0's files and 2-3 in dp rank 1's)
read as today's model names it (p3d.checkpoint.per_expert): each layer's experts one stacked tensor, expert j's rows
after expert j - 1's, parameters and optimizer states alike, with the stacked shard spec. Training on from it is
tests/e2e/test_moe_runs.py's."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import torch

from p3d.checkpoint.files import coordinate_reader, read_tensors

FIXTURE = Path(__file__).parents[2] / "fixtures" / "moe_checkpoint_per_expert.tar.gz"
N_EXPERTS = 4


def test_per_expert_tensors_read_as_the_stacked_experts(tmp_path):
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path, filter="data")
    step = tmp_path / "checkpoints" / "step_00000003"
    meta = json.loads((step / "meta.json").read_text())
    raw: dict[str, torch.Tensor] = {}
    for d in (0, 1):
        tensors, _ = read_tensors(step / "model" / f"pp0_tp0_dp{d}.safetensors")
        raw |= {name.removesuffix("/param"): t for name, t in tensors.items() if ".mlp.experts." in name}
    assert "2.mlp.experts.3.w_down.weight" in raw and "2.mlp.experts.0.w_down.weight" in raw
    read = coordinate_reader(step, meta)
    model, optim = read("model", 0, 0), read("optim", 0, 0)
    for layer in (2, 3):  # moe_tiny's MoE blocks (module 0 the embedding, 1 the dense block)
        for part in ("w_gate_up", "w_down"):
            name = f"{layer}.mlp.experts.{part}.weight"
            per_expert = [f"{layer}.mlp.experts.{j}.{part}.weight" for j in range(N_EXPERTS)]
            assert not any(p in model["params"] for p in per_expert)
            want = torch.cat([raw[p].reshape(model["params"][name].shape[0] // N_EXPERTS, -1) for p in per_expert])
            torch.testing.assert_close(model["params"][name], want.view_as(model["params"][name]), rtol=0, atol=0)
            assert model["shard"][name]["experts"] == N_EXPERTS
            assert set(optim[name]) >= {"master", "exp_avg", "exp_avg_sq"}
            torch.testing.assert_close(optim[name]["master"].view_as(want), want.view_as(optim[name]["master"]))
