"""What the planner counts exactly: the layout, parameters per rank and stage, and FLOPs per token.

Notation (docs/planner.md uses the same): L layers, h hidden, a = n_heads, hd = h / a, q = a * hd,
kv = n_kv_heads * hd, f = ffn_hidden_size, V vocab (V_pad: padded to a multiple of tp, as p3d
builds it), s sequence, b micro batch, t = tp, p = pp, d = dp, m micro batches per replica per
step, v virtual stages.

Parameters per tensor-parallel rank mirror the modules p3d builds (p3d/model/llama.py, pipe.py):

    llama block:  matrices  h (q + 2 kv) / t  (q|k|v)  +  h q / t  (o)  +  3 h f / t  (gate|up, down)
                  vectors   2 h  (two RMSNorm weights, replicated on every tp rank)
    gpt block:    matrices  h (q + 2 kv) / t  +  h q / t  +  2 h f / t  (fc1, fc2)
                  vectors   (q + 2 kv) / t + f / t  (column-parallel biases)  +  2 h  (row-parallel
                            biases, replicated)  +  4 h  (two LayerNorms, weight and bias)
    embedding:    V_pad h / t  (+ gpt: learned positions s h, replicated)
    final norm:   h (llama RMSNorm) or 2 h (gpt LayerNorm)
    head:         V_pad h / t; with tied embeddings and pp > 1 the last stage holds a copy of the
                  embedding (DeepSpeed's TiedLayerSpec), with pp = 1 the one table serves both.

Layers are placed on stages by ``p3d.config.validate.stage_bounds``, the function p3d-train uses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from p3d.config.schema import Arch, Config, ModelConfig
from p3d.config.validate import P3DConfigError, layer_names, padded_vocab, stage_bounds


@dataclass(frozen=True)
class Layout:
    """One parallel layout: degrees, micro batch and the derived micro batches per replica."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    micro_batches: int
    virtual_stages: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def describe(self) -> str:
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (f"tp={self.tp} pp={self.pp} dp={self.dp} ({self.world_size} ranks), micro batch "
                f"{self.micro_batch_size} x {self.micro_batches}{v}")


def world_size(cfg: Config) -> int | None:
    """GPUs of the cluster: nodes x gpus_per_node; None on cpu, where the mesh decides the world."""
    gpn = cfg.cluster.gpus_per_node
    return None if gpn is None else cfg.cluster.nodes * gpn


