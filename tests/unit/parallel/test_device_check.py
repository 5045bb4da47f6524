"""The device check (p3d.parallel.device_check): on a CPU machine, p3d's host tensors become meta tensors and the
collectives refuse them, as NCCL refuses a host tensor on a GPU (issue 51). In-process: the refusal comes before
the collective would run, so no process group is needed."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from p3d.parallel.device_check import device_checked

CPU = torch.device("cpu")


def p3d_module(source: str) -> types.ModuleType:
    """A module named like one of p3d's, holding ``source``: factories called from it count as p3d's own."""
    module = types.ModuleType("p3d.train.fake_for_test")
    module.__dict__["torch"] = torch
    exec(source, module.__dict__)
    return module


def p2p_op(tensor: torch.Tensor) -> dist.P2POp:
    """A P2POp holding ``tensor``, without the default group its constructor wants."""
    op = object.__new__(dist.P2POp)
    op.tensor = tensor
    return op


@pytest.fixture
def checked(monkeypatch):
    monkeypatch.setenv("P3D_TEST_DEVICE_CHECK", "1")


def test_p3d_host_tensors_are_meta_and_device_tensors_stay(checked):
    made = p3d_module(
        "def make(x):\n"
        "    return [torch.tensor([1.0]), torch.zeros(3), torch.full((2,), 1.0), torch.zeros(3, device=x.device),\n"
        "            torch.zeros_like(x), x * 2]\n"
    )
    with device_checked(CPU):
        devices = [t.device.type for t in made.make(torch.ones(2))]
        assert torch.tensor([1.0]).device.type == "cpu"  # not made by p3d: this test's own, torch's own
    assert devices == ["meta", "meta", "meta", "cpu", "cpu", "cpu"]
    assert made.make(torch.ones(2))[0].device.type == "cpu"  # outside the check: as before


def test_data_ranks_host_batches_are_exempt(checked):
    module = types.ModuleType("p3d.data.fake_for_test")
    module.__dict__["torch"] = torch
    exec("def make():\n    return torch.tensor([[1, 2, 3]])\n", module.__dict__)
    with device_checked(CPU):
        assert module.make().device.type == "cpu"


@pytest.mark.parametrize(
    "call",
    [
        lambda t: dist.all_reduce(t),
        lambda t: dist.all_gather([torch.empty(1), torch.empty(1)], t),
        lambda t: dist.broadcast(t, 0),
        lambda t: dist.all_to_all_single(torch.empty(2), t),
        lambda t: dist.batch_isend_irecv([p2p_op(t)]),
    ],
    ids=["all_reduce", "all_gather", "broadcast", "all_to_all_single", "batch_isend_irecv"],
)
def test_a_collective_refuses_a_host_tensor_and_names_its_caller(checked, call):
    make = p3d_module("def make():\n    return torch.tensor([1.0])\n").make
    with device_checked(CPU), pytest.raises(RuntimeError, match="got a host tensor") as err:
        call(make())
    assert "NCCL takes device tensors only" in str(err.value) and "\n" not in str(err.value)


def test_the_check_is_off_unless_asked_and_leaves_dist_as_it_was(monkeypatch):
    original = dist.all_reduce
    monkeypatch.delenv("P3D_TEST_DEVICE_CHECK", raising=False)
    with device_checked(CPU):
        assert dist.all_reduce is original
    monkeypatch.setenv("P3D_TEST_DEVICE_CHECK", "1")
    with device_checked(CPU):
        assert dist.all_reduce is not original
        with device_checked(CPU):  # re-entrant: the inner one adds nothing
            inner = dist.all_reduce
        assert dist.all_reduce is inner
    assert dist.all_reduce is original
