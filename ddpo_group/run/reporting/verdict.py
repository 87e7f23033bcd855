"""The verdict on what a run hands over, from its change on images nothing was chosen on (the fresh final evaluation,
run/fresh_evaluation.py; scripts/evaluate.py's paired difference):

    did_not_learn   the weights are the starting weights (every image the base model's), or the change is within
                    two standard errors of 0: nothing measurable was learnt
    fell            the change is more than two standard errors below 0: below its start
    learned         the change is more than two standard errors above 0

With a held-out reward (eval_reward_fn) a run that learned but whose held-out change is more than two standard errors
below 0 is ``hacked``: the trained reward rose and what it stands for fell.
"""

from __future__ import annotations

import math

LEARNED, DID_NOT_LEARN, FELL, HACKED = "learned", "did_not_learn", "fell", "hacked"
MARGIN = 2.0  # standard errors


def verdict(change: float, se: float, same_as_start: bool = False, heldout: dict | None = None) -> tuple[str, str]:
    """(the verdict, a sentence saying why) of a change ± se (module docstring); ``heldout``: the held-out reward's
    {"change", "se"}, when scored."""
    measured = f"{change:+.4f} ± {se:.4f} (standard error) on fresh images"
    if same_as_start:
        return DID_NOT_LEARN, ("did not learn: the weights it hands over are its starting weights (each fresh image "
                               "is the base model's)")
    if not math.isfinite(se) or abs(change) <= MARGIN * se:
        return DID_NOT_LEARN, f"did not learn: the change, {measured}, is within {MARGIN:g} standard errors of 0"
    if change < 0:
        return FELL, f"fell below its start: the change, {measured}, is more than {MARGIN:g} standard errors below 0"
    if heldout is not None and heldout["change"] < -MARGIN * heldout["se"]:
        return HACKED, (f"hacked: the trained reward rose ({measured}) while the held-out reward fell "
                        f"({heldout['change']:+.4f} ± {heldout['se']:.4f}), more than {MARGIN:g} standard errors")
    return LEARNED, f"learned: the change, {measured}, is more than {MARGIN:g} standard errors above 0"
