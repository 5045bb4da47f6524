"""``make gpu-check``: the GPU path, checked in one command that fits a short device lease (issue 16).

    make gpu-check                      # on a machine with CUDA GPUs: run every step, write docs/gpu.md
    make gpu-check ARGS=--dry           # anywhere: say which steps would run and check their configs
    .venv/bin/python bench/gpu_check.py --out /tmp/gpu --budget-s 480

Steps (each in its own time limit; one that fails is reported and the next one runs):
  sdpa. The kernels p3d's attention core runs for llama3_2_1b's shapes in bf16 (profiled): flash expected.
  a. ``mesh=single`` bf16 training of ``model=llama3_2_1b`` (16 layers, hidden 2048, 2k context) for 30
     steps: tokens/s, MFU and HFU against the device's dense bf16 peak (and against the ~790 TFLOP/s a
     bf16 8192^3 matmul reaches on an H200), peak allocated memory beside ``p3d-plan``'s prediction.
  b. bf16 on the GPU against fp32 on the CPU: ``model=small`` (256-token context) for 20 steps on the
     GPU, then the single-process fp32 reference (p3d.train.reference) of the same run spec on the
     host's cores; every step's loss within ``BF16_RTOL``.
  c. With two or more GPUs: the parity meshes on NCCL in fp32 against the same reference (tolerance
     ``NCCL_RTOL``); with one GPU it says so and skips.
  e. The torch executor on one rank (``mesh=single zero=stage3``: torch's Schedule1F1B, the step loss and
     the step's clocks on the device), bf16, ``model=small`` for 20 steps against the fp32 CPU reference.
  f, g. FSDP2 (a whole chunk, ZeRO-3, one-rank NCCL mesh) and an MoE layer in bf16 on the GPU against their fp32
     twins on the CPU (bench/gpu_layers.py).
  h. cp = 2 attention: each rank's fused kernels and log-sum-exp merge in bf16 on the GPU against SDPA on the
     whole sequence in fp32 on the CPU, and the kernels it ran (bench/gpu_layers.py).
  j. A DeepSeek-V3 block: multi-head latent attention at V3's head dims (q, k 192, v 128 padded for the flash
     kernel) and the grouped sigmoid router, bf16 on the GPU against its fp32 twin on the CPU; flash expected.
  Then it writes the figures to docs/gpu.md (and to --out, so they come back from a device lease).

Without a CUDA device (or with --dry) it prints that it found none and which steps it would run, checks each
training step's config the way p3d-train would (``dry_run=true``) and p3d-plan's prediction, so a config error
shows up here and not in the lease, and runs the layer steps (f, g, h) with the CPU as the device. A machine with an
NVIDIA GPU whose chosen Python has no CUDA fails at once with the reason (a dry pass there would hide it).
Exit status: 0 every step that ran passed, 1 not.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BF16_RTOL = 0.03  # per-step loss, bf16 (GPU) vs fp32 (CPU), 20 steps of model=small; CPU bf16 differs ~4e-3
NCCL_RTOL = 1e-4  # fp32 on GPUs (TF32 off) vs fp32 on the CPU, 10 steps
MATMUL_CEILING_TFLOPS = {"h200": 790.0}  # bf16 8192^3 matmul measured on the lent H200 (shared notes)
PRESETS = (("H200", "h200"), ("H100", "h100_sxm"), ("B200", "b200"), ("A100", "a100_80gb"))

THROUGHPUT = ["model=llama3_2_1b", "mesh=single", "schedule.micro_batch_size=4", "schedule.global_batch_size=32"]
BF16_SMALL = ["model=small", "model.seq_len=256", "mesh=single", "schedule.micro_batch_size=4"]
BF16_SMALL += ["schedule.global_batch_size=16", "train.dtype=bf16"]
TORCH_EXECUTOR = [*BF16_SMALL, "zero=stage3"]  # one rank: torch's Schedule1F1B (DeepSpeed refuses ZeRO-3)
PARITY_MESHES = {"dp2": 2, "tp2": 2, "pp2": 2, "tp2_pp2": 4, "dp2_pp2_tp2": 8}
# float8 (train.fp8, docs/precision.md): llama3_2_1b on the torch executor (one rank: zero=stage3), bf16 then tensorwise
FLOAT8_BASE = [*THROUGHPUT, "zero=stage3", "train.dtype=bf16"]
FLOAT8_RTOL = 0.02  # per-step loss, float8 vs bf16 on the GPU, 30 steps


@dataclass
class Step:
    name: str
    what: str
    figures: dict = field(default_factory=dict)
    status: str = "not run"  # passed, failed: <why>, skipped: <why>, dry: config ok


def env_python() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def p3d(module: str, args: list[str], timeout: float, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", module, *args]
    print("  $ " + " ".join(cmd[1:]), flush=True)
    return subprocess.run(cmd, cwd=cwd, env=env_python(), capture_output=True, text=True, timeout=timeout)


def tail(proc: subprocess.CompletedProcess, n: int = 6) -> str:
    return " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-n:])


def plan_of(overrides: list[str], cwd: Path) -> dict:
    proc = p3d("p3d.cli.plan", [*overrides, "format=json"], 120, cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"p3d-plan refused {' '.join(overrides)}: {tail(proc)}")
    return json.loads(proc.stdout)


def train(overrides: list[str], run_dir: Path, timeout: float, dry: bool) -> list[dict]:
    args = [*overrides, f"run.dir={run_dir}", "logger=none", "train.save_every=0", "train.eval_every=0"]
    proc = p3d("p3d.cli", [*args, *(["dry_run=true"] if dry else [])], timeout, run_dir.parent)
    if proc.returncode != 0:
        raise RuntimeError(f"p3d-train exited {proc.returncode}: {tail(proc)}")
    if dry:
        return []
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def gpus_on_machine() -> list[str]:
    """The NVIDIA GPUs this machine has, whatever the chosen Python's torch can see (``nvidia-smi -L``'s lines, or
    the driver's /proc entries)."""
    if shutil.which("nvidia-smi"):
        try:
            proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            proc = None
        if proc is not None and proc.returncode == 0:
            return [line for line in proc.stdout.splitlines() if line.startswith("GPU ")]
    gpus = Path("/proc/driver/nvidia/gpus")
    return sorted(p.name for p in gpus.iterdir()) if gpus.is_dir() else []


