"""The step's clocks on CUDA (issue 51): intervals are CUDA events on the stream, read once when the step's figures
are taken, so the figures are GPU time and timing adds no host sync inside the step. No GPU here: torch.cuda.Event
is replaced by a fake whose timestamps are a simulated GPU clock, apart from the host's."""

from __future__ import annotations

import time

import pytest
import torch

from p3d.train.timing import StepClocks, TorchStageTimer


class FakeEvent:
    """torch.cuda.Event's calls p3d makes: record (stamps the simulated GPU clock), synchronize, elapsed_time (ms)."""

    gpu_now = 0.0
    syncs = 0

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.at: float | None = None

    def record(self, stream=None) -> None:
        self.at = FakeEvent.gpu_now

    def synchronize(self) -> None:
        FakeEvent.syncs += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1e3


@pytest.fixture
def cuda_events(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.gpu_now, FakeEvent.syncs = 0.0, 0
    return FakeEvent


def gpu_work(seconds: float) -> None:
    FakeEvent.gpu_now += seconds  # the kernels the host launched run this long on the device


def test_cuda_figures_are_gpu_time_not_the_host_time_of_the_launches(cuda_events):
    clocks = StepClocks(torch.device("cuda", 0))
    with clocks.compute.timing():
        time.sleep(0.05)  # the host's launches take time the device does not
        gpu_work(0.3)
    gpu_work(1.0)  # between intervals: not counted
    with clocks.wait.timing():
        gpu_work(0.2)  # a stream stalled on a neighbour's p2p
    with clocks.compute.timing():
        gpu_work(0.1)
    assert cuda_events.syncs == 0  # nothing waited for the device inside the step
    assert clocks.take_compute() == pytest.approx(0.4)
    assert clocks.take() == pytest.approx(0.2)
    assert clocks.take_dp_comm() == 0.0
    assert cuda_events.syncs > 0  # read when taken
    assert clocks.take_compute() == 0.0  # taken once: a fresh start


def test_the_torch_stage_timer_times_the_stages_methods_on_the_gpu_clock(cuda_events):
    class Stage:
        def forward_one_chunk(self):
            gpu_work(0.5)

        def backward_one_chunk(self):
            gpu_work(1.0)

        def backward_weight_one_chunk(self):
            gpu_work(0.25)

    stage = Stage()
    timer = TorchStageTimer([stage], device=torch.device("cuda", 0))
    stage.forward_one_chunk()
    stage.backward_one_chunk()
    stage.backward_weight_one_chunk()
    assert cuda_events.syncs == 0
    assert timer.take_compute() == pytest.approx(1.75)


def test_the_cpu_clock_is_the_hosts(cuda_events):
    clocks = StepClocks(torch.device("cpu"))
    with clocks.compute.timing():
        time.sleep(0.05)
        gpu_work(5.0)  # no CUDA clock on a CPU run
    assert 0.04 < clocks.take_compute() < 1.0
    assert cuda_events.syncs == 0
