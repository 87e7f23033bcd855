"""The guard: rules over the evaluations during training (run/periodic_eval.py) that name reward hacking and collapse
when they begin, instead of after the GPU hours are spent, and the best evaluation whose weights are kept.

Each evaluation (epoch -1: before training) gives the guard its metrics:

    best       the evaluation with the highest held-out reward (eval_heldout/reward_mean: eval_reward_fn), else the
               highest eval/reward_mean; its weights are kept (lora_best/, or best/ for full fine-tuning)
    heldout    eval_heldout/reward_mean < its best - guard.heldout_drop x SE while eval/reward_mean > its value at
               that best evaluation: the held-out reward falls while the trained one rises (SE: the held-out reward's
               std over the evaluation's images / sqrt(their number), at the best evaluation)
    diversity  eval/diversity < guard.min_diversity x its value before training: each prompt's images alike
    drift      some |eval/drift/<statistic>| > guard.max_drift: the images' look moved (run/reporting/image_stats.py)

A rule raises its alarm once; ``guard.on_alarm`` says what an alarm does (the trainer: "warn", "stop", "off"). Every
process observes the same gathered metrics, so all decide alike. A resumed run replays its eval.jsonl.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ON_ALARM = ("warn", "stop", "off")


@dataclass
class Alarm:
    rule: str  # "heldout", "diversity" or "drift"
    message: str


class Guard:
    def __init__(self, config, heldout: bool):
        """``config``: the config's guard section; ``heldout``: whether the evaluations hold held-out rewards."""
        if config.on_alarm not in ON_ALARM:
            raise ValueError(f"guard.on_alarm={config.on_alarm!r} must be one of {ON_ALARM}")
        self.config, self.heldout = config, heldout
        self.best: dict | None = None  # {"epoch", "score", "reward", "se"} of the best evaluation so far
        self.start_diversity: float | None = None
        self.raised: set[str] = set()

    @property
    def measure(self) -> str:
        return "eval_heldout/reward_mean" if self.heldout else "eval/reward_mean"

    def observe(self, epoch: int, metrics: dict) -> tuple[bool, list[Alarm]]:
        """(whether evaluation ``epoch`` is the best so far, the alarms it raises for the first time)."""
        score = metrics[self.measure]
        best = self.best is None or score > self.best["score"]
        if best:
            std = metrics.get("eval_heldout/reward_std", 0.0) if self.heldout else 0.0
            self.best = {"epoch": epoch, "score": score, "reward": metrics["eval/reward_mean"],
                         "se": std / math.sqrt(max(int(metrics.get("eval/num_images", 1)), 1))}
        if epoch < 0 or self.start_diversity is None:
            self.start_diversity = metrics.get("eval/diversity")
        alarms = [alarm for alarm in self.rules(epoch, metrics) if alarm.rule not in self.raised]
        self.raised |= {alarm.rule for alarm in alarms}
        return best, alarms

    def rules(self, epoch: int, metrics: dict) -> list[Alarm]:
        c, best, alarms = self.config, self.best, []
        after = f"after epoch {epoch}"
        if self.heldout and epoch > best["epoch"]:
            score, reward = metrics[self.measure], metrics["eval/reward_mean"]
            if score < best["score"] - c.heldout_drop * best["se"] and reward > best["reward"]:
                alarms.append(Alarm("heldout", (
                    f"the held-out reward fell to {score:.4f} {after}, {best['score'] - score:.4f} below its best "
                    f"{best['score']:.4f} (epoch {best['epoch']}; more than guard.heldout_drop={c.heldout_drop:g} "
                    f"standard errors of {best['se']:.4f}), while the training reward's evaluation rose from "
                    f"{best['reward']:.4f} to {reward:.4f}: the trained reward is being hacked")))
        diversity = metrics.get("eval/diversity")
        if diversity is not None and self.start_diversity and diversity < c.min_diversity * self.start_diversity:
            alarms.append(Alarm("diversity", (
                f"eval/diversity fell to {diversity:.4f} {after}, below guard.min_diversity={c.min_diversity:g} of its "
                f"{self.start_diversity:.4f} before training: each prompt's images look alike")))
        drifts = {key: value for key, value in metrics.items() if key.startswith("eval/drift/")}
        if drifts:
            key = max(drifts, key=lambda k: abs(drifts[k]))
            if abs(drifts[key]) > c.max_drift:
                alarms.append(Alarm("drift", (
                    f"{key}={drifts[key]:+.4f} {after}: the images' {key.rsplit('/', 1)[1]} moved more than "
                    f"guard.max_drift={c.max_drift:g} from before training")))
        return alarms

    def after_evaluation(self, epoch: int, metrics: dict, session, weights) -> None:
        """Evaluation ``epoch`` observed: its weights, inside ``weights()``, kept when it is the best so far
        (session.keep_best), and each alarm it raises acted on as guard.on_alarm says: "warn" one line naming the
        rule, its numbers and the best evaluation; "stop" that line, then the run stops after this epoch with a
        checkpoint and exit 0 (session.stop_by_guard); "off" nothing."""
        best, alarms = self.observe(epoch, metrics)
        if best:
            session.keep_best(epoch, self.measure, metrics[self.measure], weights)
        if self.config.on_alarm == "off":
            return
        for alarm in alarms:
            session.print(f"guard ({alarm.rule}): {alarm.message}; {self.best_line()}, its weights in "
                          f"{session.best_path()}")
            session.guard_notes.append(f"{alarm.rule} after epoch {epoch}")
            if self.config.on_alarm == "stop":
                session.stop_by_guard(alarm.message)

    def best_line(self) -> str:
        return (f"the best evaluation so far: epoch {self.best['epoch']}, {self.measure}={self.best['score']:.4f}"
                if self.best else "no evaluation yet")

    def replay(self, records: list[dict]) -> None:
        """A resumed run's evaluations (eval.jsonl, rewound to its checkpoint), observed again without a word."""
        for record in records:
            if self.measure in record:
                self.observe(record["epoch"], record)
