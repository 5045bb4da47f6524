"""Chunks of the torch schedules, in-process: placement arithmetic, bubble theory, ChunkModule (names, tied sharing,
full recompute), the torch touchpoints, and the refusals of p3d.train.executors.torch_pipeline."""

from __future__ import annotations

import pytest
import torch

from p3d.compat.pipelining_internals import TOUCHPOINTS, Touchpoint, stage_to_rank_mapping
from p3d.config.schema import Partition, Recompute
from p3d.layout.geometry import chunk_to_rank, rank_chunks, schedule_bubble, stage_bounds
from p3d.model.llama import TransformerBlock
from p3d.parallel.mesh import Mesh
from p3d.pipeline.chunks import ChunkModule
from p3d.pipeline.specs import build_layer_specs
from tests.helpers.runs import typed


@pytest.mark.parametrize("style", ["loop", "v"])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("pp", [2, 4])
def test_chunk_to_rank_is_torchs_mapping(pp, v, style):
    assert chunk_to_rank(pp, pp * v, style) == stage_to_rank_mapping(pp, pp * v, style)
    held = [rank_chunks(pp, v, style, r) for r in range(pp)]
    assert sorted(c for chunks in held for c in chunks) == list(range(pp * v))
    assert all(len(chunks) == v for chunks in held)


def test_tiny_pp2_v2_chunks_as_the_design_draws_them():
    assert stage_bounds(4, 4, Partition.blocks) == [0, 2, 3, 4, 7]  # embed+block0 | block1 | block2 | block3+norm+head
    assert [rank_chunks(2, 2, "loop", r) for r in (0, 1)] == [[0, 2], [1, 3]]
    assert [rank_chunks(2, 2, "v", r) for r in (0, 1)] == [[0, 3], [1, 2]]  # V: rank 0 holds embedding and head
    with pytest.raises(ValueError, match="divisible"):
        chunk_to_rank(4, 6, "v")
    with pytest.raises(ValueError, match="style"):
        chunk_to_rank(2, 4, "zigzag")


def test_schedule_bubble_theory():
    assert schedule_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert schedule_bubble("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    assert schedule_bubble("interleaved_zero_bubble", 4, 8, 2) == pytest.approx(3 / 51)  # 3 v m chunk passes
    assert schedule_bubble("zbv", 4, 8, 2) == pytest.approx(3 / 51)
    assert schedule_bubble("zbv", 4, 4, 2) == pytest.approx(6 / 30)  # below m = (3p - 1) / 2 its warmup idles
    assert schedule_bubble("dualpipev", 4, 8, 2) == pytest.approx(3 / 51)
    assert schedule_bubble("interleaved_1f1b", 4, 8, 2) < schedule_bubble("1f1b", 4, 8)
    with pytest.raises(ValueError, match="schedule 'nope'"):
        schedule_bubble("nope", 2, 4)


@pytest.mark.parametrize("touchpoint", TOUCHPOINTS, ids=lambda t: t.name)
def test_installed_torch_still_has(touchpoint: Touchpoint):
    assert touchpoint.present(), f"torch {torch.__version__} no longer has {touchpoint.name} ({touchpoint.used_by})"


def _specs(*overrides: str):
    cfg, plan = typed("mesh=single", *overrides)
    return cfg, build_layer_specs(cfg.model, plan.padded_vocab_size, Mesh(tp=1, pp=1, dp=1), cfg.train.seed)


def test_v_placement_shares_one_tied_table():
    _, specs = _specs("model.tie_embeddings=true")
    tied: dict = {}
    first, last = ChunkModule(specs, 0, 2, tied), ChunkModule(specs, 5, 7, tied)  # rank 0 of zbv on tiny pp2
    assert first.tied_modules["embed"] is last.tied_modules["embed"]
    both = torch.nn.ModuleList([first, last])
    assert len(list(both.parameters())) == len(set(map(id, first.parameters())) | set(map(id, last.parameters())))
    with pytest.raises(ValueError, match="outside"):
        ChunkModule(specs, 3, 9)


def test_full_recompute_reruns_each_block_and_changes_nothing():
    _, specs = _specs()
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    results = []
    for recompute in (False, True):
        chunk = ChunkModule(specs, 0, len(specs), recompute=recompute)
        calls: list[int] = []
        count = calls.append  # a pre-hook: non-reentrant recompute stops before the block's forward returns
        for m in chunk.modules():
            if isinstance(m, TransformerBlock):
                m.register_forward_pre_hook(lambda *_, count=count: count(1))
        chunk(ids).float().square().mean().backward()
        results.append((len(calls), {n: p.grad.clone() for n, p in chunk.named_parameters()}))
    (plain_calls, plain_grads), (ckpt_calls, ckpt_grads) = results
    assert (plain_calls, ckpt_calls) == (4, 8)
    for name, g in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], g, rtol=0, atol=0)


def test_torch_pipe_refusals():
    from p3d.train.executors.torch_optim import build_torch_optimizer
    from p3d.train.executors.torch_pipeline import check_recompute, chunks_per_rank

    assert chunks_per_rank("interleaved_1f1b", 3) == 3
    assert chunks_per_rank("gpipe", 1) == 1
    with pytest.raises(ValueError, match="schedule.virtual_stages=1: .*try virtual_stages=2"):
        chunks_per_rank("interleaved_1f1b", 1)
    with pytest.raises(ValueError, match="schedule.virtual_stages=3: zbv places exactly two"):
        chunks_per_rank("zbv", 3)
    with pytest.raises(ValueError, match="schedule.pipeline=bfs"):
        chunks_per_rank("bfs", 2)
    check_recompute("interleaved_1f1b", Recompute.full)
    check_recompute("zbv", Recompute.selective)
    for name in ("interleaved_zero_bubble", "zbv", "dualpipev"):
        with pytest.raises(ValueError, match=f"schedule.recompute=full with schedule.pipeline={name}: .* try "):
            check_recompute(name, Recompute.full)
    assert chunks_per_rank("1f1b", 1) == 1  # torch's Schedule1F1B, which ZeRO-2/3 run on
    for stage in (2, 3):  # a plain AdamW over FSDP2's shards, whose moments are sharded with them
        cfg, _ = typed("mesh=dp2", f"zero=stage{stage}")
        opt, _ = build_torch_optimizer(torch.nn.Linear(2, 2), cfg, Mesh(tp=1, pp=1, dp=2))
        assert type(opt) is torch.optim.AdamW, stage
