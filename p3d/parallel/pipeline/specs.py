"""The Llama as a flat list of DeepSpeed layer specs, and its single-process twin.

Flat list (``p3d.layout.run_plan.layer_names``):
    [embed, block0 .. block{L-1}, final_norm, head]   then loss_fn(logits, labels)
Between stages flows one tensor: the hidden states (b, s, h), replicated over the TP group; with
sequence parallelism this rank's block of the sequence, (b, s/tp, h), so p2p bytes fall by tp.
The first stage reads token ids (b, s); the loss reads labels (b, s) on the last stage.
With tied embeddings, embed and head are one ``TiedLayerSpec`` (key "embed"): DeepSpeed keeps a
copy on the first and on the last stage and all-reduces their gradients.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from p3d.config.schema import Recompute
from p3d.model.llama import TransformerBlock
from p3d.model.norms import RMSNorm
from p3d.parallel.tp.cross_entropy import vocab_parallel_cross_entropy
from p3d.parallel.tp.layers import ColumnParallelLinear, VocabParallelEmbedding


class EmbeddingPipe(VocabParallelEmbedding):
    def __init__(self, cfg, padded_vocab_size: int, mesh, seed: int, sequence_parallel: bool = False):
        super().__init__(
            cfg.vocab_size, padded_vocab_size, cfg.hidden_size, mesh, "embed", cfg.init_std, seed, sequence_parallel
        )


class FinalNorm(RMSNorm):
    def __init__(self, cfg, sp_group=None):
        super().__init__(cfg.hidden_size, cfg.norm_eps, sp_group)


class HeadPipe(ColumnParallelLinear):
    """Untied output projection, split by vocab: (b, s, h) -> local logits (b, s, V_pad/tp)."""

    def __init__(self, cfg, padded_vocab_size: int, mesh, seed: int, sequence_parallel: bool = False):
        super().__init__(
            cfg.hidden_size,
            [cfg.vocab_size],
            mesh,
            ["head"],
            cfg.init_std,
            seed,
            padded_rows=[padded_vocab_size],
            sequence_parallel=sequence_parallel,
        )
        rows = padded_vocab_size // mesh.tp
        real = max(0, min(rows, cfg.vocab_size - mesh.tp_rank * rows))
        self.padding_numel = (rows - real) * cfg.hidden_size  # vocab padding entries on this rank


def tied_head_forward(embedding: EmbeddingPipe, x: torch.Tensor) -> torch.Tensor:
    return embedding.as_head(x)


class VocabParallelLoss:
    """Mean token cross entropy from this rank's vocab slice of the logits."""

    def __init__(self, cfg, padded_vocab_size: int, mesh):
        self.group = mesh.tp_group
        self.vocab_start = mesh.tp_rank * (padded_vocab_size // mesh.tp)
        self.vocab_size = cfg.vocab_size
        self.__name__ = "vocab_parallel_cross_entropy"

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels, self.group, self.vocab_start, self.vocab_size).mean()


def build_layer_specs(
    cfg,
    padded_vocab_size: int,
    mesh,
    seed: int,
    sequence_parallel: bool = False,
    recompute_attention: bool = False,
    recompute_swiglu: bool = False,
    cp_attention: str = "allgather",
) -> list[LayerSpec]:
    """cfg: ModelConfig. The specs of every layer; PipelineModule builds only this stage's.

    ``sequence_parallel``: split the sequence over tp outside the TP regions (schedule.sequence_parallel);
    ``recompute_attention``: selective recompute of the attention core (schedule.recompute=selective);
    ``recompute_swiglu``: silu(gate) * up too (schedule.recompute_swiglu); ``cp_attention``: how the attention
    reaches the other cp ranks' keys with mesh.cp > 1 (context.attention)."""
    sp = sequence_parallel and mesh.tp > 1
    if cfg.tie_embeddings:
        embed = TiedLayerSpec("embed", EmbeddingPipe, cfg, padded_vocab_size, mesh, seed, sp, tied_weight_attr="weight")
        head = TiedLayerSpec(
            "embed",
            EmbeddingPipe,
            cfg,
            padded_vocab_size,
            mesh,
            seed,
            sp,
            tied_weight_attr="weight",
            forward_fn=tied_head_forward,
        )
    else:
        embed = LayerSpec(EmbeddingPipe, cfg, padded_vocab_size, mesh, seed, sp)
        head = LayerSpec(HeadPipe, cfg, padded_vocab_size, mesh, seed, sp)
    blocks = [
        LayerSpec(TransformerBlock, cfg, mesh, i, seed, sp, recompute_attention, recompute_swiglu, cp_attention)
        for i in range(cfg.n_layers)
    ]
    final_norm = LayerSpec(FinalNorm, cfg, mesh.tp_group if sp else None)
    return [embed, *blocks, final_norm, head]


