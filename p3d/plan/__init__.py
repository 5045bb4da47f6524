"""The analytic planner behind ``p3d-plan``: memory per GPU and step time of a config, no GPU needed.

    from p3d.plan import plan, best_layout
    report = plan(cfg)            # cfg: p3d.config.schema.Config after validate.fill_cluster
    report.fits, report.to_json(), report.render()
    best_layout(cfg)              # mesh=auto: Layout(tp, pp, dp, micro_batch_size, ...)

Modules: shapes (layout, exact parameter counts, FLOPs), memory (model states, activations),
time (compute, communication, bubble), search (mesh=auto), report / render (output), cli.
Formulas and sources: docs/planner.md. Nothing here imports torch or deepspeed.
"""
from p3d.plan.report import PlanReport, apply_layout, evaluate, plan
from p3d.plan.search import best_layout, search
from p3d.plan.shapes import Layout

__all__ = ["Layout", "PlanReport", "apply_layout", "best_layout", "evaluate", "plan", "search"]
