"""``dp_comm_s``'s clocks (p3d.compat.dp_collectives) on real gloo collectives in 2 processes: rank 1 arrives
late at each collective, so rank 0 is blocked in it for the delay; only collectives over the dp groups count, an
asynchronous one through its ``wait()``, a collective built on another once, and DeepSpeed's dp all-gather of the
updated pieces too."""

from __future__ import annotations

import time

from tests.helpers.dist import run_distributed

LATE = 0.3  # rank 1's delay before each collective


def _clocks(rank, world):
    import torch
    import torch.distributed as dist

    from p3d.compat.dp_collectives import timed_deepspeed_allgathers, timed_dp_collectives
    from p3d.train.timing import DeviceClock, Seconds

    dp_group, other_group = dist.new_group([0, 1]), dist.new_group([0, 1])
    seconds = Seconds(DeviceClock())  # the host's clock on CPU, as a gloo worker's

    def late():
        if rank == 1:
            time.sleep(LATE)

    def blocked(run) -> list[float]:
        seconds.take()
        late()
        with timed_dp_collectives([dp_group], seconds.timing):
            run()
        return seconds.durations()

    x = torch.ones(1000)
    got = blocked(lambda: dist.all_reduce(x, group=dp_group))
    assert len(got) == 1 and (rank == 1 or got[0] >= LATE * 0.8), got
    assert float(x[0]) == 2.0
    got = blocked(lambda: dist.all_reduce(x, group=other_group))  # not a dp group: not counted
    assert got == [], got
    out = torch.empty(2000)
    got = blocked(lambda: dist.all_gather_single(out, x, group=dp_group))  # FSDP2's call, however it is built
    assert len(got) == 1 and (rank == 1 or got[0] >= LATE * 0.8), got
    got = blocked(lambda: dist.broadcast(x, src=1, group=dp_group, async_op=True).wait())  # launch, then wait
    assert len(got) == 2 and (rank == 1 or sum(got) >= LATE * 0.8), got
    assert dist.all_reduce is not None and "call" not in dist.all_reduce.__qualname__  # restored afterwards

    # DeepSpeed's ZeRO-1 step: each dp rank's updated piece, gathered into the flat buffer over dp
    import deepspeed
    from deepspeed.runtime.zero import stage_1_and_2

    from p3d.compat.deepspeed_internals import quiet_stdout

    with quiet_stdout():
        deepspeed.init_distributed("gloo")  # on the process group already there
    seconds.take()
    timed_deepspeed_allgathers(seconds.timing)
    timed_deepspeed_allgathers(seconds.timing)  # a second engine in the process: still one clock per call
    flat = torch.zeros(4)
    pieces = [flat[0:2], flat[2:4]]
    pieces[rank].fill_(rank + 1)
    late()
    stage_1_and_2.all_gather_dp_groups(
        groups_flat=[flat],
        partitioned_param_groups=[pieces],
        dp_process_group=[dp_group],
        start_alignment_factor=1,
        allgather_bucket_size=1 << 20,
    )
    assert flat.tolist() == [1.0, 1.0, 2.0, 2.0]
    calls = seconds.durations()
    assert len(calls) == 1 and (rank == 1 or calls[0] >= LATE * 0.8), calls


def test_time_blocked_in_dp_collectives_is_clocked():
    run_distributed(_clocks, 2)
