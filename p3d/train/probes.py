"""The probes of ``p3d-plan calibrate`` (p3d.launch.calibrate spawns them; docs/planner.md, Calibration).

    python -m p3d.train.probes compute <job.json> <out.json>
    python -m p3d.train.probes collectives <job.json> <out.json> <rank> <world>
    python -m p3d.train.probes tp_blocks <job.json> <out.json> <rank> <tp>

``compute`` times, in one process with one thread (as a cpu worker runs):

- p3d's own ``TransformerBlock`` on a Mesh of tp ranks without process groups: its tp layers hold tp rank 0's
  slices and every tp collective returns early, so this is one tp rank's block compute, collectives left out.
  Forward and backward are timed apart, for each recompute mode asked (full: the block under
  ``torch.utils.checkpoint``, as the torch executors run it; full_deepspeed: under DeepSpeed's reentrant
  ``checkpointing.checkpoint``, as its PipelineModule runs it; selective: the attention core recomputed);
- the final norm, the vocab-parallel head (V_pad / tp columns) and the loss, the same way; the embedding lookup.
  These are timed in ``rounds``: each round passes every one of them ``reps`` times in turn, and each figure is the
  median of its passes over all rounds. This machine's speed moves by 5-15 % over minutes: probed one after the
  other, a slow stretch fell on one probe alone (a selective-recompute forward 31.7 ms against 24.1 ms for the
  same forward without recompute, which made that layout's prediction 16 % long); in rounds it falls on every
  probe alike, in one round of several;
- a GEMM of the block's feed-forward shape (TFLOP/s), a copy (memory GB/s), an AdamW step (s per parameter).

With a ``barrier`` in the job (the loaded copies: ``parties`` of them, a directory), every probe starts when all
copies have reached it, so that each loaded figure is timed with every copy running the same probe. Without it
the copies drift apart over the run and the last probes (the optimizer's, the engine's copies: memory-bound, where
the contention is) run partly alone.

``tp_blocks``: one of tp gloo ranks; each block of that tp on a real tp group, its all-reduces in (for tp up to the
cores: a rank per core, as the run has them).

``collectives``: one of ``world`` gloo (nccl on GPUs) ranks through a FileStore; for each group size n it times
all_reduce, all_gather, reduce_scatter (the list forms p3d's tp layers call) and a send/recv ping-pong (halved)
at a few sizes; rank 0 writes the medians. At the plan's dp gradient message (and the largest size in quick mode)
groups of up to ``cores`` ranks also time ``engine_reduce``: DeepSpeed's ZeRO 0 reduce whole, as its engine runs
it on the group's real ranks.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from p3d.config.schema import Config
from p3d.layout.geometry import padded_vocab
from p3d.parallel.mesh import Mesh
from p3d.train.host_memory import keep_freed_memory

SEED = 1234
FAILED = "failed"  # in a barrier's directory: a copy died, the others stop waiting
BARRIER_TIMEOUT_S = 600.0  # a loaded copy waiting for the others at a probe (each takes seconds)
# DeepSpeed's reduce whole took 0.57-0.95 s (median of 3) in calibrations of one evening for model=small's 0.49 GB
# on 2 ranks, and the runs' dp_comm_s 0.44-1.03 s: a median of 7 (about 5 s) moves less with one slow pass
ENGINE_REDUCE_REPS = 7
# The model, DeepSpeed's layer specs and the optimizer are imported by the compute probe only: the collectives
# probe starts up to 8 processes on the machine it measures, each as light as it can be.


def as_a_cpu_worker() -> None:
    """A cpu worker's settings (p3d.train.worker.set_up_cpu_worker): one thread, and freed memory kept by malloc,
    without which every activation and gradient buffer above glibc's default thresholds faults its pages in again
    at each use and the probes time page faults the run does not take."""
    torch.set_num_threads(1)
    keep_freed_memory()


def _median(fn: Callable[[], Any], reps: int, sync: Callable[[], None]) -> float:
    """Median seconds of ``fn`` over ``reps`` calls after one warm-up call."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


Run = Callable[[], torch.Tensor]  # builds an output; its backward takes a ones gradient
Probe = tuple[dict[str, Any], Run]  # what is timed (the row's fields) and how