def layout_of(cfg: Config) -> Layout:
    """The layout the config asks for, modelled even where p3d-train would refuse it.

    dp=auto takes world / (tp pp); an explicit dp that disagrees with the cluster is modelled as
    given (tp pp dp GPUs). Micro batches m = global_batch / (micro_batch dp), at least 1.
    """
    tp, pp, s = cfg.mesh.tp, cfg.mesh.pp, cfg.schedule
    for name, val in (("mesh.tp", tp), ("mesh.pp", pp), ("schedule.micro_batch_size", s.micro_batch_size),
                      ("schedule.global_batch_size", s.global_batch_size),
                      ("schedule.virtual_stages", s.virtual_stages)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise P3DConfigError(f"{name}={val!r} must be a positive integer")
    dp = cfg.mesh.dp
    if dp == "auto":
        world = world_size(cfg)
        if world is None:
            dp = 1
        elif world % (tp * pp):
            raise P3DConfigError(f"mesh.tp*mesh.pp={tp * pp} must divide the {world} GPUs of the cluster "
                                 f"(cluster.nodes={cfg.cluster.nodes} x cluster.gpus_per_node="
                                 f"{cfg.cluster.gpus_per_node}); set mesh.dp or change cluster.nodes")
        else:
            dp = world // (tp * pp)
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise P3DConfigError(f"mesh.dp={dp!r} must be a positive integer or auto; try mesh.dp=auto")
    m = max(1, s.global_batch_size // (s.micro_batch_size * dp))
    return Layout(tp, pp, dp, s.micro_batch_size, m, s.virtual_stages)


def head_dims(m: ModelConfig) -> tuple[int, int]:
    """(q, kv): widths of the query and of each of the key/value projections."""
    hd = m.hidden_size // m.n_heads
    return m.n_heads * hd, m.n_kv_heads * hd


def block_matmul_params(m: ModelConfig, tp: int = 1) -> int:
    """Weights of one block's matrices on one tp rank (the ones that do 2 FLOPs per token each)."""
    q, kv = head_dims(m)
    mlp = (3 if m.arch == Arch.llama else 2) * m.hidden_size * m.ffn_hidden_size
    return (m.hidden_size * (q + 2 * kv) + m.hidden_size * q + mlp) // tp


def block_vector_params(m: ModelConfig, tp: int = 1) -> int:
    """Norm weights and biases of one block on one tp rank."""
    h = m.hidden_size
    if m.arch == Arch.llama:
        return 2 * h
    q, kv = head_dims(m)
    return (q + 2 * kv) // tp + m.ffn_hidden_size // tp + 2 * h + 4 * h


@dataclass(frozen=True)
class StageParams:
    """Parameters on one rank of a stage, split as p3d's optimizer groups them."""

    matrices: int  # ndim >= 2: weight-decayed group
    vectors: int  # norms, biases: no-decay group
    blocks: int  # transformer blocks on this stage
    layers: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return self.matrices + self.vectors


def _layer_params(m: ModelConfig, name: str, tp: int, vpad: int) -> tuple[int, int]:
    h = m.hidden_size
    if name == "embed":
        return vpad * h // tp + (m.seq_len * h if m.arch == Arch.gpt else 0), 0
    if name == "head":
        return vpad * h // tp, 0
    if name == "final_norm":
        return 0, (h if m.arch == Arch.llama else 2 * h)
    return block_matmul_params(m, tp), block_vector_params(m, tp)


def stage_params(cfg: Config, layout: Layout) -> list[StageParams]:
    """Per stage, the parameters of one tp rank (identical on every tp rank and dp replica)."""
    m = cfg.model
    vpad = padded_vocab(m.vocab_size, layout.tp)
    names = layer_names(m.n_layers)
    bounds = stage_bounds(m.n_layers, layout.pp, cfg.schedule.partition)
    out = []
    for s in range(layout.pp):
        here = names[bounds[s]:bounds[s + 1]]
        mat = vec = 0
        for name in here:
            if name == "head" and m.tie_embeddings and "embed" in here:
                continue  # pp=1 (or embed and head on one stage): one tied table
            if name == "head" and m.tie_embeddings:
                mat += vpad * m.hidden_size // layout.tp  # DeepSpeed's tied copy: the embedding table only
                continue
            dm, dv = _layer_params(m, name, layout.tp, vpad)
            mat, vec = mat + dm, vec + dv
        out.append(StageParams(mat, vec, sum(n.startswith("block") for n in here), tuple(here)))
    return out


def total_params(m: ModelConfig) -> int:
    """Closed form of the whole model, unpadded vocab, a tied table counted once."""
    h = m.hidden_size
    embed = m.vocab_size * h * (1 if m.tie_embeddings else 2) + (m.seq_len * h if m.arch == Arch.gpt else 0)
    final = h if m.arch == Arch.llama else 2 * h
    return m.n_layers * (block_matmul_params(m) + block_vector_params(m)) + embed + final


def model_flops_per_token(m: ModelConfig) -> float:
    """Model FLOPs per token, forward + backward (the MFU numerator; recompute not counted).

        6 * (L * block_matmul_params + h * V)  +  12 * L * s * q

    6 = 2 FLOPs per multiply-add x 3 (forward, and backward's two matmuls). The attention scores
    and the weighted sum cost 2 * 2 * s * q per token forward, the full s x s square (the
    Megatron / PaLM convention: causality not discounted). Embedding lookups, norms, activations
    and the softmax are not counted. For a llama this equals p3d.flops.model_flops_per_token; for a
    GPT with f = 4h it is Narayanan et al. (2021) Eq. 3 without the recompute term:
    72 L h^2 (1 + s / 6h + V / 12 L h) per token.
    """
    q, _ = head_dims(m)
    return 6.0 * (m.n_layers * block_matmul_params(m) + m.hidden_size * m.vocab_size) \
        + 12.0 * m.n_layers * m.seq_len * q


def recompute_flops_per_token(m: ModelConfig, recompute: str) -> float:
    """FLOPs of the forward work that recompute repeats, per token (HFU counts them, MFU does not).

    full: every block's forward again, 2 * L * block_matmul_params + 4 * L * s * q (Narayanan Eq. 3
    counts exactly this: its factor 96 = 4 x 24). selective: the attention core, 4 * L * s * q.
    """
    q, _ = head_dims(m)
    attn = 4.0 * m.n_layers * m.seq_len * q
    if recompute == "full":
        return 2.0 * m.n_layers * block_matmul_params(m) + attn
    return attn if recompute == "selective" else 0.0


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
