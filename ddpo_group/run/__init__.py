"""A training run: the epoch loop (trainer.py), its lifecycle (session.py: signals, resume, checkpoints,
summary), what it writes (epoch_logger.py, metrics_log.py, plots.py, summary.py) and its start-up checks."""
