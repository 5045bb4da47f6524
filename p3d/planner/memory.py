"""Memory per GPU and per pipeline stage: model states (ZeRO, precision) and activations (1F1B).

Model states per rank, N = the rank's parameters (p3d.planner.shapes.stage_params), d = dp (dp x cp: below):

    precision   params   grads           optimizer (Adam)
    fp32        4 N      4 N             8 N moments; with ZeRO >= 1 also a 4 N fp32 copy, all / d
    bf16        2 N      2 N (+2 N)      4 N fp32 master + 8 N moments, / d
    torch       4 N      4 N             8 N moments, / d with ZeRO 1   (schedule.pipeline other than 1f1b,
                                         fp32 or bf16: autocast over the fp32 weights)
    ZeRO 2, 3   4 N / d  4 N / d         8 N / d    (FSDP2 on the torch executor, any schedule) + a step's
                                         buffers: c N gathered weights + 4 N unsharded fp32 gradients

Context parallelism (``mesh.cp``): the cp ranks of a dp replica hold the same parameters, so every "/ d" above reads
/ (d cp): gradients reduce, ZeRO-1's moments and FSDP2's shards spread over the d cp holders (p3d.layout.dims
``dp_cp_ranks``). cp > 1 runs on the torch executor, so its rows apply.

A mixture of experts splits N into the routed experts N_e (E / ep per MoE block) and the rest N_d: wherever the
table divides by d, N_e divides by edp = d / ep (times cp) instead (their gradients reduce over edp, ZeRO-1's
second optimizer and FSDP2's expert units shard over it), so the divisions read N_d / d + N_e / edp. With ep > 1
the torch executor runs every schedule (DeepSpeed's engine reduces every gradient over all of dp), so its rows
apply.

ZeRO 2 divides the gradients and ZeRO 3 also the parameters by d in Rajbhandari et al. 2020, Table 1
(2 + 2 + K with K = 12); p3d's FSDP2 stages hold both as shards between steps (docs/zero.md).
Two DeepSpeed facts that p3d inherits: its ZeRO optimizer keeps an fp32 copy of the partition even
when the model is fp32, and with bf16 and zero.stage=0 the pipeline engine uses BF16_Optimizer,
which already shards master weights and moments over dp and keeps a
second bf16 gradient buffer (the "+2 N"). Sharded optimizer partitions are DeepSpeed's: each param
group (matrices, vectors) is flattened, padded to a multiple of 2 d elements and split in d.

Activations per micro batch (one tp rank, bytes per token, c = 4 for fp32 and 2 for bf16) follow
what the p3d model saves for backward, checked against torch's saved-tensor hooks
(tests/unit/planner/test_activations.py):

    llama block  2 norms    2 (4 h + 4 + 2 c h)      fp32: x, rsqrt, x_hat, x_hat * w
                            2 (2 c h + 4)            bf16: x, 1/rms (fp32), the output (the next matmul's input)
                 attention  c (3 q + 3 kv) / t + 4 a / t     q|k|v, rotated q and k, output,
                                                              flash log-sum-exp (fp32)
                 q/k norms  (c (q + kv) + 4 (a + a_kv)) / t   fp32: x_hat, 1/rms (fp32); bf16: 1/rms only
                            + c (q + kv) / t          selective recompute: their output, the checkpoint's input
                 mlp        4 c f / t                 gate|up, silu(gate), silu(gate) * up
                 rope       2 s hd c per micro batch  cos, sin (since they are built once, a buffer per
                                                  block: an over-count of (in flight - 1) x 2 s hd c per
                                                  block, 4 MB at 8k context in bf16)
    gpt block    Korthikanti et al. (2022), Eq. 2 with c bytes: (4 c + 2) h replicated
                 + c (2 q + 2 kv + 2 f) / t + (2 c + 1) a s / t  (softmax, dropout mask and output)

Sequence parallelism divides the replicated terms (norms, residual-side tensors) by t too: p3d's
column-parallel layers keep only the (b, s/t, h) block of their input and all-gather it again in
backward (p3d.parallel.tp.mappings.gathered_linear). Without flash attention a llama also keeps the (a/t) s x s
probabilities; selective recompute drops the attention core (probabilities, or the log-sum-exp), and
in a llama also RoPE (rotated q and k, cos and sin, recomputed with the core under
torch.utils.checkpoint): the block keeps c (2 q + 2 kv) / t per token of attention, q|k|v and the
output (measured, tests/workers/test_plan_sp_activations.py); full recompute keeps only each
block's input (c h, / t with sequence parallelism) plus one block's full set while it recomputes.
First stage: token ids (8 bytes/token, + a 1-byte mask with tp > 1). Last stage: the final norm,
the saved fp32 softmax of the vocab-parallel cross entropy (4 V_pad / t) and its int64 / bool
targets, and the loss buffer: the logits DeepSpeed holds until backward (c V_pad / t) plus the
backward's fp32 gradient (and its cast to c bytes when c < 4). An MoE block keeps its feed-forward's inventory
(p3d.planner.experts) in place of the SwiGLU's 4 c f / t.

Context parallelism: a rank holds s / cp tokens of each sequence (p3d.planner.context), so every s above, the rope
tables' rows, the first and last stages' and the loss buffer's tokens read s / cp, and its attention keeps what flash
attention keeps (the local rotated q and k, v, the output and the log-sum-exp) whatever ``plan.flash_attention``
says: a block keeps exactly 1/cp of its cp = 1 flash bytes. Beside them, one layer at a time, the cp attention's
working set (the keys and values it gathers or passes round, its fp32 gradient sums:
``context.attention_working_bytes``).

On cpu every worker also holds its process and the data's shuffle pool (``host_bytes``): peak_mem_gb is the peak
RSS there, and the workers share the host's memory. The figure predicted is the live peak: what the RSS peaks at
under ``train.host_memory=release``; the default ``keep`` leaves freed blocks resident in the heap, which the plan
does not count (p3d.train.host_memory, docs/context.md).

In flight: the micro batches whose activations a rank holds at its peak, per schedule (p stages, m micro
batches, v chunks per rank, rank s 0-based; counted in chunks, each 1/v of the rank's layers; docs/planner.md):

    1f1b                     min(p - s, m)                              DeepSpeed's TrainSchedule
    gpipe                    m                                          all forwards, then all backwards
    interleaved_1f1b         min(2 (p - s - 1) + (v - 1) p + 1, m v)    Narayanan et al. 2021 (stage 0:
                                                                        1 + (p - 1)/(p v) times p micro batches)
    interleaved_zero_bubble  min(p, m) v                                torch's ZB1P: a full warmup on every rank
    zbv                      min(2 p, m + 1 + s)                        Qi et al. 2024 (ZB-V: 1F1B's p stages' worth)
    dualpipev                2 p + 1                                    torch's DualPipeV (m >= 2 p)

With the I/W-split schedules a chunk's activations live until its W (weight-gradient) pass: torch's I pass
runs ``autograd.grad`` with ``retain_graph=True`` (pipelining/_backward.py), so the counts above run to W.
tests/unit/planner/test_schedules.py checks every row against the peak counted from the action lists of
DeepSpeed's TrainSchedule and of torch's schedules (``pipeline_order``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from p3d.config.schema import Arch, Config, DataSource, DType, Recompute
from p3d.layout.geometry import head_dim, head_dims, is_mla, padded_vocab, token_bytes
from p3d.planner import experts, mla
from p3d.planner.context import attention_working_bytes, local_tokens
from p3d.planner.shapes import Layout, StageParams, dtype_bytes, stage_params

GB = 1e9  # memory figures are decimal GB, the unit of the ZeRO paper's tables and of device datasheets
# A cpu worker's resident memory before its model states and activations: the interpreter, torch, DeepSpeed, gloo,
# the tokenizer and the data readers (peak_mem_gb is the peak RSS on cpu). Measured 2026-12-05 on this machine's
# kind: p3d-train model=tiny model.seq_len=64 peaked at 0.317-0.320 GB (mesh=single) and 0.327-0.330 GB a rank
# (mesh.cp=2, 4: the torch executor), with some 5 MB of states and activations in it.
CPU_WORKER_BYTES = 0.32e9
__all__ = ["GB", "dtype_bytes", "stage_memory", "state_bytes"]


def optimizer_sharded(cfg: Config) -> bool:
    """Whether Adam's states are split over dp: ZeRO >= 1, or bf16 (DeepSpeed's BF16_Optimizer)."""
    return cfg.zero.stage >= 1 or cfg.train.dtype == DType.bf16


def _partition(n: int, dp: int) -> int:
    """Elements of one rank's slice of a flat group: padded to a multiple of 2 dp, then / dp."""
    return math.ceil(n / (2 * dp)) * 2 if n else 0


