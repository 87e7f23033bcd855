"""The pre-flight check (``scripts/check.py``): does the training forward reproduce what the sampler did?

It builds the run as training would (run/trainer.py: the family, precision, LoRA, compile_denoiser,
pairs_per_forward, guidance, the objective), in a scratch directory, samples one sampling batch with the training
sampler (the rollout policy, in the training precision, under sample.precision as the run samples), and then:

* a policy-gradient run: re-scores every recorded stochastic transition x_n -> x_{n+1} through the training forward,
  chunk by chunk of train.pairs_per_forward pairs in training mode, as the update does, and compares it with the
  recorded log-probability, judged against what it protects:

      1. per step: max |l_train - l_recorded|, max |ratio - 1| and the share of pairs outside the policy loss's trust
         region (train.clip_range for a ratio-clipping loss; another loss's own bound, policy_losses.py)
      2. consistent when max |ratio - 1| <= the precision's tolerance (update/on_policy.py) and at most
         CLIPPED_SHARE of the pairs are outside the trust region: beyond it PPO's clipping acts on numerics
      3. the training forward's randomness: the first chunk scored twice in training mode; any difference beyond
         RANDOM_SHARE of the tolerance is a random forward (dropout or another stochastic layer left on), named with
         its size and the layers that cause it
      4. on a mismatch, each change it can test re-scores with that one thing changed: the sampler's guidance scale,
         the sampler's noise level, each recorded x_n rounded to the model's dtype (precision), the sampling
         batch's layout of pairs, the eager forward (compilation), the family's schedule (timesteps), the log-prob
         in float64; a change is named when it removes at least NAMED_SHARE of the gap (most of it: a residual of
         the CPU's own rounding decides nothing); and the clip range that would leave at most CLIPPED_SHARE of the
         pairs clipped
* a matching or preference objective (deterministic rollouts, no log-probabilities: algorithm.objective): runs the
  training forward at each recorded x_n (the forward process's velocity path, the training guidance, training mode,
  at the rollout policy: the old model's for an objective that samples with one) through the family's deterministic
  step and compares the result with the recorded x_{n+1}: per step max |difference| / max |x_{n+1}|, against the
  precision's tolerance. Its forward-process loss is then evaluated at that same model, so the check is whether the
  model it trains is the model that sampled.

It also reports the device memory a forward and backward of pairs_per_forward pairs takes (CUDA), the seconds an
epoch will take (the sampled batch's seconds, and one chunk's forward and backward after a warm-up one, scaled to an
epoch's samples and pairs on one process) and the config's warnings.
"""

from __future__ import annotations

import copy
import tempfile
import time
from dataclasses import dataclass, field, replace

import torch

from ddpo_group.algorithms import get_policy_loss
from ddpo_group.algorithms.policy_losses import dppo_kl, outside_kl_bound
from ddpo_group.rollout.sampler import sampling_precision, widened
from ddpo_group.run.config_checks import config_warnings
from ddpo_group.sampling.gaussian import gaussian_log_prob
from ddpo_group.sampling.noise import round_seed, sample_generators
from ddpo_group.sampling.trajectories import condition_dtype
from ddpo_group.update.on_policy import CLIPPED_SHARE, RATIO_TOLERANCE, ratio_deviation

# max |x_{n+1} - step(training forward)| / max |x_{n+1}| a deterministic rollout allows, by mixed_precision
MATCHING_TOLERANCE = {"no": 1e-4, "fp16": 5e-3, "bf16": 2e-2}
NAMED_SHARE = 0.75  # a change is named when alone it removes at least this share of the worst |ratio - 1|
RANDOM_SHARE = 0.1  # two training-mode passes over the same pairs differing by more than this share of the tolerance


