"""ZeRO-3's float8 all-gather (p3d.parallel.zero.float8_gather) against the float8 cast without ZeRO: on dp2 x tp2,
after an optimizer step, the weight every float8 layer receives from FSDP2's all-gather (cast from the fp32 shards
with the scale precomputed over dp x tp, gathered as uint8 on gloo) is bitwise the float8 weight the layer would
cast from the whole tp-local fp32 weight with its tp-reduced amax (p3d.parallel.tp.float8). And the same without the
reduction over tp is caught: its scales differ."""

from __future__ import annotations

import json

from tests.helpers.dist import run_distributed
from tests.helpers.runs import typed

OVERRIDES = ("model=tiny", "mesh=dp2_tp2", "zero=stage3", "train.fp8=tensorwise", "train.dtype=bf16")


def _check(rank, world, out_path):
    import torch
    import torch.distributed as dist

    from p3d.compat import torchao_internals as ao
    from p3d.compat.fsdp_float8 import gathered_shard, hp_tensor
    from p3d.data.loader import global_batches
    from p3d.layout.schedule_rules import chunks_per_rank
    from p3d.parallel.mesh import Mesh
    from p3d.parallel.tp.float8 import COLUMN, ROW
    from p3d.parallel.tp.layers import ColumnParallelLinear
    from p3d.train.executors.torch_pipeline import TorchPipeline

    cfg, plan = typed(*OVERRIDES)
    mesh = Mesh.from_plan(plan, rank).with_groups()
    pipe = TorchPipeline(cfg, plan, mesh, cfg.schedule.pipeline.value, chunks_per_rank(cfg))
    assert pipe.float8_gathered, "tensorwise under ZeRO-3 gathers its float8 weights in float8"
    batches = global_batches(cfg.data, cfg.model.seq_len, cfg.schedule.global_batch_size, cfg.train.seed)
    pipe.train_step(next(batches))  # the weights moved: the scales are the updated weights'
    seen = {}

    def capture(module, args):
        seen.setdefault(id(module), (module.weight._data.view(torch.uint8).clone(), module.weight._scale.clone()))

    hooks = [m.register_forward_pre_hook(capture) for m in pipe.float8_gathered]
    pipe.eval_step(next(batches))
    for h in hooks:
        h.remove()
    checked = 0
    for m in pipe.float8_gathered:
        data, scale = seen[id(m)]
        shard = hp_tensor(gathered_shard(m.weight)).detach()  # this dp rank's fp32 rows of the tp-local weight
        pieces = [torch.empty_like(shard) for _ in range(mesh.dp)]
        dist.all_gather(pieces, shard.contiguous(), group=mesh.dp_group)  # FSDP2 cuts dim 0 evenly here
        whole = torch.cat(pieces)[: data.shape[0]]  # (N, K) fp32, as without ZeRO
        mm = m.float8
        split = COLUMN if isinstance(m, ColumnParallelLinear) else ROW
        want = mm.cast(whole.t(), "weight", split)  # the layer's cast: amax max-reduced over tp
        want_data, want_scale = ao.payload(want)
        assert torch.equal(scale, want_scale), (scale, want_scale)
        assert torch.equal(data, want_data.t().contiguous().view(torch.uint8)), "gathered float8 bytes differ"
        own = ao.amax_to_scale(whole.abs().max(), mm.casts["weight"])  # this tp rank's alone: not the scale
        checked += int(not torch.equal(own, scale))
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump({"layers": len(pipe.float8_gathered), "per_rank_scale_differs": checked}, f)


def test_zero3_float8_all_gather_is_bitwise_the_unsharded_float8_weight(tmp_path):
    out = tmp_path / "result"
    run_distributed(_check, 4, str(out), timeout=300)
    results = [json.loads((tmp_path / f"result.{r}").read_text()) for r in range(4)]
    assert all(r["layers"] == 16 for r in results)  # 4 blocks x q|k|v, o, gate|up, down
    # somewhere a tp rank's own amax is not the tp-reduced one: the reduction over tp is load-bearing
    assert sum(r["per_rank_scale_differs"] for r in results) > 0
