"""The peak of tensor memory a call allocates on the CPU, exactly: torch's profiler records every allocation and free
of torch's CPU allocator in order (``profile_memory``; kernels' own workspaces included), and the running sum of
those records peaks where the call held the most. A count, not a timing: the same on a busy machine as on an idle
one. Used by the cp memory tests (tests/workers/test_cp_activations.py) and bench/cp.py attention."""

from __future__ import annotations

from collections.abc import Callable


def peak_allocated(fn: Callable[[], object]) -> int:
    """Bytes: the most that ``fn()`` held at once beyond what was allocated before it (its result kept until the
    end counts, as a step's activations do)."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # the garbage of earlier calls is freed before, not during, the measured call
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        pass  # the profiler's own first-use allocations, before the measured call
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    records.sort(key=lambda e: e.start_ns())
    held = peak = 0
    for record in records:
        held += record.nbytes()
        peak = max(peak, held)
    return peak
