"""The parameters the algorithm tests run each registered estimator with. An estimator takes its config-driven
parameters without defaults (the trainer passes config/base.py's); these are the values the tests' hand computations
assume."""

PARAMS = {
    "grpo": {"norm_adv_by_std": True, "global_std": False},
    "tree_grpo": {"norm_adv_by_std": True},
    "grpo_passk": {"norm_adv_by_std": True},
    "reinforce_plus_plus": {"gamma": 1.0},
    "gae": {"gamma": 1.0, "gae_lambda": 1.0, "whiten": True, "gae_start_value": "critic"},
    "group_ppo": {"tau": 1.0, "max_segment_steps": 16, "numerical_floor": 1e-6, "gae_lambda": 1.0,
                  "norm_adv_by_std": False, "value_source": "critic", "value_blend": 0.5},
}


def params(name: str, **overrides) -> dict:
    """Estimator ``name``'s parameters, with ``overrides``."""
    return {**PARAMS.get(name, {}), **overrides}
