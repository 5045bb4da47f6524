"""Float8 matmuls of the tensor-parallel layers (``train.fp8``, torchao; docs/precision.md).

torchao's ``Float8Linear`` swaps ``nn.Linear``; p3d's column and row layers are its own, so each computes its shard
with the pieces ``Float8Linear`` is made of (p3d.compat.torchao_internals): ``y = x W^T`` with x and W cast to float8
as the recipe says, and in backward ``dx = dy W`` and ``dW = dy^T x`` with the recipe's casts of dy, W and x. At tp = 1
it is bitwise torchao's (tests/unit/parallel/test_float8.py). Shapes: x (M, K), w_t = W^T (K, N), dy (M, N); a cast
scales its operand by one amax (tensorwise) or one per row or column (axiswise: rowwise recipes).

Tensor parallelism: a split operand's amax must be the unsplit operand's, or each shard scales differently and the
tp ranks' partial products no longer add up to the unsplit layer's (per-shard scales differ by 2-4%; torchtitan
issue 3109's NaN losses). Where a cast's amax runs over a split dimension it is max-reduced over tp
(``max_over_tp``); an axiswise amax along a dimension that is not split is already whole:

    column (W_r = rows of W):  w_t split along N, dy along N   -> tensorwise w and dy, dy's per-row amax (axis -1)
    row (W_r = columns of W):  x split along K, w_t along K    -> tensorwise x and w, x's per-row amax, w_t's per
                                                                   column amax (axis 0)
    SP, tensorwise:            x's (b, s/tp, K) blocks         -> the whole sequence's amax, the blocks cast and
                                                                   all-gathered in float8 (``_GatherFloat8FromSP``)

Casts per step (``Float8Matmul.counts``): the weight is cast from the fp32 master once a step per cast the recipe
makes of it (tensorwise: one, shared by forward and the input gradient; rowwise: two, per row and per column) and
shared by every micro batch in flight, as bf16's ``compute_weight``; ``drop_weight_casts`` forgets them with the
bf16 copies. Inputs and gradients are cast once per micro batch per cast (the weight-gradient casts equal to the
forward's reuse them). The input is cast to the autocast dtype first: torchao follows CUDA autocast only.
"""

from __future__ import annotations

from collections import Counter

import torch

from p3d.compat import torchao_internals as ao
from p3d.layout.float8_rules import FLOAT8_MULTIPLE
from p3d.parallel.tp.mappings import _gather_seq, _reduce_scatter_seq, _size, copy_to_tp, gather_from_sp, max_over_tp
from p3d.parallel.tp.precision import autocast_dtype

# which 2-D axis of each operand a layer's tp split cuts: (input (M, K), w_t (K, N), grad_output (M, N))
COLUMN = {"input": None, "weight": 1, "grad_output": 1}
ROW = {"input": 1, "weight": 0, "grad_output": None}
OPERAND = {
    "input": "input",
    "input_for_grad_weight": "input",
    "weight": "weight",
    "weight_for_grad_input": "weight",
    "grad_output": "grad_output",
    "grad_output_for_grad_weight": "grad_output",
}