def device_preset() -> tuple[str, str, int]:
    import torch

    if not torch.cuda.is_available():
        return "", "", 0
    name = torch.cuda.get_device_name(0)
    preset = next((p for key, p in PRESETS if key in name.upper()), "h100_sxm")
    return name, preset, torch.cuda.device_count()


def step_throughput(step: Step, gpu: list[str], out: Path, dry: bool, timeout: float) -> None:
    overrides = [*THROUGHPUT, *gpu]
    plan = plan_of(overrides, out)
    step.figures["predicted_peak_gb"] = round(plan["memory_gb"]["total"], 2)
    step.figures["predicted_mfu"] = round(plan["mfu"], 3)
    records = train([*overrides, "train.steps=30"], out / "a_throughput", timeout, dry)
    if dry:
        return
    kept = records[5:]  # the first steps include CUDA context, allocator warm-up and autotuning
    peak_tflops = records[0]["tflops_per_device"] / records[0]["mfu"]
    mfu = statistics.median(r["mfu"] for r in kept)
    hfu_over_mfu = plan["hfu"] / plan["mfu"]  # recompute's extra forward, as the planner counts it
    ceiling = MATMUL_CEILING_TFLOPS.get(gpu[0].split("=")[1])
    step.figures.update(
        tokens_per_s=round(statistics.median(r["tokens_per_s"] for r in kept)),
        tflops_per_gpu=round(mfu * peak_tflops, 1),
        mfu=round(mfu, 3),
        hfu=round(mfu * hfu_over_mfu, 3),
        mfu_of_matmul_ceiling=round(mfu * peak_tflops / ceiling, 3) if ceiling else None,
        peak_allocated_gb=round(max(r.get("peak_mem_gb", 0.0) for r in records), 2),
        steps=len(records),
    )


