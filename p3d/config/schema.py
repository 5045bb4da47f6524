"""Structured schema of every config group.

Each YAML file under ``conf/<group>/`` extends one of these dataclasses (``defaults: [base_<group>]``),
so Hydra rejects unknown keys and wrong types at compose time. Cross-group rules (world size, head
divisibility, batch arithmetic, ...) live in :mod:`p3d.layout.run_plan`. The enums the fields take are in
:mod:`p3d.config.options`, every numeric field's range in :mod:`p3d.config.bounds`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from p3d.config.devices import DeviceName
from p3d.config.options import (
    AdamWImpl,
    Arch,
    AttentionType,
    ContextAttention,
    DataSource,
    DType,
    ElasticVary,
    Float8,
    HostMemory,
    Launcher,
    LRDecay,
    OnNonFinite,
    OnSpike,
    OutputFormat,
    Partition,
    Pipeline,
    Progress,
    Recompute,
    RopeType,
    RouterScore,
    TextUnit,
    WandbMode,
)


@dataclass
class MoEConfig:
    """A mixture-of-experts feed-forward in every block from ``first_dense_layers`` on (p3d/model/moe.py,
    docs/moe.md). ``model.moe: null`` is a dense model."""

    n_experts: int = 8  # routed experts per MoE layer
    top_k: int = 2  # experts each token is routed to
    expert_ffn_size: Optional[int] = None  # each expert's SwiGLU inner size; null: model.ffn_hidden_size
    n_shared_experts: int = 0  # experts every token goes through (one SwiGLU of n_shared x expert_ffn_size)
    first_dense_layers: int = 0  # the first blocks keep a dense SwiGLU of model.ffn_hidden_size
    score: RouterScore = RouterScore.softmax
    # group-limited routing (DeepSeek-V3): the experts in n_groups equal groups, each scored by the sum of its 2 best
    # (bias-corrected) scores; a token's top_k experts are chosen within its topk_groups best groups. 1: no groups
    n_groups: int = 1
    topk_groups: int = 1
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to 1 (Mixtral: true; DeepSeekMoE: false)
    route_scale: float = 1.0  # the routed experts' output scaled by this (DeepSeek-V3: 2.5)
    aux_loss_coef: float = 0.01  # load-balancing loss weight, per MoE layer (0: off)
    # aux-loss-free balancing (DeepSeek-V3): after each step, each expert's selection bias moves by this much
    # toward the mean load (up when underloaded); 0: off
    bias_update_rate: float = 0.0
    # null: dropless (every routed token is computed); a number: each expert takes at most
    # ceil(capacity_factor x tokens x top_k / n_experts) tokens of a micro batch, the rest of its tokens dropped
    capacity_factor: Optional[float] = None


@dataclass
class RopeScaling:
    """RoPE's frequencies rescaled for a longer context (p3d/model/rope.py, docs/models.md), the fields named as in
    HF's config.json ``rope_parameters`` (the old ``rope_scaling``). ``rope_type: null`` (the default) is plain RoPE:
    then no other field may be set. On the command line: ``model.rope_scaling.rope_type=linear
    model.rope_scaling.factor=4``."""

    rope_type: Optional[RopeType] = None  # null: plain RoPE; llama3, linear or yarn
    factor: Optional[float] = None  # the context's growth over the pretraining context (required with a rope_type)
    original_max_position_embeddings: Optional[int] = None  # llama3, yarn: the pretraining context (required)
    low_freq_factor: Optional[float] = None  # llama3 (required): wavelengths above original / low are divided by factor
    high_freq_factor: Optional[float] = None  # llama3 (required): below original / high they are kept
    beta_fast: Optional[float] = None  # yarn: the ramp's extrapolation bound, in rotations (null: 32)
    beta_slow: Optional[float] = None  # yarn: the ramp's interpolation bound (null: 1)
    attention_factor: Optional[float] = None  # yarn: cos and sin scaled by it (null: 0.1 ln(factor) + 1, or mscale's)
    mscale: Optional[float] = None  # yarn: attention_factor = mscale'(mscale) / mscale'(mscale_all_dim) when both set
    mscale_all_dim: Optional[float] = None
    truncate: bool = True  # yarn: the ramp's bounds rounded to whole dimensions


@dataclass
class MLAConfig:
    """Multi-head latent attention's widths (``model.attention=mla``; p3d/model/mla.py, docs/models.md), named as
    DeepSeek's config.json names them; all null under ``model.attention=gqa``. DeepSeek-V3: 1536, 512, 128, 64, 128."""

    q_lora_rank: Optional[int] = None  # the queries' latent width; null: q straight from the hidden (DeepSeek-V2-Lite)
    kv_lora_rank: Optional[int] = None  # the keys' and values' latent width (required under mla)
    qk_nope_head_dim: Optional[int] = None  # each query and key head's width without RoPE (required)
    qk_rope_head_dim: Optional[int] = None  # ... and with RoPE: one rotated key shared by every head (required, even)
    v_head_dim: Optional[int] = None  # each value head's width (required)


