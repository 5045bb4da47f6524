"""Megatron-style tensor-parallel layers over an explicit mesh.

Every weight is initialised by drawing ONE master tensor from a generator seeded by
(train.seed, parameter key) and keeping this rank's slice, so tp=1 and tp=N start from the same
model. Under ``torch.device("meta")`` no master is drawn (dry runs of 70B+ models).
With ``sequence_parallel`` the activations outside the TP regions are split along the sequence,
(b, s/tp, h): a column-parallel layer all-gathers its input (reduce-scatters the gradient), a
row-parallel layer and the embedding reduce-scatter their output instead of all-reducing it.
Sharded parameters carry ``model_parallel = True``: DeepSpeed's ZeRO and bf16 optimizers, and
our own clipping, count them on every TP rank, and replicated ones on tp rank 0 only.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from p3d.parallel.tp.mappings import copy_to_tp, gathered_linear, reduce_from_tp, reduce_scatter_to_sp
from p3d.parallel.tp.precision import autocast_dtype, compute_weight


def on_meta() -> bool:
    return torch.empty(()).device.type == "meta"


def master_normal(shape: Sequence[int], std: float, key: str, seed: int) -> torch.Tensor:
    """The unsharded initial value of parameter ``key``: identical on every mesh."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{key}".encode()))
    return torch.randn(*shape, generator=gen) * std


def mark_sharded(p: nn.Parameter) -> nn.Parameter:
    p.model_parallel = True  # type: ignore[attr-defined]  # a marker attribute the Parameter stub does not declare
    p.tensor_model_parallel = True  # type: ignore[attr-defined]  # likewise
    return p


def owned_by_tp_rank(p: nn.Parameter, tp_rank: int) -> bool:
    """Whether this rank's copy counts once in the model: a sharded slice always, a replicated
    tensor (identical on every tp rank) on tp rank 0 only."""
    return bool(getattr(p, "model_parallel", False)) or tp_rank == 0


def _new_param(local_shape, make) -> nn.Parameter:
    return nn.Parameter(torch.empty(*local_shape) if on_meta() else make())