def step_bf16(
    step: Step, gpu: list[str], out: Path, dry: bool, timeout: float, overrides=tuple(BF16_SMALL), name="b_bf16"
) -> None:
    run_dir = out / name
    records = train([*overrides, *gpu, "train.steps=20"], run_dir, timeout, dry)
    if dry:
        return
    import torch

    from p3d.rundir.spec import read_spec
    from p3d.train.reference import reference_run

    cfg, _ = read_spec(run_dir)
    torch.set_num_threads(os.cpu_count() or 1)
    with torch.device("cpu"):
        ref = reference_run(cfg)  # fp32: to_sequential's parameters are fp32 whatever train.dtype says
    rel = [abs(r["loss"] - q["loss"]) / abs(q["loss"]) for r, q in zip(records, ref, strict=True)]
    step.figures.update(max_rel_loss_diff=float(f"{max(rel):.3g}"), tolerance=BF16_RTOL, steps=len(rel))
    step.figures.update(first_loss=round(records[0]["loss"], 4), last_loss=round(records[-1]["loss"], 4))
    if max(rel) > BF16_RTOL:
        raise RuntimeError(f"bf16 loss off the fp32 reference by {max(rel):.3g} > {BF16_RTOL} (relative)")


def step_float8(step: Step, gpu: list[str], out: Path, dry: bool, timeout: float) -> None:
    """bf16 and train.fp8=tensorwise on one GPU, the same layout (the torch executor): the measured speedup beside
    p3d-plan's; the float8 curve within FLOAT8_RTOL of bf16's. Needs compute capability 8.9 (the run refuses
    before it starts otherwise, in one line)."""
    fp8 = [*FLOAT8_BASE, *gpu, "train.fp8=tensorwise"]
    step.figures["predicted_speedup"] = round(plan_of(fp8, out)["float8_speedup"], 3)
    bf16 = train([*FLOAT8_BASE, *gpu, "train.steps=30"], out / "i_bf16", timeout / 2, dry)
    float8 = train([*fp8, "train.steps=30"], out / "i_float8", timeout / 2, dry)
    if dry:
        return
    speed = statistics.median(r["tokens_per_s"] for r in float8[5:]) / statistics.median(
        r["tokens_per_s"] for r in bf16[5:]
    )
    rel = [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(float8, bf16, strict=True)]
    step.figures.update(measured_speedup=round(speed, 3), max_rel_loss_diff=float(f"{max(rel):.3g}"))
    if max(rel) > FLOAT8_RTOL:
        raise RuntimeError(f"float8 loss off bf16's by {max(rel):.3g} > {FLOAT8_RTOL} (relative)")


def step_nccl(step: Step, gpu: list[str], out: Path, dry: bool, timeout: float, n_gpus: int) -> None:
    meshes = [m for m, world in PARITY_MESHES.items() if world <= n_gpus] if not dry else list(PARITY_MESHES)
    if not meshes:
        step.status = f"skipped: {n_gpus} GPU; the parity meshes need 2 or more (they run on CPU/gloo in make test)"
        return
    worst = 0.0
    for mesh in meshes:
        n = PARITY_MESHES[mesh]
        over = [f"mesh={mesh}", "train.dtype=fp32", "train.steps=10", f"cluster.gpus_per_node={n}"]
        records = train([*over, *gpu[:1]], out / f"c_{mesh}", timeout / len(meshes), dry)
        if dry:
            continue
        import torch

        from p3d.rundir.spec import read_spec
        from p3d.train.reference import reference_run

        cfg, _ = read_spec(out / f"c_{mesh}")
        torch.set_num_threads(os.cpu_count() or 1)
        ref = reference_run(cfg)
        rel = max(abs(r["loss"] - q["loss"]) / abs(q["loss"]) for r, q in zip(records, ref, strict=True))
        step.figures[mesh] = float(f"{rel:.3g}")
        worst = max(worst, rel)
    if not dry and worst > NCCL_RTOL:
        raise RuntimeError(f"a mesh on NCCL is off the reference by {worst:.3g} > {NCCL_RTOL}")