@dataclass
class ModelConfig:
    name: str = "tiny"
    arch: Arch = Arch.llama
    n_layers: int = 4
    hidden_size: int = 64
    n_heads: int = 8
    n_kv_heads: int = 4  # grouped-query attention: n_heads / n_kv_heads query heads share one kv head
    ffn_hidden_size: int = 192  # SwiGLU inner size
    vocab_size: int = 512  # before padding to a multiple of mesh.tp
    seq_len: int = 64
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)  # rope_type null: plain RoPE; llama3, linear, yarn
    head_dim: Optional[int] = None  # each attention head's width; null: hidden_size / n_heads (Qwen3: 128 always)
    qkv_bias: bool = False  # biases on q, k and v (Qwen2/2.5), split by heads under tp
    qk_norm: bool = False  # an RMSNorm over head_dim of every query and key head, before RoPE (Qwen3)
    attention: AttentionType = AttentionType.gqa  # gqa, or mla: multi-head latent attention of model.mla's widths
    mla: MLAConfig = field(default_factory=MLAConfig)  # MLA's widths (model.attention=mla; DeepSeek-V3)
    # the attention window: null, or at least seq_len, is none (p3d attends to the whole sequence; shorter is refused)
    sliding_window: Optional[int] = None
    # the context the model is made for (HF's max_position_embeddings, which p3d-export writes; null: seq_len)
    max_position_embeddings: Optional[int] = None
    # the Hugging Face architecture p3d-export writes, by its model_type (docs/models.md: llama, mistral, qwen2, qwen3,
    # qwen3_moe, mixtral); null: llama, or mixtral for a model with experts
    family: Optional[str] = None
    norm_eps: float = 1e-5
    init_std: float = 0.02  # std of every weight matrix at init; output projections scaled by 1/sqrt(2 L)
    init_from: Optional[str] = (
        None  # a HF checkpoint dir (docs/models.md): its config.json sets the shape, its weights the init
    )
    # model.init_from: import a DeepSeek-V3 checkpoint without its multi-token prediction layers, which p3d does not
    # train (without it such a checkpoint is refused: p3d drops no tensor unasked)
    drop_mtp: bool = False
    compile: bool = False  # torch.compile each transformer block (inductor; GPU and CPU)
    moe: Optional[MoEConfig] = None  # null: dense; else a mixture-of-experts feed-forward (MoEConfig)


@dataclass
class MeshConfig:
    name: str = "single"
    tp: int = 1
    pp: int = 1
    dp: Any = "auto"  # an int, or "auto": world size / (tp * pp)
    ep: int = 1  # expert parallelism: the experts of each MoE layer split over ep ranks carved from dp (divides dp)
    cp: int = 1  # context parallelism: each sequence split over cp ranks (2 cp chunks, head-tail), docs/context.md


@dataclass
class ContextConfig:
    """Context parallelism's options (``mesh.cp`` sets its degree): p3d.parallel.context, docs/context.md."""

    attention: ContextAttention = ContextAttention.allgather


@dataclass
class ScheduleConfig:
    name: str = "default"
    micro_batch_size: int = 2
    global_batch_size: int = 16  # sequences per optimizer step, over all dp replicas
    recompute: Recompute = Recompute.none
    partition: Partition = Partition.cost
    # split the sequence over tp outside the TP regions (needs tp > 1); null: on wherever mesh.tp > 1 and the sequence
    # divides over it (p3d.layout.run_plan.sequence_parallel_default; docs/schedules.md), false: off
    sequence_parallel: Optional[bool] = None
    recompute_swiglu: bool = False  # with recompute=selective: silu(gate) * up recomputed in backward too
    # chunks per pp rank: >= 2 with interleaved_*, exactly 2 with zbv / dualpipev, 1 with 1f1b / gpipe;
    # null: derived from the pipeline (its fewest: 2 for the interleaved and V schedules, else 1)
    virtual_stages: int | None = None
    pipeline: Pipeline = Pipeline["1f1b"]  # the executor; see Pipeline (p3d.config.options)
    # Uneven layouts (heterogeneous clusters, docs/clusters.md): [] leaves the choice to schedule.partition and an even
    # split of the global batch. stage_blocks: transformer blocks per pipeline piece (mesh.pp x chunks per rank, in
    # chunk order; the embedding rides with the first, the final norm and the head with the last); with cluster.groups
    # the planner fills it in proportion to each stage's device speed.
    stage_blocks: list[int] = field(default_factory=list)
    # micro batches of each dp replica (mesh.dp of them; their sum x micro_batch_size = global_batch_size): replicas on
    # faster devices run more; the loss and gradients are weighted so that a step is the even split's step
    replica_micro_batches: list[int] = field(default_factory=list)