def state_bytes(cfg: Config, layout: Layout, sp: StageParams) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes on one rank of a stage (d: the dp x cp holders of its parameters)."""
    c, d, zero = dtype_bytes(cfg), layout.dp_cp, cfg.zero.stage
    n = sp.total
    if fsdp_sharded(cfg, layout):
        # ZeRO-2/3 (p3d.parallel.zero.fsdp): FSDP2 cuts every fp32 parameter, its gradient and its moments over dp x
        # cp (rows / d each; / zero.shard_size under HSDP), the routed experts over edp (a unit of their own); what the
        # step gathers on top is in step_buffer_bytes
        s = cfg.zero.shard_size or d
        shard = sp.dense / s + sp.experts / (s if layout.ep == 1 else layout.edp)
        return 4.0 * shard, 4.0 * shard, 8.0 * shard
    if layout.torch_executor:
        # the torch executor (p3d.train.executors.torch_pipeline): fp32 weights and gradients in either precision
        # (bf16 is autocast over them: they are the master copy); ZeRO-1 is torch's ZeroRedundancyOptimizer, each
        # rank keeping the Adam moments of the parameters it owns, whole (~1/d of them, d = dp x cp; the experts'
        # ~1/edp)
        return 4.0 * n, 4.0 * n, 8.0 * (sp.dense / d + sp.experts / layout.edp if zero >= 1 else n)
    params = n * c / (d if zero >= 3 else 1)
    grads = n * c / (d if zero >= 2 else 1)
    if cfg.train.dtype == DType.bf16 and zero == 0:
        grads += 2 * n  # BF16_Optimizer: a flat bf16 accumulation buffer beside the params' own grads
    if optimizer_sharded(cfg):
        optimizer = 12.0 * (_partition(sp.matrices, d) + _partition(sp.vectors, d))
    else:
        optimizer = 8.0 * n  # torch AdamW on the fp32 params: exp_avg, exp_avg_sq
    return params, grads, optimizer


def fsdp_sharded(cfg: Config, layout: Layout) -> bool:
    """ZeRO-2/3 with dp x cp > 1: FSDP2 on the torch executor shards the model states."""
    return cfg.zero.stage >= 2 and layout.dp_cp > 1


def step_buffer_bytes(cfg: Config, layout: Layout, sp: StageParams) -> float:
    """ZeRO-2/3: what a step holds beside the shards, at its peak. Under torch's pipelining every unit's weights,
    once gathered for its first backward, stay gathered until the step's one reduction
    (``PipelineStage.backward_maybe_with_nosync``), and its gradient accumulates unsharded over the micro
    batches, in fp32: c N + 4 N (c = 2 under bf16, whose gathered copies are bf16), under stage 2 and stage 3 alike
    (stage 3 frees a unit's weights after each forward, which lowers the peak only while the first backward has
    not reached it).

    The torch executor's bf16 without FSDP2 (autocast over the fp32 weights): the step's one bf16 copy of every
    matrix, made at its first use and shared by every micro batch in flight (p3d.parallel.tp.precision), but an
    untied embedding table, which the lookup reads in fp32."""
    if fsdp_sharded(cfg, layout):
        return (dtype_bytes(cfg) + 4.0) * sp.total
    if layout.torch_executor and cfg.train.dtype == DType.bf16:
        m = cfg.model
        lookup_only = "embed" in sp.layers and not m.tie_embeddings
        table = padded_vocab(m.vocab_size, layout.tp) // layout.tp * m.hidden_size if lookup_only else 0
        return 2.0 * (sp.matrices - table)
    return 0.0


def _norm_bytes(cfg: Config) -> float:
    """One norm per token: llama RMSNorm keeps, in fp32, x, rsqrt, x_hat and x_hat * w; in bf16 x, 1/rms (fp32) and
    its output, the next matmul's input (p3d.model.norms._LowPrecisionRMSNorm); gpt LayerNorm its input."""
    h, c = cfg.model.hidden_size, dtype_bytes(cfg)
    if cfg.model.arch != Arch.llama:
        return c * h
    return 4 * h + 4 + 2 * c * h if c == 4 else 2 * c * h + 4


