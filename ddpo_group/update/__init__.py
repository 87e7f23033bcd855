"""The update phase of an epoch: the update loop every objective shares (updater.py: train batches, chunks of pairs,
the optimizer step), the clipped policy-gradient loss of a chunk of recorded (sample, step) pairs (policy_update.py)
and the critic's value regression (critic.py)."""
