"""CPU workers keep the host memory they free, so a step does not fault its activations in again.

A training step frees its activations at the end and allocates the same sizes again in the next. glibc's malloc
hands memory back to the kernel in two ways: a block above ``M_MMAP_THRESHOLD`` gets its own mmap and is unmapped
when freed, and free memory at the top of the heap beyond ``M_TRIM_THRESHOLD`` is trimmed. Either way the next
step touches fresh pages, and each one is a page fault that the kernel zeroes. glibc raises both thresholds by
itself after the first unmap, but only up to the size of the blocks it has seen freed, so a step whose peak
varies keeps trimming.

Measured on pp2 (bench/schedules.py's model, m = 8, per step and rank): DeepSpeed's 1f1b took 5 page faults; the
torch executor, whose interleaved schedule keeps more micro batches in flight, 13,000 (51 MiB) and 20 ms more
system time on one rank, zbv 4,000-6,000. With the thresholds below: 12 to 30 under every schedule.

glibc's mmap threshold stops at 32 MiB, and a real vocabulary's gradients are above it: each micro batch's
embedding gradient (dense, V_pad x h) and head weight gradient are new buffers, added into ``.grad`` and freed.
For ``model=small`` (50,304 x 768: 154 MB each) that is 75,000 faults a micro batch, and a one-rank step of 8
micro batches spent about a tenth of its time in the kernel zeroing pages (84,000 faults/s). So large blocks get
no mmap at all (``M_MMAP_MAX`` 0): the heap serves them too, and keeps them when they are freed. Measured in one
process (a 12-block stack of ``model=small``, 8 micro batches fwd + bwd, 2026-12-04): 63,000 faults/s and
10.6-10.8 s a step before, none and 9.6-9.9 s after; the embedding's backward 74 -> 16 ms, the head's 283 -> 229.

On GPUs the activations live in CUDA's caching allocator and this changes nothing that matters; the workers set it
on CPU runs only (``p3d.train.worker.set_up_cpu_worker``). Other C libraries (macOS, musl) are left as they are.

The price is in ``peak_mem_gb``, which is the peak RSS on CPU: a heap that keeps what it frees holds the step's
largest reach, holes included, where CUDA's ``max_memory_allocated`` counts live tensors only (the caching
allocator's free blocks are its reserved bytes, not counted). ``train.host_memory=release`` makes the CPU figure the
GPU's counterpart: every block over 128 KiB gets its own mmap and is unmapped when freed (a fixed threshold, so glibc
does not raise it), and the heap is trimmed above 128 KiB of free top, so RSS follows the live bytes and its peak
(the kernel's high-water mark, intra-op peaks included) is the live peak plus the process. It costs the page faults
above; docs/benchmarks.md (Context parallelism: memory) measures both, and p3d-plan's per-rank figure is the
live peak.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit (HEAP_MAX_SIZE / 2): blocks up to it come from the heap
TRIM_THRESHOLD = 1 << 30  # free memory kept at the heap's top before any is handed back
RELEASE_THRESHOLD = 128 << 10  # train.host_memory=release: glibc's initial mmap threshold, fixed, and the trim's


def _mallopt():
    """glibc's mallopt, or None (another C library: musl has one but ignores these options; macOS has none)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def set_host_memory(policy: str) -> bool:
    """``train.host_memory``: ``keep`` (:func:`keep_freed_memory`) or ``release`` (:func:`release_freed_memory`)."""
    return keep_freed_memory() if policy == "keep" else release_freed_memory()


def release_freed_memory() -> bool:
    """Give every block over ``RELEASE_THRESHOLD`` its own mmap, unmapped when freed, and trim the heap's free top
    above it, so that RSS follows the live bytes; False where the C library is not glibc (or refuses)."""
    mallopt = _mallopt()
    return mallopt is not None and all(
        mallopt(option, value) == 1
        for option, value in ((M_MMAP_THRESHOLD, RELEASE_THRESHOLD), (M_TRIM_THRESHOLD, RELEASE_THRESHOLD))
    )


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process and give no block its own mmap; False where the C
    library is not glibc (or refuses)."""
    mallopt = _mallopt()
    return mallopt is not None and all(
        mallopt(option, value) == 1
        for option, value in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_MMAP_MAX, 0))
    )
