"""The run's evaluations. During training (``eval_freq``): before the first update and after every due epoch, the
fixed evaluation (run/periodic_eval.py) is run, logged (eval.jsonl, samples/eval_*.png), read by the guard
(run/guard.py), which keeps the best one's weights (run/best_weights.py) and, with ``guard.on_alarm="restore"``, puts
them back after a fall. A run without evaluations (``eval_freq=0``) has the same object, never due. At the end: the
fresh final evaluation (run/fresh_evaluation.py) of the weights handed over and the best evaluation's, beside the base
model, on images nothing was chosen on; the run's summary and verdict read it.
"""

from __future__ import annotations

from contextlib import nullcontext

from ddpo_group.reference.model import ReferenceModel
from ddpo_group.rewards import rising_measure
from ddpo_group.run.best_weights import BestWeights
from ddpo_group.run.fresh_evaluation import FreshEvaluation
from ddpo_group.run.guard import Guard
from ddpo_group.run.periodic_eval import PeriodicEvaluation


class Evaluations:
    """``periodic``: the evaluation (None: eval_freq=0); ``guard``, ``best``: its guard and best weights; ``fresh``:
    the fresh final evaluation; ``weights``: the context holding the weights evaluated (the EMA's with
    train.ema_eval); ``restore(after_epoch)``: the trainer's restore of the best evaluation, returning its epoch;
    ``logger``: the run's EpochLogger."""

    def __init__(self, config, periodic: PeriodicEvaluation | None, guard: Guard | None, best: BestWeights | None,
                 fresh: FreshEvaluation, weights, restore, logger, session, timer):
        self.config, self.periodic, self.guard, self.best, self.fresh = config, periodic, guard, best, fresh
        self.weights, self.restore, self.logger, self.session, self.timer = weights, restore, logger, session, timer

    @classmethod
    def from_config(cls, config, accelerator, family, reward_scorer, gather, model, params, session, timer,
                    weights=nullcontext, restore=None, logger=None, learned=dict, relearn=None) -> "Evaluations":
        """``learned()``, ``relearn(state)``: the run's learned state and its restore (the trainer's), which the best
        weights hold with ``guard.on_alarm="restore"``."""
        fresh = FreshEvaluation.from_config(config, accelerator, family, reward_scorer, gather)
        if not config.eval_freq:
            return cls(config, None, None, None, fresh, weights, restore, logger, session, timer)
        periodic = PeriodicEvaluation.from_config(config, accelerator, family, reward_scorer, gather)
        guard = Guard(config.guard, heldout=periodic.heldout_scorer is not None,
                      rising=rising_measure(reward_scorer.reward_fn))
        restores = config.guard.on_alarm == "restore"
        best = BestWeights(config, accelerator, model, family, params, session, timer,
                           holds=restores or fresh.enabled, restores=restores, learned=learned, relearn=relearn)
        return cls(config, periodic, guard, best, fresh, weights, restore, logger, session, timer)

    def due(self, epoch: int) -> bool:
        return self.periodic is not None and self.periodic.due(epoch)

    def before_training(self) -> None:
        """The evaluation before the first update, and the base model's fresh scores."""
        with self.timer.phase("evaluation"):
            self.fresh.score_base()
        if self.periodic is not None:
            self.evaluate(-1)

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
            restored = self.restore(epoch)
            if epoch == self.config.num_epochs - 1:  # the weights the run hands over, evaluated as they are
                return self.evaluate(epoch, restored)
            return {**result.metrics, "guard/restored_epoch": restored}
        return result.metrics

    def after_training(self, handed_over, model) -> dict:
        """The fresh final evaluation (run/fresh_evaluation.py) of the weights ``handed_over()`` holds (what lora/
        holds) and of the best evaluation's, against the base model's; {} when it is off (``final_eval_num_seeds=0``)
        or cannot be made. Its grids: samples/fresh_{final,best}.png. ``model``: the unwrapped policy."""
        fresh = self.fresh
        if not fresh.enabled:
            return {}
        with self.timer.phase("evaluation"):
            if fresh.base is None:  # resumed from a checkpoint written before the base model's scores were kept
                if not self.config.use_lora:
                    self.session.print("no fresh final evaluation: the checkpoint this run resumed from holds no "
                                       "fresh scores of the base model, and full fine-tuning keeps no base weights")
                    return {}
                with ReferenceModel(model, "base").applied(model):  # the policy with its adapters disabled
                    fresh.score_base()
            final = fresh.score(handed_over)
            best, epoch = None, None
            if self.best is not None and self.best.epoch is not None:
                epoch = self.best.epoch
                best = fresh.score(self.best.swapped_in)
        self.logger.save_image(final.grid, "fresh_final")
        if best is not None:
            self.logger.save_image(best.grid, "fresh_best")
        report = fresh.report(final, best, epoch)
        report["restores"] = list(self.best.restores) if self.best is not None else []
        return report

    def resume(self, records: list[dict]) -> None:
        """A resumed run's evaluations so far (eval.jsonl, rewound to the checkpoint)."""
        if self.periodic is not None:
            self.periodic.restore(records)
            self.guard.replay(records)
