"""The command lines README.md, the docs/ pages and the recipe headers show, and how each one is run by the tests.

A documented line is a line of a code block of README.md or of a docs/*.md page (indented four spaces)
that starts with a command, or a ``#   `` line of a recipe header that does. Every one must have an entry
in ``CASES`` (a test fails otherwise), so that a line added to the docs cannot go untested. ``run`` lines
are typed as written, in a fresh working directory, with the few overrides that keep them small here
appended; ``refused`` lines need what this machine lacks and must fail with the one-line error that says
so; ``dry`` lines need GPU nodes and are checked by the dry run of the same config; ``not_here`` lines say
why not. The examples indented inside a bullet of a page (a feature's own walk-through, more than four
spaces) and transcripts shown with a ``$ `` prompt are not collected here; the feature's tests run them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE_COMMAND = re.compile(r"^    ((?:p3d-|make |sbatch |\.venv/bin/|NPROC=)\S*.*)$")
PAGES = ("README.md", *sorted(f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md")))
DOCS = {
    **dict.fromkeys(PAGES, PAGE_COMMAND),
    "recipes/slurm/train.sbatch": re.compile(r"^#   ((?:p3d-|sbatch |NPROC=)\S*.*)$"),
    "recipes/torchrun.sh": re.compile(r"^#   ((?:p3d-|sbatch |NPROC=)\S*.*)$"),
}
SMALL = ("train.steps=1",)  # appended to every training line: the last value of a field wins in Hydra
# model=small's one step in seconds, not 20: 4 micro batches of 1 x 128 tokens (from 8 of 2 x 1024), one per stage
SMALL_MODEL_STEP = (*SMALL, "model.seq_len=128", "schedule.micro_batch_size=1", "schedule.global_batch_size=4")


def strip_comment(line: str) -> str:
    """The command without its trailing ``# comment`` (a ``#`` after a space)."""
    return re.split(r"\s+#\s", line, maxsplit=1)[0].strip()


def documented_lines() -> list[tuple[str, str]]:
    """(file, command) for every documented command line, in document order."""
    out = []
    for name, pattern in DOCS.items():
        for text in (ROOT / name).read_text().splitlines():
            found = pattern.match(text)
            if found:
                out.append((name, strip_comment(found.group(1))))
    return out


@dataclass(frozen=True)
class Case:
    kind: str  # run | slurm | refused | dry | not_here
    extra: tuple[str, ...] = SMALL  # appended overrides
    setup: str = ""  # a name in tests/e2e/test_documented_commands.py's SETUPS: files the line needs
    expect: str = ""  # refused: a regex the one-line error must match; not_here: the reason
    then: tuple[str, ...] = field(default_factory=tuple)  # further documented lines run in the same directory
    check: str = ""  # a name in tests/e2e/test_documented_commands.py's CHECKS: what the line promises beyond status 0
    slow: bool = False  # the slow tier: a variant of a path another line in make test already runs (say which)


# a bench line runs for minutes; its script's parser reads it in a test
BENCHMARK = Case(
    "not_here", expect="a benchmark (minutes of timing), never a test; tests/unit/test_bench_commands.py parses it"
)


def argv_of(command: str, tmp: Path) -> tuple[dict[str, str], list[str]]:
    """(environment assignments, argv) of a documented line, with the paths that only exist on the
    reader's cluster mapped into ``tmp`` and the repository's recipes addressed from any directory."""
    words = [w.replace("/shared/runs/", f"{tmp}/shared/runs/") for w in shlex.split(command)]
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    words = [str(ROOT / w) if w.startswith("recipes/") else w for w in words]
    return env, words


