"""The sampling phase of an epoch: prompts -> trajectories with log-probs -> rewards -> advantages.

collect.py samples and scores one process's prompts; rounds.py turns an epoch into sampling rounds
(gathered over processes, advantages on the whole round, DAPO's dynamic sampling); snapshot.py undoes
what an abandoned sampling phase changed.
"""
