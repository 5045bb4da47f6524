"""A sweep point as p3d-train writes it (run_spec.yaml, metrics.jsonl, p3d_status.json), for the report tests."""

from __future__ import annotations

import json

from omegaconf import OmegaConf


def make_point(
    root,
    name,
    *,
    tp=1,
    pp=2,
    dp=1,
    steps=3,
    done_steps=3,
    tokens=(100.0, 2000.0, 3000.0),
    bubble=None,
    status=None,
    mesh="pp2",
    cp=1,
    ep=1,
    zero=0,
    pipeline="1f1b",
    v=1,
    recompute="none",
    overrides=None,
):
    """A point's directory; ``overrides`` (a list of strings): its .hydra/overrides.yaml, as a sweep writes it."""
    d = root / name
    d.mkdir(parents=True)
    spec = {
        "mesh": {"name": mesh, "tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep},
        "schedule": {"pipeline": pipeline, "virtual_stages": v, "recompute": recompute},
        "zero": {"stage": zero},
        "train": {"steps": steps},
        "run_plan": {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep, "world_size": tp * pp * dp * cp},
    }
    (d / "run_spec.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(spec)))
    if overrides is not None:
        (d / ".hydra").mkdir()
        (d / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
    lines = []
    for step in range(1, done_steps + 1):
        rec = {
            "step": step,
            "loss": 7.0 - step,
            "tokens_per_s": tokens[step - 1],
            "mfu": tokens[step - 1] / 1e5,
            "peak_mem_gb": 0.1 * step,
        }
        if bubble is not None:
            rec["bubble"] = bubble
        lines.append(json.dumps(rec))
    if lines:
        (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if status:
        (d / "p3d_status.json").write_text(json.dumps(status))
    return d
