"""Interleaved and zero-bubble pipeline schedules, executed by ``torch.distributed.pipelining``.

DeepSpeed's engine runs plain 1F1B only; these schedules come from torch (docs/schedules.md).
The model is the same flat list of ``LayerSpec``s (``layer_specs_of``), cut by the one stage-bounds
function into p * v chunks (``geometry.stage_bounds(n_layers, p, partition, model, v, style)``); chunk c is torch's
``PipelineStage`` c, on pp rank ``geometry.chunk_to_rank(p, p * v, style)[c]``. Init, the TP layers, tied
embeddings and the vocab-parallel loss are unchanged; only the executor differs.

One optimizer step (``TorchPipeline.train_step``):
  1. ``schedule.step``: m micro batches of this dp replica, loss = VocabParallelLoss / m on the last chunk,
     ``scale_grads=False`` (the schedule would divide per stage, twice for a module two stages share);
     afterwards every ``.grad`` holds d(mean loss of the replica)/d(param), summed over the micro batches. Replicas
     with their own counts m_r (``schedule.replica_micro_batches``) each build their schedule for m_r and divide by
     the mean count M / dp (M the global batch's micro batches), so that after the mean over dp every micro batch
     weighs 1 / M, the single process's mean (``RunPlan.mean_micro_batches``);
  2. tied embeddings under loop placement: the two copies' grads summed over the two holders (DeepSpeed's
     ``TiedLayerSpec`` rule); under V placement one module serves both ends and autograd sums;
  3. dp: all grads flattened into one fp32 buffer, all-reduced (SUM; gloo has no AVG) over dp, divided by dp
     (with context parallelism over the dp x cp holders: each cp rank's loss is its tokens' mean);
  4. the exact global norm (``optim.global_grad_norm``: tied copy once, replicated params on tp 0), clipping
     with ``clip_grad_norm_``'s rule, AdamW (ZeRO-1: torch's ZeroRedundancyOptimizer over dp), the LR
     schedule; a non-finite norm skips the update and the LR step and sets ``overflow`` (``ClippedAdamW``'s).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from p3d.compat.deepspeed_internals import mark_pipe_replicated
from p3d.compat.overlap_internals import DeferredReduceScatters, on_last_backward, reduce_in_last_backward
from p3d.compat.pipelining_internals import (
    SCHEDULE_CLASSES,
    after_metadata_inference,
    forward_only_order,
    schedule_class,
    split_backward_on_gathered_weights,
    timed_p2p_waits,
)
from p3d.config.schema import DType, Recompute
from p3d.data.order import replica_rows
from p3d.layout.float8_rules import recipe
from p3d.layout.geometry import chunk_to_rank, rank_chunks, stage_bounds
from p3d.model.moe import moe_blocks, set_micro_batches
from p3d.parallel.context.chunks import take_local
from p3d.parallel.device_check import device_checked
from p3d.parallel.experts.params import is_expert_param
from p3d.parallel.pipeline.chunks import ChunkModule
from p3d.parallel.pipeline.specs import VocabParallelLoss, layer_specs_of
from p3d.parallel.tp.precision import drop_weight_casts
from p3d.parallel.zero.fsdp import local
from p3d.train.executors.grad_buckets import GradBuckets, bucket_bytes
from p3d.train.executors.torch_optim import build_torch_optimizer
from p3d.train.optim import global_grad_norm
from p3d.train.timing import StepClocks, drain

SCHEDULES = tuple(SCHEDULE_CLASSES)
# schedule.pipeline=1f1b runs here (on torch's Schedule1F1B) only where DeepSpeed's engine cannot: zero.stage >= 2
TORCH_1F1B = "1f1b"
# Schedules that split backward into I (dx) and W (dw) passes (torch's stage_backward_input / _weight).
IW_SPLIT = ("interleaved_zero_bubble", "zbv", "dualpipev")


def check_recompute(schedule: str, recompute: Recompute) -> None:
    """Full recompute with an I/W-split schedule is refused: W computes each weight's gradient by its own
    autograd pass over the chunk, and the non-reentrant checkpoint recomputes a block's forward for each
    (measured with torch 2.13: 8 forwards of a Llama block per micro batch instead of 2; docs/schedules.md)."""
    if schedule in IW_SPLIT and recompute == Recompute.full:
        raise ValueError(
            f"schedule.recompute=full with schedule.pipeline={schedule}: its split W pass reruns every block's "
            "forward once per weight (8 times a micro batch, not 2); "
            "try schedule.recompute=selective or schedule.pipeline=interleaved_1f1b"
        )


def chunks_per_rank(schedule: str, virtual_stages: int) -> int:
    """v: the chunks each pp rank holds. V schedules place exactly two (schedules.py:3249), gpipe and 1f1b one."""
    if schedule == TORCH_1F1B:
        return 1
    if schedule not in SCHEDULE_CLASSES:
        raise ValueError(f"schedule.pipeline={schedule}: expected one of {', '.join(SCHEDULES)}")
    style = SCHEDULE_CLASSES[schedule][1]
    if schedule == "gpipe":
        return 1
    if style == "v":
        if virtual_stages != 2:
            raise ValueError(
                f"schedule.virtual_stages={virtual_stages}: {schedule} places exactly two chunks per rank; "
                "try schedule.virtual_stages=2"
            )
        return 2
    if virtual_stages < 2:
        raise ValueError(f"schedule.virtual_stages={virtual_stages}: {schedule} interleaves; try virtual_stages=2")
    return virtual_stages


def tied_holder_groups(mesh) -> object | None:
    """The group of this rank's two tied-embedding holders (first and last pp rank of its (dp, tp) pipeline),
    created on every rank in the same order; None on ranks in the middle of the pipeline."""
    if mesh.pp == 2:
        return mesh.pp_group  # the pipeline is exactly the two holders
    mine = None
    for ranks in mesh.dims.pp_ranks():
        group = dist.new_group(ranks=[ranks[0], ranks[-1]])
        if mesh.rank in (ranks[0], ranks[-1]):
            mine = group
    return mine


def _drop_routing_figures(chunk: nn.Module) -> None:
    for block in moe_blocks(chunk):
        block.take_stats()


class TorchPipeline:
    """This rank's chunks, their ``PipelineStage``s, the torch schedule and the optimizer.

    ``cfg``: Config; ``plan``: RunPlan (``micro_batches`` per replica, ``padded_vocab_size``); ``mesh``: with
    groups. ``schedule``: a key of ``SCHEDULES``; ``virtual_stages``: v (the V schedules need 2, gpipe 1).
    ``prepare``: called with the chunks once built, before they are sharded (``model.init_from``).
    Every rank of the world builds one (the tied-holder groups are created collectively).
    """

    def __init__(
        self,
        cfg,
        plan,
        mesh,
        schedule: str,
        virtual_stages: int,
        device: torch.device | None = None,
        prepare: Callable[[list[ChunkModule]], None] | None = None,
    ):
        import torch.distributed.pipelining as pipelining

        self.cfg, self.plan, self.mesh, self.schedule_name = cfg, plan, mesh, schedule
        self.v = chunks_per_rank(schedule, virtual_stages)
        check_recompute(schedule, cfg.schedule.recompute)
        self.style = "loop" if schedule == TORCH_1F1B else SCHEDULE_CLASSES[schedule][1]
        self.n_chunks = mesh.pp * self.v
        self.m = plan.micro_batches_of(mesh.dp_rank)  # this replica's; its pp, tp and cp ranks run as many
        self.device = device or torch.device("cpu")
        blocks = cfg.schedule.stage_blocks if len(cfg.schedule.stage_blocks) == self.n_chunks else None
        self.bounds = stage_bounds(
            cfg.model.n_layers, mesh.pp, cfg.schedule.partition, cfg.model, self.v, self.style, blocks
        )
        self.chunk_rank = chunk_to_rank(mesh.pp, self.n_chunks, self.style)
        self.chunk_ids = rank_chunks(mesh.pp, self.v, self.style, mesh.pp_rank)
        torch.manual_seed(cfg.train.seed)  # as reference_run; the weights come from seeded masters anyway
        specs = layer_specs_of(cfg, plan, mesh)
        tied: dict[str, nn.Module] = {}  # one module per key on this rank (shared by its chunks)
        recompute = cfg.schedule.recompute == Recompute.full
        # bf16: autocast over the fp32 weights, which are the master copy (cast once a step for all micro batches:
        # p3d.parallel.tp.precision); gradients accumulate in fp32
        autocast = torch.bfloat16 if cfg.train.dtype == DType.bf16 else None
        self.chunks = [
            ChunkModule(specs, self.bounds[c], self.bounds[c + 1], tied, recompute=recompute, autocast_dtype=autocast)
            for c in self.chunk_ids
        ]
        # each micro batch's loss weighs 1 / m, m the replicas' mean count (plan.mean_micro_batches): with the mean over
        # dp below, 1 / (micro batches of the global batch) on every replica, however many this one runs
        self.loss_divisor = plan.mean_micro_batches
        for chunk in self.chunks:
            chunk.to(self.device)
            set_micro_batches(chunk, self.loss_divisor)  # a micro batch's balancing loss weighs as its LM loss
        if prepare is not None:  # before sharding: it writes whole tensors
            prepare(self.chunks)
        self.precision_line: str | None = None  # train.fp8: what computes in float8 (the console's line)
        self.float8_gathered: list[
            nn.Module
        ] = []  # ZeRO-2/3 tensorwise: the layers whose weights FSDP2 gathers in float8
        fp8 = recipe(cfg)
        if fp8 != "none":
            from p3d.train.executors.float8 import apply_float8

            self.precision_line = apply_float8(self.chunks, fp8, self.device)
        # ZeRO-2/3: FSDP2 over the dp (x cp) holders of the parameters, which reduces the grads itself
        self.sharded = cfg.zero.stage >= 2 and mesh.dp_cp > 1
        self.replicas = mesh.dp_cp // (cfg.zero.shard_size or mesh.dp_cp) if self.sharded else 1  # HSDP's copies
        # the groups whose collectives dp_comm_s counts (and FSDP2's, below)
        self.dp_groups = [mesh.dp_group] + ([mesh.dp_cp_group] if mesh.cp > 1 else [])
        if self.sharded:
            from p3d.model.llama import TransformerBlock
            from p3d.model.moe import routed_experts
            from p3d.parallel.zero.fsdp import dp_device_mesh, expert_device_mesh, mixed_precision, shard_chunk

            dp_mesh = dp_device_mesh(mesh, self.device, cfg.zero.shard_size)
            self.dp_groups += [dp_mesh.get_group(dim) for dim in range(dp_mesh.ndim)]
            experts_mesh = expert_device_mesh(mesh, self.device) if mesh.ep > 1 else None
            if fp8 == "tensorwise":  # the float8 layers' weights gathered in float8 (p3d.parallel.zero.float8_gather)
                from p3d.parallel.zero.float8_gather import gather_in_float8

                self.float8_gathered = gather_in_float8(self.chunks)
            if experts_mesh is not None:
                self.dp_groups.append(mesh.edp_group)
            for chunk in self.chunks:
                shard_chunk(
                    chunk,
                    dp_mesh,
                    cfg.zero.stage,
                    TransformerBlock,
                    mixed_precision(cfg.train.dtype),
                    experts_of=routed_experts if experts_mesh is not None else None,
                    experts_mesh=experts_mesh,
                )
        self.module = nn.ModuleList(self.chunks)  # parameters() lists a module shared by two chunks once
        self.first_chunk, self.last_chunk = 0, self.n_chunks - 1
        self.holds_first = self.first_chunk in self.chunk_ids
        self.holds_last = self.last_chunk in self.chunk_ids
        # Tied embedding with its two ends on different ranks: two copies (the same seeded init); the last
        # chunk's copy is "pipe replicated", counted once in the norm as DeepSpeed's copy is.
        self.tied_cross_rank = cfg.model.tie_embeddings and self.chunk_rank[0] != self.chunk_rank[self.last_chunk]
        self.tied_group = tied_holder_groups(mesh) if self.tied_cross_rank else None
        self.tied_params = [p for module in tied.values() for p in module.parameters()]
        if self.tied_cross_rank and self.holds_last:
            for p in self.tied_params:
                mark_pipe_replicated(p)  # the marker optim.counts_in_norm reads

        loss = VocabParallelLoss(cfg.model, plan.padded_vocab_size, mesh)
        divisor = self.loss_divisor

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            # torch runs the loss after the last chunk's forward_one_chunk; timed as compute, as DeepSpeed's is
            with self.clocks.compute.timing("loss") if self.clocks is not None else contextlib.nullcontext():
                return loss(logits, labels) / divisor  # the reference's 1/m per micro batch; summed by autograd

        self.stages = [
            pipelining.PipelineStage(chunk, c, self.n_chunks, self.device, group=mesh.pp_group)
            for c, chunk in zip(self.chunk_ids, self.chunks)
        ]
        for stage, chunk in zip(self.stages, self.chunks):  # the routing figures of torch's shape pass are no step's
            after_metadata_inference(stage, partial(_drop_routing_figures, chunk))
        if self.sharded and cfg.zero.stage >= 3 and schedule in IW_SPLIT:
            for stage in self.stages:
                split_backward_on_gathered_weights(stage)
        cls = pipelining.Schedule1F1B if schedule == TORCH_1F1B else schedule_class(schedule)
        stages = self.stages[0] if schedule in ("gpipe", TORCH_1F1B) else self.stages  # one stage per rank
        self.schedule = cls(stages, n_microbatches=self.m, loss_fn=loss_fn, scale_grads=False)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer, self.lr_scheduler = build_torch_optimizer(self.module, cfg, mesh)
        self.overflow = False
        # the dp reduction, issued in each chunk's last backward of the step and waited for after the schedule
        # (docs/overlap.md): ZeRO 0/1 by p3d's buckets, ZeRO-2/3 by FSDP2 per unit
        self.buckets: GradBuckets | None = None
        self.deferred = DeferredReduceScatters()  # FSDP2's reduce-scatters on gloo, issued asynchronously
        self.prefetch = self.sharded and cfg.zero.stage == 2 and self.device.type == "cpu"
        self.steps_run = 0
        if mesh.dp_cp > 1 and not self.sharded:
            self.buckets = GradBuckets(list(zip(self.chunk_ids, self.chunks)), mesh, bucket_bytes(cfg.zero))
            for c, stage in zip(self.chunk_ids, self.stages):
                on_last_backward(stage, partial(self.buckets.last_backward, c))
        if self.sharded:
            if schedule not in IW_SPLIT:  # their W pass would come after FSDP2's per-unit hook: reduced at the end
                for stage in self.stages:
                    reduce_in_last_backward(stage)
            if self.device.type == "cpu" and self.replicas == 1:  # CUDA: FSDP2's own streams overlap it
                comm = self.deferred.comm()
                for unit in self.fsdp_units():
                    unit.set_custom_reduce_scatter(comm)
        # set by p3d.train.executors: the step gate (grads, replica loss or None), and the step's clocks (the p2p
        # waits and the drain, the loss's compute, the dp collectives: p3d.train.timing.StepClocks)
        self.before_update: Callable[[list[torch.Tensor], float | None], None] | None = None
        self.clocks: StepClocks | None = None

    def waits(self):
        """A context that times the schedule's waits on pipeline neighbours (when ``clocks`` are set)."""
        return timed_p2p_waits(self.clocks.wait.timing) if self.clocks is not None else contextlib.nullcontext()

    def comm_timed(self):
        """A context that times every collective over a dimension's group into that dimension's clock (when
        ``clocks`` are set): the mesh's groups, FSDP2's dp groups and the tied holders' (pp)."""
        if self.clocks is None:
            return contextlib.nullcontext()
        comm = self.clocks.comm
        comm.classify("dp", self.dp_groups)
        comm.classify_mesh(self.mesh)
        comm.classify("pp", [self.tied_group])
        return comm.timed()

    def fsdp_units(self) -> list[Any]:
        """This rank's FSDP2 modules (each chunk's blocks, experts and the chunk itself), in forward order."""
        from torch.distributed.fsdp import FSDPModule

        seen: dict[int, Any] = {}
        for chunk in self.chunks:
            for module in chunk.modules():
                if isinstance(module, FSDPModule):
                    seen.setdefault(id(module), module)
        roots = [m for m in seen.values() if any(m is c for c in self.chunks)]
        return roots + [m for m in seen.values() if not any(m is c for c in self.chunks)]

    def prefetch_weights(self) -> None:
        """ZeRO-2 on CPU: every unit's all-gather issued asynchronously as the step starts (FSDP2 waits for each in
        the unit's first forward; on CUDA it prefetches on its own streams), the first unit's alone before the rest
        (the first forward needs it at once: it would share gloo's threads with the others). From the second step:
        the first runs FSDP2's lazy initialization."""
        if not self.prefetch or self.steps_run == 0:
            return
        units = self.fsdp_units()
        first = units[0].unshard(async_op=True)
        if first is not None:
            first.wait()
        for unit in units[1:]:
            unit.unshard(async_op=True)

    def float8_scales(self) -> None:
        """ZeRO-2/3 tensorwise: the scales of the float8 gathers of the step to come, from the weights as the last
        optimizer step (or a checkpoint's load) left them (p3d.parallel.zero.float8_gather)."""
        if self.float8_gathered:
            from p3d.parallel.zero.float8_gather import precompute_scales

            precompute_scales(self.float8_gathered, self.mesh.dp_cp_group, self.mesh.tp_group)

    # ---- one step
    def replica_rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This dp replica's rows of the global batch (gbs, s + 1), as ``loader.rank_slice`` takes them."""
        mbs, split = self.cfg.schedule.micro_batch_size, self.plan.replica_micro_batches
        first, rows = replica_rows(batch.shape[0], mbs, self.mesh.dp, self.mesh.dp_rank, split)
        return batch[first : first + rows]

    def local_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """This cp rank's tokens of inputs or labels (rows, s) -> (rows, s / cp): chunks cp_rank and
        2 cp - 1 - cp_rank of each sequence (p3d.parallel.context.chunks); the whole rows when cp = 1."""
        return take_local(x, self.mesh.cp, self.mesh.cp_rank)

    def get_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def train_step(self, batch: torch.Tensor) -> tuple[float, float]:
        """One optimizer step on the global batch (gbs, s + 1) (every rank passes the same one): the mean
        loss over the global batch and the global gradient norm before clipping."""
        rows = self.replica_rows(batch).to(self.device)
        return self.run_step(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())  # cut to cp ranks by run_step

    def train_batch(self, data_iter) -> tuple[float, float]:
        """``train_step`` fed as DeepSpeed's engine is: ``data_iter`` yields this replica's m micro batches as
        (inputs, labels), each (mbs, s) (``loader.micro_batches``); None on ranks that hold neither end."""
        if not (self.holds_first or self.holds_last):
            return self.run_step(None, None)
        pairs = [next(data_iter) for _ in range(self.m)]
        inputs = torch.cat([x for x, _ in pairs]).to(self.device)
        return self.run_step(inputs, torch.cat([y for _, y in pairs]).to(self.device))

    def run_step(self, inputs: torch.Tensor | None, labels: torch.Tensor | None) -> tuple[float, float]:
        """One optimizer step on this replica's (m mbs, s) inputs and labels (read on the end chunks' holders)."""
        if inputs is not None and labels is not None:
            inputs, labels = self.local_tokens(inputs), self.local_tokens(labels)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.holds_first else ()
        kwargs = dict(target=labels, losses=losses) if self.holds_last else {}
        drop_weight_casts(self.module)  # bf16: each weight cast once this step, for all its micro batches
        with device_checked(self.device), self.comm_timed():  # every dimension's collectives, into their clocks
            self.float8_scales()
            self.prefetch_weights()
            with self.waits():
                self.schedule.step(*args, return_outputs=False, **kwargs)
            if self.clocks is not None:  # the drain: until every stage of this pipeline is done (p3d.train.timing)
                drain(self.mesh.pp_group, self.clocks.wait)
            self.reduce_dp_grads()  # issued in the last backward; waited for here
            self.reduce_tied_grads()
            replica_loss = self.replica_loss(losses)  # (), on the device
            if self.before_update is not None:  # the step gate: judges the reduced gradients, may fill them with nan
                grads = [local(p.grad) for p in self.params if p.grad is not None]
                self.before_update(grads, float(replica_loss) if self.holds_last else None)  # the step's host read
            norm = self.clip_and_step()
        drop_weight_casts(self.module)  # no bf16 copy outlives its step
        self.steps_run += 1
        return self.step_loss(replica_loss), norm

    @torch.no_grad()
    def eval_step(self, batch: torch.Tensor | None) -> float:
        """The mean loss over the global batch (gbs, s + 1), forward only (as DeepSpeed's ``eval_batch``).

        Under the V schedules torch's ``eval`` would still run their input-gradient actions and fail, so their
        action lists are cut to the forwards for the call (``torch_compat.forward_only_order``)."""
        forward_only = forward_only_order(self.schedule) if self.style == "v" else contextlib.nullcontext()
        losses: list[torch.Tensor] = []
        args: tuple = ()
        kwargs: dict = {}
        if batch is not None:  # None on ranks that hold neither end
            rows = self.replica_rows(batch).to(self.device)
            args = (self.local_tokens(rows[:, :-1]),) if self.holds_first else ()
            kwargs = dict(target=self.local_tokens(rows[:, 1:]), losses=losses) if self.holds_last else {}
        drop_weight_casts(self.module)
        with device_checked(self.device), forward_only:
            self.float8_scales()
            self.schedule.eval(*args, return_outputs=False, **kwargs)
            drop_weight_casts(self.module)
            if self.buckets is not None and not self.buckets.idle():  # it would corrupt the next step's gradients
                raise RuntimeError("an evaluation started the dp gradient reduction (p3d.compat.overlap_internals)")
            return self.step_loss(self.replica_loss(losses))

    def reduce_tied_grads(self) -> None:
        """Sum the two tied copies' grads over their holders (loop placement only)."""
        if self.tied_group is None or not (self.holds_first or self.holds_last):
            return
        for p in self.tied_params:
            if p.grad is None:  # pragma: no cover - every chunk runs forward and backward each step
                p.grad = torch.zeros_like(p)
            dist.all_reduce(local(p.grad), group=self.tied_group)  # both holders cut a table alike over dp

    def reduced_norm(self) -> float:
        """The global norm of this step's gradients, reduced over dp and the tied copies already (the step gate's
        report of a discarded loss spike: the norm the optimizer would have seen)."""
        return float(global_grad_norm(self.params, self.mesh, sharded_over_dp=self.sharded, replicas=self.replicas))

    def reduce_dp_grads(self) -> None:
        """Mean of the replicas' grads, issued in each chunk's last backward (ZeRO 0/1: ``GradBuckets``, dense over
        dp, experts over edp; ZeRO-2/3: FSDP2 per unit, the dense ones to their mean over dp and the experts' to
        their mean over edp, which is ep times their mean over dp): here they are waited for."""
        if self.buckets is not None:
            self.buckets.finish()
        self.deferred.finish()
        if self.sharded and self.mesh.ep > 1:
            for p in self.params:
                if p.grad is not None and is_expert_param(p):
                    local(p.grad).div_(self.mesh.ep)

    @torch.no_grad()
    def clip_and_step(self) -> float:
        """Exact global norm, clip (``clip_grad_norm_``'s rule), AdamW and the LR step; skip on a non-finite norm."""
        norm = float(global_grad_norm(self.params, self.mesh, sharded_over_dp=self.sharded, replicas=self.replicas))
        self.overflow = not math.isfinite(norm)
        if not self.overflow:
            max_norm = self.cfg.train.grad_clip
            if max_norm > 0:
                coef = max_norm / (norm + 1e-6)
                if coef < 1.0:
                    for p in self.params:
                        if p.grad is not None:
                            p.grad.mul_(coef)
            self.optimizer.step()
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def replica_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """This rank's share of the replica's loss, a float64 scalar on the compute device: the sum of the last
        chunk's m micro-batch losses (each already / m) on its holder, 0 elsewhere. No host read."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for x in losses:
            total += x.detach()
        return total

    def step_loss(self, replica_loss: torch.Tensor) -> float:
        """The step's mean loss over the global batch from each rank's ``replica_loss``: summed over pp (only the
        holder is non-zero), averaged over dp x cp (a cp rank's loss is the mean over its s / cp tokens of each
        sequence: equal counts, so the mean of the means is the whole mean). The collectives take the device
        tensor (NCCL takes nothing else); the one host read is the returned float."""
        total = replica_loss.clone()
        if self.mesh.pp > 1:
            dist.all_reduce(total, group=self.mesh.pp_group)
        if self.mesh.dp_cp > 1:
            dist.all_reduce(total, group=self.mesh.dp_cp_group)
            total /= self.mesh.dp_cp
        return float(total)
