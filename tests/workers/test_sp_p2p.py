"""Bytes sent between pipeline stages per micro batch, counted at DeepSpeed's p2p send, with sequence
parallelism off and on (model=tiny, tp2_pp2: four gloo processes, the engine exactly as p3d-train
builds it).

What is true, and asserted:
- With SP each tp rank of stage 0 sends its own (b, s/tp, h) block of the activation, and stage 1 sends
  back the gradient of that block: exactly 1/tp of the unpartitioned (b, s, h) activation that SP off
  sends when DeepSpeed's ``pipeline.pipe_partitioned`` / ``grad_partitioned`` are off.
- DeepSpeed's default with tp > 1 (what p3d uses with SP off) is partitioning on: the sender cuts the
  flattened activation into tp pieces, sends its piece plus a small int64 meta tensor, and the receiving
  stage all-gathers the pieces over tp. Its payload is the same b*s*h/tp elements as SP's; SP sends the
  meta tensor less, and the receiver does no all-gather (it needs only its own block).
- The SP blocks are the sequence shards of the unpartitioned activation (same values up to fp32
  reduction order).
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.runs import typed

TP = 2
# name -> (sequence_parallel, DeepSpeed pipe/grad partitioning); None: what p3d's DeepSpeed JSON says
CASES = {"sp": (True, None), "partitioned": (False, None), "unpartitioned": (False, False)}


def _count(rank, world, cases, out_dir):
    import deepspeed
    import torch

    from p3d.compat.deepspeed_internals import pipe_sends
    from p3d.data.loader import micro_batches
    from p3d.parallel.mesh import Mesh
    from p3d.train.executors import ds_engine as executor  # build_engine and the deepspeed_config it calls

    deepspeed.init_distributed(dist_backend="gloo")
    p3d_json = executor.deepspeed_config
    report = {}
    for name, (cfg, plan, partitioned) in cases.items():
        ds_json = p3d_json(cfg, plan)
        if partitioned is not None:
            ds_json["pipeline"] = {"pipe_partitioned": partitioned, "grad_partitioned": partitioned}
        executor.deepspeed_config = lambda c, p, j=ds_json: j
        mesh = Mesh.from_plan(plan, rank).with_groups()
        engine, _, _ = executor.build_engine(cfg, plan, mesh)
        s = cfg.schedule
        data = micro_batches(
            cfg.data, cfg.model.seq_len, s.global_batch_size, s.micro_batch_size, plan.dp, 0, cfg.train.seed
        )
        first: list = []
        with pipe_sends(first, keep_tensors=True):  # the first step, from the same init in every case
            engine.train_batch(data_iter=data)
        steady: list = []
        with pipe_sends(steady):  # the second: no shape meta (DeepSpeed sends it with the first batch only)
            engine.train_batch(data_iter=data)
        report[name] = {"ds_pipeline": ds_json["pipeline"], "sends": steady}
        floats = [t for _, _, dtype, _, t in first if dtype == "torch.float32" and mesh.is_first_stage]
        if floats:  # stage 0's first activation send of the run
            torch.save(floats[0], out_dir / f"{name}-{mesh.tp_rank}.pt")
        report[name]["stage"], report[name]["tp_rank"] = mesh.pp_rank, mesh.tp_rank
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.timeout(1500)
def test_p2p_bytes_per_micro_batch_fall_by_tp_with_sp(tmp_path):
    import torch

    cases = {}
    for name, (sp, partitioned) in CASES.items():
        cfg, plan = typed("model=tiny", f"mesh=tp{TP}_pp2", f"schedule.sequence_parallel={str(sp).lower()}")
        cases[name] = (cfg, plan, partitioned)
    cfg, plan, _ = cases["sp"]
    b, s, h, m = cfg.schedule.micro_batch_size, cfg.model.seq_len, cfg.model.hidden_size, plan.micro_batches
    run_distributed(_count, 4, cases, tmp_path, timeout=1200)  # process start-up takes minutes on a loaded machine
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]

    full = b * s * h * 4  # the (b, s, h) fp32 activation of one micro batch
    meta = 8 * (1 + 3 + 2 + TP + 1)  # PartitionedTensor.to_meta: ndim, shape, num_parts, rank, tp + 1 offsets
    for report in reports:
        # p3d's DeepSpeed JSON: partitioning off under SP, DeepSpeed's default (on) without it
        assert report["sp"]["ds_pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False}
        assert report["partitioned"]["ds_pipeline"] == {"pipe_partitioned": True, "grad_partitioned": True}
        dest = 1 - report["sp"]["stage"]  # stage 0 sends activations to 1, stage 1 their gradients to 0
        sends = {name: [tuple(x[:2]) + (x[2], x[3]) for x in report[name]["sends"]] for name in CASES}
        for x in sends.values():
            assert {d for d, *_ in x} == {dest}
        fp32 = "torch.float32"
        assert sends["sp"] == [(dest, [b, s // TP, h], fp32, full // TP)] * m
        assert sends["unpartitioned"] == [(dest, [b, s, h], fp32, full)] * m
        assert (
            sends["partitioned"]
            == [(dest, [1 + 3 + 2 + TP + 1], "torch.int64", meta), (dest, [b * s * h // TP], fp32, full // TP)] * m
        )
        per_micro_batch = {name: sum(x[3] for x in sends[name]) / m for name in CASES}
        assert per_micro_batch["unpartitioned"] == TP * per_micro_batch["sp"]  # exactly tp
        assert per_micro_batch["partitioned"] == per_micro_batch["sp"] + meta  # same payload, plus the meta

    # SP's blocks are the sequence shards of the unpartitioned activation
    whole = torch.load(tmp_path / "unpartitioned-0.pt")
    assert torch.equal(whole, torch.load(tmp_path / "unpartitioned-1.pt"))  # both tp ranks send it all
    shards = torch.cat([torch.load(tmp_path / f"sp-{t}.pt") for t in range(TP)], dim=1)
    assert shards.shape == whole.shape
    torch.testing.assert_close(shards, whole, rtol=1e-5, atol=1e-6)