CASES: dict[str, Case] = {
    # README: two commands, quick start
    "make train": Case("run", slow=True),  # slow tier: kept: `p3d-train`, the job make train runs
    "make test": Case("not_here", expect="the suite itself: CI's .ci/run runs it"),
    "p3d-train": Case("run"),
    "p3d-train mesh=tp2_pp2 train.steps=200": Case("run"),
    "p3d-train mesh=dp2_pp2_tp2 zero=stage1": Case("run"),
    # slow tier: kept: tests/e2e/test_zero_runs.py runs ZeRO-3 through p3d-train, the worker test on dp2_pp2
    "p3d-train mesh=dp2_pp2 zero=stage3": Case("run", slow=True),
    # docs/zero.md; slow tier: kept: the same
    "p3d-train mesh=dp2_pp2_tp2 zero=stage2 schedule.pipeline=interleaved_1f1b": Case("run", slow=True),
    "p3d-train mesh=dp4 zero=stage3 zero.shard_size=2": Case("run", slow=True),
    # slow tier: kept: the full-recompute parity cases
    "p3d-train model=small mesh=pp4 schedule=recompute": Case("run", extra=SMALL_MODEL_STEP, slow=True),
    # slow tier: kept: the SP + selective parity cases
    "p3d-train model=small mesh=tp2_pp2 schedule.sequence_parallel=true schedule.recompute=selective": Case(
        "run",
        extra=SMALL_MODEL_STEP,
        slow=True,
    ),
    "p3d-train mesh=pp2 schedule.pipeline=interleaved_1f1b schedule.virtual_stages=2": Case("run"),
    # README and docs/moe.md
    "p3d-train model=moe_tiny mesh=dp2 mesh.ep=2": Case("run"),
    # docs/moe.md; slow tier: kept: the zbv MoE parity case's variant runs in test-all, ep2 on dp2_pp2 in make test
    "p3d-train model=moe_tiny mesh=dp2_pp2 mesh.ep=2 schedule.pipeline=zbv": Case("run", slow=True),
    # docs/moe.md, docs/context.md; slow tier: kept: the ep2 x cp2 parity case of e2e/test_moe_parity.py in make test
    "p3d-train model=moe_tiny mesh=dp2 mesh.ep=2 mesh.cp=2": Case("run", slow=True),
    "p3d-train model=mixtral_8x7b mesh.tp=4 mesh.pp=4 mesh.dp=4 mesh.ep=4 schedule.global_batch_size=64 "
    "cluster=h100_sxm cluster.nodes=8 dry_run=true": Case("run", extra=()),
    "p3d-plan model=mixtral_8x7b cluster=h100_64 mesh=auto": Case("run", extra=()),
    # docs/clusters.md, heterogeneous clusters; slow tier: kept: tests/unit/planner/test_hetero_plan.py plans and
    # renders the same config in-process
    "p3d-plan cluster=mixed_h100_a100 model=llama3_8b mesh=auto": Case("run", extra=(), slow=True),
    # README and docs/context.md; slow tier: kept: e2e/test_cp_runs.py trains dp2 x cp2 through p3d-train first
    "p3d-train mesh=dp2 mesh.cp=2": Case("run", slow=True),
    # docs/context.md; slow tier: kept: e2e/test_cp_runs.py trains tp2 x pp2 x cp2 with SP, interleaved, in make test
    "p3d-train mesh=tp2 mesh.cp=2 schedule.sequence_parallel=true": Case("run", slow=True),
    "p3d-train mesh=pp2 mesh.cp=2 schedule.pipeline=interleaved_1f1b": Case("run", slow=True),
    "p3d-plan model=llama3_8b model.seq_len=131072 cluster=h100_sxm cluster.nodes=4 mesh=auto": Case("run", extra=()),
    "p3d-train model=llama3_1_405b model.seq_len=131072 mesh.tp=8 mesh.cp=16 mesh.pp=16 mesh.dp=8 cluster=h100_sxm "
    "cluster.nodes=2048 schedule.micro_batch_size=1 schedule.global_batch_size=128 schedule.sequence_parallel=true "
    "zero=stage1 schedule.recompute=full dry_run=true": Case("run", extra=()),
    "p3d-train data=files data.path='/data/*.jsonl'": Case(
        "refused", expect=r"^p3d: (config|input) error: data.path=/data/\*.jsonl .*matches no file"
    ),
    "p3d-train mesh=tp8_pp8 model=llama70b cluster=h100_sxm cluster.nodes=8 schedule=large dry_run=true": Case(
        "run", extra=()
    ),
    # slow tier: kept: e2e/test_token_store_runs.py prepares and trains
    "p3d-prepare data=files data.path='corpus/*.jsonl' prepare.out=store": Case(
        "run",
        setup="jsonl_corpus",
        extra=(),
        then=("p3d-train data=prepared data.path=store",),
        slow=True,
    ),
    "p3d-train data=prepared data.path=store": Case("run"),
    "p3d-train -m mesh=dp2,tp2,pp2 train.steps=20": Case("run", then=("p3d-report multirun/2025-01-01/12-00-00",)),
    # docs/precision.md; slow tier: kept: tests/e2e/test_float8.py trains the first through p3d-train in make test
    "p3d-train mesh=tp2 schedule.sequence_parallel=true train.fp8=tensorwise": Case("run", slow=True),
    "p3d-train model=moe_tiny mesh=dp2 mesh.ep=2 train.fp8=mxfp8": Case("run", slow=True),
    "p3d-plan model=llama3_8b cluster=h100_sxm mesh.tp=2 mesh.pp=1 mesh.dp=auto zero=stage3 "
    "schedule.micro_batch_size=1 schedule.global_batch_size=8 schedule.sequence_parallel=true "
    "schedule.recompute=selective": Case("run", extra=()),
    "p3d-plan model=llama70b cluster=h100_sxm cluster.nodes=16 mesh.tp=8 mesh.pp=1 mesh.dp=auto zero=stage3 "
    "schedule.micro_batch_size=1 schedule.global_batch_size=128 schedule.sequence_parallel=true "
    "schedule.recompute=full": Case("run", extra=()),
    # README, docs/clusters.md: Slurm
    # slow tier: kept: cluster/slurm/test_slurm_jobs.py submits p3d-train cluster=slurm
    "p3d-train cluster=slurm mesh=tp2_pp2 train.steps=200": Case("slurm", slow=True),
    "p3d-train cluster=h100_sxm cluster.nodes=8 mesh=tp8_pp8 model=llama70b schedule=large cluster.partition=gpu "
    "cluster.account=proj": Case("dry", extra=("dry_run=true",)),
    "sbatch recipes/slurm/train.sbatch mesh=tp2_pp2 run.dir=/shared/runs/exp1": Case("slurm"),
    "sbatch --nodes=8 --gpus-per-node=8 recipes/slurm/train.sbatch cluster=h100_sxm mesh=tp8_pp8 model=llama70b "
    "schedule=large": Case("dry", extra=("cluster.nodes=8", "dry_run=true")),
    # slow tier: kept: the sweep `p3d-train -m mesh=dp2,tp2,pp2 train.steps=20`, and the Slurm sweep through submitit
    # (tests/cluster/slurm/test_slurm_jobs.py)
    "p3d-train -m mesh=dp4,tp2_pp2,pp4 train.steps=50": Case("run", slow=True),
    "p3d-train -m cluster=slurm mesh=dp4,tp2_pp2,pp4 train.steps=50": Case("slurm", slow=True),
    "p3d-report multirun/2025-01-01/12-00-00": Case("not_here", expect="run after the -m sweep above (its `then`)"),
    # README, docs/data.md, docs/checkpoints.md: data, checkpoints, resume
    # slow tier: kept: the resume pair, with W&B, validation and saves
    "p3d-train train.save_every=100 train.eval_every=50 logger=wandb": Case(
        "run",
        extra=("train.steps=2", "train.save_every=2", "train.eval_every=2"),
        slow=True,
    ),
    "p3d-train mesh=pp2 train.save_every=2 train.eval_every=2 logger=wandb train.steps=4 run.dir=outputs/run1": Case(
        "run", extra=(), then=("p3d-train train.resume=auto run.dir=outputs/run1 train.steps=6",)
    ),
    "p3d-train train.resume=auto run.dir=outputs/run1 train.steps=6": Case(
        "run", extra=(), check="resume_keeps_the_run"
    ),
    # slow tier: kept: the resume pair; e2e/test_layouts.py, e2e/test_hf_roundtrip.py
    "p3d-train train.resume=auto run.dir=outputs/run1": Case(
        "run",
        setup="trained_run1",
        extra=("train.steps=3",),
        then=(
            "p3d-train train.resume=auto run.dir=outputs/run1 mesh=pp4",
            "p3d-export run.dir=outputs/run1 out=hf/run1 [step=N] [max_shard_gb=5] [overwrite=true]",
        ),
        slow=True,
    ),
    "p3d-train train.resume=auto run.dir=outputs/run1 mesh=pp4": Case("run", extra=("train.steps=4",)),
    # slow tier: kept: e2e/test_observe.py trains and round-trips a p3d-tokenizer
    "p3d-tokenizer data=files data.path='corpus/*.jsonl' tokenizer.vocab_size=8192 tokenizer.out=tok.json": Case(
        "run",
        setup="jsonl_corpus",
        extra=(),
        then=("p3d-train data=files data.path='corpus/*.jsonl' data.tokenizer=tok.json model.vocab_size=8192",),
        slow=True,
    ),
    "p3d-train data=files data.path='corpus/*.jsonl' data.tokenizer=tok.json model.vocab_size=8192": Case("run"),
    "p3d-train data.source=hub data.path=HuggingFaceFW/fineweb-edu data.subset=sample-10BT": Case(
        "not_here", expect="needs the Hugging Face Hub; this machine reaches package registries only"
    ),
    "p3d-train data=files data.path=corpus data.text_unit=paragraph": Case("run", setup="txt_corpus"),
    # slow tier: kept: tests/unit/launch/test_override_keys.py composes the quoted form and refuses the bare one
    "p3d-train data=files 'data.path=\"corpus/notes0.txt,corpus/notes1.txt\"'": Case(
        "run", setup="txt_corpus", slow=True
    ),
    # README, docs/checkpoints.md: HF import and export
    "p3d-train model.init_from=/models/Meta-Llama-3-8B mesh=tp2_pp2": Case(
        "refused", expect=r"^p3d: (config|input) error: model.init_from=/models/Meta-Llama-3-8B .*"
    ),
    "p3d-export run.dir=outputs/run1 out=hf/run1 [step=N] [max_shard_gb=5] [overwrite=true]": Case(
        "not_here", expect="run after its resume line above (its `then`), once bare and once with every option"
    ),
    # docs/models.md: the families
    "p3d-train model.init_from=/models/Qwen3-8B mesh=tp2_pp2": Case(
        "refused", expect=r"^p3d: (config|input) error: model.init_from=/models/Qwen3-8B .*no config.json there"
    ),
    "p3d-train model.init_from=/models/DeepSeek-V3 model.drop_mtp=true mesh=auto cluster=h100_sxm "
    "cluster.nodes=256": Case(
        "refused", expect=r"^p3d: (config|input) error: model.init_from=/models/DeepSeek-V3 .*no config.json there"
    ),
    "p3d-train model=deepseek_v3 cluster=h100_sxm cluster.nodes=256 mesh=auto dry_run=true": Case(
        "refused",
        expect=r"^p3d: config error: mesh=auto: no valid layout of 2048 GPUs .*try schedule.global_batch_size=256$",
    ),
    "p3d-train model=deepseek_v3 cluster=h100_sxm cluster.nodes=256 mesh=auto dry_run=true "
    "schedule.global_batch_size=15360": Case(
        "run",
        extra=(),
        slow=True,  # mesh=auto's search over 2048 GPUs (minutes); tests/unit/layout/test_tensors.py
    ),  # holds the closed form it prints
    "p3d-plan model=deepseek_v3 cluster=h100_sxm cluster.nodes=256 mesh=auto schedule.global_batch_size=15360": Case(
        "run", extra=(), slow=True
    ),
    "p3d-plan model=deepseek_v3 cluster=h100_sxm cluster.nodes=256 mesh.tp=1 mesh.pp=16 mesh.dp=128 mesh.ep=64 "
    "zero=stage1 schedule.global_batch_size=15360 schedule.micro_batch_size=1 schedule.pipeline=1f1b "
    "schedule.recompute=full": Case("run", extra=()),
    "p3d-train model=tiny model.head_dim=12 model.qkv_bias=true model.qk_norm=true model.rope_scaling.rope_type=yarn "
    "model.rope_scaling.factor=4 model.rope_scaling.original_max_position_embeddings=16": Case(
        "run",
        slow=True,  # tests/e2e/test_family_parity.py trains this model on tp2_pp2 in make test
    ),
    "p3d-train model=qwen3_235b_a22b cluster=h100_sxm cluster.nodes=16 mesh=auto dry_run=true "
    "schedule.global_batch_size=1024": Case(
        "run",
        extra=(),
        slow=True,  # mesh=auto's search of a 94-block MoE; make test builds its layout's model
    ),  # (tests/unit/launch/test_dryrun.py)
    # README, docs/planner.md: planner
    "p3d-plan mesh=tp8_pp8 model=llama70b cluster=h100_sxm cluster.nodes=8 schedule=large": Case("run", extra=()),
    "p3d-plan model=llama3_1_405b mesh=auto cluster=h100_sxm cluster.nodes=1024 schedule=large format=json": Case(
        "run", extra=()
    ),
    "p3d-plan mesh=tp8_pp8 model=llama70b cluster=h100_sxm cluster.nodes=8 schedule=large plan.efficiency=0.55": Case(
        "run", extra=()
    ),
    # README: development; docs/benchmarks.md
    "make test-fast": Case("not_here", expect="a tier of this suite; CI runs make test"),
    "make test-all": Case("not_here", expect="the suite with its slow tier; make test runs the rest"),
    "make lint": Case("not_here", expect="CI's .ci/run runs it before the tests"),
    'make test PYTEST_ARGS="tests/unit/planner"': Case("not_here", expect="the suite itself, on one folder"),
    "make bench": BENCHMARK,
    **dict.fromkeys(
        (
            ".venv/bin/python bench/overhead.py breakdown",
            ".venv/bin/python bench/data.py",
            ".venv/bin/python bench/compile.py --set model.n_layers=4",
            ".venv/bin/python bench/checkpoint.py save --steps 13 --save-every 4",
            ".venv/bin/python bench/checkpoint.py save --steps 8 --save-every 3",
            ".venv/bin/python bench/checkpoint.py dcp /tmp/i14/small_ckpt --repeat 5",
            ".venv/bin/python bench/schedules.py throughput",
            ".venv/bin/python bench/schedules.py throughput --m 8 --rounds 16 --schedules 1f1b interleaved_1f1b zbv",
            ".venv/bin/python bench/schedules.py throughput --m 8 --rounds 16 --schedules 1f1b interleaved_1f1b zbv "
            "--set model.hidden_size=512 model.ffn_hidden_size=1536 model.seq_len=128 model.n_layers=8",
            ".venv/bin/python bench/schedules.py throughput --m 8 --rounds 40 --schedules 1f1b interleaved_1f1b zbv",
            ".venv/bin/python bench/schedules.py throughput --m 8 --rounds 12 --schedules 1f1b interleaved_1f1b zbv",
            ".venv/bin/python bench/schedules.py executor",
            ".venv/bin/python bench/schedules.py partition --rounds 2",
            ".venv/bin/python bench/sp_recompute.py --rounds 6",
            ".venv/bin/python bench/zero.py --passes 1",
            ".venv/bin/python bench/moe.py ep --deepspeed",
            ".venv/bin/python bench/moe.py layer --passes 3 --steps 5",
            ".venv/bin/python bench/cp.py layouts",
            ".venv/bin/python bench/cp.py runs",
            ".venv/bin/python bench/cp.py runs --extra model=small",
            ".venv/bin/python bench/cp.py runs --host-memory release --added-over 256",
            ".venv/bin/python bench/cp.py runs --host-memory release --added-over 256 --extra context.attention=ring",
            ".venv/bin/python bench/cp.py attention",
            ".venv/bin/python bench/cp.py rss --cp 1 2 4",
            ".venv/bin/python bench/cp.py rss --cp 1 2 4 --extra model.seq_len=16384",
            ".venv/bin/python bench/cp.py rss --cp 1 2 4 --extra model=small",
        ),
        BENCHMARK,
    ),
    # docs/context.md (issue 52)
    ".venv/bin/python bench/cp.py variants": Case(
        "not_here", expect="the planner's key/value formulas over lengths; tests/unit/planner/test_context.py"
    ),
    # docs/planner.md, docs/benchmarks.md (issue 36)
    ".venv/bin/python bench/planner.py published": Case(
        "not_here",
        expect="the table of tests/helpers/published.py, whose rows tests/unit/planner/test_published.py checks",
    ),
    ".venv/bin/python bench/planner.py published --fit": Case(
        "not_here",
        expect="the fit of tests/helpers/published_fit.py, whose result tests/unit/planner/test_published.py checks",
    ),
    **dict.fromkeys(
        (
            ".venv/bin/python bench/planner.py accuracy",
            ".venv/bin/python bench/planner.py accuracy --calibration cal.json --json accuracy.json",
        ),
        Case(
            "not_here",
            expect="a benchmark (minutes of timing), never a test; its arithmetic: test_accuracy_bench.py, its "
            "options: test_bench_commands.py",
        ),
    ),
    "make gpu-check": Case("not_here", expect="needs a CUDA GPU; its dry mode is tests/e2e/test_gpu_check.py"),
    # README, docs/timeline.md (issue 56); slow tier: kept: tests/e2e/test_trace.py (the same trace, checked in full)
    "p3d-train train.trace_steps=[2] run.dir=runs/traced": Case(
        "run", extra=("train.steps=2",), check="traced_step_is_drawn", slow=True
    ),
    "p3d-report runs/traced": Case("not_here", expect="run by the check of the p3d-train line above it"),
    **dict.fromkeys(
        (
            ".venv/bin/python bench/timelines.py picture",
            ".venv/bin/python bench/timelines.py cost --baseline /tmp/p3d-base",
        ),
        BENCHMARK,
    ),
    # docs/clusters.md: multi-node, on the two-node cluster of tests/cluster/multinode (the same lines, a few steps)
    "sbatch --nodes=2 --ntasks-per-node=4 recipes/slurm/train.sbatch mesh=dp2_pp2_tp2 model=tiny": Case(
        "not_here", expect="tests/cluster/multinode/test_two_nodes.py runs it across two nodes"
    ),
    "p3d-train cluster=slurm cluster.nodes=2 mesh=dp2_tp2 model=tiny": Case(
        "not_here", expect="tests/cluster/multinode/test_p3d_train_two_nodes.py runs it across two nodes"
    ),
    "p3d-train -m cluster=slurm cluster.nodes=1,2 mesh=dp2_tp2 model=tiny": Case(
        "not_here", expect="tests/cluster/multinode/test_p3d_train_two_nodes.py runs the sweep"
    ),
    # recipe headers
    # slow tier: kept: the sbatch line with run.dir; cluster/slurm/test_slurm_jobs.py
    "sbatch recipes/slurm/train.sbatch mesh=tp2_pp2 model=tiny": Case("slurm", slow=True),
    "sbatch --nodes=8 --gpus-per-node=8 recipes/slurm/train.sbatch mesh=tp8_pp8 model=llama70b cluster=h100_sxm "
    "schedule=large": Case("dry", extra=("cluster.nodes=8", "dry_run=true")),
    # slow tier: kept: the same recipe line without --ntasks-per-node
    "sbatch --ntasks-per-node=4 recipes/slurm/train.sbatch mesh=tp2_pp2 run.dir=/shared/runs/exp1": Case(
        "slurm", slow=True
    ),
    "p3d-train cluster=slurm mesh=tp2_pp2 ...": Case("not_here", expect="the README's cluster=slurm line, with ..."),
    # slow tier: kept: e2e/test_cli.py runs recipes/torchrun.sh
    "NPROC=8 RUN_DIR=/shared/runs/exp1 recipes/torchrun.sh mesh=dp2_pp2_tp2 model=tiny": Case("run", slow=True),
}


BIN = Path(sys.executable).parent


def user_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A shell whose PATH starts with the environment p3d is installed in, as after `source .venv/bin/activate`."""
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(extra or {})}


def run_line(command: str, cwd: Path, extra: tuple[str, ...] = (), timeout: float = 600) -> subprocess.CompletedProcess:
    env, argv = argv_of(command, cwd)
    if argv[0] == "make":  # the Makefile's commands run in the checkout; ARGS reaches p3d-train
        args = " ".join([shlex.quote(f"run.dir={cwd / 'make-train'}"), *extra])  # the recipe's shell splits ARGS
        argv = ["make", "-C", str(ROOT), *argv[1:], f"ARGS={args}"]
    else:
        argv = [*argv, *extra]
    return subprocess.run(argv, cwd=cwd, env=user_env(env), capture_output=True, text=True, timeout=timeout)


def metrics_files(where: Path) -> list[Path]:
    return sorted(where.rglob("metrics.jsonl"))


def last_step(metrics: Path) -> int:
    return max(r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if "step" in r and "loss" in r)
