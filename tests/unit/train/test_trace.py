"""Recording a traced step (issue 56), in-process: the events are the step clocks' own intervals (on CUDA, events
timed from a step-start event, read after the step with no sync inside it), labelled with the pass, micro batch and
chunk; the calls traced only on traced steps are restored after; a collective's dimension comes from its group's
ranks. The trace of a real run: tests/e2e/test_trace.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from p3d.parallel.mesh import Mesh
from p3d.train.timing import StepClocks, TorchStageTimer
from p3d.train.trace import GroupDims
from p3d.train.trace_events import StepTrace
from tests.unit.train.test_clocks import FakeEvent, cuda_events, gpu_work  # noqa: F401 - cuda_events: a fixture


def test_a_traced_steps_events_are_its_clocks_intervals_on_the_gpu_clock(cuda_events):  # noqa: F811
    clocks = StepClocks(torch.device("cuda", 0))
    gpu_work(5.0)  # the previous step: before the step-start event
    trace = StepTrace(clocks.wait.clock, step=2)
    clocks.begin_trace(trace)
    with clocks.compute.timing("F", "0F0", micro_batch=0, chunk=0):
        gpu_work(0.3)
    gpu_work(0.1)
    with clocks.wait.timing():  # a p2p wait: the clock's own label
        gpu_work(0.2)
    with clocks.wait.timing("drain"):
        gpu_work(0.05)
    trace.end = trace.clock.mark()
    clocks.end_trace()
    with clocks.compute.timing("B", "0B0"):  # after the traced step: timed, not traced
        gpu_work(1.0)
    assert FakeEvent.syncs == 0  # nothing waited for the device while recording
    step_s, events = trace.read()
    assert step_s == pytest.approx(0.65)
    assert [e[:3] for e in events] == [
        ["schedule", "F", "0F0"],
        ["schedule", "wait", "p2p wait"],
        ["schedule", "drain", "drain"],
    ]
    assert [e[3:5] for e in events] == [pytest.approx([0.0, 3e5]), pytest.approx([4e5, 2e5]), pytest.approx([6e5, 5e4])]
    assert events[0][5] == {"micro_batch": 0, "chunk": 0}
    assert clocks.take_compute() == pytest.approx(1.3) and clocks.take() == pytest.approx(0.25)  # the same marks


def test_calls_traced_on_traced_steps_only_are_restored_after():
    class Pipe:
        def clip_and_step(self) -> float:
            return 1.5

    pipe, clocks = Pipe(), StepClocks()
    clocks.traced_calls.append((pipe, "clip_and_step", "optimizer"))
    trace = StepTrace(clocks.wait.clock, step=1)
    clocks.begin_trace(trace)
    assert pipe.clip_and_step() == 1.5
    clocks.end_trace()
    assert "clip_and_step" not in vars(pipe) and pipe.clip_and_step() == 1.5  # the class's method again
    assert [(e[1], e[2]) for e in trace.events] == [("optimizer", "clip_and_step")]  # once: the traced call


def test_each_torch_pass_is_labelled_with_its_micro_batch_and_chunk():
    class Stage:
        stage_index = 3

        def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None):
            pass

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            pass

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            pass

    stage = Stage()
    timer = TorchStageTimer([stage])
    stage.forward_one_chunk(1, ())  # untraced: timed only
    trace = StepTrace(timer.wait.clock, step=1)
    timer.begin_trace(trace)
    stage.forward_one_chunk(2, (), {})
    stage.backward_one_chunk(2, loss=None, full_backward=False, last_backward=False)  # zero bubble: I, then W
    stage.backward_weight_one_chunk(2, last_backward=False)
    stage.backward_one_chunk(0)  # 1F1B's call: a full backward
    timer.end_trace()
    assert [e[2] for e in trace.events] == ["3F2", "3I2", "3W2", "3B0"]
    assert [e[5] for e in trace.events][1] == {"micro_batch": 2, "chunk": 3}
    assert len(timer.compute.spans) == 5


def test_a_collectives_dimension_comes_from_its_groups_ranks(monkeypatch):
    mesh = Mesh(tp=2, pp=4, dp=2, rank=11)
    d = Mesh(tp=2, pp=4, dp=2).dims
    mine = {name: next(r for r in getattr(d, f"{name}_ranks")() if 11 in r) for name in ("tp", "pp", "dp", "replica")}
    groups = {
        "tp": mine["tp"],
        "pp": mine["pp"],
        "dp": mine["dp"],
        "mp": mine["replica"],
        "tied": [mine["pp"][0], mine["pp"][-1]],  # the tied embeddings' two holders: a part of the pipeline
        "world": list(range(16)),
        "other": [0, 11],
    }
    handles = {name: object() for name in groups}
    ranks_of = {id(h): groups[name] for name, h in handles.items()}
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda g: ranks_of[id(g)])
    dims = GroupDims(mesh)
    found = {name: dims.of(h) for name, h in handles.items()}
    assert found == {"tp": "tp", "pp": "pp", "dp": "dp", "mp": "mp", "tied": "pp", "world": "world", "other": "other"}
    assert dims.of(None) == "world"


def test_the_mesh_groups_name_their_dimension_where_two_have_the_same_ranks(monkeypatch):
    """dp2 with ep2: the experts' all-to-all group and the gradients' dp group hold the same two ranks; each
    collective is drawn with the dimension of the mesh group it ran on, not the first dimension with those ranks."""
    ep_group, dp_group, edp_group = object(), object(), object()
    mesh = Mesh(tp=1, pp=1, dp=2, ep=2, rank=1)
    mesh = dataclasses.replace(mesh, ep_group=ep_group, dp_group=dp_group, edp_group=edp_group)
    ranks_of = {id(ep_group): [0, 1], id(dp_group): [0, 1], id(edp_group): [1]}
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda g: ranks_of[id(g)])
    dims = GroupDims(mesh)
    assert (dims.of(ep_group), dims.of(dp_group), dims.of(edp_group)) == ("ep", "dp", "dp")