def fwd_bwd_rounds(
    runs: list[Run], reps: int, rounds: int, sync: Callable[[], None], gate: Callable[[str], None] = lambda _: None
) -> list[tuple[float, float]]:
    """(forward, backward) median seconds of each run over ``rounds`` x ``reps`` passes: each round passes every run
    ``reps`` times in turn, the first round each run's warm-up pass before. ``gate(name)`` is called before each
    run's passes in a round (the loaded copies' barrier)."""
    fwd: list[list[float]] = [[] for _ in runs]
    bwd: list[list[float]] = [[] for _ in runs]
    for r in range(rounds):
        for i, run in enumerate(runs):
            gate(f"r{r}p{i}")
            for k in range(reps + (r == 0)):
                t0 = time.perf_counter()
                y = run()
                sync()
                t1 = time.perf_counter()
                y.backward(torch.ones_like(y))
                sync()
                t2 = time.perf_counter()
                if r or k:
                    fwd[i].append(t1 - t0)
                    bwd[i].append(t2 - t1)
    return [(statistics.median(f), statistics.median(b)) for f, b in zip(fwd, bwd)]


def block_probes(cfg: Config, tp: int, modes: list[str], device, mesh: Mesh | None = None) -> list[Probe]:
    """One tp rank's block at (b, s), once under each recompute mode of ``modes``: one block, its recompute flags
    set by each run (the layers read them at each forward). Without ``mesh``: on a Mesh without process groups
    (tp rank 0's slices, the collectives return early); with one, on its tp group."""
    from deepspeed.runtime.activation_checkpointing import checkpointing
    from torch.utils.checkpoint import checkpoint

    from p3d.model.llama import TransformerBlock, is_moe_layer
    from p3d.planner.calibration import FULL_DEEPSPEED

    m, b, s = cfg.model, cfg.schedule.micro_batch_size, cfg.model.seq_len
    block = TransformerBlock(m, mesh or Mesh(tp=tp, pp=1, dp=1), 0, SEED).to(device)
    x = torch.randn(b, s, m.hidden_size, device=device, requires_grad=True)  # (b, s, h), replicated over tp
    mlp: Any = block.mlp  # a SwiGLU: the calibration probes no MoE block

    def under(recompute: str) -> Run:
        def run() -> torch.Tensor:
            block.attn.recompute = recompute == "selective"
            mlp.recompute = recompute == "selective" and cfg.schedule.recompute_swiglu
            if recompute == FULL_DEEPSPEED:
                return checkpointing.checkpoint(block, x)
            return checkpoint(block, x, use_reentrant=False) if recompute == "full" else block(x)

        return run

    row = {"arch": m.arch.value, "moe": bool(is_moe_layer(m, 0)), "tp": tp, "b": b, "s": s, "dtype": "fp32"}
    return [({**row, "recompute": rec}, under(rec)) for rec in modes]


def head_probe(cfg: Config, tp: int, device) -> Probe:
    """Final norm, the head's V_pad / tp columns and the vocab-parallel loss of one tp rank at (b, s)."""
    from p3d.pipeline.specs import FinalNorm, HeadPipe, VocabParallelLoss

    m, b, s = cfg.model, cfg.schedule.micro_batch_size, cfg.model.seq_len
    mesh, vpad = Mesh(tp=tp, pp=1, dp=1), padded_vocab(m.vocab_size, tp)
    norm, head = FinalNorm(m).to(device), HeadPipe(m, vpad, mesh, SEED).to(device)
    loss_fn = VocabParallelLoss(m, vpad, mesh)
    x = torch.randn(b, s, m.hidden_size, device=device, requires_grad=True)
    labels = torch.randint(0, m.vocab_size, (b, s), device=device)

    def run() -> torch.Tensor:
        return loss_fn(head(norm(x)), labels)

    return {"tp": tp, "b": b, "s": s, "vocab_padded": vpad}, run


