"""The routed experts' SwiGLU over rows grouped by expert: a fixed number of kernels whatever the number of experts,
and no host sync.

Shapes: R rows sorted by local expert (G = E_l groups, ``Groups.sizes`` rows each; under a capacity the rows
dropped from every expert may follow the last group, a tail whose outputs are zero), h hidden, f = f_e / tp an
expert's inner width on this tp rank; the weights stacked with the experts leading: w_gate_up (G, 2f, h), each
expert's [gate; up] rows as the dense SwiGLU's column-parallel weight, and w_down (G, h, f), its row-parallel one.

Two paths, the same math (``grouped_swiglu`` picks one):
- grouped, ``torch._grouped_mm`` (p3d.compat.grouped_mm): rows (R, h) -> (R, 2f) -> silu(gate) up (R, f) -> (R, h),
  each group of rows by its expert's matrices. Two GEMMs forward, four backward. Taken where the op waits for
  nothing: on CPU in any dtype (the tests' path, fp32 included), on CUDA in bf16 on sm90 / sm100 (one kernel each).
- padded, ``torch.bmm``: the rows scattered into a (G, cap, h) block, group g's in row g, zero-padded to
  cap = ``Groups.bound`` rows (a bound known on the host without asking the device); two bmm, the outputs gathered
  back. Exact: a padded row's output is never read and its zero input adds exact zeros to the weight gradients. Its
  price is G cap rows of work for R: at ep = 1 cap is the micro batch's tokens N (a token picks an expert at most
  once), so G / k times the routed rows (64 experts, top-6: 10.7x). Taken for fp32 and fp16 on CUDA, where
  ``_grouped_mm`` copies the group ends to the host and loops over the groups, and wherever a width misses the
  op's 16-byte stride rule. Training on a GPU runs bf16 on the grouped path; the padded one keeps fp32 runs (a
  debugging run, a parity check on a GPU) free of syncs.
Under autocast both compute in the autocast dtype (the op is not on autocast's list: the cast is done here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from p3d.compat.grouped_mm import grouped_mm, grouped_mm_fits, grouped_mm_without_sync


@dataclass
class Groups:
    """How R rows are grouped by local expert: ``sizes`` (G,) int64 on the rows' device, rows [sum(sizes[:g]),
    sum(sizes[:g+1])) for expert g; ``bound`` a host int no group exceeds; ``tail``: rows may follow the last group
    (a capacity's dropped pairs), their outputs zero and their gradients too."""

    sizes: torch.Tensor
    bound: int
    tail: bool = False

    def ends(self) -> torch.Tensor:
        """(G,) int32: where each group's rows end (``torch._grouped_mm``'s offsets)."""
        return torch.cumsum(self.sizes, 0).to(torch.int32)

    def slots(self, n_rows: int) -> torch.Tensor:
        """(R,): each row's place in the padded (G bound + 1, h) layout, group g's rows at [g bound, g bound +
        sizes[g]); the tail's rows all at the last place (G bound), a spare row no output reads."""
        sizes = self.sizes
        n_groups, device = sizes.numel(), sizes.device
        ends = torch.cumsum(sizes, 0)
        row = torch.arange(n_rows, device=device)
        group = torch.searchsorted(ends, row, right=True)  # G for the tail
        inside = group < n_groups
        first = (ends - sizes).index_select(0, group.clamp(max=n_groups - 1))
        return torch.where(inside, group * self.bound + row - first, n_groups * self.bound)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _activation(hidden: torch.Tensor, recompute: bool) -> torch.Tensor:
    """silu(gate) * up of (..., 2f) [gate | up] -> (..., f); ``recompute``: keep only gate and up for backward."""
    gate, up = hidden.chunk(2, dim=-1)
    if recompute and torch.is_grad_enabled():
        return checkpoint(_swiglu, gate, up, use_reentrant=False)
    return _swiglu(gate, up)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts compute in: autocast's where it is on (bf16 over fp32 weights), else the rows'."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def grouped_swiglu(
    rows: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    groups: Groups,
    recompute: bool = False,
    low_precision_mm=None,
) -> torch.Tensor:
    """rows (R, h) grouped as ``groups`` says -> (R, h): each row through its expert's SwiGLU (module doc), partial
    over tp like the dense SwiGLU's row-parallel output. ``low_precision_mm``: ``grouped_mm``'s twin in MXFP8
    (p3d.parallel.experts.mxfp8), taken when no rows follow the last group."""
    dtype = compute_dtype(rows)
    x, w1, w2 = rows.to(dtype), w_gate_up.to(dtype), w_down.to(dtype)
    n_groups, two_f, h = w1.shape
    if low_precision_mm is not None and not groups.tail:
        return _grouped(x, w1, w2, groups, recompute, low_precision_mm)
    if grouped_mm_without_sync(x.device, dtype) and grouped_mm_fits(dtype, h, two_f, two_f // 2):
        return _grouped(x, w1, w2, groups, recompute)
    return _padded(x, w1, w2, groups, recompute)


def _grouped(x, w1, w2, groups: Groups, recompute: bool, mm=grouped_mm) -> torch.Tensor:
    ends = groups.ends()
    live = None
    if groups.tail:  # rows after the last group are never computed: zero them going in and coming out
        live = (torch.arange(x.shape[0], device=x.device) < ends[-1]).unsqueeze(1)  # (R, 1)
        x = torch.where(live, x, 0)
    hidden = mm(x, w1.transpose(1, 2), ends)  # (R, 2f)
    out = mm(_activation(hidden, recompute), w2.transpose(1, 2), ends)  # (R, h)
    return out if live is None else torch.where(live, out, 0)


def _padded(x, w1, w2, groups: Groups, recompute: bool) -> torch.Tensor:
    n_groups, _, h = w1.shape
    cap = groups.bound
    slots = groups.slots(x.shape[0])
    block = torch.index_copy(x.new_zeros(n_groups * cap + 1, h), 0, slots, x)  # the last row: the tail's spare
    hidden = torch.bmm(block[:-1].view(n_groups, cap, h), w1.transpose(1, 2))  # (G, cap, 2f)
    out = torch.bmm(_activation(hidden, recompute), w2.transpose(1, 2)).view(n_groups * cap, h)
    return torch.cat([out, out.new_zeros(1, h)]).index_select(0, slots)  # (R, h), the tail's rows zero