def _qk_norm_bytes(cfg: Config, selective: bool) -> float:
    """Qwen3's q and k norms per token (x t): what the RMSNorm of each head keeps beside its input (q|k|v's rows):
    1/rms in fp32 per head, and in fp32 x_hat (the product with w needs it); the output only under selective
    recompute (the checkpoint's input: RoPE's products with cos and sin keep only the tables)."""
    m = cfg.model
    if not m.qk_norm:
        return 0.0
    q, kv = head_dims(m)
    c = dtype_bytes(cfg)
    return ((c == 4) + selective) * c * (q + kv) + 4 * (m.n_heads + m.n_kv_heads)


def block_bytes(cfg: Config, layout: Layout, recompute: Recompute | None = None, moe: bool = False) -> float:
    """Activation bytes one block keeps for backward, per micro batch, on one tp rank (``moe``: an MoE block,
    whose feed-forward keeps ``experts.ffn_activation_bytes`` in place of the SwiGLU's). s: the rank's s / cp tokens;
    with cp > 1 the attention keeps flash attention's inventory (the cp attention saves the log-sum-exp)."""
    m, sched = cfg.model, cfg.schedule
    recompute = sched.recompute if recompute is None else recompute
    c, t, b, s = dtype_bytes(cfg), layout.tp, layout.micro_batch_size, local_tokens(cfg, layout)
    h, a, f = m.hidden_size, m.n_heads, m.ffn_hidden_size
    q, kv = head_dims(m)
    sp = t if sched.sequence_parallel else 1
    flash = cfg.plan.flash_attention or layout.cp > 1
    if recompute == Recompute.full:
        return b * s * c * h / sp
    if m.arch == Arch.llama and is_mla(m):  # multi-head latent attention (p3d.planner.mla), always on a fused kernel
        ffn = experts.ffn_activation_bytes(cfg, layout, recompute) if moe else 0.0
        selective = recompute == Recompute.selective
        per_token = 2 * _norm_bytes(cfg) / sp + (0 if moe else c * 4 * f / t)
        per_token += mla.attention_bytes_per_token(cfg, layout, selective)
        if selective and sched.recompute_swiglu and not moe:
            per_token -= c * f / t
        return b * s * per_token + (0 if selective else mla.rope_table_bytes(cfg, layout)) + ffn
    if m.arch == Arch.llama:
        ffn = experts.ffn_activation_bytes(cfg, layout, recompute) if moe else 0.0
        selective = recompute == Recompute.selective
        per_token = 2 * _norm_bytes(cfg) / sp + (0 if moe else c * 4 * f / t) + _qk_norm_bytes(cfg, selective) / t
        if recompute == Recompute.selective:  # RoPE + attention core recomputed: q|k|v and the output stay
            if sched.recompute_swiglu and not moe:  # silu(gate) recomputed too: gate|up and the product stay
                per_token -= c * f / t
            return b * s * (per_token + c * (2 * q + 2 * kv) / t) + ffn
        if flash:
            per_token += c * (3 * q + 3 * kv) / t + 4 * a / t
        else:  # math attention: no log-sum-exp, a contiguous output copy, and the probabilities
            per_token += c * (4 * q + 3 * kv) / t + c * a * s / t
        return b * s * per_token + 2 * s * head_dim(m) * c + ffn
    per_token = (4 * c + 2) * h / sp + c * (2 * q + 2 * kv + 2 * f) / t
    if recompute != Recompute.selective:
        per_token += 4 * a / t if flash else (2 * c + 1) * a * s / t
    return b * s * per_token