class Float8Matmul:
    """One linear's float8 matmul: the recipe's casts (``ao.recipe_casts``), its GEMM settings, its tp ``group``,
    the step's weight casts and the casts counted by name. ``reduce_amax`` False: per-shard scales (what
    tests/workers/test_float8_tp.py shows to be wrong)."""

    def __init__(self, recipe: str, emulate: bool, group, reduce_amax: bool = True):
        config = ao.float8_config(recipe, emulate)
        self.recipe, self.group, self.reduce_amax = recipe, group, reduce_amax
        self.casts, self.mm_config = ao.recipe_casts(config), ao.linear_mm_config(config)
        self.counts: Counter[str] = Counter()
        self._weights: dict[str, tuple[int, int, torch.Tensor]] = {}  # name -> (id, version, float8 w_t)

    def drop(self) -> None:
        """Forget the step's weight casts (``drop_weight_casts``, as a step starts and ends)."""
        self._weights.clear()

    def cast(self, t: torch.Tensor, name: str, split: dict) -> torch.Tensor:
        """The 2-D operand ``t`` cast as the recipe's cast ``name`` says (a float8 tensor passes, DISABLED keeps it),
        its amax max-reduced over tp where the cast's amax spans the split axis (``split``: COLUMN or ROW)."""
        c = self.casts[name]
        if c.dtype is None or ao.is_float8(t):
            return t
        amax = ao.amax(t, c)
        cut = split[OPERAND[name]]
        if self.reduce_amax and cut is not None and (c.axis is None or c.axis % 2 == cut):
            amax = max_over_tp(amax, self.group)
        self.counts[name] += 1
        return ao.to_float8(t, amax, c, self.mm_config)

    def weight_t(self, weight: torch.Tensor, name: str, split: dict) -> torch.Tensor:
        """W^T (K, N) cast as ``name`` says, once a step (the cache is keyed by the tensor and its version); a cast
        equal to another's reuses it (tensorwise: forward and input gradient share one)."""
        if ao.is_float8(weight):  # already float8 (gathered so by ZeRO-3)
            return weight.t()
        same = next((n for n in ("weight", "weight_for_grad_input") if self.casts[n] == self.casts[name]), name)
        key = (id(weight), weight._version)
        hit = self._weights.get(same)
        if hit is None or hit[:2] != key:
            hit = (*key, self.cast(weight.detach().t(), same, split))
            self._weights[same] = hit
        return hit[2]

    def column(self, x: torch.Tensor, weight: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
        """A column-parallel layer's y_r = x W_r^T: x (b, s, K) replicated, or with ``sequence_parallel`` this rank's
        (b, s/tp, K) block; out (b, s, N/tp)."""
        x = _in_autocast_dtype(x)
        if sequence_parallel and _size(self.group) > 1:
            if self.casts["input"].axis is None and self.casts["input"].dtype is not None:  # gathered in float8
                x = _GatherFloat8FromSP.apply(x, self)
            else:  # rowwise: each token's scale is its own, the block gathered in high precision
                x = gather_from_sp(x, self.group)
        else:
            x = copy_to_tp(x, self.group)
        return _linear(x, weight, self, COLUMN)

    def row(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's partial sum x_r W_r^T: x (b, s, K/tp) -> (b, s, N), partial over tp."""
        return _linear(_in_autocast_dtype(x), weight, self, ROW)


def _in_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    dtype = autocast_dtype(x.device.type)
    return x if dtype is None or ao.is_float8(x) else x.to(dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor, mm: Float8Matmul, split: dict) -> torch.Tensor:
    """(..., K) -> (..., N): the 2-D GEMM's output reshaped outside the Function (a view made inside one could not
    be reduced in place by ``reduce_from_tp``)."""
    y = _Float8Linear.apply(x.reshape(-1, x.shape[-1]), weight, mm, split)  # (M, N)
    return y.view(*x.shape[:-1], y.shape[-1])


class _Float8Linear(torch.autograd.Function):
    """forward: y = x W^T, x (M, K) and W^T cast as the recipe says; backward: dx = dy W and dW = dy^T x with the
    recipe's casts of dy, W and x (torchao's ``matmul_with_hp_or_float8_args``, with tp-reduced amaxes). Outside
    autocast: the operands carry their dtypes (the GEMM's result is in the input's)."""

    @staticmethod
    def forward(ctx, x2, weight, mm: Float8Matmul, split: dict):
        ctx.mm, ctx.split = mm, split
        with torch.autocast(x2.device.type, enabled=False):
            xq = mm.cast(x2, "input", split)
            y = torch.mm(xq, mm.weight_t(weight, "weight", split))  # (M, N)
        # the weight gradient's x: the forward's cast when the recipe's is the same (tensorwise), else x itself
        same = mm.casts["input_for_grad_weight"] == mm.casts["input"]
        ctx.save_for_backward(xq if same else x2, weight)
        return y

    @staticmethod
    def backward(ctx, dy2):
        x2, weight = ctx.saved_tensors
        mm, split = ctx.mm, ctx.split
        with torch.autocast(dy2.device.type, enabled=False):
            dyq = mm.cast(dy2, "grad_output", split)
            dx = torch.mm(dyq, mm.weight_t(weight, "weight_for_grad_input", split).t())  # (M, K)
            same = mm.casts["grad_output_for_grad_weight"] == mm.casts["grad_output"]
            dyq_w = dyq if same else mm.cast(dy2, "grad_output_for_grad_weight", split)
            xq_w = mm.cast(x2, "input_for_grad_weight", split)
            dw = torch.mm(dyq_w.t(), xq_w)  # (N, K)
        return dx, dw.to(weight.dtype), None, None


class _GatherFloat8FromSP(torch.autograd.Function):
    """forward: this rank's (b, s/tp, K) block cast to float8 with the whole sequence's amax (max over tp), the float8
    payload all-gathered as uint8 (gloo has no float8 types; half bf16's bytes) into one (b, s, K) float8 tensor;
    backward: the gradient reduce-scattered along the sequence, as ``gather_from_sp``."""

    @staticmethod
    def forward(ctx, x, mm: Float8Matmul):
        ctx.group = mm.group
        c = mm.casts["input"]
        amax = ao.amax(x, c)
        if mm.reduce_amax:
            amax = max_over_tp(amax, mm.group)
        mm.counts["input"] += 1
        block = ao.to_float8(x, amax, c, mm.mm_config)
        data, scale = ao.payload(block)
        gathered = _gather_seq(data.view(torch.uint8), mm.group).view(data.dtype)  # (b, s, K)
        return ao.from_payload(gathered, scale, x.dtype, mm.mm_config, c.role)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


def float8_linears(module: torch.nn.Module) -> list[tuple[str, Float8Matmul]]:
    """(name, matmul) of every layer of ``module`` that computes in float8."""
    return [(n, m.float8) for n, m in module.named_modules() if getattr(m, "float8", None) is not None]


def cast_counts(module: torch.nn.Module) -> dict[str, Counter[str]]:
    """Each float8 layer's casts so far, by the recipe's cast name."""
    return {name: Counter(mm.counts) for name, mm in float8_linears(module)}


def convert_to_float8(module: torch.nn.Module, recipe: str, emulate: bool, skip: tuple[type, ...] = ()) -> list[str]:
    """Give every column- and row-parallel layer of ``module`` a float8 matmul for ``recipe`` (tensorwise, rowwise,
    rowwise_with_gw_hp), except those under a module of a ``skip`` type (the head, the shared experts) and those
    with a local dimension that is not a multiple of 16 (torch._scaled_mm's rule; they stay bf16). Returns what
    stays bf16, one phrase per layer ("block3.mlp.w_down: in 24")."""
    from p3d.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear

    kept: list[str] = []
    skipped = [n for n, m in module.named_modules() if skip and isinstance(m, skip)]
    for name, m in module.named_modules():
        if not isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            continue
        if any(name == s or name.startswith(s + ".") for s in skipped):
            continue
        out_rows, in_cols = m.weight.shape
        odd = [f"{what} {n}" for what, n in (("out", out_rows), ("in", in_cols)) if n % FLOAT8_MULTIPLE]
        if odd:
            kept.append(f"{name}: {', '.join(odd)}")
            continue
        m.float8 = Float8Matmul(recipe, emulate, m.group)  # type: ignore[assignment]  # None by default
    return kept
