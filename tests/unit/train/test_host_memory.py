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
