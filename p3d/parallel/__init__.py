"""The workers' distributed runtime: the Mesh and its process groups, rendezvous, the hang watch; tp/ and pipeline/."""
