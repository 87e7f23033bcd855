"""The update phase of an epoch: clipped policy-gradient steps over recorded (sample, step) pairs (policy_update.py)
and the critic's value regression (critic.py)."""
