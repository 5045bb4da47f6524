"""Exit statuses of p3d-train and its workers, for scripts and requeueing recipes."""

OK = 0
WORKER_FAILED = 1  # a worker raised or died; the launcher names the rank
CONFIG_ERROR = 2  # refused before any worker started; one line names the field and the fix
RENDEZVOUS_FAILED = 3  # a worker could not join the others (store path, host or port); p3d-train reports it, exits 1
NONFINITE = 4  # a step's loss or gradient norm was inf/nan (train.on_nonfinite=stop, or train.max_skipped exceeded)
HUNG = 5  # no progress for cluster.timeout_s in a collective / p2p wait; the launcher names who never arrived
NODES_LOST = 6  # an elastic run has fewer nodes left than cluster.elastic.min_nodes; the newest checkpoint is kept
PREEMPTED = 75  # (EX_TEMPFAIL) SIGTERM/SIGUSR1: the step finished, a checkpoint was saved; requeue and resume


class SweepNotDone(SystemExit):
    """Ends ``p3d-train -m`` when some point is not done (p3d.launch.report.SweepCallback, after the report): its
    code is the sweep's exit status, WORKER_FAILED when a point failed, CONFIG_ERROR when all were skipped."""
