"""The rules of a mixture of experts (``model.moe``) and expert parallelism (``mesh.ep``): docs/moe.md.

Each raises :class:`P3DConfigError` with one line: field, value, fix. ``build_plan`` runs ``check_experts``; the
planner runs ``check_expert_degree`` too (it cannot place experts otherwise).
"""

from __future__ import annotations

from p3d.config.errors import P3DConfigError
from p3d.config.schema import Config
from p3d.layout.dims import largest_divisor_at_most


def check_expert_degree(cfg: Config, dp: int) -> None:
    """``mesh.ep`` places each MoE layer's experts: E / ep on each of ep dp ranks (p3d.layout.dims), so it divides
    the dp degree and ``model.moe.n_experts``. The planner calls this too: it cannot place experts otherwise."""
    ep, moe = cfg.mesh.ep, cfg.model.moe
    if moe is None or ep == 1:
        return
    if dp % ep:
        raise P3DConfigError(
            f"mesh.ep={ep} must divide the dp degree {dp} (experts are split over ep ranks carved from dp); "
            f"try mesh.ep={largest_divisor_at_most(dp, ep, moe.n_experts)}"
        )
    if moe.n_experts % ep:
        raise P3DConfigError(
            f"mesh.ep={ep} must divide model.moe.n_experts={moe.n_experts} (each ep rank holds n_experts / ep "
            f"of them); try mesh.ep={largest_divisor_at_most(moe.n_experts, ep, dp)}"
        )


def _groups_fix(moe, g: int) -> str:
    """The overrides that make ``n_groups=g`` (or the largest valid count below it) a valid grouping: topk_groups
    lowered to fit, or raised until the kept groups hold top_k experts."""
    e, k = moe.n_experts, moe.top_k
    g = max(d for d in range(1, g + 1) if e % d == 0 and (d == 1 or e // d >= 2))
    kept = max(min(moe.topk_groups, g), -(-k // (e // g)))
    return f"model.moe.n_groups={g}" + (f" model.moe.topk_groups={kept}" if kept != moe.topk_groups else "")


def check_groups(moe) -> None:
    """Group-limited routing (``model.moe.n_groups``, ``topk_groups``; p3d.model.moe.Router): the experts in
    n_groups equal groups, each scored by its 2 best scores, a token's top_k chosen within its topk_groups best."""
    g, kept, e, k = moe.n_groups, moe.topk_groups, moe.n_experts, moe.top_k
    if e % g:
        raise P3DConfigError(
            f"model.moe.n_groups={g} must divide model.moe.n_experts={e} (the experts form equal groups); "
            f"try {_groups_fix(moe, g)}"
        )
    if g > 1 and e // g < 2:
        raise P3DConfigError(
            f"model.moe.n_groups={g} leaves 1 expert per group of model.moe.n_experts={e}: a group is scored by the "
            f"sum of its 2 best experts' scores; try {_groups_fix(moe, g - 1)}"
        )
    if kept > g:
        raise P3DConfigError(
            f"model.moe.topk_groups={kept} exceeds model.moe.n_groups={g} (a token's experts come from its "
            f"topk_groups best groups); try model.moe.topk_groups={g}"
        )
    if k > kept * (e // g):
        raise P3DConfigError(
            f"model.moe.top_k={k} exceeds the {kept * (e // g)} experts of model.moe.topk_groups={kept} groups of "
            f"{e // g} (model.moe.n_groups={g}); try model.moe.topk_groups={-(-k // (e // g))}, or "
            f"model.moe.top_k={kept * (e // g)}"
        )


def check_experts(cfg: Config, dp: int) -> None:
    """A mixture of experts (``model.moe``) and expert parallelism (``mesh.ep``): what p3d cannot build or run."""
    ep, moe, m = cfg.mesh.ep, cfg.model.moe, cfg.model
    if moe is None:
        if ep > 1:
            raise P3DConfigError(
                f"mesh.ep={ep} needs a mixture-of-experts model (model={m.name} has model.moe=null: no experts to "
                "split); try mesh.ep=1, or model=moe_tiny"
            )
        return
    if moe.top_k > moe.n_experts:
        raise P3DConfigError(
            f"model.moe.top_k={moe.top_k} exceeds model.moe.n_experts={moe.n_experts} (a token's k experts are "
            f"distinct); try model.moe.top_k={moe.n_experts}"
        )
    check_groups(moe)
    if moe.first_dense_layers >= m.n_layers:
        raise P3DConfigError(
            f"model.moe.first_dense_layers={moe.first_dense_layers} leaves no MoE block of model.n_layers="
            f"{m.n_layers}; try model.moe.first_dense_layers={m.n_layers - 1}, or model.moe=null for a dense model"
        )
    f_e, tp = moe.expert_ffn_size or m.ffn_hidden_size, cfg.mesh.tp  # null: ffn_hidden_size, check_mesh's rule
    if f_e % tp:
        ok = largest_divisor_at_most(f_e, tp, m.n_heads, m.n_kv_heads)
        raise P3DConfigError(
            f"mesh.tp={tp} must divide model.moe.expert_ffn_size={f_e} (each expert is cut over tp as the dense "
            f"SwiGLU); try mesh.tp={ok}"
        )
    if ep > 1 and cfg.zero.shard_size is not None:
        raise P3DConfigError(
            f"zero.shard_size={cfg.zero.shard_size} with mesh.ep={ep}: HSDP's shard groups and the expert groups "
            "would both cut dp, which p3d does not combine; try zero.shard_size=null, or mesh.ep=1"
        )
    check_expert_degree(cfg, dp)
