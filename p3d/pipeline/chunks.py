"""One chunk of the flat pipeline for the torch schedules: layers [lo, hi) of ``build_layer_specs``'s list.

The torch schedules (p3d.train.executors.torch_pipeline) cut the same list of DeepSpeed ``LayerSpec``s that DeepSpeed's
engine runs into p * v chunks (``geometry.stage_bounds(n_layers, p * v, ...)``); chunk c is torch's
``PipelineStage`` c. A chunk registers its parameters under exactly the names DeepSpeed's ``PipelineModule``
gives them (deepspeed/runtime/pipe/module.py, ``_build``): layer i as ``str(i)`` (its index in the whole list),
a ``TiedLayerSpec`` under ``tied_modules.<key>``. So checkpoints, ``hf.load_into`` and ``p3d-export`` see
the same global names whichever executor built the model (tests/workers/test_chunk_names.py).

Between chunks flows what flows between DeepSpeed stages: token ids (b, s) into the first, hidden states
(b, s, h) (with sequence parallelism (b, s/tp, h)) between chunks, local logits (b, s, V_pad/tp) out of the
last.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch.utils.checkpoint import checkpoint

from p3d.model.llama import TransformerBlock


class ChunkModule(nn.Module):
    """Layers ``specs[lo:hi]``, chained as DeepSpeed's ``PipelineModule.forward`` chains its stage.

    ``tied``: key -> module, shared by the chunks of one rank. A tied spec is built once per rank: under V
    placement (zbv, dualpipev) the first and last chunk are on one rank and share one module (one parameter,
    gradients summed by autograd); under loop placement each end is on its own rank and holds its own copy
    (the caller sums their gradients, as DeepSpeed does for its tied copies).
    ``recompute``: full recompute, every ``TransformerBlock`` through non-reentrant
    ``torch.utils.checkpoint`` (its activations are recomputed in backward; DeepSpeed's engine does the same
    with ``activation_checkpoint_interval=1``).
    ``autocast_dtype``: run the forward under ``torch.autocast`` in this dtype (parameters stay as built).
    """

    def __init__(
        self,
        specs: list[LayerSpec],
        lo: int,
        hi: int,
        tied: dict[str, nn.Module] | None = None,
        recompute: bool = False,
        autocast_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if not 0 <= lo < hi <= len(specs):
            raise ValueError(f"chunk [{lo}, {hi}) outside the {len(specs)} layers of the pipeline")
        self.lo, self.hi = lo, hi
        self.recompute, self.autocast_dtype = recompute, autocast_dtype
        tied = {} if tied is None else tied
        self.tied_modules = nn.ModuleDict()
        self._funcs: list[Callable[[torch.Tensor], torch.Tensor]] = []
        self._checkpointed: list[bool] = []
        for index in range(lo, hi):
            spec = specs[index]
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in tied:
                    tied[spec.key] = spec.build()
                module = tied[spec.key]
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = module
                self._funcs.append(partial(spec.forward_fn, module) if spec.forward_fn else module)
            else:
                module = spec.build()
                self.add_module(str(index), module)
                self._funcs.append(module)
            self._checkpointed.append(recompute and isinstance(module, TransformerBlock))

    @property
    def layer_indices(self) -> range:
        """The indices of this chunk's layers in the flat list (``geometry.layer_names``)."""
        return range(self.lo, self.hi)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        for f, ckpt in zip(self._funcs, self._checkpointed):
            x = checkpoint(f, x, use_reentrant=False) if ckpt and torch.is_grad_enabled() else f(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.autocast_dtype is None:
            return self._run(x)
        with torch.autocast(x.device.type, dtype=self.autocast_dtype):
            return self._run(x)
