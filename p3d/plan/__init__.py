"""The analytic planner behind ``p3d-plan``: memory per GPU and step time of a config, no GPU needed.

    from p3d.plan import plan, best_layout
    report = plan(cfg)            # cfg: p3d.config.schema.Config after validate.fill_derived
    report.fits, report.to_json(), report.render()
    best_layout(cfg)              # mesh=auto: Layout(tp, pp, dp, micro_batch_size, ..., pipeline, recompute, zero)

Modules, each importing only those before it: shapes (layout, parameters per rank; the model's
closed forms are p3d.model.geometry's), memory (model states, activations), step_time (compute,
communication, bubble), render (text), report (PlanReport, evaluate), search (mesh=auto, plan), cli.
Formulas and sources: docs/planner.md. Nothing here imports torch or deepspeed.
"""

from p3d.plan.report import PlanReport, apply_layout, evaluate
from p3d.plan.search import best_layout, plan, search
from p3d.plan.shapes import Layout

__all__ = ["Layout", "PlanReport", "apply_layout", "best_layout", "evaluate", "plan", "search"]
