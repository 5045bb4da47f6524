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

On GPUs the activations live in CUDA's caching allocator and this changes nothing that matters; the workers set it
on CPU runs only (``p3d.train.worker.set_up_cpu_worker``). Other C libraries (macOS, musl) are left as they are.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit (HEAP_MAX_SIZE / 2): blocks up to it come from the heap
TRIM_THRESHOLD = 1 << 30  # free memory kept at the heap's top before any is handed back


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where the C library is not glibc (or refuses)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl has mallopt but ignores it
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