@dataclass
class ZeroConfig:
    name: str = "stage0"
    stage: int = 0
    # ZeRO-2/3: shard over groups of this many dp ranks and replicate across the groups (HSDP); null: the whole
    # dp group (docs/zero.md)
    shard_size: Optional[int] = None
    # the torch executor's dp gradient reduction (ZeRO 0/1): buckets of about this many MB, each all-reduced as soon
    # as its gradients are final in the step's last backward (docs/overlap.md)
    bucket_mb: float = 25.0


@dataclass
class ElasticConfig:
    """Elastic runs (docs/clusters.md): a lost node does not stop the run; it continues on the nodes left."""

    # null: a lost node restarts or requeues the run at the same size; N: continue on the nodes left (re-planned,
    # the global batch kept) while at least N remain, below that stop (exit_codes.NODES_LOST)
    min_nodes: Optional[int] = None
    vary: ElasticVary = ElasticVary.dp  # dp: only dp follows the nodes; any: the planner picks the layout


@dataclass
class ClusterGroup:
    """One group of a heterogeneous cluster (``cluster.groups``, docs/clusters.md): ``nodes`` nodes of one device.
    Groups take the nodes in their order, so the ranks of the first group's nodes come first."""

    device: Optional[str] = None  # a preset of p3d/config/devices.py; required
    nodes: int = 1
    peak_tflops: Optional[float] = None  # null: the device preset's; set to describe a slower or faster part
    memory_gb: Optional[float] = None  # null: the device preset's
    calibration: Optional[str] = None  # a p3d-plan calibrate file of this group's nodes (null: the preset's rates)
    partition: Optional[str] = None  # Slurm: this group's --partition (null: cluster.partition)
    constraint: Optional[str] = None  # Slurm: the node features that pick this group's nodes (--constraint)


@dataclass
class ClusterConfig:
    name: str = "local"
    launcher: Launcher = Launcher.local
    device: DeviceName = (
        DeviceName.cpu
    )  # a preset of p3d/config/devices.py: cpu, a100_40gb, a100_80gb, h100_sxm, h200, b200
    nodes: int = 1
    # The numbers below come from the device preset when left null; set any to override it.
    gpus_per_node: Optional[int] = None  # processes per node; null on cpu: the whole world on one node
    peak_tflops: Optional[float] = None  # dense peak per device (bf16 on GPUs)
    memory_gb: Optional[float] = None
    intra_node_gbps: Optional[float] = None  # GB/s per device, one direction, inside a node
    inter_node_gbps: Optional[float] = None  # GB/s per device, one direction, across nodes
    timeout_s: int = 300  # a collective that waits longer than this fails instead of hanging
    # Slurm (launcher=slurm): sbatch options of the job (p3d.jobs.slurm.submit); null leaves Slurm's default.
    partition: Optional[str] = None  # --partition
    account: Optional[str] = None  # --account
    qos: Optional[str] = None  # --qos
    cpus_per_task: Optional[int] = None  # --cpus-per-task: CPUs per rank (one rank per GPU)
    time: Optional[str] = None  # --time: wall-clock limit, Slurm's format (MM, HH:MM:SS, D-HH:MM:SS)
    constraint: Optional[str] = None  # --constraint: node features
    extra_sbatch: list[str] = field(default_factory=list)  # more sbatch options, e.g. ["--exclusive", "--mem=0"]
    setup: list[str] = field(default_factory=list)  # shell lines the job runs first (module load ..., source ...)
    job_name: str = "p3d"  # --job-name
    signal_s: int = 300  # SIGUSR1 this many seconds before the time limit: checkpoint, exit 75, requeue
    requeue: bool = True  # --requeue; a job whose workers exit 75 (preempted) requeues itself
    max_requeues: int = 20  # a job requeues itself at most this many times
    recipe: str = "recipes/slurm/train.sbatch"  # the batch script p3d-train submits (relative: p3d's own, p3d/recipes/)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)  # continue on the nodes left after a lost node
    # A heterogeneous cluster: groups of nodes, each of one device, e.g. [{device: h100_sxm, nodes: 1}, {device:
    # a100_80gb, nodes: 1}]; cluster.nodes is their sum. [] : every node is cluster.device (docs/clusters.md)
    groups: list[ClusterGroup] = field(default_factory=list)


