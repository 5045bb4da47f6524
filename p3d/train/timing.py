"""Measured pipeline bubble: the share of a step a stage spends blocked on its pipeline neighbours.

DeepSpeed's pipeline engine runs a step as a list of instructions (load, forward, backward,
send/recv of activations and gradients, reduce, optimizer step). We time the send/recv ones on this
rank: in 1F1B they are where a stage waits for the stage before or after it (the transfer itself is
small next to the wait). The theoretical idle share for p stages and m micro batches is
``p3d.model.geometry.pipeline_bubble``, (p - 1) / (m + p - 1).
"""

from __future__ import annotations

import time
from types import FunctionType

from p3d.ds_compat import pipeline_instruction_map, set_pipeline_instruction_map

PIPE_WAITS = ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad")


class StageTimer:
    def __init__(self, engine):
        self.wait_s = 0.0
        timed = {}
        for instr, fn in pipeline_instruction_map(engine).items():
            timed[instr] = self._wrap(fn) if instr.__name__ in PIPE_WAITS else fn
        set_pipeline_instruction_map(engine, timed)  # this engine instance only

    def _wrap(self, fn: FunctionType):
        def timed(engine, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(engine, *args, **kwargs)
            finally:
                self.wait_s += time.perf_counter() - t0

        return timed

    def take(self) -> float:
        """Seconds blocked on pipeline neighbours since the last call."""
        wait, self.wait_s = self.wait_s, 0.0
        return wait
