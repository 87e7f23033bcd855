"""The fresh final evaluation: what a run hands over, scored where nothing was chosen.

The evaluations during training (run/periodic_eval.py) draw the curves and feed the guard, which chooses the best of
them on half their images and restores it (run/guard.py): a score read on those images afterwards is read where it
was chosen. At the end of a run this evaluation scores each of

    base    the starting weights (sampled before the first update, kept in the checkpoint)
    final   the weights the run hands over: lora/ (or the full model), the EMA's with train.ema_export
    best    the best evaluation's, lora_best/ (or best/), when the run kept one

on the evaluation's prompts x ``final_eval_num_seeds`` initial noises that no evaluation during training uses (noises
FRESH_NOISE .. FRESH_NOISE + M - 1 of run/periodic_eval.py's ``noise_seed``), with the deterministic sampler. Each
image of ``final`` and ``best`` is paired with the base model's image of the same prompt and noise; over the n pairs

    before = mean r_base        after = mean r_w        change = after - before
    SE     = std(r_w - r_base, ddof 1) / sqrt(n)        the paired difference's standard error

and per prompt its change; the same for the held-out rewards (eval_reward_fn) when the run has them. r is what training
raises on each image (EvalResult's ``trained``): its reward, or a groupwise reward's pointwise score (a win rate's mean
over a group is 1/2 whatever the images); a groupwise reward that declares none leaves the reward unscored here. The
run's summary gives these (run/reporting/summary.py) and its verdict reads ``final``'s change
(run/reporting/verdict.py).
"""

from __future__ import annotations

import math

import torch

from ddpo_group.rewards import rising_measure
from ddpo_group.rollout.component import Component
from ddpo_group.run.components import register_component
from ddpo_group.run.periodic_eval import PeriodicEvaluation

FRESH_NOISE = 1_000_000  # the first fresh noise's index: the evaluations during training use 0 .. eval_num_seeds - 1


def paired(weights: torch.Tensor, base: torch.Tensor, groups: list[str]) -> dict:
    """before, after, change and its standard error (module docstring) of ``weights``' rewards against ``base``'s
    [n] (same rows), and each group's change ({group: change}, ``groups``: each row's)."""
    weights, base = weights.double(), base.double()
    difference = weights - base
    n = difference.numel()
    se = float(difference.std()) / math.sqrt(n) if n > 1 else float("nan")
    per_group: dict[str, list[float]] = {}
    for group, value in zip(groups, difference.tolist()):
        per_group.setdefault(group, []).append(value)
    return {"before": float(base.mean()), "after": float(weights.mean()), "change": float(difference.mean()), "se": se,
            "per_prompt": {group: sum(values) / len(values) for group, values in per_group.items()}}


@register_component("fresh_evaluation")
class FreshEvaluation(Component):
    """The fresh final evaluation (module docstring); its checkpointed state is the base model's scores. Disabled
    (``final_eval_num_seeds=0``) it scores nothing and reports {}."""

    stateful = True
    missing_ok = True  # a checkpoint written before it existed: the base model is scored at the end instead

    @classmethod
    def build(cls, parts):
        return parts.fresh_evaluation

    def __init__(self, periodic: PeriodicEvaluation | None):
        """``periodic``: the evaluation on the fresh noises (None: disabled)."""
        self.periodic = periodic
        self.base: torch.Tensor | None = None  # [n] the base model's trained measure (module docstring) on them
        self.base_heldout: torch.Tensor | None = None  # [n] its held-out rewards

    @classmethod
    def from_config(cls, config, accelerator, family, reward_scorer, gather) -> "FreshEvaluation":
        seeds = int(config.final_eval_num_seeds)
        periodic = PeriodicEvaluation.from_config(config, accelerator, family, reward_scorer, gather,
                                                  num_seeds=seeds, first_noise=FRESH_NOISE) if seeds else None
        return cls(periodic)

    @property
    def enabled(self) -> bool:
        return self.periodic is not None

    def learned_state(self):
        return None  # the base model's scores: nothing the run learned

    def score_base(self) -> None:
        """The starting weights' fresh scores (before the first update, or in a context that holds them)."""
        if self.enabled and self.base is None:
            result = self.periodic.run(-1)
            self.base, self.base_heldout = result.trained, result.heldout

    def score(self, weights):
        """The EvalResult of the weights ``weights()`` holds on the fresh images."""
        with weights():
            return self.periodic.run(0)

    def report(self, final, best=None, best_epoch: int | None = None) -> dict:
        """The fresh scores of ``final`` and ``best`` (EvalResults; ``best_epoch``: its evaluation) against the base
        model's (``score_base`` first): {"images", "prompts", "noises", "reward": {"final": paired, "best": paired},
        "heldout": {...}, "same_as_start"}."""
        periodic = self.periodic
        groups = [periodic.prompts[r // periodic.num_seeds] for r in range(periodic.num_rows)]
        out = {"images": periodic.num_rows, "prompts": len(periodic.prompts), "noises_per_prompt": periodic.num_seeds,
               "noises": f"{FRESH_NOISE}..{FRESH_NOISE + periodic.num_seeds - 1} (evaluations during training use "
                         f"0..{int(periodic.config.eval_num_seeds) - 1})",
               "reward_measure": rising_measure(periodic.reward_scorer.reward_fn) or "none (a groupwise reward without a "
                                                                                   "pointwise score)"}
        for measure, base in (("reward", self.base), ("heldout", self.base_heldout)):
            if base is None:
                continue
            scored = {"final": paired(final.trained if measure == "reward" else final.heldout, base, groups)}
            if best is not None:
                scored["best"] = {"epoch": best_epoch,
                                  **paired(best.trained if measure == "reward" else best.heldout, base, groups)}
            out[measure] = scored
        out["same_as_start"] = self.base is not None and bool(torch.equal(final.trained, self.base))
        return out

    def state_dict(self) -> dict:
        return {"base": self.base, "base_heldout": self.base_heldout}

    def load_state_dict(self, state: dict) -> None:
        self.base, self.base_heldout = state["base"], state["base_heldout"]
