"""The values a config field takes: the enums and choices of the schema (p3d.config.schema), each member's
value the string a config file or the command line gives."""

from __future__ import annotations

from enum import Enum

from p3d.config.choice import Choice


class Arch(Enum):
    llama = "llama"
    gpt = "gpt"  # planned by p3d-plan (published GPT runs); the trainer builds llama only


class RopeType(Enum):
    """How RoPE's frequencies are rescaled for a longer context (p3d/model/rope.py); HF's ``rope_type`` values."""

    llama3 = "llama3"  # Llama 3.1-3.3: low frequencies divided by factor, the middle band blended
    linear = "linear"  # every frequency divided by factor (position interpolation)
    yarn = "yarn"  # YaRN: frequencies ramped between interpolation and extrapolation, cos/sin scaled


class AttentionType(Enum):
    """``model.attention``: the attention of every block (docs/models.md)."""

    gqa = "gqa"  # grouped-query attention: q, k, v of model.head_dim per head (Llama, Mistral, Qwen)
    mla = "mla"  # multi-head latent attention (DeepSeek-V2/V3): keys and values from a latent (p3d/model/mla.py)


class Recompute(Enum):
    none = "none"
    selective = "selective"  # RoPE + attention core recomputed in backward (torch.utils.checkpoint)
    full = "full"


class RouterScore(Enum):
    softmax = "softmax"  # Mixtral, Qwen-MoE, DeepSeekMoE: a softmax over the experts' logits
    sigmoid = "sigmoid"  # DeepSeek-V3: an independent sigmoid per expert (weights normalised over the top-k)


class Partition(Enum):
    blocks = "blocks"  # balance transformer blocks over stages (embedding/head ride along)
    uniform = "uniform"  # balance all pipeline layers, embedding and head counted as layers
    cost = "cost"  # balance each stage's modelled FLOPs: blocks, and the head with its loss, by their cost


# The pipeline schedule: which executor runs the steps (docs/schedules.md). "1f1b" is DeepSpeed's
# PipelineEngine (p3d's default since the start); the others run torch.distributed.pipelining's schedules over
# the same layer list cut into mesh.pp x schedule.virtual_stages chunks (p3d/train/executors/torch_pipeline.py).
# Functional form: "1f1b" is not an identifier. Read a member as Pipeline["zbv"], compare values as strings.
Pipeline = Enum(
    "Pipeline",
    {
        "1f1b": "1f1b",
        "interleaved_1f1b": "interleaved_1f1b",
        "interleaved_zero_bubble": "interleaved_zero_bubble",
        "zbv": "zbv",
        "dualpipev": "dualpipev",
        "gpipe": "gpipe",
    },
)


class DType(Enum):
    auto = "auto"  # fp32 on cpu, bf16 on GPUs (resolved when the run spec is frozen)
    fp32 = "fp32"
    bf16 = "bf16"


class Float8(Enum):
    """``train.fp8``: the float8 recipe of the TP layers' matmuls inside a bf16 run (torchao; docs/precision.md)."""

    none = "none"  # bf16 (or fp32) matmuls
    tensorwise = "tensorwise"  # one scale per tensor (e4m3 forward, e5m2 gradients); SP gathers in float8
    rowwise = "rowwise"  # one scale per row of each operand, powers of 2, e4m3 throughout
    rowwise_with_gw_hp = "rowwise_with_gw_hp"  # rowwise, the weight gradient's GEMM in bf16
    mxfp8 = "mxfp8"  # the routed experts' grouped GEMMs in MXFP8 (a scale per 32 values; GPUs: sm100)


class AdamWImpl(Enum):
    default = "default"  # torch's choice: the foreach (multi-tensor) kernels where the tensors allow
    foreach = "foreach"
    fused = "fused"  # one fused kernel per parameter group (CUDA and CPU)


class HostMemory(Enum):
    keep = "keep"  # CPU workers keep freed memory in their heap for the next step (fast; peak_mem_gb counts it)
    release = "release"  # freed blocks over 128 KiB go back to the kernel: peak_mem_gb is the live peak (~10 % slower)


class LRDecay(Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class OnNonFinite(Enum):
    stop = "stop"  # no update for that step; the run stops with exit_codes.NONFINITE
    skip = "skip"  # the update is discarded, the run goes on (train.max_skipped in a row at most)


class OnSpike(Enum):
    warn = "warn"  # flagged in metrics and on the console; the update is applied
    skip = "skip"  # flagged, and the update is discarded like a non-finite step's


class Launcher(Enum):
    local = "local"
    slurm = "slurm"


class ElasticVary(Choice):
    dp = "dp"  # tp, pp and cp stay (each stage's memory does not change); dp follows the nodes left
    any = "any"  # the planner picks a layout for the nodes left (p3d.planner.best_layout)


class ContextAttention(Choice):
    """How a cp rank's attention reaches the other ranks' keys and values (docs/context.md, "All-gather or ring")."""

    allgather = "allgather"  # all-gathered over the cp group once a layer, then attended (Llama 3)
    ring = "ring"  # passed around the cp group, one rank's block a step, while the previous block computes


class DataSource(Enum):
    stdlib = "stdlib"  # Python's standard library sources and English docs: on every machine
    files = "files"  # local text / json / jsonl / parquet files or globs
    hub = "hub"  # a Hugging Face hub dataset by name (needs network access), streamed
    prepared = "prepared"  # a token store written by p3d-prepare (data.path, or data.mix): memory-mapped


class Progress(Choice):
    auto = "auto"  # a live progress bar when the console is a terminal, else lines
    bar = "bar"
    lines = "lines"


class WandbMode(Choice):
    auto = "auto"  # WANDB_MODE if set, else online with an API key and offline without
    online = "online"
    offline = "offline"
    disabled = "disabled"


class OutputFormat(Choice):
    text = "text"
    json = "json"


class TextUnit(Enum):
    """What one document is in a text (each followed by the end-of-document token when packed)."""

    document = "document"  # a whole text file (a whole record's text); line breaks kept
    paragraph = "paragraph"  # a run of non-blank lines, its line breaks kept; blank lines separate paragraphs
    line = "line"  # one line, without its line break
