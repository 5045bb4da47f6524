"""``p3d-export``: a p3d checkpoint as a Hugging Face checkpoint of its family's architecture (``model.family``:
Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral; null: Llama for a dense model, Mixtral for an MoE one).

    p3d-export run.dir=outputs/run1 out=hf/run1              # the newest checkpoint
    p3d-export run.dir=outputs/run1 step=200 out=hf/run1-200 max_shard_gb=5
    p3d-export run.dir=outputs/run1 out=hf/run1 overwrite=true   # replace an earlier export whole

Writes ``config.json``, ``generation_config.json``, ``model.safetensors`` (or
``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json`` when larger than
``max_shard_gb``), and the run's tokenizer: its ``tokenizer.json``, or for the built-in byte tokenizer
the HF tokenizer that gives the same ids, with ``tokenizer_config.json`` naming its end-of-text token.
Tensors are the fp32 master weights, assembled from the (pp, tp) shards one at a time (``dtype=bf16``: cast to bf16,
the routers' weights and selection biases kept fp32, as transformers keeps DeepSeek-V3's; never float8 blocks: an
imported FP8 checkpoint comes back unquantized, p3d.hf.fp8). Every file gets
the mode the umask gives (0644 under umask 022), the weights too.
Everything is written into a new directory beside ``out`` that is renamed to ``out`` when complete:
a failed export leaves no ``out``, and an existing ``out`` is never mixed with a new export.
``transformers`` loads the result with its architecture's class (``Qwen3ForCausalLM.from_pretrained(out)``, ...).
config.json keeps the model's context (``max_position_embeddings``: the imported or preset one, or model.seq_len
if that is longer), and so does the tokenizer's ``model_max_length``. A model its architecture cannot hold (an
MoE model without Mixtral's or Qwen3-MoE's routing, selection biases, q/k norms written as Llama, ...) is refused
in one line and nothing is written (p3d.hf.config_json.export_problem).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from p3d.checkpoint import find as ckpt_find
from p3d.hf.architectures import Architecture, of_model
from p3d.hf.config_json import context_length, export_problem, hf_config
from p3d.hf.names import hf_names, row_order, twin_name
from p3d.hf.rope_rows import inverse
from p3d.layout.tensors import block_buffers

USAGE = "usage: p3d-export run.dir=<run> out=<dir> [step=N] [max_shard_gb=5] [overwrite=false] [dtype=fp32|bf16]"
KEYS = ("run.dir", "out", "step", "max_shard_gb", "overwrite", "dtype")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KEPT_FP32 = ".mlp.router."  # the routers' weights and selection biases stay fp32 in a bf16 export (as HF keeps them)


class ExportError(ValueError):
    """Bad p3d-export input; the one-line message names the argument, the value and the fix."""


class _ShardWriter:
    def __init__(self, out: Path, max_bytes: float):
        self.out, self.max_bytes = out, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.files: list[tuple[str, list[str]]] = []
        self.total = self.pending_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total += size

    def _flush(self) -> None:
        from p3d.checkpoint.files import save_safetensors

        tmp = f"model-{len(self.files) + 1:05d}.tmp.safetensors"
        save_safetensors(self.out / tmp, self.pending, {"format": "pt"})
        self.files.append((tmp, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        if self.pending:
            self._flush()
        if len(self.files) == 1:
            (self.out / self.files[0][0]).rename(self.out / "model.safetensors")
            return ["model.safetensors"]
        n, weight_map, names = len(self.files), {}, []
        for i, (tmp, tensors) in enumerate(self.files, 1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            (self.out / tmp).rename(self.out / final)
            weight_map.update({t: final for t in tensors})
            names.append(final)
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names


def complete_steps(run_dir: Path) -> list[int]:
    """Steps of the run's complete checkpoints (meta.json written), oldest first."""

    ckpts = ckpt_find.root(run_dir).glob("step_*")
    steps = [d.name.removeprefix("step_") for d in ckpts if (d / "meta.json").is_file()]
    return sorted(int(s) for s in steps if s.isdigit())


def _holds(run_dir: Path) -> str:
    steps = complete_steps(run_dir)
    if not steps:
        return "it holds no complete checkpoint"
    return f"it holds step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}; try step={steps[-1]}"


def _checkpoint(run_dir: Path, step: int | None, given: str) -> Path:

    if not run_dir.is_dir():
        raise ExportError(f"run.dir={given}: no such directory; give the run directory of a p3d-train run")
    if step is None:
        found = ckpt_find.find(run_dir, "auto")
        if found is None:
            raise ExportError(
                f"run.dir={given} holds no complete checkpoint (none in {ckpt_find.root(run_dir)}); "
                "give the run directory of a p3d-train run that saved one"
            )
        return found
    found = ckpt_find.step_dir(run_dir, step)
    if not (found / "meta.json").is_file():
        raise ExportError(f"step={step}: run.dir={given} has no complete checkpoint of that step; {_holds(run_dir)}")
    return found


