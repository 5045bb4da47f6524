"""Slurm: sizing and submitting a job, the srun step inside it, array jobs for p3d-prepare."""