@dataclass
class Rescored:
    """The recorded stochastic transitions scored again: per pair its step, l_train - l_recorded, |ratio - 1| and
    whether the policy loss's trust region acts on it."""

    steps: torch.Tensor  # [P]
    difference: torch.Tensor  # [P]
    deviation: torch.Tensor  # [P]
    outside: torch.Tensor  # [P] bool
    kl: torch.Tensor  # [P] the exact KL of each step's Gaussian, recorded to re-scored

    @property
    def worst(self) -> float:
        return float(self.deviation.max())

    @property
    def clipped(self) -> float:
        return float(self.outside.float().mean())

    def per_step(self) -> dict:
        return {int(n): {"log_prob": float(self.difference[self.steps == n].abs().max()),
                         "ratio": float(self.deviation[self.steps == n].max()),
                         "clipped": float(self.outside[self.steps == n].float().mean())}
                for n in self.steps.unique()}


@dataclass
class CheckResult:
    checks: str  # what was compared
    per_step: dict  # {step: {column: value}}
    worst: float  # the largest difference (|ratio - 1| or the relative step error)
    tolerance: float
    clipped: float = 0.0  # the share of pairs outside the policy loss's trust region (a policy-gradient run)
    random: float = 0.0  # the largest difference of two training-mode passes over the same pairs
    causes: dict = field(default_factory=dict)  # {change: (worst |ratio - 1|, clipped share) with it} (a mismatch)
    lines: list = field(default_factory=list)  # the report

    @property
    def on_policy(self) -> bool:
        return self.worst <= self.tolerance and self.clipped <= CLIPPED_SHARE

    @property
    def consistent(self) -> bool:
        return self.on_policy and self.random <= RANDOM_SHARE * self.tolerance

    def named(self) -> list:
        """The changes that alone remove the mismatch or most of it (NAMED_SHARE of its worst |ratio - 1|)."""
        return [change for change, (worst, clipped) in self.causes.items()
                if (worst <= self.tolerance and clipped <= CLIPPED_SHARE) or worst <= (1 - NAMED_SHARE) * self.worst]


def stochastic_layers(model, most: int = 5) -> list:
    """The names of ``model``'s dropout layers with p > 0 (at most ``most``, then how many more)."""
    found = [f"{name} (p={module.p:g})" for name, module in model.named_modules()
             if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0]
    return found[:most] + ([f"{len(found) - most} more"] if len(found) > most else [])


def check_config(config, directory: str):
    """A copy of ``config`` for the check: a fresh run in ``directory`` that writes nothing else (no wandb, no
    evaluation, checkpoint or grid)."""
    config = copy.deepcopy(config)
    config.logdir, config.run_name, config.resume_from = directory, "check", ""
    config.wandb.mode, config.eval_freq, config.save_freq, config.log_images_every = "disabled", 0, 0, 0
    config.num_epochs = 1
    config.sft.epochs, config.sft.data_dir = 0, ""  # the check samples and re-scores the reinforcement learning's steps
    return config


class CheckFailed(RuntimeError):
    """The check was built but failed while it ran (sampling, scoring, the re-scoring): not a usage error."""


def run_check(config, say=print) -> CheckResult:
    """Build, sample, compare (module docstring); prints the report through ``say`` and returns it. An error building
    the run (the config, the model, the reward or prompts it names) propagates as it is; one while the check runs is
    raised as CheckFailed."""
    from ddpo_group.run.trainer import Trainer  # the run as training builds it

    with tempfile.TemporaryDirectory() as directory:
        trainer = Trainer(check_config(config, directory))
        try:
            return Preflight(trainer, say).run()
        except Exception as error:
            raise CheckFailed(f"the check failed while it ran: {type(error).__name__}: {error}") from error
        finally:
            trainer.rollouts.close()