class ColumnParallelLinear(nn.Module):
    """Y = X A, A = [A_1 ... A_p] split by output columns: rank r computes Y_r = X A_r (no bias).

    ``out_features`` may list several logical matrices fused along the output dim (q|k|v, gate|up);
    each is split over tp on its own, so rank r holds [q_r | k_r | v_r] and ``split_output`` hands
    them back separately. weight: (sum(out_features) / tp, in_features).
    The input is replicated over tp; its gradient is all-reduced (copy_to_tp). With
    ``sequence_parallel`` the input is this rank's (b, s/tp, in) block: all-gathered along the
    sequence, its gradient reduce-scattered; only the block is kept for backward (gathered_linear).
    """

    def __init__(
        self,
        in_features: int,
        out_features: Sequence[int],
        mesh,
        keys: Sequence[str],
        std: float,
        seed: int,
        padded_rows: Sequence[int] | None = None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        tp, rank = mesh.tp, mesh.tp_rank
        self.group, self.sequence_parallel = mesh.tp_group, sequence_parallel
        padded = list(padded_rows or out_features)  # rows after padding (vocab), a multiple of tp
        if any(o % tp for o in padded):
            raise ValueError(f"out_features {padded} not divisible by tp={tp}")
        self.tp, self.real_out, self.local_out = tp, list(out_features), [o // tp for o in padded]

        def make():
            shards = []
            for o, p, key in zip(out_features, padded, keys):
                w = F.pad(master_normal((o, in_features), std, key, seed), (0, 0, 0, p - o))
                shards.append(w.chunk(tp, dim=0)[rank])
            return torch.cat(shards, dim=0).contiguous()

        self.weight = mark_sharded(_new_param((sum(self.local_out), in_features), make))

    float8 = None  # with train.fp8, a float8 matmul on this shard (p3d.parallel.tp.float8.convert_to_float8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float8 is not None:
            return self.float8.column(x, self.weight, self.sequence_parallel)  # (b, s, sum(out)/tp)
        w = compute_weight(self.weight)  # under bf16 autocast: one bf16 copy a step (p3d.parallel.tp.precision)
        if self.sequence_parallel:  # x: (b, s/tp, in), gathered along the sequence, only the block kept
            return gathered_linear(x, w, self.group)  # (b, s, sum(out)/tp)
        return F.linear(copy_to_tp(x, self.group), w)  # (b, s, sum(out)/tp)

    def shard_spec(self) -> dict:
        """How the full weight is cut: rows of each fused block (before padding) split over tp."""
        return {"kind": "rows", "blocks": list(self.real_out), "padded": [o * self.tp for o in self.local_out]}

    def split_output(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, self.local_out, dim=-1)


class RowParallelLinear(nn.Module):
    """Y = X A, A = [A_1; ...; A_p] split by input rows: rank r computes X_r A_r, then sum over tp.

    The input arrives already split along its last dim (the output of a ColumnParallelLinear).
    weight: (out_features, in_features / tp). The partial sums are all-reduced, or with
    ``sequence_parallel`` reduce-scattered along the sequence: out (b, s/tp, out).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mesh,
        key: str,
        std: float,
        seed: int,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        tp, rank = mesh.tp, mesh.tp_rank
        self.group, self.sequence_parallel = mesh.tp_group, sequence_parallel
        if in_features % tp:
            raise ValueError(f"in_features {in_features} not divisible by tp={tp}")
        self.weight = mark_sharded(
            _new_param(
                (out_features, in_features // tp),
                lambda: master_normal((out_features, in_features), std, key, seed).chunk(tp, dim=1)[rank].contiguous(),
            )
        )

    float8 = None  # with train.fp8, a float8 matmul on this shard (p3d.parallel.tp.float8.convert_to_float8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float8 is not None:
            y = self.float8.row(x, self.weight)  # (b, s, out), partial over tp
        else:
            y = F.linear(x, compute_weight(self.weight))  # (b, s, out), partial over tp
        return reduce_scatter_to_sp(y, self.group) if self.sequence_parallel else reduce_from_tp(y, self.group)

    def shard_spec(self) -> dict:
        return {"kind": "cols"}


class ReplicatedLinear(nn.Module):
    """Y = X A with A (out, in) whole on every tp rank (no bias): MLA's down-projections to its latents, small beside
    the heads' matrices. Without sequence parallelism every tp rank computes the same Y from the same X; its
    gradient then arrives summed over tp by the column-parallel layer Y enters (copy_to_tp), so A's gradient is the
    same on every rank. With ``sp_group`` (sequence parallelism) X is this rank's (b, s/tp, in) block: A enters
    through copy_to_tp, so its gradient, partial over the sequence blocks, is summed over tp (as the norms' are).
    Not float8 under ``train.fp8`` (p3d.parallel.tp.float8 converts the column and row layers)."""

    def __init__(self, in_features: int, out_features: int, key: str, std: float, seed: int, sp_group=None):
        super().__init__()
        self.sp_group = sp_group
        self.weight = _new_param((out_features, in_features), lambda: master_normal((out_features, in_features), std,
                                                                                    key, seed))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp_group is None:
            return F.linear(x, compute_weight(self.weight))  # (b, s, out)
        # the fp32 weight enters the sum over tp (autocast casts it after): its gradient is summed in fp32
        return F.linear(x, copy_to_tp(self.weight, self.sp_group))  # (b, s/tp, out)


class VocabParallelEmbedding(nn.Module):
    """Embedding table E (V_pad, h) split by vocab rows: rank r holds rows [r V_pad/tp, (r+1) V_pad/tp).

    A token outside a rank's rows looks up zeros there; the sum over tp yields the full embedding.
    Rows >= vocab_size are padding: zero at init and never looked up.
    ``as_head`` reuses the table as a column-parallel output projection (tied embeddings). With
    ``sequence_parallel`` the sum is reduce-scattered along the sequence, out (b, s/tp, h), and the
    head all-gathers its (b, s/tp, h) input.
    """

    def __init__(
        self,
        vocab_size: int,
        padded_vocab_size: int,
        hidden_size: int,
        mesh,
        key: str,
        std: float,
        seed: int,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        tp, rank = mesh.tp, mesh.tp_rank
        self.group, self.tp, self.sequence_parallel = mesh.tp_group, tp, sequence_parallel
        self.vocab_size = vocab_size
        self.rows = padded_vocab_size // tp
        self.vocab_start = rank * self.rows
        self.weight = mark_sharded(
            _new_param(
                (self.rows, hidden_size),
                lambda: (
                    F.pad(
                        master_normal((vocab_size, hidden_size), std, key, seed),
                        (0, 0, 0, padded_vocab_size - vocab_size),
                    )
                    .chunk(tp, dim=0)[rank]
                    .contiguous()
                ),
            )
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # the lookup reads the table in its dtype; under autocast the rows leave in the compute dtype (bf16: the
        # residual stream and the pipeline's activations are bf16), before the tp sum (each row is another rank's 0)
        dtype = autocast_dtype(ids.device.type)
        if self.tp == 1:
            out = F.embedding(ids, self.weight)  # (b, s, h)
            return out if dtype is None else out.to(dtype)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (b, s, h)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if dtype is not None:
            out = out.to(dtype)
        return reduce_scatter_to_sp(out, self.group) if self.sequence_parallel else reduce_from_tp(out, self.group)

    def shard_spec(self) -> dict:
        return {"kind": "rows", "blocks": [self.vocab_size], "padded": [self.rows * self.tp]}

    @property
    def padding_numel(self) -> int:
        """Entries of this rank's rows that are vocab padding (rows >= vocab_size)."""
        real = max(0, min(self.rows, self.vocab_size - self.vocab_start))
        return (self.rows - real) * self.weight.shape[1]

    def as_head(self, x: torch.Tensor) -> torch.Tensor:
        w = compute_weight(self.weight)
        if self.sequence_parallel:  # x: (b, s/tp, h)
            return gathered_linear(x, w, self.group)  # (b, s, V_pad/tp)
        return F.linear(copy_to_tp(x, self.group), w)  # (b, s, V_pad/tp)