@dataclass
class MixSource:
    """One store of a ``data.mix``: its directory and its share of the samples (weights are normalised)."""

    path: str = "???"
    weight: float = 1.0


@dataclass
class DataConfig:
    name: str = "stdlib"
    source: DataSource = DataSource.stdlib
    path: Optional[str] = None  # files: a path or glob (comma-separated for several); hub: the dataset name
    subset: Optional[str] = None  # hub: the dataset's config name (e.g. sample-10BT)
    split: str = "train"  # hub: the split to stream
    format: str = "auto"  # files: text, json, parquet, or auto (from the extension)
    text_column: str = "text"  # json / jsonl / parquet / csv / hub: the column that holds the text
    text_unit: TextUnit = TextUnit.document  # one document: a whole file (record), a paragraph, or a line
    tokenizer: str = "auto"  # byte, a HF tokenizer.json (see p3d-tokenizer), or auto: model.init_from's, else byte
    shuffle_buffer: int = 1024  # windows; 0 keeps the corpus order. Seeded by train.seed and the epoch
    val_fraction: float = 0.005  # share of documents held out for validation (chosen by a hash of the text)
    mix: list[MixSource] = field(default_factory=list)  # prepared: stores blended by weight, [{path, weight}, ...]


@dataclass
class LoggerConfig:
    name: str = "none"  # none: console + metrics.jsonl; wandb: also Weights & Biases
    log_every: int = 1  # console line every N steps (metrics.jsonl gets every step)
    progress: Progress = Progress.auto  # auto: a live progress bar when the console is a terminal; bar; lines
    project: str = "p3d"  # wandb project
    entity: Optional[str] = None  # wandb entity (team or user)
    mode: WandbMode = (
        WandbMode.auto
    )  # wandb: online, offline, disabled; auto: WANDB_MODE, else online with an API key or offline
    group: Optional[str] = None  # wandb group; a -m sweep sets it to the sweep's name


@dataclass
class TrainConfig:
    steps: int = 300
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # decay ends at lr * min_lr_ratio
    warmup_steps: int = 20
    decay: LRDecay = LRDecay.cosine
    weight_decay: float = 0.1  # matrices only; norms are not decayed
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    adamw_impl: AdamWImpl = AdamWImpl.default  # default | foreach | fused: torch.optim.AdamW's kernels
    tf32: bool = False  # GPUs: fp32 matmuls and convolutions in TF32 (no effect on CPU)
    grad_clip: float = 1.0  # max global L2 norm of the gradient; 0 turns clipping off
    seed: int = 1234
    dtype: DType = DType.auto
    # float8 matmuls inside the bf16 run (torchao, the fp8 extra; docs/precision.md): none | tensorwise | rowwise |
    # rowwise_with_gw_hp (the TP layers) | mxfp8 (the routed experts); emulated on CPU, GPUs from sm89 (mxfp8: sm100)
    fp8: Float8 = Float8.none
    eval_every: int = 0  # steps between validation passes; 0: none
    eval_batches: int = 2  # global batches of held-out data per validation pass
    save_every: int = 0  # steps between checkpoints (<run.dir>/checkpoints); 0: only on SIGTERM/SIGUSR1 and at the end
    keep_last: int = 2  # complete checkpoints kept (0: all); older ones are deleted once a newer one is complete
    on_nonfinite: OnNonFinite = OnNonFinite.stop  # a step with an inf/nan loss or gradient norm: stop | skip
    max_skipped: int = 5  # on_nonfinite=skip: the most steps discarded in a row; one more stops the run
    spike_factor: float = 0.0  # flag a loss above spike_factor x the median of the last spike_window steps; 0: off
    spike_window: int = 20
    on_spike: OnSpike = OnSpike.warn
    straggler_factor: float = 2.0  # name a rank whose forward+backward time is above this x the median; 0: off
    straggler_steps: int = 3  # ... for this many steps in a row
    trace_steps: list[int] = field(default_factory=list)  # steps whose timeline is written (traces/, docs/timeline.md)
    max_restarts: int = 0  # a worker killed by a signal or a hang: restart all from the newest checkpoint, N times
    async_save: Optional[bool] = None  # write checkpoints in the background (None: on under nccl, off on CPU)
    host_memory: HostMemory = HostMemory.keep  # CPU runs: keep | release freed memory (p3d.train.host_memory)
    resume: str = "none"  # none | auto (the newest complete checkpoint in run.dir, if any) | a checkpoint dir


