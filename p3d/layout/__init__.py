"""The pure arithmetic of one run, no torch: parallel dims, the run plan and its cross-group rules, the model's
geometry."""
