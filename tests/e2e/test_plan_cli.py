"""p3d-plan as a user runs it: same overrides as p3d-train, text or JSON, exit 2 on a bad config."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.runs import ROOT, p3d_plan

FIELDS = {
    "fits": bool,
    "memory_gb": dict,
    "step_time_s": float,
    "tokens_per_s": float,
    "tflops_per_gpu": float,
    "hfu_tflops_per_gpu": float,
    "mfu": float,
    "hfu": float,
    "bubble": float,
    "warnings": list,
}


def test_json_has_the_issue_fields(tmp_path):
    out = p3d_plan(
        "mesh=tp8_pp8",
        "model=llama70b",
        "cluster.device=h100_sxm",
        "cluster.nodes=8",
        "cluster.launcher=slurm",
        "schedule=large",
        "train.dtype=bf16",
        "zero=stage1",
        "format=json",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    for name, kind in FIELDS.items():
        assert isinstance(report[name], kind), name
    assert set(report["memory_gb"]) >= {"params", "grads", "optimizer", "activations", "total"}
    assert report["fits"] and report["warnings"] == []
    assert len(report["stages"]) == 8
    assert list(tmp_path.iterdir()) == []  # wrote nothing (no Hydra output directory)


def test_text_report_names_stages_and_verdict():
    out = p3d_plan()  # the default config: tiny on dp2_pp2_tp2, cpu
    assert out.returncode == 0, out.stderr
    assert "memory per GPU" in out.stdout and "fits" in out.stdout and "stage" in out.stdout
    assert "tokens/s" in out.stdout


@pytest.mark.parametrize(
    "override,needle",
    [
        ("format=yaml", "format=yaml (command line) must be one of text, json; try format=text"),
        ("cluster.device=tpu_v5", "cluster.device=tpu_v5 (command line) must be one of a100_40gb, a100_80gb, h100_sxm"),
    ],
)
def test_a_closed_choice_fails_at_compose_in_one_line_listing_its_values(override, needle):
    out = p3d_plan(override)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and needle in lines[0] and out.stdout == "", out.stderr


@pytest.mark.parametrize("override,needle", [("mesh.dp=0", "mesh.dp=0")])
def test_bad_config_exits_2_with_one_line(override, needle):
    out = p3d_plan(override)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("p3d: config error:") and needle in lines[0], out.stderr
    assert out.stdout == ""


def test_unknown_group_option_exits_2():
    assert p3d_plan("model=no_such_model").returncode == 2


def test_refused_layout_is_planned_with_a_warning():
    # FSDP2 cannot shard the V placement's shared tied table for two chunks
    out = p3d_plan("mesh=pp2", "zero.stage=3", "schedule.pipeline=zbv", "model.tie_embeddings=true", "format=json")
    assert out.returncode == 0, out.stderr
    assert any("p3d-train would refuse" in w for w in json.loads(out.stdout)["warnings"])


def test_mesh_auto_prints_a_ranking():
    out = p3d_plan(
        "mesh=auto",
        "model=llama70b",
        "cluster.device=h100_sxm",
        "cluster.nodes=8",
        "cluster.launcher=slurm",
        "schedule=large",
        "train.dtype=bf16",
        "zero=stage1",
        "format=json",
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    ranking = report["ranking"]
    assert len(ranking) == 5 and all(r["fits"] for r in ranking)
    assert [r["tokens_per_s"] for r in ranking] == sorted((r["tokens_per_s"] for r in ranking), reverse=True)
    assert report["layout"]["tp"] * report["layout"]["pp"] * report["layout"]["dp"] == 64


def test_fast_and_without_torch():
    code = "\n".join(
        [
            "import sys, time",
            "t = time.perf_counter()",
            "sys.argv = ['p3d-plan', 'model=llama70b', 'mesh=tp8_pp8', 'format=json']",
            "from p3d.cli.plan import main",
            "try:",
            "    main()",
            "except SystemExit as e:",
            "    assert not e.code",
            "print('HEAVY', sorted(m for m in ('torch', 'deepspeed') if m in sys.modules), time.perf_counter() - t)",
        ]
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY [] " in out.stdout  # planning imports neither torch nor deepspeed: about a second
