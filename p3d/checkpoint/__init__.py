"""The layout-free checkpoint: find and verify (no torch), files, snapshots, the Checkpointer, resharding."""
