"""The sampling phase of an epoch: prompts -> trajectories with log-probs -> rewards -> advantages.

collector.py (RolloutCollector) turns an epoch into sampling rounds (gathered over processes, advantages on the whole
round, DAPO's dynamic sampling); sampler.py (RolloutSampler) samples one process's prompts, reward_scorer.py
(RewardScorer) scores them; snapshot.py undoes what an abandoned sampling phase changed.
"""
