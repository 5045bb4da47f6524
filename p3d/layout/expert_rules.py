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
