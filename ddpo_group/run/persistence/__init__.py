"""What survives a run: atomic checkpoints, their manifest and state files, which to resume, the metrics logs."""
