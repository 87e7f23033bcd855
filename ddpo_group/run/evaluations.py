"""The evaluations during training (``eval_freq``): before the first update and after every due epoch, the fixed
evaluation (run/periodic_eval.py) is run, logged (eval.jsonl, samples/eval_*.png), read by the guard (run/guard.py),
which keeps the best one's weights (run/best_weights.py) and, with ``guard.on_alarm="restore"``, puts them back after a
fall. A run without evaluations (``eval_freq=0``) has the same object, never due.
"""

from __future__ import annotations

from contextlib import nullcontext

from ddpo_group.rewards import rising_measure
from ddpo_group.run.best_weights import BestWeights
from ddpo_group.run.guard import Guard
from ddpo_group.run.periodic_eval import PeriodicEvaluation


class Evaluations:
    """``periodic``: the evaluation (None: eval_freq=0); ``guard``, ``best``: its guard and best weights; ``weights``:
    the context holding the weights evaluated (the EMA's with train.ema_eval); ``restore()``: the trainer's restore of
    the best weights, returning their evaluation's epoch; ``logger``: the run's EpochLogger."""

    def __init__(self, config, periodic: PeriodicEvaluation | None, guard: Guard | None, best: BestWeights | None,
                 weights, restore, logger, session, timer):
        self.config, self.periodic, self.guard, self.best = config, periodic, guard, best
        self.weights, self.restore, self.logger, self.session, self.timer = weights, restore, logger, session, timer

    @classmethod
    def from_config(cls, config, accelerator, family, reward_scorer, gather, model, params, session, timer,
                    weights=nullcontext, restore=None, logger=None) -> "Evaluations":
        if not config.eval_freq:
            return cls(config, None, None, None, weights, restore, logger, session, timer)
        periodic = PeriodicEvaluation.from_config(config, accelerator, family, reward_scorer, gather)
        guard = Guard(config.guard, heldout=periodic.heldout_scorer is not None,
                      rising=rising_measure(reward_scorer.reward_fn))
        best = BestWeights(config, accelerator, model, family, params, session, timer,
                           restores=config.guard.on_alarm == "restore")
        return cls(config, periodic, guard, best, weights, restore, logger, session, timer)

    def due(self, epoch: int) -> bool:
        return self.periodic is not None and self.periodic.due(epoch)

    def before_training(self) -> dict:
        """The evaluation before the first update (the "before" of the run summary)."""
        return self.evaluate(-1) if self.periodic is not None else {}

    def after_epoch(self, epoch: int) -> dict:
        """The evaluation after epoch ``epoch`` when due (after the update, so the checkpoint that follows holds the
        evaluated weights); its eval/* metrics, or none."""
        return self.evaluate(epoch) if self.due(epoch) else {}

    def evaluate(self, epoch: int, restored: int | None = None) -> dict:
        """The fixed evaluation after epoch ``epoch`` (-1: before the first update) with the weights ``weights()``
        holds, written to eval.jsonl and samples/eval_*.png; returns its eval/* metrics. ``restored``: the epoch whose
        weights the guard has just restored (guard/restored_epoch)."""
        with self.timer.phase("evaluation"), self.weights():
            result = self.periodic.run(epoch)
        if restored is not None:
            result.metrics["guard/restored_epoch"] = restored
        with self.timer.phase("logging"):
            self.logger.log_evaluation(epoch, result.metrics, result.grid,
                                       "ema" if self.weights is not nullcontext else "training",
                                       result.audio, result.audio_sample_rate)
        # the best weights kept, the alarms acted on
        restore = self.guard.after_evaluation(epoch, result.metrics, self.session, self.best, self.weights)
        if restore and restored is None:
            restored = self.restore()
            if epoch == self.config.num_epochs - 1:  # the weights the run hands over, evaluated as they are
                return self.evaluate(epoch, restored)
        return result.metrics

    def resume(self, records: list[dict]) -> None:
        """A resumed run's evaluations so far (eval.jsonl, rewound to the checkpoint)."""
        if self.periodic is not None:
            self.periodic.restore(records)
            self.guard.replay(records)
