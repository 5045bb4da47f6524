"""The launcher side that starts and watches workers: local fork/exec, restarts, stop signals, log following;
slurm/ for Slurm jobs."""
