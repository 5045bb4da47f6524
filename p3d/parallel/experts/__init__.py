"""Expert parallelism (the mixture-of-experts issue): routed experts sharded over ep ranks carved from dp, tokens
dispatched to their experts by all-to-all and combined on the way back. Empty until that issue lands."""
