"""Algorithm library: pure tensor functions (no model, no accelerate), each family in a registry.

Advantage estimators, policy losses, KL kinds and KL controllers are looked up by name (or plugin path)::

    from ddpo_group.algorithms import aggregation_weights, get_adv_estimator, get_policy_loss, AdvantageInputs
    out = get_adv_estimator("grpo")(AdvantageInputs(rewards, step_mask, group_index), **params)
    weights = aggregation_weights(step_mask, "step-mean")
    loss, metrics = get_policy_loss("vanilla")(old_lp, lp, out.advantages, weights,
                                               clip_low=1e-4, clip_high=1e-4, clip_ratio_c=3.0)
"""

from ddpo_group.registry import Registry
from .aggregation import (
    AGG_ALIASES,
    AGG_MODES,
    agg_loss,
    aggregation_weights,
    canonical_agg_mode,
    compact_group_index,
    group_stats,
    group_sum,
    masked_mean,
    masked_var,
    masked_whiten,
)
from .kl import (
    KL_CONTROLLER_REGISTRY,
    KL_KIND_REGISTRY,
    AdaptiveKLController,
    FixedKLController,
    KLKind,
    gaussian_kl,
    get_kl_controller,
    get_kl_kind,
    register_kl_kind,
    register_log_ratio_kl,
)
from .value_loss import clipped_value_loss, value_loss_matrix
from .filters import zero_variance_group_filter
from .multi_reward import MULTI_REWARD_MIXES, component_metrics, component_normalized_sum
from .group_ppo import (
    SegmentEndpoints,
    GroupPPOResult,
    GroupThresholdController,
    critic_endpoint_mask_and_targets,
    find_segment_endpoints,
    group_ppo_from_values,
    post_step_values,
    segment_advantages,
    segment_metrics,
    td_deltas,
)
from .advantages import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageInputs,
    AdvantageOutput,
    EstimatorSpec,
    adv_estimator,
    endpoint_targets,
    every_step_returns,
    get_adv_estimator,
    register_adv_est,
    step_reward_estimators,
)
from .policy_losses import (
    POLICY_LOSS_REGISTRY,
    PolicyLossSpec,
    get_policy_loss,
    policy_loss,
    clipped_surrogate,
    ratio_norm_policy_loss,
    register_policy_loss,
    vanilla_policy_loss,
)

from .objectives import (
    OBJECTIVE_REGISTRY,
    ObjectiveSpec,
    draw_times,
    flow_forward,
    get_objective,
    group_rows,
    objective,
    optimality_probability,
    preference_pairs,
    register_objective,
)

__all__ = [name for name in dir() if not name.startswith("_")]