def embedding_probe(cfg: Config, tp: int, device) -> Probe:
    """The vocab-parallel lookup of one tp rank at (b, s): its backward writes a dense (V_pad / tp, h) gradient."""
    from p3d.pipeline.specs import EmbeddingPipe

    m, b, s = cfg.model, cfg.schedule.micro_batch_size, cfg.model.seq_len
    mesh, vpad = Mesh(tp=tp, pp=1, dp=1), padded_vocab(m.vocab_size, tp)
    embed = EmbeddingPipe(m, vpad, mesh, SEED).to(device)
    ids = torch.randint(0, m.vocab_size, (b, s), device=device)

    def run() -> torch.Tensor:
        return embed(ids)

    return {"tp": tp, "b": b, "s": s, "vocab_padded": vpad}, run


def gemm_probe(cfg: Config, reps: int, device, sync) -> dict[str, Any]:
    """x (b s, h) @ w (h, 2 f): the block's largest GEMM at tp = 1; TFLOP/s of its forward."""
    m = cfg.model
    rows, k, n = cfg.schedule.micro_batch_size * m.seq_len, m.hidden_size, 2 * m.ffn_hidden_size
    x, w = torch.randn(rows, k, device=device), torch.randn(k, n, device=device)
    t = _median(lambda: x @ w, max(reps, 3), sync)
    return {"m": rows, "k": k, "n": n, "fwd_s": t, "tflops": 2.0 * rows * k * n / t / 1e12}


