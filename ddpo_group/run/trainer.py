"""The training loop. ``Trainer.run`` is the epoch loop; ``Trainer.train_epoch`` is one epoch, read top to bottom:

    1. sample and score: P prompts x G copies with log-probs, their rewards and what the estimator reads, gathered
       over the processes (rollout/collector.py, rollout/sampler.py, rollout/reward_scorer.py);
    2. advantages: the estimator on each whole round; each process keeps its rows (algorithms/advantages.py);
    3. update the policy with the objective (algorithms/objectives.py): the policy gradient on the recorded (sample,
       step) pairs (update/policy_update.py), a matching objective on the noised final samples
       (update/matching_update.py) or a preference objective on each group's pair (update/preference_update.py);
    4. update the critic (update/critic.py);
    5. after the epoch: the KL term's controller and reference (reference/regularizer.py), the estimator's
       controller (GROUP_PPO's tau), the EMA's metrics (update/ema.py; the EMA itself moves after optimizer steps);
    6. evaluate when due: fixed prompts x fixed noise, deterministic sampler (run/periodic_eval.py); also before the
       first update; the guard reads it (run/guard.py) and, with guard.on_alarm="restore", a fall puts the best
       evaluation's weights back (update/restore_point.py);
    7. log (run/reporting/epoch_metrics.py, run/reporting/throughput.py, run/reporting/epoch_logger.py).

The run's session (run/session.py) keeps it survivable around the loop: signals, resume, checkpoints, summary.
``Trainer.__init__`` builds every piece from the config, in an order that keeps the random streams of a resumed
run identical to an uninterrupted one.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager, nullcontext

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, ProjectConfiguration, set_seed

from ddpo_group.algorithms import get_adv_estimator, get_objective, get_policy_loss
from ddpo_group.algorithms.objectives import PREFERENCE
from ddpo_group.algorithms.stat_tracker import PerPromptStatTracker
from ddpo_group.distributed import ProcessShards
from ddpo_group.errors import ConfigError, EpochAbandoned, NonFiniteLossError
from ddpo_group.models.speed_options import (check_cuda_graphs, compile_denoiser, sampling_denoiser,
                                             set_attention_backend)
from ddpo_group.models.trainable import apply_settings, build_policy, lora_config, make_optimizer, optimizer_settings
from ddpo_group.prompts import PromptSampler
from ddpo_group.reference.regularizer import KLRegularizer
from ddpo_group.rewards import is_groupwise, make_reward_fn, rising_measure
from ddpo_group.rollout.collector import Estimation, RolloutCollector
from ddpo_group.run.config_checks import config_warnings, validate_config
from ddpo_group.run.processes.cpu_fsdp import enable_fsdp_on_cpu
from ddpo_group.run.reporting.epoch_logger import EpochLogger
from ddpo_group.run.reporting.epoch_metrics import epoch_metrics
from ddpo_group.run.guard import Guard
from ddpo_group.run.periodic_eval import PeriodicEvaluation
from ddpo_group.run.processes.determinism import make_deterministic
from ddpo_group.run.processes.process_failures import process_group_kwargs
from ddpo_group.run.session import RunSession
from ddpo_group.run.processes.threads import apply_num_threads
from ddpo_group.run.reporting.throughput import DenoiserEvaluations, Throughput, measure_model_flops
from ddpo_group.sampling.trajectories import TransitionScorer
from ddpo_group.timing import PHASES, PhaseTimer
from ddpo_group.update.critic import Critic
from ddpo_group.update.ema import EMAWeights
from ddpo_group.update.matching_update import MatchingUpdater
from ddpo_group.update.old_model import OldModel
from ddpo_group.update.on_policy import OnPolicyWatch
from ddpo_group.update.memory_fit import PairsPerForward, names_the_setting
from ddpo_group.update.policy_update import PolicyUpdater
from ddpo_group.update.preference_update import PreferenceUpdater
from ddpo_group.update.restore_point import RestorePoint


class Trainer:
    def __init__(self, config):
        validate_config(config)
        self.config = config
        self.session = RunSession(config)  # run dir and resume checked before any model loads
        for warning in config_warnings(config):
            self.session.print(f"warning: {warning}")
        # the same seed on every process: all draw the same epoch prompt list and take their slice
        self.prompt_sampler = PromptSampler(config.prompt_fn, config.prompt_fn_kwargs.to_dict(), seed=config.seed)
        self.prompt_sampler.probe()
        self.reward_fn = make_reward_fn(config.reward_fn, **config.reward_fn_kwargs.to_dict())
        if config.deterministic:  # before the first CUDA kernel (cuBLAS reads its workspace setting once)
            make_deterministic()
        self.accelerator = self.make_accelerator(config, self.session)
        validate_config(config, num_processes=self.accelerator.num_processes,
                        groupwise_reward=is_groupwise(self.reward_fn))
        # accelerate launch's default OMP_NUM_THREADS=1 would leave a CPU run on one core (run/processes/threads.py)
        apply_num_threads(config.num_cpu_threads, self.accelerator.device.type == "cpu",
                          int(os.environ.get("LOCAL_WORLD_SIZE", self.accelerator.num_processes)))
        if config.allow_tf32 and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = True
        set_seed(config.seed, device_specific=True)
        self.timer = PhaseTimer()  # wall time per phase (time/<phase> in the metrics; bench/epoch.py syncs it)
        self._timer_mark = self.timer.snapshot()
        self.build_model(config)
        self.build_algorithm(config)
        # the epoch's samples over the processes: each process's slice, and the gathers the loop calls
        self.shards = ProcessShards(self.accelerator, config.sample.batch_size * config.sample.num_batches_per_epoch)
        estimation = Estimation(self.estimator, self.stat_tracker, self.estimator_controller, self.critic,
                                self.kl.below_start if self.kl is not None else None)
        self.rollouts = RolloutCollector(
            config, self.shards, self.family, self.reward_fn, self.prompt_sampler, estimation,
            kl_in_reward=self.kl_in_reward if self.kl is not None and self.kl.in_reward else None,
            timer=self.timer, should_stop=self.session.stop_agreed,
        )
        self.evaluation = self.guard = None  # evaluation during training (eval_freq): the same on every process
        if config.eval_freq:
            self.evaluation = PeriodicEvaluation.from_config(config, self.accelerator, self.family,
                                                             self.rollouts.reward_scorer, self.shards.gather)
            self.guard = Guard(config.guard, heldout=self.evaluation.heldout_scorer is not None,
                               rising=rising_measure(self.reward_fn))
        export_ema = self.ema is not None and config.train.ema_export  # the exported LoRA holds the EMA weights
        self.session.attach(self.accelerator, self.model, self.family, self.checkpointed_state(), self.timer,
                            lora_weights=self.ema.swapped_in if export_ema else nullcontext)
        self.pairs_per_forward.restore()  # a resumed run: the sizes its first run chose
        if self.session.resume_path is not None:  # a resumed optimizer keeps its saved settings unless told here
            changed = apply_settings(self.optimizer, optimizer_settings(config))
            if self.critic is not None:
                changed += apply_settings(self.critic.optimizer, Critic.settings(config))
            for line in changed:
                self.session.print(line)
        if self.evaluation is not None:  # a resumed run: its evaluations so far (eval.jsonl, rewound to the checkpoint)
            records = self.session.evaluations()
            self.evaluation.restore(records)
            self.guard.replay(records)
        self.epoch_logger = EpochLogger(self.accelerator, self.session.run_dir, self.session.wandb_mode,
                                        config.log_images_every, self.session.print)
        self.throughput = Throughput(self.accelerator, config.mixed_precision, self.model_flops, self.session.print)
        self.nfe = DenoiserEvaluations()  # perf/nfe_*: the denoisers' forwards while sampling and while training
        # train/ratio_before_update and train/clipped_before_update against their bounds
        region = get_policy_loss(config.algorithm.policy_loss).trust_region_fields(config)
        self.on_policy = OnPolicyWatch(config.mixed_precision, region, self.session.print)
        sampling_copy = [self.sampling_model] if self.sampling_model is not self.family.model else []
        for module in self.family.denoisers() + self.denoiser_copies() + sampling_copy:
            self.nfe.watch(module)

    @staticmethod
    def make_accelerator(config, session: RunSession) -> Accelerator:
        processes = int(os.environ.get("WORLD_SIZE", "1"))
        if config.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device='cuda' but torch sees no CUDA GPU; use device='' (the GPU when there is one)")
        accelerator = Accelerator(
            # the CPU when asked for; several processes without CUDA: accelerate uses gloo only when asked for the CPU
            cpu=config.device == "cpu" or (processes > 1 and not torch.cuda.is_available()),
            mixed_precision=config.mixed_precision,
            gradient_accumulation_steps=config.train.gradient_accumulation_steps,
            log_with="wandb" if session.wandb_mode != "disabled" else None,
            project_config=ProjectConfiguration(project_dir=str(session.run_dir)),
            kwargs_handlers=[process_group_kwargs(config)],  # collective_timeout_s (run/processes/process_failures.py)
        )
        enable_fsdp_on_cpu(accelerator, config.mixed_precision)  # an FSDP launch on the CPU shards too
        return accelerator

    def build_model(self, config) -> None:
        """The model family (its pipeline), the trainable parameters, the KL term's reference (it adds an adapter to
        or copies the denoiser, so before accelerate wraps it), the optimizer, and how transitions are scored."""
        self.family, self.params = build_policy(config, self.accelerator.device)
        self.pipe = self.family.pipe
        self.family.check_trainable(config.sample)
        lora = lora_config(config, self.family.lora_target_modules) if config.use_lora else None
        self.kl = KLRegularizer.from_config(config, self.family.model, lora, self.timer)  # its forwards: "reference"
        self.objective = get_objective(config.algorithm.objective)
        # a matching objective's old model (an adapter on the denoiser, or a copy): before accelerate wraps it too
        uses_old = self.objective.uses_old_model(config.algorithm.objective_kwargs)
        self.old = OldModel.from_config(config, self.family.model, lora) if uses_old else None
        optimizer = make_optimizer(config, self.params)
        set_attention_backend(config.attention_backend, self.accelerator.device, config.mixed_precision)
        sharded = self.accelerator.distributed_type == DistributedType.FSDP
        check_cuda_graphs(config.cuda_graphs, self.accelerator.device, sharded)
        # in place: names, hooks, state dict unchanged
        compiled = compile_denoiser(self.family.model, config.compile_denoiser, self.accelerator.device, sharded,
                                    config.deterministic)
        if config.compile_denoiser == "auto" and compiled:
            self.accelerator.print(f"compile_denoiser auto -> {compiled} (the first epoch compiles)")
        self.model, self.optimizer = self.accelerator.prepare(self.family.model, optimizer)
        # what the sampling steps call: the denoiser, or its copy replayed as CUDA graphs (accelerate's mixed-precision
        # forward included)
        self.sampling_model = sampling_denoiser(self.family.model, config.cuda_graphs)
        if self.accelerator.distributed_type == DistributedType.FSDP:  # sharding replaced the parameters: clip those
            self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.scorer = TransitionScorer.from_config(config, self.family)

    def build_algorithm(self, config) -> None:
        """The estimator (and what it declares it needs: a critic, a controller), the stat tracker, the updater."""
        self.estimator = get_adv_estimator(config.algorithm.adv_estimator)
        tracking = config.per_prompt_stat_tracking
        if tracking:
            self.stat_tracker = PerPromptStatTracker(tracking.buffer_size, tracking.min_count, mode="buffer")
        else:  # ddpo-pytorch's per_prompt_stat_tracking=None: whole-batch statistics, always
            self.stat_tracker = PerPromptStatTracker(buffer_size=1, min_count=2**31, mode="buffer")
        self.critic = None
        if self.estimator.needs_critic:
            self.critic = Critic(config, self.accelerator, self.family.latent_shape(), self.family.text_dim)
        self.estimator_controller = self.estimator.controller(config) if self.estimator.controller else None
        # "auto": measured on the card at the first training phase (update/memory_fit.py), kept in checkpoints
        self.pairs_per_forward = PairsPerForward(config, self.accelerator, self.family, self.session.state.sizes,
                                                 say=self.session.print)
        self.ema = EMAWeights.from_config(config, self.params)  # None unless train.ema
        # the best evaluation's weights, loaded back on the guard's fall (guard.on_alarm="restore")
        restores = config.eval_freq and config.guard.on_alarm == "restore"
        self.restore_point = RestorePoint(self.params) if restores else None
        # the update loop (update/updater.py) with the objective's loss: the policy gradient, a matching objective on
        # the final samples, or a preference objective on each group's units
        shared = (config, self.accelerator, self.model, self.optimizer, self.params, self.scorer, self.kl,
                  self.pairs_per_forward, self.ema.step if self.ema is not None else None)
        if self.objective.kind == PREFERENCE:
            self.updater = PreferenceUpdater(*shared)
        elif self.objective.is_matching:
            self.updater = MatchingUpdater(*shared, old=self.old, step_count=lambda: self.state.global_step)
        else:
            self.updater = PolicyUpdater(*shared)

    def denoiser_copies(self) -> list[torch.nn.Module]:
        """The frozen denoiser copies of full fine-tuning: the KL reference's and the old model's (with LoRA both are
        adapters of the policy's denoiser)."""
        holders = [self.kl.reference if self.kl is not None else None,
                   self.old.weights if self.old is not None else None]
        return [holder.copy for holder in holders if holder is not None and holder.copy is not None]

    def checkpointed_state(self) -> list:
        """Every stateful piece a checkpoint holds besides the prepared models and optimizer (fixed order)."""
        pieces = [self.prompt_sampler, self.session.state, self.stat_tracker]
        pieces += [self.critic.optimizer] if self.critic is not None else []
        # the EMA, the old model, then the adaptive branch steps, last: checkpoints written before they existed keep
        # their order (run/persistence/resume_check.py)
        return pieces + [p for p in (self.kl, self.estimator_controller, self.ema, self.old, self.rollouts.branching,
                                     self.restore_point) if p is not None]

    @property
    def run_dir(self):
        return self.session.run_dir

    @property
    def state(self):
        return self.session.state

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        """Every remaining epoch, then the LoRA export and the summary."""
        metrics = {}
        try:
            with self.session.running(close=lambda: self.rollouts.close(wait=False)):  # signals; a failure stops all
                for epoch in self.session.remaining_epochs():
                    try:
                        metrics = self.train_epoch(epoch)
                    except EpochAbandoned:  # a stop signal while sampling: the epoch is dropped before any update
                        raise self.session.stopped_in_sampling(epoch) from None
                    self.session.end_of_epoch(epoch)  # the checkpoint when due; a stop signal stops here
        finally:
            self.epoch_logger.draw_reward_curve()  # the epochs since its last draw, whatever ended the run
        self.session.finish(close=self.rollouts.close)
        return metrics

    def train_epoch(self, epoch: int) -> dict:
        """One epoch (module docstring); returns its metrics."""
        start = time.perf_counter()
        self.throughput.start_epoch()
        self.model.eval()
        if epoch == 0 and self.evaluation is not None:  # the "before" of the run summary
            self.evaluate(-1)
        # 1. sample and score: trajectories (the old model's, for an objective that has one), rewards, gathered over
        #    the processes (a stop signal drops the epoch)
        with names_the_setting("sampling", f"sample.batch_size={self.config.sample.batch_size}"), \
                self.rollout_policy() as rollout_model, self.nfe.counting("sampling"):
            rounds = self.rollouts.collect(epoch, rollout_model)
        # 2. advantages: the estimator on each whole round; each process keeps its rows
        with self.timer.phase("advantage"), self.nfe.counting("sampling"):
            rollouts = self.rollouts.estimate(rounds)
        batch = rollouts.batch
        try:
            # 3. update the policy
            if self.critic_warming_up(epoch):  # the critic learns the policy's values before the policy moves
                train = {"optimizer_steps": 0, "pairs": 0}
            else:
                with self.timer.phase("training"), names_the_setting("training", self.chunk_setting()), \
                        self.nfe.counting("training"):
                    train = self.updater.train_epoch(batch, show_progress=self.accelerator.is_local_main_process)
            # warned once: the update is off-policy from its start
            self.on_policy(train.get("ratio_before_update"), train.get("clipped_before_update"))
            self.state.global_step += train.pop("optimizer_steps")
            pairs = train.pop("pairs")
            # 4. update the critic
            critic = {}
            if self.critic is not None:
                with self.timer.phase("critic"):
                    critic = self.critic.train_epoch(batch, self.config.train.batch_size)
        except NonFiniteLossError as error:
            raise self.session.non_finite_loss(error, epoch) from error
        # 5. after the epoch: the KL coefficient and the reference, the estimator's controller
        after = self.after_epoch(epoch, rollouts, train)
        # 6. evaluate when due (after the update, so the checkpoint that follows holds the evaluated weights)
        evaluation = self.evaluate(epoch) if self.evaluation is not None and self.evaluation.due(epoch) else {}
        # 7. log
        metrics = epoch_metrics(epoch, self.state.global_step, rollouts, train, critic, after)
        metrics.update(evaluation)
        metrics.update(self.timing(start))
        metrics.update(self.throughput.metrics(rollouts.reward_queries, pairs, metrics["time/sampling"],
                                               metrics["time/training"], batch, self.nfe.take(),
                                               cuda_peak_floor=self.pairs_per_forward.take_seen_peak()))
        with self.timer.phase("logging"):
            self.epoch_logger.log(epoch, metrics, batch)
        if self.estimator_controller is not None and (line := self.estimator_controller.summary(epoch, metrics)):
            self.session.print(line)
        return metrics

    @contextmanager
    def rollout_policy(self):
        """The denoiser the rollouts sample with, inside the block: the old model for an objective that samples with
        one (its adapter switched on, or its copy), else the policy's sampling denoiser (itself, or its CUDA-graph
        copy: cuda_graphs)."""
        with self.updater.rollout_policy() as old:
            yield old if old is not None else self.sampling_model

    def kl_in_reward(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The KL to the reference of every sampled step [B, T] and the step rewards -beta KL_n (kl.in_reward), the
        transitions scored as the update scores them."""
        kl = self.kl.rollout_kl(batch, self.scorer, self.family.model, self.updater.chunk_size(batch),
                                self.family.stochastic_steps(self.config.sample))
        return kl, self.kl.step_rewards(kl)

    def critic_warming_up(self, epoch: int) -> bool:
        """The first ``critic.warmup_epochs`` epochs train the critic only (their rollouts are reward queries too)."""
        return self.critic is not None and epoch < int(self.config.critic.warmup_epochs)

    def chunk_setting(self) -> str:
        value = self.pairs_per_forward.value
        auto = " (auto)" if self.pairs_per_forward.auto else ""
        return f"train.pairs_per_forward={value if value is not None else 'auto'}{auto}"

    def after_epoch(self, epoch: int, rollouts, train: dict) -> dict:
        """The updates that follow the policy's: beta and the reference, the estimator's controller."""
        metrics = {}
        if self.kl is not None:
            loss_kl = self.shards.gather(torch.tensor([train.get("kl", 0.0)]))  # every process's KL in the loss
            metrics.update(self.kl.after_epoch(self.accelerator.unwrap_model(self.model), epoch,
                                               rollouts.gathered("step_kl"), loss_kl, self.shards.total))
        if self.estimator_controller is not None:  # fit of the critic over the kept targets of every round
            with self.timer.phase("advantage"):
                self.estimator_controller.update(*self.rollouts.critic_fit(rollouts.rounds))
            metrics.update(self.estimator_controller.metrics())
        if self.ema is not None:
            metrics.update(self.ema.metrics())
        if self.rollouts.branching is not None:  # the next epoch's branch steps
            metrics.update(self.rollouts.branching.update(rollouts.gathered("tree_nodes"), rollouts.rewards))
        return metrics

    def evaluate(self, epoch: int, restored: int | None = None) -> dict:
        """The fixed evaluation after epoch ``epoch`` (-1: before the first update), with the EMA weights when
        train.ema and train.ema_eval; written to eval.jsonl and samples/eval_*.png; returns its eval/* metrics.
        ``restored``: the epoch whose weights the guard has just restored (guard/restored_epoch)."""
        use_ema = self.ema is not None and self.config.train.ema_eval
        weights = self.ema.swapped_in if use_ema else nullcontext
        with self.timer.phase("evaluation"), weights():
            result = self.evaluation.run(epoch)
        if restored is not None:
            result.metrics["guard/restored_epoch"] = restored
        with self.timer.phase("logging"):
            self.epoch_logger.log_evaluation(epoch, result.metrics, result.grid, "ema" if use_ema else "training",
                                             result.audio, result.audio_sample_rate)
        # the best weights kept, the alarms acted on
        restore = self.guard.after_evaluation(epoch, result.metrics, self.session, weights)
        if self.restore_point is not None and self.guard.best["epoch"] == epoch and restored is None:
            with weights():
                self.restore_point.keep(epoch)
        if restore and restored is None:
            restored = self.restore_best()
            if epoch == self.config.num_epochs - 1:  # the weights the run hands over, evaluated as they are
                return self.evaluate(epoch, restored)
        return result.metrics

    def restore_best(self) -> int:
        """guard.on_alarm="restore": the best evaluation's weights back in the policy, the optimizer's moments cleared
        (they point where the run fell), the EMA and a matching objective's old model set to them; returns that
        evaluation's epoch."""
        epoch = self.restore_point.restore()
        self.optimizer.optimizer.state.clear()
        if self.ema is not None:
            self.ema.reset()
        if self.old is not None:
            self.old.reset(self.accelerator.unwrap_model(self.model))
        return epoch

    def model_flops(self, batch):
        """F_pair and F_image of run/reporting/throughput.py, on this epoch's first sample at its first trained step."""
        sample = self.config.sample
        step = int(self.family.stochastic_steps(sample).nonzero()[0])
        return measure_model_flops(self.scorer, self.accelerator.unwrap_model(self.model), batch, self.params, step,
                                   sample.guidance_scale, sample.num_steps, self.updater.uses_reference,
                                   self.accelerator.autocast)

    def timing(self, start: float) -> dict:
        """Wall time per phase since the previous epoch's metrics (so time/logging and time/checkpoint are the
        previous epoch's: they run after its metrics are written) and of the whole epoch."""
        now = self.timer.snapshot()
        spent = PhaseTimer.since(self._timer_mark, now)
        self._timer_mark = now
        return {**{f"time/{phase}": spent.get(phase, 0.0) for phase in PHASES},
                "time/epoch": time.perf_counter() - start}