def first_stage_bytes(cfg: Config, layout: Layout) -> float:
    """Embedding: token ids (int64), the out-of-slice mask with tp > 1; gpt: its dropout mask (s / cp tokens)."""
    b, s, t = layout.micro_batch_size, local_tokens(cfg, layout), layout.tp
    per_token: float = 8 + (1 if t > 1 else 0)
    if cfg.model.arch == Arch.gpt:
        per_token += cfg.model.hidden_size / (t if cfg.schedule.sequence_parallel else 1)
    return b * s * per_token


def last_stage_bytes(cfg: Config, layout: Layout) -> float:
    """Final norm, head input and what the vocab-parallel cross entropy saves (fp32 softmax, targets), s / cp tokens."""
    b, s, t, c = layout.micro_batch_size, local_tokens(cfg, layout), layout.tp, dtype_bytes(cfg)
    sp = t if cfg.schedule.sequence_parallel else 1
    vpad = padded_vocab(cfg.model.vocab_size, t)
    norm = _norm_bytes(cfg) if cfg.model.arch == Arch.llama else 2 * c * cfg.model.hidden_size
    return b * s * (norm / sp + 4 * vpad / t + 8 + 1)


def loss_buffer_bytes(cfg: Config, layout: Layout) -> float:
    """Logits held until backward, plus the loss backward's fp32 gradient (and its cast), s / cp tokens."""
    b, s, t, c = layout.micro_batch_size, local_tokens(cfg, layout), layout.tp, dtype_bytes(cfg)
    vpad = padded_vocab(cfg.model.vocab_size, t)
    return b * s * vpad / t * (c + 4 + (c if c < 4 else 0))