def _check_out(out: Path, given: str, overwrite: bool, run_dir: Path) -> None:
    """Refuse an ``out`` that is a file, holds files (unless overwrite=true, and then only an earlier
    export: a directory with config.json), or contains the run or the working directory."""
    if out.is_file() or (out.exists() and not out.is_dir()):
        raise ExportError(f"out={given} is a file; give a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise ExportError(
            f"out={given} already holds files; add overwrite=true to replace it whole, or choose another out"
        )
    for inside, what in ((run_dir.resolve(), "run.dir"), (Path.cwd().resolve(), "the working directory")):
        if inside == out.resolve() or out.resolve() in inside.parents:
            raise ExportError(f"out={given} contains {what}; overwrite=true would delete it: choose another out")
    if not (out / "config.json").is_file():
        raise ExportError(
            f"out={given} holds files but no config.json: overwrite=true replaces only an earlier "
            "export; choose another out"
        )


def _run_tokenizer(ckpt: Path, spec: str):
    """(tokenizer, its tokenizer.json, the tokenizer_config.json beside it) of the checkpoint: the copy
    saved with it, or (older checkpoints) the file its run_spec.yaml names; no file for the byte
    tokenizer (the export writes its HF equivalent)."""
    from p3d.data.tokenizer import HF_CONFIG, ByteTokenizer, HFTokenizer

    path = ckpt / "tokenizer.json"
    if not path.is_file():
        if spec == "byte":
            return ByteTokenizer(), None, None
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ExportError(
                f"the run's tokenizer {spec} (data.tokenizer in {ckpt}/run_spec.yaml) is not found from "
                f"{Path.cwd()}, and this checkpoint holds no copy of it; run p3d-export from the "
                "directory the training ran in"
            )
    config = path.with_name(HF_CONFIG) if path.name == "tokenizer.json" else None
    try:
        return HFTokenizer(str(path)), path, config if config and config.is_file() else None
    except Exception as exc:
        raise ExportError(f"the run's tokenizer {path} cannot be read ({type(exc).__name__}: {exc})") from None


def _write_tokenizer(tmp: Path, tokenizer, max_length: int) -> dict[str, dict]:
    """Writes ``tmp/tokenizer.json``: the run's, or (a byte run, which has no file) the byte tokenizer's
    HF equivalent; returns the JSON files that name its special tokens."""
    from p3d.hf.tokenizer import byte_tokenizer_configs, byte_tokenizer_json, tokenizer_configs

    tok, tok_file, tok_config = tokenizer
    target = tmp / "tokenizer.json"
    if tok_file is None:
        target.write_text(byte_tokenizer_json())
        return byte_tokenizer_configs(target, max_length)
    shutil.copyfile(tok_file, target)  # not copy: the umask's mode, like every other file, not the source's
    return tokenizer_configs(tok, tok_config, max_length)