def memory_probe(mbytes: int, reps: int, device, sync) -> float:
    """GB/s of a copy (bytes read + written)."""
    src = torch.ones(mbytes * (1 << 20) // 4, device=device)
    dst = torch.empty_like(src)
    t = _median(lambda: dst.copy_(src), max(reps, 3), sync)
    return 2 * src.numel() * 4 / t / 1e9


def stage_tensors(cfg: Config, elements: int, device) -> list[torch.Tensor]:
    """Zero tensors in the model's shapes, about ``elements`` in all: the vocab matrix first when it fits in that
    count (a stage holding the embedding or the head holds it), then the block's weights in turn. The rates per
    element of what streams over a stage's parameters depend on their shapes: a block's matrices and their states
    partly stay in the last-level cache, the vocab matrix's never does."""
    m = cfg.model
    vocab = (padded_vocab(m.vocab_size, 1), m.hidden_size)
    block = [(m.hidden_size, m.hidden_size)] * 4 + [(m.ffn_hidden_size, m.hidden_size)] * 3
    shapes = [vocab] if vocab[0] * vocab[1] <= elements else []
    total, i = sum(r * c for r, c in shapes), 0
    while total < elements or not shapes:
        shapes.append(block[i % len(block)])  # a block's weights in their order, q k v o then the three of its MLP
        total, i = total + shapes[-1][0] * shapes[-1][1], i + 1
    return [torch.zeros(shape, device=device) for shape in shapes]


def optimizer_probe(cfg: Config, params: int, reps: int, device, sync) -> float:
    """Seconds per parameter of the executors' optimizer step (p3d's ClippedAdamW: the gradient norm, the clip and
    AdamW) over ``params`` parameters in the model's shapes (the plan's largest stage). The gradients are in place
    before each timed step, as the step's backward leaves them; the step's zero_grad drops them (set to None)."""
    from p3d.train.optim import build_optimizer

    tensors = [torch.nn.Parameter(t) for t in stage_tensors(cfg, params, device)]
    n = sum(p.numel() for p in tensors)
    opt, _ = build_optimizer(torch.nn.ParameterList(tensors), cfg.train, Mesh(tp=1, pp=1, dp=1), clip_here=True)
    times = []
    for i in range(max(reps, 3) + 1):  # the first is a warm-up (the moments' first allocation)
        for p in tensors:
            p.grad = torch.full_like(p, 1e-3)
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        if i:
            times.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
    return statistics.median(times) / n


def engine_copy_probe(cfg: Config, elements: int, reps: int, device, sync) -> float:
    """Seconds per gradient element of what DeepSpeed's ZeRO 0 engine does around its dp all-reduce
    (``allreduce_and_copy``): flatten the gradients into a new buffer, scale it by 1 / dp, copy each slice back.
    Over ``elements`` in the model's shapes, as many as the largest stage of the plan holds: the new buffer's first
    touch costs page faults that a copy between warm buffers does not show."""
    grads = stage_tensors(cfg, elements, device)
    n = sum(g.numel() for g in grads)
    return _median(lambda: deepspeed_reduce(grads, 2), max(reps, 3), sync) / n


def deepspeed_reduce(grads: list[torch.Tensor], dp: int, group=None) -> None:
    """What DeepSpeed's ZeRO 0 engine does with a bucket of gradients (``allreduce_and_copy``): flatten them into a
    new buffer, all-reduce it over ``group`` (None: the copies alone), scale it by 1 / dp, copy each slice back."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    flat = _flatten_dense_tensors(grads)
    if group is not None:
        dist.all_reduce(flat, group=group)
    flat.mul_(1.0 / dp)
    for buf, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        buf.copy_(synced)


def rendezvous(barrier: dict[str, Any] | None, name: str) -> None:
    """Wait until all ``barrier["parties"]`` copies have reached the probe ``name`` (a file each in
    ``barrier["dir"]``); None: one process, no wait."""
    if barrier is None:
        return
    where = Path(barrier["dir"])
    (where / f"{name}.{os.getpid()}").touch()
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while len(list(where.glob(f"{name}.*"))) < int(barrier["parties"]):
        if (where / FAILED).exists():
            raise RuntimeError(f"probe {name}: another loaded copy failed")
        if time.monotonic() > deadline:
            raise RuntimeError(f"probe {name}: the other loaded copies did not arrive in {BARRIER_TIMEOUT_S} s")
        time.sleep(0.001)


def run_compute(job: dict[str, Any]) -> dict[str, Any]:
    from p3d.rundir.spec import to_config

    cfg = to_config(job["config"])
    cuda = job.get("device", "cpu") != "cpu"
    device = torch.device("cuda" if cuda else "cpu")
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    if not cuda:
        as_a_cpu_worker()
    torch.manual_seed(SEED)
    reps, barrier = int(job["reps"]), job.get("barrier")

    def together(name: str, probe: Callable[[], Any]) -> Any:
        rendezvous(barrier, name)
        return probe()

    modes: dict[int, list[str]] = {}  # tp: its recompute modes, in the job's order
    for tp, rec in job["blocks"]:
        modes.setdefault(tp, []).append(rec)
    probes = {
        "blocks": [p for tp, recs in modes.items() for p in block_probes(cfg, tp, recs, device)],
        "head": [head_probe(cfg, tp, device) for tp in job["heads"]],
        "embedding": [embedding_probe(cfg, tp, device) for tp in job["heads"]],
    }
    runs = [run for kind in probes.values() for _, run in kind]
    timed = fwd_bwd_rounds(runs, reps, int(job.get("rounds", 1)), sync, lambda name: rendezvous(barrier, name))
    out: dict[str, Any] = {}
    for kind, rows in probes.items():
        out[kind] = [{**row, "fwd_s": f, "bwd_s": b} for (row, _), (f, b) in zip(rows, timed)]
        timed = timed[len(rows) :]
    return {
        **out,
        "gemm": [together("gemm", lambda: gemm_probe(cfg, reps, device, sync))],
        "memory_gbps": together("memory", lambda: memory_probe(int(job["memory_mb"]), reps, device, sync)),
        "optimizer_s_per_param": together(
            "optimizer", lambda: optimizer_probe(cfg, int(job["optimizer_params"]), reps, device, sync)
        ),
        "engine_copy_s_per_param": (
            together("engine_copy", lambda: engine_copy_probe(cfg, int(job["dp_elements"]), reps, device, sync))
            if job.get("dp_elements")
            else None
        ),
    }


def run_tp_blocks(job: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """One of ``world`` = tp ranks: each (tp, recompute) block of the job on a real tp group, its collectives in (as a
    tp rank runs it: each rank on its own core, waiting for its peer at every all-reduce). A barrier starts each
    forward and each backward together; rank 0's medians are written."""
    from p3d.rundir.spec import to_config

    as_a_cpu_worker()
    cfg = to_config(job["config"])
    dist.init_process_group("gloo", store=dist.FileStore(job["store"], world), rank=rank, world_size=world)
    mesh = Mesh(tp=world, pp=1, dp=1, rank=rank).with_groups()
    torch.manual_seed(SEED)
    device, reps = torch.device("cpu"), int(job["reps"])

    def sync() -> None:
        dist.barrier(group=mesh.tp_group)

    barrier = _median(sync, max(reps, 5), lambda: None)  # each timed pass ends in one: taken off again
    probes = block_probes(cfg, world, [rec for tp, rec in job["blocks"] if tp == world], device, mesh)
    timed = fwd_bwd_rounds([run for _, run in probes], reps, int(job.get("rounds", 1)), sync)
    rows = [
        {**row, "fwd_s": max(0.0, f - barrier), "bwd_s": max(0.0, b - barrier)}
        for (row, _), (f, b) in zip(probes, timed)
    ]
    dist.destroy_process_group()
    return {"blocks": rows, "barrier_s": barrier}


def _timed(fn: Callable[[], None], reps: int, group) -> float:
    """Median seconds of a collective over ``group``, each rep started together (a barrier before it)."""
    times = []
    for i in range(reps + 1):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_collectives(job: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Every rank makes every group (torch requires it); the ranks of a group time its ops, the others wait at the
    next world barrier (asleep in gloo: the measurement has the cores)."""
    from p3d.rundir.spec import to_config

    as_a_cpu_worker()
    store = dist.FileStore(job["store"], world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    reps, points = int(job["reps"]), []
    cfg = to_config(job["config"]) if "config" in job else None  # engine_reduce: the model's shapes
    for n in job["group_sizes"]:
        group = dist.new_group(list(range(n)))
        if rank < n:
            for size in job["sizes"]:
                elems = size // 4
                x = torch.ones(elems)
                parts = [torch.empty(elems // n) for _ in range(n)]
                mine = torch.ones(elems // n)  # (a 0.5 GB message allocates these needlessly: 1.1x its bytes)
                ops: dict[str, Callable[[], None]] = {
                    "all_reduce": lambda: dist.all_reduce(x, group=group),  # noqa: B023 - run in this iteration
                    "all_gather": lambda: dist.all_gather(parts, mine, group=group),  # noqa: B023
                    "reduce_scatter": lambda: dist.reduce_scatter(mine, list(x.chunk(n)), group=group),  # noqa: B023
                }
                big = size > 1 << 25  # a dp gradient message: all-reduced whole (DeepSpeed's ZeRO 0/1 bucket)
                for op, fn in ops.items():
                    if op == "all_reduce" or not big:
                        points.append({"op": op, "n": n, "bytes": size, "s": _timed(fn, reps, group)})
                if cfg is not None and n <= job["engine_reduce_upto"] and (big or size == max(job["sizes"])):
                    reduce, more = engine_reduce(cfg, elems, group), max(reps, ENGINE_REDUCE_REPS)
                    points.append({"op": "engine_reduce", "n": n, "bytes": size, "s": _timed(reduce, more, group)})
                if n == 2 and not big:  # a ping-pong between ranks 0 and 1: two messages, halved
                    points.append({"op": "send_recv", "n": 2, "bytes": size, "s": _ping_pong(x, rank, reps) / 2})
        dist.barrier()
    dist.destroy_process_group()
    return {"points": points}


def engine_reduce(cfg: Config, elements: int, group) -> Callable[[], None]:
    """``deepspeed_reduce`` of a stage's fp32 gradients (in the model's shapes) over ``group``, whole. Timed on real
    ranks: on a 2-core host its parts timed apart (the all-reduce, the copies) add up to 0.48 s for
    ``model=small``'s 124M gradients, and the whole took 0.65-1.3 s (median 0.85 s)."""
    grads, n = stage_tensors(cfg, elements, torch.device("cpu")), dist.get_world_size(group)
    return lambda: deepspeed_reduce(grads, n, group)


def _ping_pong(x: torch.Tensor, rank: int, reps: int) -> float:
    def once() -> None:
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)

    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        once()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str]) -> int:
    kind, job_path, out = argv[0], Path(argv[1]), Path(argv[2])
    job = json.loads(job_path.read_text())
    if kind == "compute":
        try:
            result = run_compute(job)
        except BaseException:
            if job.get("barrier"):  # the other copies stop waiting for this one
                (Path(job["barrier"]["dir"]) / FAILED).touch()
            raise
    else:
        rank, world = int(argv[3]), int(argv[4])
        result = (run_collectives if kind == "collectives" else run_tp_blocks)(job, rank, world)
        if rank:
            return 0
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