def host_bytes(cfg: Config, layout: Layout) -> float:
    """What a cpu worker holds beside its model states and activations, 0 on GPUs (their peak_mem_gb is CUDA's
    max-allocated, and the host is not device memory): the process itself (``CPU_WORKER_BYTES``) and the data
    reader's shuffle pool, data.shuffle_buffer windows of s + 1 tokens, each id in the vocabulary's smallest integer
    (p3d.data.loader.pack; 2 bytes for the byte tokenizer: 8.4 MB for 1,024 windows of 4,097, where Python lists
    held 34 MB). A prepared token store is read by index, no pool."""
    if cfg.cluster.device != "cpu":
        return 0.0
    d, m = cfg.data, cfg.model
    pool = 0 if d.source == DataSource.prepared else d.shuffle_buffer * (m.seq_len + 1) * token_bytes(m.vocab_size)
    return CPU_WORKER_BYTES + pool


def in_flight_chunks(pipeline: str, p: int, m: int, v: int, stage: int) -> int:
    """Chunks (1/v of a rank's layers each) whose activations rank ``stage`` holds at its peak under ``pipeline``."""
    if pipeline == "1f1b":
        return min(p - stage, m)
    if pipeline == "gpipe":
        return m
    if pipeline == "interleaved_1f1b":
        return min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)
    if pipeline == "interleaved_zero_bubble":
        return min(p, m) * v
    if pipeline == "zbv":
        return min(2 * p, m + 1 + stage)
    if pipeline == "dualpipev":
        return 2 * p + 1
    raise ValueError(f"schedule {pipeline!r}: no in-flight model")


def in_flight(layout: Layout, stage: int) -> float:
    """Micro batches whose activations stage ``stage`` holds at its peak (in units of the full stage)."""
    p, m, v = layout.pp, layout.micro_batches, layout.virtual_stages
    return in_flight_chunks(layout.pipeline, p, m, v, stage) / v


@dataclass
class StageMemory:
    stage: int
    params: StageParams
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float  # per micro batch
    in_flight: float
    recompute_bytes: float  # one block's full activations while it is recomputed
    loss_bytes: float
    step_buffers: float = 0.0  # ZeRO-2/3: gathered weights and unsharded gradients during a step
    attention_bytes: float = 0.0  # cp > 1: one layer's cp attention working set (context.attention_working_bytes)
    host_bytes: float = 0.0  # cpu: the worker process and its data buffer (host_bytes); 0 on GPUs
    notes: list[str] = field(default_factory=list)

    @property
    def activations_total(self) -> float:
        """In-flight activations + recompute working set + loss buffer + the cp attention's working set."""
        return self.activation_bytes * self.in_flight + self.recompute_bytes + self.loss_bytes + self.attention_bytes

    @property
    def total(self) -> float:
        states = self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.step_buffers
        return states + self.activations_total + self.host_bytes


def stage_memory(cfg: Config, layout: Layout, stages: list[StageParams] | None = None) -> list[StageMemory]:
    """Each stage's memory on one rank. ``stages``: ``stage_params(cfg, layout)`` when the caller has them (mesh=auto
    computes them once per tp, pp, schedule placement and ep, for every micro batch, recompute, ZeRO stage and cp)."""
    out = []
    recompute = cfg.schedule.recompute
    kinds = (False, True) if cfg.model.moe is not None else (False,)  # dense blocks, MoE blocks
    per_block = {moe: block_bytes(cfg, layout, moe=moe) for moe in kinds}
    working = dict.fromkeys(kinds, 0.0)
    if recompute != Recompute.none:  # one block's full set while it is rebuilt, less what it keeps anyway
        for moe in kinds:
            kept = 0.0 if recompute == Recompute.full else per_block[moe]
            working[moe] = block_bytes(cfg, layout, Recompute.none, moe) - kept
    host = host_bytes(cfg, layout)
    for s, sp in enumerate(stage_params(cfg, layout) if stages is None else stages):
        params, grads, opt = state_bytes(cfg, layout, sp)
        dense = sp.blocks - sp.moe_blocks
        act = dense * per_block[False] + (sp.moe_blocks * per_block[True] if sp.moe_blocks else 0.0)
        if "embed" in sp.layers:
            act += first_stage_bytes(cfg, layout)
        last = "head" in sp.layers
        if last:
            act += last_stage_bytes(cfg, layout)
        rebuilt = max([working[False]] * (dense > 0) + [working.get(True, 0.0)] * (sp.moe_blocks > 0), default=0.0)
        out.append(
            StageMemory(
                s,
                sp,
                params,
                grads,
                opt,
                act,
                in_flight(layout, s),
                rebuilt,
                loss_buffer_bytes(cfg, layout) if last else 0.0,
                step_buffers=step_buffer_bytes(cfg, layout, sp),
                attention_bytes=attention_working_bytes(cfg, layout) if sp.blocks else 0.0,
                host_bytes=host,
            )
        )
    return out