def hf_tensors(
    name: str, full: torch.Tensor, spec: dict, n_layers: int, arch: Architecture, order: list[int] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of the whole p3d tensor ``full`` of parameter ``name`` (shard spec ``spec``): fused blocks
    (q|k|v, gate|up) split, a stacked routed experts' weight split by expert as well (p3d.hf.names). ``order``: the
    HF row each row came from at import (p3d.hf.names.row_order): written back to it."""
    if order is not None:
        full = full[inverse(order)]
    names = hf_names(name, n_layers, arch, range(spec["experts"]) if "experts" in spec else None)
    parts = full.split(spec["blocks"], dim=0) if spec["kind"] == "rows" else full.chunk(len(names), dim=0)
    return list(zip(names, parts, strict=True))


def _is_buffer(name: str, m) -> bool:
    """Whether global ``name`` is a persistent buffer (a router's selection bias), which has no fp32 master."""
    head, _, rest = name.partition(".")
    return head.isdigit() and 1 <= int(head) <= m.n_layers and rest in block_buffers(m, int(head) - 1)


def _write(
    tmp: Path, ckpt: Path, meta: dict, cfg, tokenizer, max_shard_gb: float, dtype: str = "fp32"
) -> tuple[list[str], float]:
    from p3d.checkpoint import checkpointer as checkpoint
    from p3d.checkpoint.reshard import ShardedCheckpoint
    from p3d.hf.tokenizer import special_ids

    tok = tokenizer[0]
    src = ShardedCheckpoint(ckpt, meta, checkpoint.reader(ckpt, meta))
    writer = _ShardWriter(tmp, max_shard_gb * 1e9)
    L, arch = cfg.model.n_layers, of_model(cfg.model)
    for name in src.names():
        spec = src.spec(name)
        if not hf_names(name, L, arch, range(spec.get("experts", 0))):  # a router's selection bias: HF has none
            if src.param(name).any():
                raise ExportError(
                    f"{name} holds non-zero selection biases (model.moe.bias_update_rate="
                    f"{cfg.model.moe.bias_update_rate}), which {arch.name} cannot represent (its router chooses by "
                    "score alone); only runs with model.moe.bias_update_rate=0 export; nothing was written"
                )
            continue
        full = src.param(name).float() if _is_buffer(name, cfg.model) else src.master(name)
        for hf_name, tensor in hf_tensors(name, full, spec, L, arch, row_order(name, arch, cfg.model)):
            writer.add(hf_name, tensor.float() if KEPT_FP32 in f".{name}" else tensor.to(DTYPES[dtype]))
    files = writer.close()
    ids = special_ids(tok)
    config = {**hf_config(cfg.model, tok.eos_id, dtype), **ids}
    files_json = {"config.json": config, "generation_config.json": {**ids, "_from_model_config": False}}
    files_json.update(_write_tokenizer(tmp, tokenizer, context_length(cfg.model)))
    for name, body in files_json.items():
        (tmp / name).write_text(json.dumps(body, indent=2) + "\n")
    return files, writer.total


def export(
    run_dir: str | Path,
    out: str | Path,
    step: int | None = None,
    max_shard_gb: float = 5.0,
    overwrite: bool = False,
    dtype: str = "fp32",
) -> Path:
    """Export the checkpoint of ``step`` (default: the newest) of ``run_dir`` to ``out``; relative paths
    are taken from the working directory. ``dtype``: fp32 (the master weights) or bf16. Raises ExportError (bad
    input, with a one-line message)."""
    from p3d.rundir.paths import absolute
    from p3d.rundir.spec import SPEC_NAME, read_spec

    given_run, given_out = str(run_dir), str(out)
    run_dir, out = absolute(run_dir), absolute(out)  # against the directory the command ran from, ~ expanded
    if max_shard_gb <= 0:
        raise ExportError(f"max_shard_gb={max_shard_gb} must be a positive number of GB; try max_shard_gb=5")
    if dtype not in DTYPES:
        raise ExportError(f"dtype={dtype} is not one p3d-export writes; try dtype=fp32 (or dtype=bf16)")
    ckpt = _checkpoint(run_dir, step, given_run)
    _check_out(out, given_out, overwrite, run_dir)
    step_name = f"step {int(ckpt.name.removeprefix('step_'))}"
    try:
        meta = ckpt_find.verify(ckpt)
        cfg, _ = read_spec(ckpt / SPEC_NAME)
    except (ckpt_find.CheckpointError, FileNotFoundError) as exc:
        raise ExportError(_rephrase(exc, ckpt, run_dir)) from None
    problem = export_problem(cfg.model)
    if problem:
        raise ExportError(f"{step_name} of {given_run}: {problem}; nothing was written")
    tokenizer = _run_tokenizer(ckpt, cfg.data.tokenizer)
    created = [p for p in reversed(out.parents) if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    old = None
    try:
        files, total = _write(tmp, ckpt, meta, cfg, tokenizer, max_shard_gb, dtype)
        if out.exists():  # an empty directory, or an earlier export (overwrite=true): replaced whole
            old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
        os.rename(tmp, out)
    except (ckpt_find.CheckpointError, FileNotFoundError) as exc:  # a file vanished or broke after verify
        _undo(tmp, old, out, created)
        raise ExportError(_rephrase(exc, ckpt, run_dir)) from None
    except BaseException:
        _undo(tmp, old, out, created)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    print(
        f"p3d-export: {step_name} of {given_run} -> {given_out} ({', '.join(files)}, {total / 1e9:.2f} GB {dtype})",
        flush=True,
    )
    return out


def _undo(tmp: Path, old: Path | None, out: Path, created: list[Path]) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    if old is not None and old.exists() and not out.exists():
        os.rename(old, out)
    for p in reversed(created):
        try:
            p.rmdir()
        except OSError:
            break


def _rephrase(exc, ckpt: Path, run_dir: Path) -> str:
    """A checkpoint problem in p3d-export's terms (no training advice)."""
    if not (ckpt / "meta.json").is_file():
        return (
            f"checkpoint {ckpt} was deleted while it was being exported (a running p3d-train keeps only its "
            f"newest checkpoints); nothing was written; {_holds(run_dir)}"
        )
    return f"{getattr(exc, 'problem', exc)}; nothing was written; export another checkpoint: {_holds(run_dir)}"


@torch.no_grad()
def load_sequential(ckpt: str | Path):
    """The single-process twin (tp = pp = 1) of a checkpoint's model, with its fp32 master weights:
    for evaluation, generation or comparisons on one process."""
    from p3d.checkpoint import checkpointer as checkpoint
    from p3d.checkpoint import find as ckpt_find
    from p3d.checkpoint.reshard import ShardedCheckpoint
    from p3d.pipeline.specs import to_sequential
    from p3d.rundir.spec import SPEC_NAME, read_spec

    ckpt = Path(ckpt)
    meta = ckpt_find.verify(ckpt)
    cfg, _ = read_spec(ckpt / SPEC_NAME)
    model = to_sequential(cfg.model, cfg.model.vocab_size, cfg.train.seed)
    src = ShardedCheckpoint(ckpt, meta, checkpoint.reader(ckpt, meta))
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    for name in src.names():
        if twin_name(name) in buffers:  # the routers' selection biases
            buffers[twin_name(name)].copy_(src.param(name))
        else:
            params[twin_name(name)].copy_(src.master(name))
    return model.eval()