class Preflight:
    def __init__(self, trainer, say=print):
        self.trainer, self.say = trainer, say
        self.config, self.family, self.accelerator = trainer.config, trainer.family, trainer.accelerator

    # ------------------------------------------------------------------ the check
    def run(self) -> CheckResult:
        config, family = self.config, self.family
        start = time.perf_counter()
        batch = self.sample_batch()
        sampling_s = time.perf_counter() - start
        policy_gradient = not self.trainer.objective.is_matching  # on-policy distillation trains on the recorded steps too
        result = self.rescore_check(batch) if policy_gradient else self.matching_check(batch)
        head = (f"pre-flight check: {config.preset or 'a config'} on {config.pretrained.model} ({family.name}), "
                f"mixed_precision {config.mixed_precision}, {len(batch)} samples x {batch.num_steps} steps")
        lines = [head, f"checks: {result.checks}", ""] + result.lines
        verdict = "consistent" if result.consistent else "NOT consistent"
        judged = f"worst {result.worst:.3g}, tolerance {result.tolerance:g} for mixed_precision={config.mixed_precision}"
        if policy_gradient:
            region = get_policy_loss(config.algorithm.policy_loss).trust_region_fields(config)
            judged += (f"; {result.clipped:.1%} of the pairs outside the loss's trust region ({region}) before any "
                       f"update, at most {CLIPPED_SHARE:.0%} allowed")
        lines.append(f"verdict: {verdict} ({judged})")
        lines += self.cause_lines(result)
        lines += [""] + self.resources(batch, sampling_s)
        warnings = config_warnings(config)
        lines += ["", "config warnings:" if warnings else "config warnings: none"] + [f"  {w}" for w in warnings]
        result.lines = lines
        for line in lines:
            self.say(line)
        return result

    def cause_lines(self, result: CheckResult) -> list:
        """The report of a mismatch: a random training forward, and each change tested alone with what it removes."""
        lines = []
        if result.random > RANDOM_SHARE * result.tolerance:
            layers = stochastic_layers(self.accelerator.unwrap_model(self.trainer.model))
            lines.append(f"the training forward is random: the same pairs scored twice in training mode differ by up "
                         f"to {result.random:.3g} in log-probability; stochastic layers active in training mode: "
                         f"{', '.join(layers) or 'none of torch.nn.Dropout* (another random op)'}. Turn them off (p = 0: "
                         "lora_dropout, the denoiser config's dropout / attention_dropout fields) before training with "
                         "it, or weigh the rollouts with algorithm.rollout_correction")
        if self.config.sample.precision and not result.consistent:
            lines.append(f"the sampler runs under sample.precision={self.config.sample.precision!r} and the training "
                         f"forward in mixed_precision={self.config.mixed_precision!r}: the rollouts' log-probabilities "
                         "are not the trainer's; algorithm.rollout_correction weighs (or rejects) the pairs by their "
                         "ratio (docs/algorithms.md, Rollout correction), or sample.precision='' samples as it trains")
        if not result.causes:
            return lines
        named = result.named()
        lines.append("likely cause: " + (", ".join(named) if named else f"none of the tested ones (none alone removes "
                                                                      f"{NAMED_SHARE:.0%} of the difference)"))
        for change, (worst, clipped) in result.causes.items():
            removed = 1 - worst / result.worst if result.worst > 0 else 0.0
            lines.append(f"  with {change} changed: worst {worst:.3g} ({removed:.0%} of it removed), {clipped:.1%} "
                         "outside the trust region")
        return lines

    def sample_batch(self):
        """One sampling batch of the epoch's first round, with the training sampler and the rollout policy."""
        trainer, config = self.trainer, self.config
        rollouts = trainer.rollouts
        size = int(config.sample.batch_size)
        prompts, metadata, _ = trainer.prompt_sampler.sample_epoch(
            rollouts.shards.total // config.train.group_size, config.train.group_size, whole_groups=rollouts.whole_groups)
        seed = round_seed(config.seed, 0, 0)
        trainer.model.eval()
        with trainer.updater.rollout_policy(trainer.sampling_model) as model, self.accelerator.autocast(), \
                sampling_precision(config.sample.precision, self.accelerator.device):  # the run's sampler, as it runs
            batch = rollouts.sampler.sample(model, prompts[:size], metadata[:size],
                                            generators=sample_generators(seed, slice(0, size), self.accelerator.device),
                                            desc=None)
        return widened(batch, config.sample.precision)

    # ------------------------------------------------------------------ the policy gradient
    def rescore_check(self, batch) -> CheckResult:
        """Steps 1-4 of the module docstring."""
        trainer, config = self.trainer, self.config
        chunk = trainer.updater.pairs_per_forward_of(batch)
        steps = torch.nonzero(self.family.stochastic_steps(config.sample)).flatten().tolist()
        rescored = self.rescore(batch, chunk=chunk)
        per_step = rescored.per_step()
        lines = [f"the training forward re-scores the {len(batch) * len(steps)} recorded transitions of the "
                 f"stochastic steps {steps}, {chunk} pairs a forward (train.pairs_per_forward)",
                 f"{'step':>6}{'max |log-prob diff|':>22}{'max |ratio - 1|':>18}{'outside the trust region':>27}"]
        lines += [f"{n:>6}{row['log_prob']:>22.3g}{row['ratio']:>18.3g}{row['clipped']:>27.1%}"
                  for n, row in per_step.items()]
        result = CheckResult("the log-probability of every recorded stochastic transition under the training forward "
                             "against the one recorded while sampling (|ratio - 1| = |exp(l_train - l_sampled) - 1|), "
                             "and the share of pairs the policy loss's trust region acts on before any update",
                             per_step, rescored.worst, RATIO_TOLERANCE[config.mixed_precision],
                             clipped=rescored.clipped, random=self.randomness(batch, chunk), lines=lines)
        if not result.on_policy and result.random <= RANDOM_SHARE * result.tolerance:
            result.causes = self.causes(batch, chunk)
            result.lines.append(self.clip_range_line(rescored))
        return result

    def rescore(self, batch, chunk: int, scorer=None, model=None, step_major: bool = False,
                recorded_dtype: str | None = None) -> Rescored:
        """The stochastic steps' pairs scored in training mode without gradients, ``chunk`` pairs a forward
        (``step_major``: the pairs of one step together, as the sampling batch ran them). ``recorded_dtype``: the
        recorded log-probabilities computed again in that dtype from the recorded step means (the same Gaussian)."""
        trainer = self.trainer
        scorer = scorer or trainer.scorer
        model = model or trainer.model
        steps = torch.nonzero(self.family.stochastic_steps(self.config.sample)).flatten()
        rows = torch.arange(len(batch))
        if step_major:
            pair_rows, pair_steps = rows.repeat(len(steps)), steps.repeat_interleave(len(rows))
        else:
            pair_rows, pair_steps = rows.repeat_interleave(len(steps)), steps.repeat(len(rows))
        device, updater = self.accelerator.device, trainer.updater
        scorer.prepare(batch.num_steps, device)
        was_training = model.training
        model.train()  # as the update runs it
        differences, deviations, outside, kls = [], [], [], []
        try:
            with torch.no_grad(), self.accelerator.autocast():
                for c in torch.split(torch.arange(len(pair_rows)), chunk):
                    r, n = pair_rows[c].to(device), pair_steps[c].to(device)
                    out = scorer(model, batch, r, n)
                    recorded = batch.log_probs[r, n]
                    if recorded_dtype is not None:
                        recorded = gaussian_log_prob(batch.next_latents[r, n], batch.step_means[r, n], out.std,
                                                     scorer.reduce, recorded_dtype)
                    differences.append((out.log_prob.double() - recorded.double()).cpu())
                    deviations.append(ratio_deviation(out.log_prob, recorded).cpu())
                    means = {"mean": out.mean, "rollout_mean": batch.step_means[r, n], "std": out.std,
                             "log_prob_reduce": scorer.reduce}
                    outside.append(updater.loss.outside_trust_region(recorded, out.log_prob, **updater.bounds, **means,
                                                                     **updater.loss_kwargs).cpu())
                    kls.append(dppo_kl(out.mean, batch.step_means[r, n], out.std, scorer.reduce).cpu())
        finally:
            model.train(was_training)
        return Rescored(pair_steps, torch.cat(differences), torch.cat(deviations).float(), torch.cat(outside),
                        torch.cat(kls))

    def randomness(self, batch, chunk: int) -> float:
        """The largest difference of the first chunk's log-probabilities scored twice in training mode (0: the
        training forward is a function of its inputs)."""
        steps = torch.nonzero(self.family.stochastic_steps(self.config.sample)).flatten()
        rows = torch.arange(len(batch)).repeat_interleave(len(steps))[:chunk]
        pair_steps = steps.repeat(len(batch))[:chunk]
        device, model, scorer = self.accelerator.device, self.trainer.model, self.trainer.scorer
        was_training = model.training
        model.train()
        try:
            with torch.no_grad(), self.accelerator.autocast():
                first, second = (scorer(model, batch, rows.to(device), pair_steps.to(device)).log_prob
                                 for _ in range(2))
        finally:
            model.train(was_training)
        return float((first.double() - second.double()).abs().max())

    def causes(self, batch, chunk: int) -> dict:
        """{change: (worst |ratio - 1|, share outside the trust region)} with each testable change made alone (module
        docstring)."""
        trainer, family, options = self.trainer, self.family, self.trainer.rollouts.sampler.options
        scorer = trainer.scorer

        dtype = condition_dtype(batch.cond, family)
        schedule = family.schedule(batch.num_steps, self.accelerator.device)
        scheduled = {key: value.to(batch.times[key].device).unsqueeze(0).expand(len(batch), -1).to(batch.times[key].dtype)
                     for key, value in schedule.items()}
        scheduled.update({key: batch.times[key] for key in family.carried_keys})  # the recorded guidance state
        levels = [level for level in options.noise_levels if level > 0]
        variants = {
            "guidance (the sampler's guidance scale in the training forward: train.cfg, sample.guidance_scale)":
                lambda: self.rescore(batch, chunk, scorer=replace(scorer, guidance_scale=options.guidance_scale)),
            "noise level (the sampler's: sample.noise_level)":
                lambda: self.rescore(batch, chunk, scorer=replace(scorer, noise_level=max(levels))),
            "precision (each recorded x_n rounded to the model's dtype, as the sampler's model read it)":
                lambda: self.rescore(replace(batch, latents=batch.latents.to(dtype).float()), chunk),
            f"layout (the sampling batch's pairs in one forward, as it ran them: train.pairs_per_forward="
            f"{len(batch)} with sample.batch_size={len(batch)})":
                lambda: self.rescore(batch, len(batch), step_major=True),
            "timesteps (the family's schedule instead of the recorded step tensors)":
                lambda: self.rescore(replace(batch, times=scheduled), chunk),
            "log-prob in float64 (sample.log_prob_dtype='float64', as Flow-Factory reduces it)":
                lambda: self.rescore(batch, chunk, scorer=replace(scorer, log_prob_dtype="float64"),
                                     recorded_dtype="float64"),
        }
        from ddpo_group.models.speed_options import eager

        compiled = any(getattr(m, "_compiled_call_impl", None) for m in self.accelerator.unwrap_model(trainer.model).modules())
        if compiled:
            def eager_rescore():
                with eager(self.accelerator.unwrap_model(trainer.model)):
                    return self.rescore(batch, chunk)
            variants["compilation (the eager forward: compile_denoiser)"] = eager_rescore
        return {name: (rescored.worst, rescored.clipped) for name, rescored in
                ((name, variant()) for name, variant in variants.items())}

    def clip_range_line(self, rescored: Rescored) -> str:
        """The bound at which at most CLIPPED_SHARE of the pairs would be outside the loss's trust region before any
        update: a ratio-clipping loss's clip range (the quantile of |ratio - 1|), dppo's KL threshold (of the step
        KL)."""
        if self.trainer.updater.loss.trust_region is outside_kl_bound:
            needed = float(torch.quantile(rescored.kl.double(), 1 - CLIPPED_SHARE))
            field, now = "train.policy_kl_threshold", self.config.train.policy_kl_threshold
        else:
            needed = float(torch.quantile(rescored.deviation.double(), 1 - CLIPPED_SHARE))
            field, now = "train.clip_range", self.config.train.clip_range
        return (f"  a larger bound: {field} > {needed:.3g} would leave at most {CLIPPED_SHARE:.0%} of the pairs outside "
                f"the trust region before any update (now {now:g}: it would then hold the update's change to that "
                "instead)")

    # ------------------------------------------------------------------ a matching or preference objective
    def matching_check(self, batch) -> CheckResult:
        trainer, family, config = self.trainer, self.family, self.config
        updater = trainer.updater
        device = self.accelerator.device
        steps = list(range(batch.num_steps))
        rows = torch.arange(len(batch), device=device)
        family.schedule(batch.num_steps, device)
        per_step = {}
        with trainer.updater.rollout_policy(trainer.sampling_model) as model:
            was_training = model.training
            model.train()
            try:
                with torch.no_grad(), self.accelerator.autocast():
                    for n in steps:
                        step = {key: batch.times[key][rows, n] for key in family.time_keys}
                        x_n = batch.latents[:, n].to(family.state_dtype(condition_dtype(batch.cond, family)))
                        output = updater.forward.velocity(model, batch, rows, step, x_n)
                        mean = family.step(output, x_n, step, 0.0, compute_log_prob=False).mean
                        target = batch.next_latents[:, n].float()
                        error = float((mean.float() - target).abs().max() / target.abs().max().clamp_min(1e-12))
                        per_step[n] = {"relative": error}
            finally:
                model.train(was_training)
        worst = max(row["relative"] for row in per_step.values())
        lines = [f"the training forward (algorithm.objective={config.algorithm.objective!r}: its velocity path, "
                 f"guidance {updater.forward.guidance_scale}) at each recorded x_n, through the deterministic step",
                 f"{'step':>6}{'max |x_(n+1) - step| / max |x_(n+1)|':>40}"]
        lines += [f"{n:>6}{row['relative']:>40.3g}" for n, row in per_step.items()]
        return CheckResult("each recorded deterministic step x_n -> x_{n+1} taken again with the training forward at "
                           "the rollout policy (the model the objective's forward-process loss is computed at)",
                           per_step, worst, MATCHING_TOLERANCE[config.mixed_precision], lines=lines)

    # ------------------------------------------------------------------ memory and time
    def resources(self, batch, sampling_s: float) -> list:
        trainer, config = self.trainer, self.config
        updater = trainer.updater
        chunk = updater.pairs_per_forward_of(batch)
        trainable = updater.trainable_steps()
        lines = []
        if self.accelerator.device.type == "cuda":
            peak = trainer.pairs_per_forward.peak(updater, batch, chunk, trainable)
            lines.append(f"memory: a forward and backward of {chunk} pairs (train.pairs_per_forward) takes "
                         f"{peak / 2**30:.2f} GiB above the model, of {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
        else:
            lines.append(f"memory: not measured on the {self.accelerator.device.type} (CUDA only)")
        from ddpo_group.update.memory_fit import probe_batch

        # the estimator's outputs are not computed here: every row its own advantage, groups in sampling order, so that
        # a preference objective forms its units (update/preference_update.py)
        group_size = int(config.train.group_size)
        batch = replace(batch, advantages=torch.arange(len(batch), dtype=torch.float32, device=batch.log_probs.device)
                        [:, None].expand(-1, batch.num_steps).contiguous(),
                        group_index=torch.arange(len(batch), device=batch.log_probs.device) // group_size)
        updater.epoch_units(batch)
        probe, rows, mask = probe_batch(batch, chunk, trainable)
        timings = []
        sync = torch.cuda.synchronize if self.accelerator.device.type == "cuda" else (lambda: None)
        for _ in range(2):  # the first one warms up (compilation, allocations)
            sync()
            start = time.perf_counter()
            with torch.enable_grad():
                updater.accumulate_gradients(probe, rows, mask, pairs_per_forward=chunk)
            sync()
            timings.append(time.perf_counter() - start)
        updater.optimizer.zero_grad(set_to_none=True)
        sample, train = config.sample, config.train
        samples = int(sample.batch_size) * int(sample.num_batches_per_epoch)
        pairs = samples * max(1, int(int(trainable.sum()) * float(train.step_fraction))) * int(train.num_inner_epochs)
        sampling = sampling_s / len(batch) * samples
        training = timings[-1] / (int(mask.sum()) * updater.unit_width) * pairs  # a preference unit: K rows a pair
        lines.append(f"an epoch, on one process: about {sampling + training:.0f} s (sampling and scoring "
                     f"{samples} samples {sampling:.0f} s, from this batch's {sampling_s:.1f} s; training {pairs} "
                     f"pairs {training:.0f} s, from one chunk's forward and backward, {timings[-1]:.2f} s after a "
                     f"{timings[0]:.2f} s first one)")
        return lines
