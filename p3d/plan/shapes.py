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

Layers are placed on stages by ``p3d.model.geometry.stage_bounds``, the function p3d-train uses;
the per-block counts and FLOPs per token are ``p3d.model.geometry``'s too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from p3d.config.schema import Arch, Config, ModelConfig
from p3d.config.validate import P3DConfigError
from p3d.model.geometry import block_matmul_params, block_vector_params, layer_names, padded_vocab, stage_bounds
from p3d.parallel_dims import resolve_dp


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
        return (
            f"tp={self.tp} pp={self.pp} dp={self.dp} ({self.world_size} ranks), micro batch "
            f"{self.micro_batch_size} x {self.micro_batches}{v}"
        )


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
    for name, val in (
        ("mesh.tp", tp),
        ("mesh.pp", pp),
        ("schedule.micro_batch_size", s.micro_batch_size),
        ("schedule.global_batch_size", s.global_batch_size),
        ("schedule.virtual_stages", s.virtual_stages),
    ):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise P3DConfigError(f"{name}={val!r} must be a positive integer")
    dp = resolve_dp(tp, pp, cfg.mesh.dp, cfg.cluster.nodes, cfg.cluster.gpus_per_node)
    m = max(1, s.global_batch_size // (s.micro_batch_size * dp))
    return Layout(tp, pp, dp, s.micro_batch_size, m, s.virtual_stages)


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
    bounds = stage_bounds(m.n_layers, layout.pp, cfg.schedule.partition, m)
    out = []
    for s in range(layout.pp):
        here = names[bounds[s] : bounds[s + 1]]
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


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