def step_sdpa(step: Step, dry: bool) -> None:
    """Which kernel p3d's attention core runs for llama3_2_1b's shapes in bf16 (GQA 32/8, 2k): the flash one."""
    if dry:
        step.status = "dry: profiles p3d.model.attention's attention core on the GPU"
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    from p3d.model.attention import _attention_core
    from p3d.model.rope import rope_cos_sin

    b, nh, nkv, s, hd = 4, 32, 8, 2048, 64
    q = torch.randn(b, nh, s, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, nkv, s, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    cos, sin = rope_cos_sin(s, hd, 5e5, None, "cuda", torch.bfloat16)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _attention_core(q, k, v, cos, sin, True).sum().backward()
        torch.cuda.synchronize()
    kernels = sorted({e.key for e in prof.key_averages() if "attention" in e.key.lower() or "flash" in e.key.lower()})
    step.figures["kernels"] = "; ".join(kernels)[:300]
    if not any("flash" in name.lower() for name in kernels):
        raise RuntimeError(f"SDPA did not run a flash kernel for these shapes: {kernels}")
    # fp32 (train.dtype=fp32): GQA's kv heads expanded for the memory-efficient kernel, not the math one
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    cos32, sin32 = rope_cos_sin(s, hd, 5e5, None, "cuda", torch.float32)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        _attention_core(q32, k32, v32, cos32, sin32, True).sum().backward()
        torch.cuda.synchronize()
    ops = {e.key for e in prof.key_averages()}
    step.figures["fp32_kernel"] = "efficient" if any("efficient_attention" in op for op in ops) else "other"
    if "aten::_scaled_dot_product_efficient_attention" not in ops:
        raise RuntimeError(f"fp32 GQA did not run SDPA's memory-efficient kernel: {sorted(ops)[:20]}")


def step_layer(step: Step, name: str, dry: bool) -> None:
    """A layer-level step of bench/gpu_layers.py, on the GPU (or the CPU in dry mode)."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_layers

    torch.manual_seed(0)
    step.figures.update(gpu_layers.check(name, torch.device("cpu" if dry else "cuda")))
    if dry:
        step.status = "dry: ran on the cpu"


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "deepspeed", "hydra-core", "omegaconf", "datasets", "torchao"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "missing"
    return out


def write_docs(path: Path, device: str, n_gpus: int, vers: dict, steps: list[Step]) -> None:
    today = datetime.date.today().isoformat()
    lines = [
        "# p3d on a GPU",
        "",
        f"Written by `make gpu-check` (bench/gpu_check.py) on {today}: {n_gpus} x {device}.",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()) + ".",
        "",
        "| step | what | status | figures |",
        "| --- | --- | --- | --- |",
    ]
    for s in steps:
        figs = ", ".join(f"{k} {v}" for k, v in s.figures.items())
        lines.append(f"| {s.name} | {s.what} | {s.status} | {figs} |")
    path.write_text("\n".join(lines) + "\n")


def out_folder(given: str | None, dry: bool, stack: contextlib.ExitStack) -> Path:
    """Where the run dirs and gpu_check.json go: ``--out`` (or ``$OUT``, a device lease's folder) when given;
    else a GPU run writes under ``outputs/gpu-check`` (git ignores ``outputs/``) and a dry one into a
    temporary folder removed at the end, so a dry run leaves nothing in the checkout."""
    if given:
        return Path(given).resolve()
    if dry:
        return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="p3d-gpu-check-")))
    return ROOT / "outputs" / "gpu-check"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="check the steps' configs; run nothing on a GPU")
    ap.add_argument(
        "--out",
        default=os.environ.get("OUT") or None,
        help="run dirs and gpu.md (default: $OUT, else outputs/gpu-check; a dry run: a temporary folder)",
    )
    ap.add_argument("--docs", default=str(ROOT / "docs" / "gpu.md"), help="where the table goes (GPU runs)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="time for all steps together")
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        return check(args, stack)


def check(args: argparse.Namespace, stack: contextlib.ExitStack) -> int:
    vers = versions()
    device, preset, n_gpus = device_preset()
    dry = args.dry or not n_gpus
    if not n_gpus and not args.dry and (found := gpus_on_machine()):
        print(
            f"gpu-check: this machine has {len(found)} NVIDIA GPU(s) ({found[0]}) but {sys.executable}'s torch "
            f"{vers['torch']} has no CUDA; run it with a CUDA build of torch (P3D_GPU_PYTHON=python3 make "
            "gpu-check), or ARGS=--dry for the dry mode"
        )
        return 1
    out = out_folder(args.out, dry, stack)
    out.mkdir(parents=True, exist_ok=True)
    if not n_gpus:
        print(f"gpu-check: no CUDA GPU found (torch {vers['torch']}); dry mode: no step runs on a GPU,")
        print("gpu-check: each step's config is checked as p3d-train and p3d-plan would check it")
    else:
        print(f"gpu-check: {n_gpus} x {device} (preset cluster.device={preset}); " + ", ".join(vers.values()))
    if missing := [k for k, v in vers.items() if v == "missing"]:
        print(f"gpu-check: missing {', '.join(missing)}; build the wheels with bench/gpu_wheels.sh and carry .whl/")
        return 1
    gpu = [f"cluster.device={preset or 'h200'}", f"cluster.gpus_per_node={max(n_gpus, 1)}"]
    steps = [
        Step("sdpa", "the attention kernel of llama3_2_1b's shapes in bf16 (GQA 32/8, 2k): flash expected"),
        Step("a", "mesh=single bf16 llama3_2_1b (2k context), 30 steps: tokens/s, MFU, HFU, peak memory vs p3d-plan"),
        Step("b", f"model=small bf16 on the GPU vs fp32 reference on the CPU, 20 steps, loss rtol {BF16_RTOL}"),
        Step("c", f"parity meshes {', '.join(PARITY_MESHES)} on NCCL (those the GPUs hold), fp32, rtol {NCCL_RTOL}"),
        Step("e", f"the torch executor on one rank (zero=stage3), model=small bf16 vs fp32 CPU, rtol {BF16_RTOL}"),
        Step("f", "FSDP2: a model=tiny chunk under ZeRO-3 on a one-rank mesh, bf16 vs its fp32 CPU twin"),
        Step("g", "an MoE layer (moe_tiny) in bf16 vs its fp32 CPU twin: output and gradients"),
        Step("h", "cp = 2 attention, each rank's fused kernels and LSE merge, bf16 vs SDPA fp32 on the CPU (2k)"),
        Step("i", f"train.fp8=tensorwise vs bf16, llama3_2_1b 30 steps: speedup vs the plan, loss rtol {FLOAT8_RTOL}"),
        Step("j", "a DeepSeek-V3 block (MLA at 192/128 head dims, grouped router) bf16 vs fp32 CPU twin; flash"),
    ]
    runs = [
        lambda s, t: step_sdpa(s, dry),
        lambda s, t: step_throughput(s, gpu, out, dry, t),
        lambda s, t: step_bf16(s, gpu, out, dry, t),
        lambda s, t: step_nccl(s, gpu, out, dry, t, n_gpus),
        lambda s, t: step_bf16(s, gpu, out, dry, t, TORCH_EXECUTOR, "e_torch_executor"),
        lambda s, t: step_layer(s, "fsdp2", dry),
        lambda s, t: step_layer(s, "moe", dry),
        lambda s, t: step_layer(s, "cp", dry),
        lambda s, t: step_float8(s, gpu, out, dry, t),
        lambda s, t: step_layer(s, "mla", dry),
    ]
    deadline = time.monotonic() + args.budget_s
    shares = (0.04, 0.25, 0.15, 0.15, 0.14, 0.04, 0.04, 0.04, 0.11, 0.04)
    for step, run, share in zip(steps, runs, shares, strict=True):
        print(f"gpu-check step {step.name}: {step.what}", flush=True)
        # a dry step only composes configs, slowly on a loaded CPU machine: no budget to keep there
        limit = 600.0 if dry else max(30.0, min(share * args.budget_s, deadline - time.monotonic()))
        t0 = time.monotonic()
        try:
            run(step, limit)
            if step.status == "not run":
                step.status = "dry: config ok" if dry else "passed"
        except Exception as exc:  # a step that breaks is reported; the lease goes on to the next one
            step.status = f"failed: {type(exc).__name__}: {exc}"
        print(f"gpu-check step {step.name}: {step.status} ({time.monotonic() - t0:.0f} s) {step.figures}", flush=True)
    (out / "gpu_check.json").write_text(json.dumps([s.__dict__ for s in steps], indent=2) + "\n")
    if not dry:
        write_docs(Path(args.docs), device, n_gpus, vers, steps)
        write_docs(out / "gpu.md", device, n_gpus, vers, steps)
        print(f"gpu-check: wrote {args.docs} and {out / 'gpu.md'}")
    failed = [s.name for s in steps if s.status.startswith("failed")]
    verdict = "failed: steps " + ", ".join(failed) if failed else "all steps passed" + (" (dry)" if dry else "")
    print(f"gpu-check: {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
