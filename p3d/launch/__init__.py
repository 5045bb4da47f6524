"""Everything between a command line and the workers, in the order it happens:

    hydra_app   compose the config once (Hydra), report a config error in one line (exit 2)
    prepare     type it, fill the cluster preset and dtype, take the HF shape and tokenizer, make paths
                absolute, check every rule, derive the run plan, pre-flight the memory plan, check the
                checkpoint to resume, the run directory and the data
    train       take the run directory's lease, freeze run_spec.yaml and the DeepSpeed JSON, launch
                (local workers, a Slurm job, or this process as a worker under torchrun / srun)

The console scripts in p3d/cli.py, p3d/plan/cli.py and p3d/data/train_tokenizer.py are thin wrappers
around these; nothing here calls sys.exit: every step returns an exit status (p3d.exit_codes).
"""
