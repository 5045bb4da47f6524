"""``p3d-prepare``'s task: check the data config, then tokenize it into a token store (p3d.data.prepare_store),
one slice of it, a merge of the slices, or an array job of slices on Slurm (p3d.jobs.slurm.prepare)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from p3d.data.prepare_store import check_prepare, our_files, prepare_store
from p3d.data.store import MANIFEST


def prepare_task(cfg_node: DictConfig) -> int:
    from p3d.data.store_parts import slice_config
    from p3d.launch.check import typed_config
    from p3d.launch.compose import config_error
    from p3d.layout.run_plan import P3DConfigError
    from p3d.rundir.paths import absolute

    try:
        cfg = typed_config(cfg_node, resolve_auto=False)
        out = absolute(cfg.prepare.out)
        if cfg.prepare.slices is not None or cfg.cluster.launcher.value == "slurm":
            from p3d.jobs.slurm.prepare import submit_slices

            return submit_slices(cfg, out, check_prepare)
        if cfg.prepare.merge:
            return merge_task(cfg, out)
        if cfg.prepare.shard:
            cfg, out = slice_config(cfg, out)
        finished = check_prepare(cfg, out)
    except (P3DConfigError, OSError, ValueError, KeyError) as exc:
        return config_error(str(exc).strip(chr(39)))
    if finished:
        print(finished, flush=True)
        return 0
    if cfg.prepare.overwrite:
        for f in our_files(out) if out.is_dir() else []:
            f.unlink()
    m = prepare_store(cfg, out)
    print(
        f"p3d-prepare: wrote {out}: {len(m['shards'])} shards, {m['train']['documents']} + {m['val']['documents']} "
        f"documents, {m['train']['tokens']} train + {m['val']['tokens']} val tokens ({m['dtype']}); train with "
        f"data=prepared data.path={out}",
        flush=True,
    )
    return 0


def merge_task(cfg, out: Path) -> int:
    from p3d.data.store_parts import merge_parts

    if (out / MANIFEST).is_file() and not cfg.prepare.overwrite:
        print(f"p3d-prepare: {out} is a finished store; left as it is (prepare.overwrite=true merges again)")
        return 0
    m = merge_parts(out)
    print(
        f"p3d-prepare: merged {m['parts']} parts into {out}: {len(m['shards'])} shards, {m['train']['tokens']} train "
        f"+ {m['val']['tokens']} val tokens; train with data=prepared data.path={out}",
        flush=True,
    )
    return 0
