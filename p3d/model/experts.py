"""The experts of an MoE block: the routed ones stacked (one weight per projection, experts leading) and computed
by grouped GEMM, and the shared ones as one dense SwiGLU in two halves. docs/moe.md has the design.

Shapes: h hidden, f = f_e an expert's inner size, t = tp, E routed experts, E_l = E / ep of them on this rank.
Both are cut over tp as the dense SwiGLU is (gate|up by columns, down by rows) without its collectives: in (rows, h)
replicated over tp, out (rows, h) partial over tp (the MoE block reduces once for all its experts).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from p3d.parallel.experts.grouped import Groups, grouped_swiglu
from p3d.parallel.experts.params import mark_expert
from p3d.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear, mark_sharded, master_normal, on_meta
from p3d.parallel.tp.precision import compute_weight


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class SwiGLUExpert(nn.Module):
    """One SwiGLU (the shared experts: one of S f_e), ``w_gate_up`` column- and ``w_down`` row-parallel weights,
    in two halves that the dispatch runs while its all-to-alls travel (p3d.parallel.experts.dispatch)."""

    def __init__(self, h: int, f: int, mesh, prefix: str, std: float, out_std: float, seed: int, recompute: bool):
        super().__init__()
        self.recompute = recompute
        self.w_gate_up = ColumnParallelLinear(h, [f, f], mesh, [f"{prefix}.w_gate", f"{prefix}.w_up"], std, seed)
        self.w_down = RowParallelLinear(f, h, mesh, f"{prefix}.w_down", out_std, seed)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """x (rows, h) -> silu(gate) * up (rows, f/t)."""
        gate, up = self.w_gate_up.split_output(F.linear(x, compute_weight(self.w_gate_up.weight)))  # (rows, f/t) each
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(_swiglu, gate, up, use_reentrant=False)
        return _swiglu(gate, up)

    def project(self, a: torch.Tensor) -> torch.Tensor:
        return F.linear(a, compute_weight(self.w_down.weight))  # (rows, h), partial over tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.hidden(x))


class StackedWeight(nn.Module):
    """One projection of this rank's routed experts, stacked: ``weight`` (E_l r, c), expert j's (r, c) matrix in
    rows [j r, (j + 1) r) (:meth:`RoutedExperts.forward` views it (E_l, r, c)). ``shard_spec``: how the whole
    tensor of all E experts, (E r_full, c_full), is cut over tp (p3d.checkpoint.reshard): each expert's matrix as the
    dense layer's, ``experts`` E."""

    def __init__(self, weight: nn.Parameter, spec: dict):
        super().__init__()
        self.weight, self._spec = weight, spec

    def shard_spec(self) -> dict:
        return dict(self._spec)


def _stacked(shape: tuple[int, int], make, spec: dict) -> StackedWeight:
    weight = nn.Parameter(torch.empty(*shape) if on_meta() else make())
    return StackedWeight(mark_expert(mark_sharded(weight)), spec)


class RoutedExperts(nn.Module):
    """This rank's E_l routed experts, the global ones [first, first + E_l), each a SwiGLU of f_e, stacked:
    ``w_gate_up.weight`` (E_l 2f/t, h), each expert's [gate_r; up_r] rows as the dense column-parallel weight's, and
    ``w_down.weight`` (E_l h, f/t), each expert's row-parallel (h, f/t). Every expert is drawn from the master weight
    of its own key (``block<i>.mlp.experts.<j>.w_gate`` / ``w_up`` / ``w_down``) and sliced: every (tp, ep) layout
    starts from the same model. Computed by ``grouped_swiglu`` on rows grouped by local expert.

    Stored 2-D, experts leading in memory, rather than (E_l, r, c): under ZeRO-2/3 each weight is cut by FSDP2 along
    its first dimension over edp, so (E_l r) rows split evenly whatever E_l; a 3-D tensor would be cut by whole
    experts, leaving ranks with none when edp > E_l. A module with a forward of its own so that ZeRO-2/3 makes it an
    FSDP2 unit (over edp)."""

    def __init__(self, h: int, f: int, n_experts: int, mesh, prefix: str, std, out_std, seed: int, recompute: bool):
        super().__init__()
        self.local, self.h, self.recompute = n_experts // mesh.ep, h, recompute
        self.first = mesh.ep_rank * self.local
        tp, rank = mesh.tp, mesh.tp_rank
        mine = range(self.first, self.first + self.local)

        def gate_up() -> torch.Tensor:  # [gate_j r-th slice; up_j r-th slice] for each local expert j
            keys = [f"{prefix}.{j}.{part}" for j in mine for part in ("w_gate", "w_up")]
            return torch.cat([master_normal((f, h), std, key, seed).chunk(tp, dim=0)[rank] for key in keys])

        def down() -> torch.Tensor:
            blocks = [master_normal((h, f), out_std, f"{prefix}.{j}.w_down", seed).chunk(tp, dim=1)[rank] for j in mine]
            return torch.cat(blocks).contiguous()

        if f % tp:
            raise ValueError(f"expert_ffn_size {f} not divisible by tp={tp}")
        blocks = [f, f] * n_experts
        gate_up_spec = {"kind": "rows", "blocks": blocks, "padded": blocks, "experts": n_experts}
        self.w_gate_up = _stacked((self.local * 2 * f // tp, h), gate_up, gate_up_spec)
        self.w_down = _stacked((self.local * h, f // tp), down, {"kind": "cols", "experts": n_experts})

    def weights_of(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global expert ``j``'s (w_gate_up (2f/t, h), w_down (h, f/t)) on this rank (views of the stacked weights)."""
        if not self.first <= j < self.first + self.local:
            raise IndexError(f"expert {j} is not on this rank (it holds {self.first}..{self.first + self.local - 1})")
        i = j - self.first
        return (
            self.w_gate_up.weight.view(self.local, -1, self.h)[i],
            self.w_down.weight.view(self.local, self.h, -1)[i],
        )

    grouped_mm = None  # train.fp8=mxfp8: the grouped GEMMs in MXFP8 (p3d.parallel.experts.mxfp8)

    def forward(self, rows: torch.Tensor, groups: Groups) -> torch.Tensor:
        """rows (R, h) grouped by local expert as ``groups`` says -> (R, h), partial over tp."""
        # under bf16 autocast: the step's one bf16 copy of each stacked weight (p3d.parallel.tp.precision)
        w_gate_up = compute_weight(self.w_gate_up.weight).view(self.local, -1, self.h)  # (E_l, 2f/t, h)
        w_down = compute_weight(self.w_down.weight).view(self.local, self.h, -1)  # (E_l, h, f/t)
        return grouped_swiglu(rows, w_gate_up, w_down, groups, self.recompute, self.grouped_mm)
