"""The guard: rules over the evaluations during training (run/periodic_eval.py) that name reward hacking, a fall and
collapse when they begin, instead of after the GPU hours are spent, and the best evaluation whose weights are kept.

The measures it reads (every evaluation, epoch -1: before training):

    rising     what training raises: eval/reward_mean; for a groupwise reward (a win rate, a rank: its evaluation mean
               is the same whatever the images) the pointwise score it declares (rewards/base.py's
               ``pointwise_score``, e.g. eval/reward_info/score, the judge's score), or none when it has none
    measure    what the best evaluation is chosen by: the held-out reward (eval_heldout/reward_mean: eval_reward_fn),
               else the rising measure, else eval/reward_mean
    SE         a measure's standard error at an evaluation: the std over its N x M images / sqrt(their number)

The rules, each raising its alarm once:

    heldout    the held-out reward below its best by more than guard.heldout_drop SE while the rising measure rose
               above its value at that best (no rising measure: the held-out fall alone): the trained reward is hacked
    fall       the rising measure below its best by more than guard.fall_drop SE and below its value before training:
               the run lost what it had learnt (the measure it is trained on falls)
    diversity  eval/diversity < guard.min_diversity x its value before training: each prompt's images alike
    drift      some |eval/drift/<statistic>| > guard.max_drift x that statistic's spread over the images before
               training (eval/image_spread/<statistic>: the std over the images): the images' look moved
               (run/reporting/image_stats.py); a family with audio: its eval/drift/audio/<statistic> too, in
               eval/audio_spread/<statistic> (run/reporting/audio_stats.py)

The best evaluation is chosen on one half of the evaluation's images (the even initial noises of each prompt: its
measure's select_half/ entry) and its score reported on the other half (report_half/): the best of several
evaluations of the same images is biased up by its own selection, the other half's is not. Its weights are kept
(lora_best/, best/) with best.json holding both (``selected_on``, ``reported_on``).

``guard.on_alarm`` says what an alarm does: "warn" one line, "stop" the line then a checkpoint and exit 0, "restore"
the line, and an alarm of a rule that finds the run below its best (fall, heldout) also loads the best evaluation's
weights back into the policy and training goes on (the trainer's ``restore_best``; those two rules then fire at every
evaluation that finds it so again, and a restore after the last epoch is evaluated again: the run ends with the
weights it hands over evaluated), "off" nothing (``Guard.after_evaluation``). Every process observes the same gathered
metrics, so all decide alike. A resumed run replays its eval.jsonl.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddpo_group.run.reporting.image_stats import spread_of

ON_ALARM = ("warn", "stop", "restore", "off")
RESTORING = ("fall", "heldout")  # the rules that find the run below its best: "restore" loads the best back
SELECT, REPORT = "select_half", "report_half"


@dataclass
class Alarm:
    rule: str  # "heldout", "fall", "diversity" or "drift"
    message: str


def half(measure: str, which: str) -> str:
    """``measure``'s entry on one half of the evaluation's images: eval/reward_mean -> eval/<which>/reward_mean."""
    prefix, _, rest = measure.partition("/")
    return f"{prefix}/{which}/{rest}"


class Guard:
    def __init__(self, config, heldout: bool, rising: str | None = "eval/reward_mean"):
        """``config``: the config's guard section; ``heldout``: whether the evaluations hold held-out rewards;
        ``rising``: the metric training raises (module docstring), None for a reward that declares none."""
        if config.on_alarm not in ON_ALARM:
            raise ValueError(f"guard.on_alarm={config.on_alarm!r} must be one of {ON_ALARM}")
        self.config, self.heldout, self.rising = config, heldout, rising
        self.measure = "eval_heldout/reward_mean" if heldout else (rising or "eval/reward_mean")
        self.best: dict | None = None  # the best evaluation so far: epoch, its selection and report scores, SE
        self.peak: dict | None = None  # the rising measure's best evaluation so far: epoch, value, SE
        self.start: dict = {}  # the evaluation before training: the rising measure, eval/diversity, the spreads
        self.raised: set[str] = set()

    def observe(self, epoch: int, metrics: dict) -> tuple[bool, list[Alarm]]:
        """(whether evaluation ``epoch`` is the best so far, the alarms it raises for the first time)."""
        if epoch < 0 or not self.start:
            self.start = dict(metrics)
        selected = metrics.get(half(self.measure, SELECT), metrics[self.measure])
        best = self.best is None or selected > self.best["selected"]
        if best:
            self.best = {"epoch": epoch, "selected": selected, "score": metrics[self.measure],
                         "reported": metrics.get(half(self.measure, REPORT), metrics[self.measure]),
                         "rising": metrics.get(self.rising), "se": standard_error(metrics, self.measure)}
        if self.rising in metrics and (self.peak is None or metrics[self.rising] > self.peak["value"]):
            self.peak = {"epoch": epoch, "value": metrics[self.rising], "se": standard_error(metrics, self.rising)}
        alarms = [alarm for alarm in self.rules(epoch, metrics) if alarm.rule not in self.raised]
        restoring = RESTORING if self.config.on_alarm == "restore" else ()  # these fire again after a restore
        self.raised |= {alarm.rule for alarm in alarms if alarm.rule not in restoring}
        return best, alarms

    def rules(self, epoch: int, metrics: dict) -> list[Alarm]:
        config, best, alarms = self.config, self.best, []
        after = f"after epoch {epoch}"
        if self.heldout and epoch > best["epoch"]:
            score, rising = metrics[self.measure], metrics.get(self.rising)
            rose = rising is None or best["rising"] is None or rising > best["rising"]
            if score < best["score"] - config.heldout_drop * best["se"] and rose:
                trained = (f"while the training reward's evaluation ({self.rising}) rose from {best['rising']:.4f} to "
                           f"{rising:.4f}" if rising is not None and best["rising"] is not None else
                           "(the training reward states no pointwise score that rises)")
                alarms.append(Alarm("heldout", (
                    f"the held-out reward fell to {score:.4f} {after}, {best['score'] - score:.4f} below its best "
                    f"{best['score']:.4f} (epoch {best['epoch']}; more than guard.heldout_drop={config.heldout_drop:g} "
                    f"standard errors of {best['se']:.4f}), {trained}: the trained reward is being hacked")))
        peak, start = self.peak, self.start.get(self.rising)
        if peak is not None and self.rising in metrics and epoch > peak["epoch"] and start is not None:
            value = metrics[self.rising]
            if value < peak["value"] - config.fall_drop * peak["se"] and value < start:
                alarms.append(Alarm("fall", (
                    f"{self.rising} fell to {value:.4f} {after}, {peak['value'] - value:.4f} below its best "
                    f"{peak['value']:.4f} (epoch {peak['epoch']}; more than guard.fall_drop={config.fall_drop:g} "
                    f"standard errors of {peak['se']:.4f}) and below its {start:.4f} before training: the run is "
                    "losing what it learnt")))
        diversity, first = metrics.get("eval/diversity"), self.start.get("eval/diversity")
        if diversity is not None and first and diversity < config.min_diversity * first:
            alarms.append(Alarm("diversity", (
                f"eval/diversity fell to {diversity:.4f} {after}, below guard.min_diversity={config.min_diversity:g} of "
                f"its {first:.4f} before training: each prompt's images look alike")))
        scaled = {}
        for key, value in metrics.items():
            if key.startswith("eval/drift/"):
                spread = self.start.get(spread_of(key))
                if spread:
                    scaled[key] = value / spread
        if scaled:
            key = max(scaled, key=lambda k: abs(scaled[k]))
            if abs(scaled[key]) > config.max_drift:
                kind, _, name = key.removeprefix("eval/drift/").rpartition("/")
                whose = "audio's" if kind == "audio" else "images'"
                alarms.append(Alarm("drift", (
                    f"{key}={metrics[key]:+.4f} {after}: the {whose} {name} moved {abs(scaled[key]):.2f} times its "
                    f"spread over the {'samples' if kind else 'images'} before training "
                    f"({self.start[spread_of(key)]:.4f}), more than guard.max_drift={config.max_drift:g}")))
        return alarms

    def after_evaluation(self, epoch: int, metrics: dict, session, best_weights, weights) -> bool:
        """Evaluation ``epoch`` observed: its weights, inside ``weights()``, kept when it is the best so far
        (run/best_weights.py's ``best_weights.keep``, with the score it was selected on and the one reported), and each
        alarm it raises acted on as guard.on_alarm says (module docstring). True when the best evaluation's weights are
        to be restored."""
        best, alarms = self.observe(epoch, metrics)
        if best:
            best_weights.keep(epoch, self.measure, self.best_record(), weights)
        if self.config.on_alarm == "off":
            return False
        restore = False
        for alarm in alarms:
            restores = self.config.on_alarm == "restore" and alarm.rule in RESTORING
            action = f"; restoring the weights of epoch {self.best['epoch']}" if restores else ""
            session.print(f"guard ({alarm.rule}): {alarm.message}; {self.best_line()}, its weights in "
                          f"{best_weights.path}{action}")
            session.guard_notes.append(f"{alarm.rule} after epoch {epoch}"
                                       + (f": the weights of epoch {self.best['epoch']} restored" if restores else ""))
            if self.config.on_alarm == "stop":
                session.stop_by_guard(alarm.message)
            restore |= restores
        return restore

    def best_record(self) -> dict:
        """best.json's scores: chosen on one half of the evaluation's images, reported on the other."""
        return {"score": self.best["reported"],
                "selected_on": {"images": "the even initial noises of each prompt", "score": self.best["selected"]},
                "reported_on": {"images": "the odd initial noises of each prompt", "score": self.best["reported"]}}

    def best_line(self) -> str:
        return (f"the best evaluation so far: epoch {self.best['epoch']}, {self.measure}={self.best['reported']:.4f} "
                "on the half of its images it was not chosen on" if self.best else "no evaluation yet")

    def replay(self, records: list[dict]) -> None:
        """A resumed run's evaluations (eval.jsonl, rewound to its checkpoint), observed again without a word."""
        for record in records:
            if self.measure in record:
                self.observe(record["epoch"], record)


def standard_error(metrics: dict, measure: str) -> float:
    """``measure``'s standard error at an evaluation: the std of its entry over the images / sqrt(their number)."""
    std = metrics.get(measure.replace("_mean", "_std") if measure.endswith("reward_mean") else f"{measure}_std", 0.0)
    return float(std) / math.sqrt(max(int(metrics.get("eval/num_images", 1)), 1))
