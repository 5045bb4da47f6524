"""``p3d-export``: a p3d checkpoint as a Hugging Face Llama checkpoint.

    p3d-export run.dir=outputs/run1 out=hf/run1              # the newest checkpoint
    p3d-export run.dir=outputs/run1 step=200 out=hf/run1-200 max_shard_gb=5

Writes ``config.json``, ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` shards with
``model.safetensors.index.json`` when larger than ``max_shard_gb``), and the run's tokenizer when it
has one (``tokenizer.json``; the built-in byte tokenizer has no HF equivalent). Tensors are the fp32
master weights, assembled from the (pp, tp) shards one at a time. ``transformers`` loads the result
with ``LlamaForCausalLM.from_pretrained(out)``.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

from p3d.hf import hf_config, hf_names


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
        from safetensors.torch import save_file

        tmp = f"model-{len(self.files) + 1:05d}.tmp.safetensors"
        save_file(self.pending, str(self.out / tmp), metadata={"format": "pt"})
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


def export(run_dir: str | Path, out: str | Path, step: int | None = None, max_shard_gb: float = 5.0) -> Path:
    from p3d.config.spec import SPEC_NAME, read_spec
    from p3d.data.tokenizer import load_tokenizer
    from p3d.train import checkpoint
    from p3d.train.reshard import ShardedCheckpoint

    run_dir = Path(run_dir)
    ckpt = checkpoint.step_dir(run_dir, step) if step is not None else checkpoint.find(run_dir, "auto")
    if ckpt is None:
        raise checkpoint.CheckpointError(f"run.dir={run_dir} holds no complete checkpoint to export")
    meta = checkpoint.verify(ckpt)
    cfg, _ = read_spec(ckpt / SPEC_NAME)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    src = ShardedCheckpoint(ckpt, meta, checkpoint._load_file)
    writer = _ShardWriter(out, max_shard_gb * 1e9)
    L = cfg.model.n_layers
    for name in src.names():
        full = src.master(name)
        spec = src.spec(name)
        parts = full.split(spec["blocks"], dim=0) if spec["kind"] == "rows" else [full]
        for hf_name, tensor in zip(hf_names(name, L), parts):
            writer.add(hf_name, tensor.float())
    files = writer.close()
    tok = load_tokenizer(cfg.data.tokenizer)
    (out / "config.json").write_text(json.dumps(hf_config(cfg.model, tok.eos_id), indent=2) + "\n")
    if cfg.data.tokenizer != "byte":
        shutil.copy(cfg.data.tokenizer, out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.decode([tok.eos_id]) or None}) + "\n")
    print(f"p3d-export: step {meta['step']} of {run_dir} -> {out} ({', '.join(files)}, "
          f"{writer.total / 1e9:.2f} GB fp32)", flush=True)
    return out


@torch.no_grad()
def load_sequential(ckpt: str | Path):
    """The single-process twin (tp = pp = 1) of a checkpoint's model, with its fp32 master weights:
    for evaluation, generation or comparisons on one process."""
    from p3d.config.spec import SPEC_NAME, read_spec
    from p3d.model.pipe import to_sequential
    from p3d.train import checkpoint
    from p3d.train.reshard import ShardedCheckpoint

    ckpt = Path(ckpt)
    meta = checkpoint.verify(ckpt)
    cfg, _ = read_spec(ckpt / SPEC_NAME)
    model = to_sequential(cfg.model, cfg.model.vocab_size, cfg.train.seed)
    src = ShardedCheckpoint(ckpt, meta, checkpoint._load_file)
    params = dict(model.named_parameters())
    for name in src.names():
        target = "tied.embed.weight" if name.startswith("tied_modules.") else f"layers.{name}"
        params[target].copy_(src.master(name))
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    """Console script ``p3d-export run.dir=<run> out=<dir> [step=N] [max_shard_gb=5]``."""
    from p3d.train.checkpoint import CheckpointError

    argv = sys.argv[1:] if argv is None else argv
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    unknown = set(args) - {"run.dir", "out", "step", "max_shard_gb"} or [a for a in argv if "=" not in a]
    if unknown or "run.dir" not in args or "out" not in args:
        print("usage: p3d-export run.dir=<run> out=<dir> [step=N] [max_shard_gb=5]", file=sys.stderr)
        return 2
    from p3d.paths import absolute

    try:  # both paths against the directory the command ran from, ~ expanded
        export(absolute(args["run.dir"]), absolute(args["out"]), int(args["step"]) if "step" in args else None,
               float(args.get("max_shard_gb", 5.0)))
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"p3d-export: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
