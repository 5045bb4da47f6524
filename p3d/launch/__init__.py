"""The launcher: everything between a command line and the workers, in the order it happens.

    compose      compose the config once (Hydra); a config Hydra cannot compose is one line (exit 2)
    resume_base  a resume starts from the resumed run's own spec, the command line's overrides on top
    check        type it, fill what follows from other fields, take the HF shape and tokenizer, make paths
                 absolute, check every field and rule, derive the run plan, pre-flight its memory, check the
                 checkpoint to resume, the run directory and the data
    train        p3d-train's task: the lease, run_spec.yaml and the DeepSpeed JSON, then the workers (local,
                 a Slurm job, or this process as a worker under torchrun / srun)
    plan, prepare, tokenizer   the tasks of p3d-plan, p3d-prepare and p3d-tokenizer
    dryrun       dry_run=true: every stage built on the meta device, the mesh map, exact parameter counts
    sweep, report  -m sweeps (one Slurm job per point) and their table, CSV and plot
    requeue      a restarted or requeued run's spec, frozen again to resume the newest checkpoint

The console scripts (p3d/cli/) are thin wrappers around these; nothing here calls sys.exit: every task returns an
exit status (p3d.exit_codes).
"""
