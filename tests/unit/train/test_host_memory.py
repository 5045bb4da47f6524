"""p3d.train.host_memory leaves C libraries other than glibc alone."""

from __future__ import annotations


def test_other_c_libraries_are_left_alone(monkeypatch):
    """musl has a mallopt that ignores these; macOS has none: the worker goes on without the setting."""
    import types

    from p3d.train import host_memory

    calls = []
    musl = types.SimpleNamespace(mallopt=lambda *args: calls.append(args) or 1)
    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda name: musl)
    assert host_memory.keep_freed_memory() is False and calls == []
    assert host_memory.release_freed_memory() is False and calls == []

    def no_libc(name):
        raise OSError("no C library to load")

    monkeypatch.setattr(host_memory.ctypes, "CDLL", no_libc)
    assert host_memory.keep_freed_memory() is False
    assert host_memory.set_host_memory("release") is False


def test_release_off_glibc_says_once_that_it_does_nothing(monkeypatch, capsys):
    """train.host_memory=release on another C library: the logging rank (the console's) says peak_mem_gb keeps the
    freed memory; keep (the default, a speed setting) and the other ranks say nothing."""
    import types

    import torch

    from p3d.train import host_memory, worker

    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda name: types.SimpleNamespace(mallopt=lambda *a: 1))
    monkeypatch.setattr(worker, "skip_cpu_shm_build", lambda: None)
    threads = torch.get_num_threads()
    try:
        worker.set_up_cpu_worker("release", shown=True)
        worker.set_up_cpu_worker("release", shown=False)
        worker.set_up_cpu_worker("keep", shown=True)
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "p3d: warning: train.host_memory=release has no effect here (the C library is not glibc): "
        "peak_mem_gb is the peak RSS, freed memory the heap keeps included"
    ]
