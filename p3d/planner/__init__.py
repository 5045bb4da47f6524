"""The analytic planner behind ``p3d-plan``, ``mesh=auto`` and p3d-train's pre-flight memory check: memory per GPU
and step time of a config, no GPU needed.

    from p3d.planner import predict, best_layout
    prediction = predict(cfg)            # cfg: a typed, checked Config (p3d.launch.check.typed_config)
    prediction = predict(cfg, run_plan)  # the run p3d-train accepted: its run plan's layout, not derived again
    prediction.fits, prediction.to_json(), prediction.render()
    best_layout(cfg)                     # mesh=auto: Layout(tp, pp, dp, micro_batch_size, ..., pipeline, ...)

Modules, each importing only those before it: shapes (layout, parameters per rank; the model's
closed forms are p3d.layout.geometry's), experts (what a mixture of experts adds: its activations, the
all-to-all's rows), context (what context parallelism adds: s / cp tokens per rank, the key/value collectives),
memory (model states, activations), gemms (a block's matmuls and each one's time from its shape), machine (the
rates: the device table or a calibration), step_time (compute, communication, bubble), verdict (warnings and
notes), hetero (a cluster of groups: the split of the blocks and micro batches over them), render (text), predict
(Prediction, evaluate), hetero_search (mesh=auto on a cluster of groups: the split of every layout), search
(mesh=auto, predict).
Formulas and sources: docs/planner.md. Nothing here imports torch or deepspeed.
"""

from p3d.planner.predict import Prediction, apply_layout, evaluate
from p3d.planner.search import best_layout, predict, search
from p3d.planner.shapes import Layout

__all__ = ["Layout", "Prediction", "apply_layout", "best_layout", "evaluate", "predict", "search"]
