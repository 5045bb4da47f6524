"""Activation bytes per transformer block with sequence parallelism and selective / full recompute,
measured on tp = 2 (two gloo processes) against the planner's ``block_bytes``.

Measured as in test_plan_activations: every tensor autograd saves during the block's forward
(``torch.autograd.graph.saved_tensors_hooks``), once per storage, parameters excluded, plus the inputs
DeepSpeed's checkpoint function keeps under full recompute. With sequence parallelism the block's
input is this rank's (b, s/tp, h) block of the sequence.
"""

from __future__ import annotations

from tests.helpers.dist import run_distributed

TP = 2
RECOMPUTE = ("none", "selective", "selective+swiglu", "full")  # +swiglu: schedule.recompute_swiglu=true
CASES = [(sp, rc, dt) for dt in ("fp32",) for sp in (False, True) for rc in RECOMPUTE]  # (sequence_parallel, ...)


def block_saved_bytes(cfg, mesh, sequence_parallel: bool, recompute: str) -> int:
    import torch

    from p3d.model.llama import TransformerBlock

    m = cfg.model
    dtype = torch.bfloat16 if cfg.train.dtype.value == "bf16" else torch.float32
    selective, swiglu = recompute.startswith("selective"), recompute.endswith("+swiglu")
    block = TransformerBlock(m, mesh, 1, cfg.train.seed, sequence_parallel, selective, swiglu).to(dtype)
    s = m.seq_len // (mesh.tp if sequence_parallel else 1)
    x = torch.randn(cfg.schedule.micro_batch_size, s, m.hidden_size, dtype=dtype, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    held: dict[int, int] = {}

    def keep(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            held.setdefault(storage.data_ptr(), storage.nbytes())

    def pack(t):
        keep(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if recompute == "full":  # what DeepSpeed's PipelineModule does with activation_checkpoint_interval=1
            from deepspeed.runtime.activation_checkpointing.checkpointing import checkpoint

            y = checkpoint(block, x)
        else:
            y = block(x)
    stack, seen = [y.grad_fn], set()
    while stack:  # DeepSpeed's CheckpointFunction keeps its inputs on the node, not through save_for_backward
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        for t in getattr(fn, "deepspeed_saved_tensors", None) or ():
            if torch.is_tensor(t):
                keep(t)
        stack.extend(n for n, _ in fn.next_functions)
    y.float().pow(2).sum().backward()  # the recomputing backward runs (and its collectives match)
    return sum(held.values())


def _measure(rank, world, cfgs, expected):
    import torch.distributed as dist

    from p3d.parallel.mesh import Mesh

    mesh = Mesh(tp=world, pp=1, dp=1, rank=rank, tp_group=dist.group.WORLD)
    got = [block_saved_bytes(cfg, mesh, sp, rc) for cfg, (sp, rc, _) in zip(cfgs, CASES)]
    wrong = [(case, g, e) for case, g, e in zip(CASES, got, expected) if g != e]
    assert not wrong, f"(sp, recompute, dtype), measured, planned: {wrong}"


def test_block_activation_bytes_with_sp_and_recompute(make_cfg):
    from p3d.planner.memory import block_bytes
    from p3d.planner.shapes import Layout

    cfgs = [
        make_cfg(
            "model=tiny",
            f"mesh=tp{TP}",
            f"schedule.sequence_parallel={str(sp).lower()}",
            f"schedule.recompute={rc.split('+')[0]}",
            f"schedule.recompute_swiglu={str(rc.endswith('+swiglu')).lower()}",
            f"train.dtype={dt}",
        )
        for sp, rc, dt in CASES
    ]
    expected = [block_bytes(cfg, Layout(TP, 1, 1, cfg.schedule.micro_batch_size, 1)) for cfg in cfgs]
    by_case = dict(zip(CASES, expected))
    for rc in RECOMPUTE:
        for dt in ("fp32",):
            assert by_case[(True, rc, dt)] < by_case[(False, rc, dt)]  # sequence parallelism saves memory
    for sp in (False, True):  # the SwiGLU knob drops silu(gate): b s ffn/tp fp32 bytes
        cfg = cfgs[CASES.index((sp, "selective", "fp32"))]
        silu = cfg.schedule.micro_batch_size * cfg.model.seq_len * cfg.model.ffn_hidden_size // TP * 4
        assert by_case[(sp, "selective", "fp32")] - by_case[(sp, "selective+swiglu", "fp32")] == silu
    run_distributed(_measure, TP, cfgs, expected, timeout=1200)  # process start-up takes minutes on a loaded machine
