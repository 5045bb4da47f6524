"""Expert parallelism (docs/moe.md): routed experts split over ep ranks carved from dp, tokens dispatched to their
experts by all-to-all and combined on the way back (dispatch), the experts' marker (params), and the step's routing
figures with aux-loss-free balancing (balance)."""