class P3DPipelineModule(PipelineModule):
    """A PipelineModule whose stage boundaries come from the run plan, not from DeepSpeed's heuristics,
    so the launcher's validation, the dry run and the workers agree on which layers live where."""

    def __init__(self, specs, stage_bounds: list[int], **kwargs):
        self._p3d_stage_bounds = list(stage_bounds)
        super().__init__(specs, **kwargs)

    def _partition_layers(self, method="uniform"):
        if len(self._p3d_stage_bounds) != self.num_stages + 1 or self._p3d_stage_bounds[-1] != len(self._layer_specs):
            raise ValueError(
                f"stage bounds {self._p3d_stage_bounds} do not fit {self.num_stages} stages of "
                f"{len(self._layer_specs)} layers"
            )
        self.parts = list(self._p3d_stage_bounds)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


class SequentialModel(nn.Module):
    """Every layer of the spec list on one process (tp = pp = dp = 1): the reference for parity.

    Tied specs share one module, exactly as DeepSpeed's tied copies do once their gradients are summed.
    """

    def __init__(self, specs: list[LayerSpec], loss_fn):
        super().__init__()
        self.tied = nn.ModuleDict()
        self.layers = nn.ModuleList()
        self._funcs = []
        for spec in specs:
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied:
                    self.tied[spec.key] = spec.build()
                module = self.tied[spec.key]
                self._funcs.append(partial(spec.forward_fn, module) if spec.forward_fn else module)
                self.layers.append(nn.Identity())  # keeps layer indices aligned with the spec list
            else:
                module = spec.build()
                self.layers.append(module)
                self._funcs.append(module)
        self.loss_fn = loss_fn

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = ids
        for f in self._funcs:
            x = f(x)
        return x  # (b, s, V_pad) logits

    def loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self(ids), labels)


def layer_specs_of(cfg, plan, mesh) -> list[LayerSpec]:
    """The layer specs of a run (cfg: the typed Config; plan: its validated plan): the schedule's sequence
    parallelism and selective recompute applied. Every executor and the dry run build from this one list."""
    selective = cfg.schedule.recompute == Recompute.selective
    return build_layer_specs(
        cfg.model,
        plan.padded_vocab_size,
        mesh,
        cfg.train.seed,
        sequence_parallel=cfg.schedule.sequence_parallel,
        recompute_attention=selective,
        recompute_swiglu=selective and cfg.schedule.recompute_swiglu,
        cp_attention=str(cfg.context.attention),
    )


def to_sequential(
    cfg, padded_vocab_size: int, seed: int, mesh=None, recompute_attention: bool = False, recompute_swiglu: bool = False
) -> SequentialModel:
    """The single-process twin of the pipeline (mesh defaults to one rank with no groups)."""
    from p3d.parallel.mesh import Mesh

    mesh = mesh or Mesh(tp=1, pp=1, dp=1)
    specs = build_layer_specs(
        cfg, padded_vocab_size, mesh, seed, recompute_attention=recompute_attention, recompute_swiglu=recompute_swiglu
    )
    return SequentialModel(specs, VocabParallelLoss(cfg, padded_vocab_size, mesh))
