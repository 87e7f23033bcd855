"""The pre-flight check (``scripts/check.py``): does the training forward reproduce what the sampler did?

It builds the run as training would (run/trainer.py: the family, precision, LoRA, compile_denoiser,
pairs_per_forward, guidance, the objective), in a scratch directory, samples one sampling batch with the training
sampler (the rollout policy, in the training precision), and then:

* a policy-gradient run: re-scores every recorded stochastic transition x_n -> x_{n+1} through the training forward,
  chunk by chunk of train.pairs_per_forward pairs in training mode, as the update does, and compares it with the
  recorded log-probability: per step max |l_train - l_recorded| and max |ratio - 1|, against the precision's
  tolerance (update/on_policy.py). On a mismatch each likely cause it can test is tested by re-scoring with that one
  thing changed: the sampler's guidance scale, the sampler's noise level, the recorded latents rounded to the model's
  dtype (precision), the sampling batch's layout of pairs (chunk size), the eager forward (compilation), the family's
  schedule instead of the recorded step tensors (timesteps); a cause is named when its change brings the ratio within
  the tolerance.
* a matching or preference objective (deterministic rollouts, no log-probabilities: algorithm.objective): runs the
  training forward at each recorded x_n (its velocity() path, the training guidance, training mode, at the rollout
  policy: the old model's for an objective that samples with one) through the family's deterministic step and compares
  the result with the recorded x_{n+1}: per step max |difference| / max |x_{n+1}|, against the precision's tolerance.
  Its forward-process loss is then evaluated at that same model, so the check is whether the model it trains is the
  model that sampled.

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

from ddpo_group.run.config_checks import config_warnings
from ddpo_group.sampling.noise import round_seed, sample_generators
from ddpo_group.update.on_policy import RATIO_TOLERANCE, ratio_deviation

# max |x_{n+1} - step(training forward)| / max |x_{n+1}| a deterministic rollout allows, by mixed_precision
MATCHING_TOLERANCE = {"no": 1e-4, "fp16": 5e-3, "bf16": 2e-2}


@dataclass
class CheckResult:
    checks: str  # what was compared
    per_step: dict  # {step: {column: value}}
    worst: float  # the largest difference (|ratio - 1| or the relative step error)
    tolerance: float
    causes: dict = field(default_factory=dict)  # {cause: worst after changing it} (on a mismatch)
    lines: list = field(default_factory=list)  # the report

    @property
    def consistent(self) -> bool:
        return self.worst <= self.tolerance


def check_config(config, directory: str):
    """A copy of ``config`` for the check: a fresh run in ``directory`` that writes nothing else (no wandb, no
    evaluation, checkpoint or grid)."""
    config = copy.deepcopy(config)
    config.logdir, config.run_name, config.resume_from = directory, "check", ""
    config.wandb.mode, config.eval_freq, config.save_freq, config.log_images_every = "disabled", 0, 0, 0
    config.num_epochs = 1
    return config


def run_check(config, say=print) -> CheckResult:
    """Build, sample, compare (module docstring); prints the report through ``say`` and returns it."""
    from ddpo_group.run.trainer import Trainer  # the run as training builds it

    with tempfile.TemporaryDirectory() as directory:
        trainer = Trainer(check_config(config, directory))
        try:
            return Preflight(trainer, say).run()
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
        if self.trainer.objective.kind == "policy_gradient":
            result = self.rescore_check(batch)
        else:
            result = self.matching_check(batch)
        head = (f"pre-flight check: {config.preset or 'a config'} on {config.pretrained.model} ({family.name}), "
                f"mixed_precision {config.mixed_precision}, {len(batch)} samples x {batch.num_steps} steps")
        lines = [head, f"checks: {result.checks}", ""] + result.lines
        verdict = "consistent" if result.consistent else "NOT consistent"
        lines.append(f"verdict: {verdict} (worst {result.worst:.3g}, tolerance {result.tolerance:g} for "
                     f"mixed_precision={config.mixed_precision})")
        if result.causes:
            named = [cause for cause, worst in result.causes.items() if worst <= result.tolerance]
            lines.append("likely cause: " + (", ".join(named) if named else "none of the tested ones (each changed "
                                             "alone leaves the difference above the tolerance)"))
            lines += [f"  with {cause} changed: worst {worst:.3g}" for cause, worst in result.causes.items()]
        if self.trainer.objective.kind == "policy_gradient" and result.worst > float(config.train.clip_range):
            lines.append(f"note: train.clip_range={config.train.clip_range:g} is below this difference: the first "
                         "update's clipping would act on it")
        lines += [""] + self.resources(batch, sampling_s)
        warnings = config_warnings(config)
        lines += ["", "config warnings:" if warnings else "config warnings: none"] + [f"  {w}" for w in warnings]
        result.lines = lines
        for line in lines:
            self.say(line)
        return result

    def sample_batch(self):
        """One sampling batch of the epoch's first round, with the training sampler and the rollout policy."""
        trainer, config = self.trainer, self.config
        rollouts = trainer.rollouts
        size = int(config.sample.batch_size)
        prompts, metadata, _ = trainer.prompt_sampler.sample_epoch(
            rollouts.shards.total // config.train.group_size, config.train.group_size, whole_groups=rollouts.whole_groups)
        seed = round_seed(config.seed, 0, 0)
        trainer.model.eval()
        with trainer.rollout_policy() as model, self.accelerator.autocast():
            return rollouts.sampler.sample(model, prompts[:size], metadata[:size],
                                           generators=sample_generators(seed, slice(0, size), self.accelerator.device),
                                           desc=None)

    # ------------------------------------------------------------------ the policy gradient
    def rescore_check(self, batch) -> CheckResult:
        trainer, config = self.trainer, self.config
        mixed_precision = config.mixed_precision
        chunk = trainer.updater.chunk_size(batch)
        steps = torch.nonzero(self.family.stochastic_steps(config.sample)).flatten().tolist()
        per_step = self.rescore(batch, chunk=chunk)
        tolerance = RATIO_TOLERANCE[mixed_precision]
        worst = max(max(row["ratio"] for row in per_step.values()), 0.0)
        lines = [f"the training forward re-scores the {len(batch) * len(steps)} recorded transitions of the "
                 f"stochastic steps {steps}, {chunk} pairs a forward (train.pairs_per_forward)",
                 f"{'step':>6}{'max |log-prob diff|':>22}{'max |ratio - 1|':>18}"]
        lines += [f"{n:>6}{row['log_prob']:>22.3g}{row['ratio']:>18.3g}" for n, row in per_step.items()]
        result = CheckResult("the log-probability of every recorded stochastic transition under the training forward "
                             "against the one recorded while sampling (|ratio - 1| = |exp(l_train - l_sampled) - 1|)",
                             per_step, worst, tolerance, lines=lines)
        if not result.consistent:
            result.causes = self.causes(batch, chunk)
        return result

    def rescore(self, batch, chunk: int, scorer=None, model=None, step_major: bool = False) -> dict:
        """{step: {"log_prob": max |l - l_recorded|, "ratio": max |ratio - 1|}} of the stochastic steps' pairs scored
        in training mode without gradients, ``chunk`` pairs a forward (``step_major``: the pairs of one step
        together, as the sampling batch ran them)."""
        trainer = self.trainer
        scorer = scorer or trainer.scorer
        model = model or trainer.model
        steps = torch.nonzero(self.family.stochastic_steps(self.config.sample)).flatten()
        rows = torch.arange(len(batch))
        if step_major:
            pair_rows, pair_steps = rows.repeat(len(steps)), steps.repeat_interleave(len(rows))
        else:
            pair_rows, pair_steps = rows.repeat_interleave(len(steps)), steps.repeat(len(rows))
        device = self.accelerator.device
        scorer.prepare(batch.num_steps, device)
        was_training = model.training
        model.train()  # as the update runs it
        try:
            with torch.no_grad(), self.accelerator.autocast():
                log_prob = torch.cat([scorer(model, batch, pair_rows[c].to(device), pair_steps[c].to(device))
                                      .log_prob.float() for c in torch.split(torch.arange(len(pair_rows)), chunk)])
        finally:
            model.train(was_training)
        recorded = batch.log_probs[pair_rows, pair_steps].float().cpu()
        difference, ratio = log_prob.cpu() - recorded, ratio_deviation(log_prob.cpu(), recorded)
        return {int(n): {"log_prob": float(difference[pair_steps == n].abs().max()),
                         "ratio": float(ratio[pair_steps == n].max())} for n in steps}

    def causes(self, batch, chunk: int) -> dict:
        """The worst |ratio - 1| with each testable cause changed alone (module docstring)."""
        trainer, family, options = self.trainer, self.family, self.trainer.rollouts.sampler.options
        scorer = trainer.scorer

        def worst(per_step: dict) -> float:
            return max(row["ratio"] for row in per_step.values())

        dtype = batch.cond[family.cond_keys[0]].dtype
        schedule = family.schedule(batch.num_steps, self.accelerator.device)
        scheduled = {key: value.to(batch.steps[key].device).unsqueeze(0).expand(len(batch), -1).to(batch.steps[key].dtype)
                     for key, value in schedule.items()}
        levels = [level for level in options.noise_levels if level > 0]
        variants = {
            "guidance (the sampler's guidance scale in the training forward: train.cfg, sample.guidance_scale)":
                lambda: self.rescore(batch, chunk, scorer=replace(scorer, guidance_scale=options.guidance_scale)),
            "noise level (the sampler's: sample.noise_level)":
                lambda: self.rescore(batch, chunk, scorer=replace(scorer, noise_level=max(levels))),
            "precision (the recorded latents rounded to the model's dtype)":
                lambda: self.rescore(replace(batch, latents=batch.latents.to(dtype).float(),
                                             next_latents=batch.next_latents.to(dtype).float()), chunk),
            "chunk size (the sampling batch's pairs in one forward: train.pairs_per_forward)":
                lambda: self.rescore(batch, len(batch), step_major=True),
            "timesteps (the family's schedule instead of the recorded step tensors)":
                lambda: self.rescore(replace(batch, steps=scheduled), chunk),
        }
        from ddpo_group.models.speed_options import eager

        compiled = any(getattr(m, "_compiled_call_impl", None) for m in self.accelerator.unwrap_model(trainer.model).modules())
        if compiled:
            def eager_rescore():
                with eager(self.accelerator.unwrap_model(trainer.model)):
                    return self.rescore(batch, chunk)
            variants["compilation (the eager forward: compile_denoiser)"] = eager_rescore
        return {name: worst(variant()) for name, variant in variants.items()}

    # ------------------------------------------------------------------ a matching or preference objective
    def matching_check(self, batch) -> CheckResult:
        trainer, family, config = self.trainer, self.family, self.config
        updater = trainer.updater
        device = self.accelerator.device
        steps = list(range(batch.num_steps))
        rows = torch.arange(len(batch), device=device)
        family.schedule(batch.num_steps, device)
        per_step = {}
        with trainer.rollout_policy() as model:
            was_training = model.training
            model.train()
            try:
                with torch.no_grad(), self.accelerator.autocast():
                    for n in steps:
                        step = {key: batch.steps[key][rows, n] for key in family.step_keys}
                        x_n = batch.latents[:, n].to(batch.cond[family.cond_keys[0]].dtype)
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
        chunk = updater.chunk_size(batch)
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
