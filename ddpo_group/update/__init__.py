"""The update phase of an epoch: the update loop every objective shares (updater.py: train batches, chunks of pairs,
the optimizer step), the clipped policy-gradient loss of a chunk of recorded (sample, step) pairs (policy_update.py)
and the critic's value regression (critic.py)."""


def updater_class(kind: str):
    """The update loop of an objective's kind (algorithms/objectives.py's KINDS): the policy gradient's, a matching
    objective's, a preference objective's or on-policy distillation's."""
    from ddpo_group.algorithms.objectives import DISTILLATION, MATCHING, POLICY_GRADIENT, PREFERENCE
    from ddpo_group.update.distillation_update import DistillationUpdater
    from ddpo_group.update.matching_update import MatchingUpdater
    from ddpo_group.update.policy_update import PolicyUpdater
    from ddpo_group.update.preference_update import PreferenceUpdater

    return {POLICY_GRADIENT: PolicyUpdater, MATCHING: MatchingUpdater, PREFERENCE: PreferenceUpdater,
            DISTILLATION: DistillationUpdater}[kind]