@dataclass
class RunConfig:
    dir: str = "outputs/run"  # run directory: run_spec.yaml, metrics.jsonl, logs/
    name: str = "p3d"


@dataclass
class TokenizerConfig:
    """What ``p3d-tokenizer`` trains: a byte-level BPE on the ``data`` group's train split."""

    vocab_size: int = 8192  # including the end-of-text token
    out: str = "tokenizer.json"  # where tokenizer.json is written
    max_documents: Optional[int] = None  # train on the first N documents only
    min_frequency: int = 2  # a merge must occur at least this often


@dataclass
class PrepareConfig:
    """What ``p3d-prepare`` writes: the ``data`` group's documents tokenized into a token store."""

    out: str = "store"  # the store's directory
    workers: Optional[int] = None  # tokenizing processes; null: every core this process may use
    overwrite: bool = False  # rebuild a finished store (else it is left as it is)
    shard_bytes: int = 16_000_000  # text per shard (UTF-8 bytes, whole documents); the unit of work and of resume
    shard: Optional[str] = None  # "i/n": prepare slice i of n of the input files into <out>/part-i-of-n
    merge: bool = False  # write <out>/manifest.json over the n finished parts <out>/part-i-of-n
    slices: Optional[int] = None  # with cluster=slurm: a Slurm array job of n prepare.shard=i/n tasks, then the merge


@dataclass
class PlanConfig:
    """Options of the analytic planner (p3d-plan, and the pre-flight check of p3d-train)."""

    force: bool = False  # launch even when the planner predicts the layout does not fit device memory
    # GPUs: the fraction of cluster.peak_tflops a large, well-shaped GEMM reaches (e of the GEMM model, each GEMM timed
    # from its shape); cpu: the fraction reached in every matmul; null: the device's fitted default
    efficiency: Optional[float] = None
    # GPUs: k0 of the GEMM model, a tile's fixed cost in k-steps (short reductions run slower); null: the device's
    gemm_k_overhead: Optional[float] = None
    hbm_gbps: Optional[float] = None  # device memory bandwidth (GB/s) for memory-bound kernels; null: the datasheet's
    flash_attention: bool = True  # attention keeps O(s) per token (flash kernels); false: the s x s probabilities
    # dp / ZeRO collectives overlap compute; null: as p3d's executor runs it (the torch schedules' and FSDP2's do,
    # DeepSpeed's pipeline engine does not; docs/overlap.md); true / false: a published run's setting
    overlap_dp: Optional[bool] = None
    overlap_tp: bool = False  # tp collectives overlap the matmuls (p3d's tp layers: they do not)
    overlap_pp: bool = False  # pipeline sends overlap compute (DeepSpeed's pipeline engine blocks on them)
    p2p_scatter: bool = False  # pipeline sends carry 1/tp of the activations (Megatron); p3d's send the full copy
    top: int = 5  # mesh=auto: how many ranked layouts to print
    # sleep-timed blocks (P3D_TEST_BLOCK_SECONDS, p3d.train.block_seconds): each block's seconds per piece (forward,
    # input gradient, weight gradient, a full recompute's forward) on the fastest group, added to every block's
    # modelled time in every section of a plan (a run timed like another device, bench/hetero.py); null: none
    block_seconds: Optional[float] = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    dry_run: bool = False
    format: OutputFormat = OutputFormat.text  # p3d-plan output: text or json
    # A file of this machine's measured rates (p3d-plan calibrate writes it; p3d-plan and mesh=auto read it);
    # null: the device preset's nominal rates (docs/planner.md, Calibration)
    calibration: Optional[str] = None


GROUPS = {
    "model": ModelConfig,
    "mesh": MeshConfig,
    "schedule": ScheduleConfig,
    "zero": ZeroConfig,
    "cluster": ClusterConfig,
    "data": DataConfig,
    "logger": LoggerConfig,
}


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore (idempotent: a second call stores nothing, since storing
    converts every schema to an OmegaConf node again, ~80 ms, and the tests compose hundreds of times)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    if "base_config.yaml" in cs.repo:
        return
    cs.store(name="base_config", node=Config)
    for group, node in GROUPS.items():
        cs.store(group=group, name=f"base_{group}", node=node)
