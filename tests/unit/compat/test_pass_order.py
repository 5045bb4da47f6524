"""The passes each pipeline rank runs, as the traces' plan has them (issue 56): DeepSpeed's TrainSchedule and torch's
schedules, in torch's notation (``0F3``: chunk 0's forward of micro batch 3)."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe

from p3d.compat.deepspeed_internals import deepspeed_pass_order
from p3d.compat.pipelining_internals import torch_pass_order


def single_schedule(kind, stages: int, micro_batches: int):
    """A torch single-stage-per-rank schedule with only what its plan (``pipeline_order``) needs: no stage, no
    process group (its ``__init__`` wants a live stage)."""
    schedule = kind.__new__(kind)
    schedule._num_stages, schedule._n_microbatches = stages, micro_batches
    schedule.pipeline_order = schedule._get_pipeline_order()
    return schedule


def one_f_one_b(rank: int, stages: int, m: int) -> list[str]:
    """1F1B as torch's runtime runs it (Schedule1F1B._step_microbatches): min(m, stages - rank) forwards, then a
    backward and a forward in turn, then the backwards left."""
    warmup = min(m, stages - rank)
    order = [f"{rank}F{i}" for i in range(warmup)]
    for i in range(m):
        order.append(f"{rank}B{i}")
        if warmup + i < m:
            order.append(f"{rank}F{warmup + i}")
    return order


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_torch_1f1b_plans_every_rank_as_its_runtime_runs_it(stages):
    """torch's own plan numbers the last rank's forwards from 1 (F1 B0 F2 B1 ... F4): the plan p3d records is the
    runtime's order on every rank, the last one (and the only one of a one-stage pipeline) included."""
    schedule = single_schedule(Schedule1F1B, stages, 4)
    for rank in range(stages):
        assert torch_pass_order(schedule, rank) == one_f_one_b(rank, stages, 4), rank


def test_gpipe_plans_all_forwards_then_all_backwards():
    schedule = single_schedule(ScheduleGPipe, 2, 3)
    assert torch_pass_order(schedule, 1) == ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]


def test_deepspeed_1f1b_order():
    assert deepspeed_pass_order(4, 1, 0) == one_f_one_b(0, 1, 4)
    assert (
        deepspeed_pass_order(4, 2, 0)
        == one_f_one_b(0, 2, 4)
        == ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"]
    )
    assert deepspeed_pass_order(4, 2, 1) == one_f_one_b(1, 2, 4)
