"""The training loop. ``Trainer.run`` is the epoch loop; ``Trainer.train_epoch`` is one epoch, read top to bottom, its
steps numbered as docs/architecture.md ("One epoch, as data flows") describes them: 1. sample and score, 2. the
advantages, 3. the policy's update, 4. the components' updates (run/components.py), 5. the evaluation when due,
6. the log.

The run's session (run/session.py) keeps it survivable around the loop: signals, resume, checkpoints, summary.
``Trainer.__init__`` builds every piece from the config, in an order that keeps the random streams of a resumed
run identical to an uninterrupted one."""

from __future__ import annotations

import os
import time

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, ProjectConfiguration, set_seed

from ddpo_group.algorithms import get_adv_estimator, get_objective, get_policy_loss
from ddpo_group.algorithms.stat_tracker import PerPromptStatTracker
from ddpo_group.distributed import ProcessShards
from ddpo_group.errors import ConfigError, EpochAbandoned, NonFiniteLossError
from ddpo_group.models.speed_options import (check_cuda_graphs, compile_denoiser, sampling_denoiser,
                                             set_attention_backend)
from ddpo_group.models.trainable import apply_settings, build_policy, lora_config, make_optimizer, optimizer_settings
from ddpo_group.prompts import PromptSampler
from ddpo_group.reference.regularizer import KLRegularizer
from ddpo_group.reference.teachers import Teachers
from ddpo_group.rewards import is_groupwise, make_reward_fn
from ddpo_group.rollout.collector import Estimation, RolloutCollector, rollout_tree
from ddpo_group.rollout.component import copied
from ddpo_group.rollout.image_folder import ImageFolderRecords
from ddpo_group.rollout.reward_scorer import RewardScorer
from ddpo_group.run.config_checks import config_warnings, validate_config
from ddpo_group.run.processes.cpu_fsdp import enable_fsdp_on_cpu
from ddpo_group.run.reporting.epoch_logger import EpochLogger
from ddpo_group.run.reporting.epoch_metrics import epoch_metrics
from ddpo_group.run.evaluations import Evaluations
from ddpo_group.run.components import RunParts, build_components
from ddpo_group.run.processes.determinism import make_deterministic
from ddpo_group.run.processes.process_failures import process_group_kwargs
from ddpo_group.run.session import RunSession
from ddpo_group.run.processes.threads import apply_num_threads
from ddpo_group.run.reporting.throughput import DenoiserEvaluations, Throughput, measure_model_flops
from ddpo_group.sampling.trajectories import TransitionScorer
from ddpo_group.timing import PHASES, PhaseTimer
from ddpo_group.update import updater_class
from ddpo_group.update.critic import Critic
from ddpo_group.update.ema import EMAWeights, held_weights
from ddpo_group.update.matching_update import MatchingUpdater
from ddpo_group.update.old_model import OldModel
from ddpo_group.update.on_policy import OnPolicyWatch
from ddpo_group.update.memory_fit import PairsPerForward, names_the_setting
from ddpo_group.update.updater import UpdateOptions


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
        reward_scorer = RewardScorer(self.reward_fn, config.reward_fn)  # the rollouts' and the evaluations' calls
        branches = rollout_tree(config, self.family, self.estimator)  # tree rollouts; {}: flat sampling
        self.epoch_logger = EpochLogger(self.accelerator, lambda: self.session.run_dir, self.session.wandb_mode,
                                        config.log_images_every, self.session.print)
        # evaluation during training (eval_freq): the same on every process; the guard and the best weights
        self.evaluations = Evaluations.from_config(
            config, self.accelerator, self.family, reward_scorer, self.shards.gather, self.model, self.params,
            self.session, self.timer, weights=held_weights(self.ema, config.train.ema_eval),
            restore=self.restore_best, logger=self.epoch_logger, learned=self.learned_state,
            relearn=self.load_learned_state)
        self.components = build_components(RunParts(
            config, self.shards, self.family, self.scorer, reward_scorer, self.estimator, self.timer,
            pairs_per_forward_of=self.updater.pairs_per_forward_of,
            unwrapped_policy=lambda: self.accelerator.unwrap_model(self.model),
            critic=self.critic, kl=self.kl, controller=self.estimator_controller, ema=self.ema, old=self.old,
            teachers=self.teachers,
            branches=branches, best_weights=self.evaluations.best, fresh_evaluation=self.evaluations.fresh))
        self.rollouts = RolloutCollector(
            config, self.shards, self.family, reward_scorer, self.prompt_sampler,
            Estimation(self.estimator, self.stat_tracker, self.estimator_controller), self.components, branches,
            critic=self.critic, timer=self.timer, should_stop=self.session.stop_agreed)
        self.session.attach(self.accelerator, self.model, self.family, self.checkpointed_state(), self.timer,
                            lora_weights=held_weights(self.ema, config.train.ema_export))
        self.pairs_per_forward.restore()  # a resumed run: the sizes its first run chose
        if self.session.resumed:  # a resumed optimizer keeps its saved settings unless told here
            changed = apply_settings(self.optimizer, optimizer_settings(config))
            for component in self.components:
                changed += component.apply_settings()
            for line in changed:
                self.session.print(line)
        self.evaluations.resume(self.session.evaluations())  # a resumed run: its evaluations so far
        self.throughput = Throughput(self.accelerator, config.mixed_precision, self.model_flops, self.session.print)
        self.nfe = DenoiserEvaluations()  # perf/nfe_*: the denoisers' forwards while sampling and while training
        # train/ratio_before_update and train/clipped_before_update against their bounds
        region = get_policy_loss(config.algorithm.policy_loss).trust_region_fields(config)
        self.on_policy = OnPolicyWatch(config.mixed_precision, region, self.session.print)
        sampling_copy = [self.sampling_model] if self.sampling_model is not self.family.model else []
        copies = [copy for component in self.components for copy in component.denoiser_copies()]
        for module in self.family.denoisers() + copies + sampling_copy:
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
        self.teachers = Teachers.from_config(config, self.family)  # on-policy distillation's: adapters on the denoiser
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
            self.critic = Critic(config, self.accelerator, self.family.latent_shape(), self.family.text_dim,
                                 self.family.text_embeds)
        self.estimator_controller = self.estimator.controller(config) if self.estimator.controller else None
        # "auto": measured on the card at the first training phase (update/memory_fit.py), kept in checkpoints
        self.pairs_per_forward = PairsPerForward(config, self.accelerator, self.family, self.session.state.sizes,
                                                 say=self.session.print)
        self.ema = EMAWeights.from_config(config, self.params)  # None unless train.ema
        # the update loop (update/updater.py) with the objective's loss: the policy gradient, a matching objective on
        # the final samples, or a preference objective on each group's units
        options = UpdateOptions(config, self.accelerator, self.model, self.optimizer, self.params, self.scorer, self.kl,
                                self.pairs_per_forward, self.ema, self.old, self.teachers,
                                step_count=lambda: self.state.global_step - self.state.supervised_steps)
        self.updater = updater_class(self.objective.kind)(options)
        # the run's first sft.epochs epochs: the sft objective on sft.data_dir's images (rollout/image_folder.py)
        if config.sft.epochs:
            self.folder = ImageFolderRecords(config, self.family, self.accelerator.num_processes,
                                             self.accelerator.process_index)
            self.supervised_updater = MatchingUpdater.supervised(options)

    def checkpointed_state(self) -> dict:
        """{name: piece} of every stateful piece a checkpoint holds besides the prepared models and optimizer: the
        prompt sampler, the counters, the stat tracker, then the components' (run/components.py, in their order)."""
        return {"prompt_sampler": self.prompt_sampler, "counters": self.session.state,
                "stat_tracker": self.stat_tracker, **self.components.stateful()}

    @property
    def run_dir(self):
        return self.session.run_dir

    @property
    def state(self):
        return self.session.state

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        """Every remaining epoch, then the fresh final evaluation, the LoRA export and the summary."""
        metrics = {}
        try:
            with self.session.running(close=lambda: self.rollouts.close(wait=False)):  # signals; a failure stops all
                for epoch in self.session.remaining_epochs():
                    try:
                        metrics = self.train_epoch(epoch)
                    except EpochAbandoned:  # a stop signal while sampling: the epoch is dropped before any update
                        raise self.session.stopped_in_sampling(epoch) from None
                    self.session.end_of_epoch(epoch)  # the checkpoint when due; a stop signal stops here
                # what the run hands over (lora/) and its best evaluation's weights, beside the base model, on images
                # nothing was chosen on: the summary's before -> after and its verdict
                fresh = self.evaluations.after_training(held_weights(self.ema, self.config.train.ema_export),
                                                        self.accelerator.unwrap_model(self.model))
        finally:
            self.epoch_logger.draw_reward_curve()  # the epochs since its last draw, whatever ended the run
        self.session.finish(close=self.rollouts.close, fresh=fresh)
        return metrics

    def train_epoch(self, epoch: int) -> dict:
        """One epoch (module docstring); returns its metrics."""
        if epoch < self.config.sft.epochs:
            return self.supervised_epoch(epoch)
        start = time.perf_counter()
        self.throughput.start_epoch()
        self.model.eval()
        if epoch == 0:  # the "before" of the run summary
            self.evaluations.before_training()
        # 1. sample and score: trajectories (the old model's, for an objective that has one), rewards, gathered over
        #    the processes with what the components add (a stop signal drops the epoch)
        with names_the_setting("sampling", f"sample.batch_size={self.config.sample.batch_size}"), \
                self.updater.rollout_policy(self.sampling_model) as rollout_model, self.nfe.counting("sampling"):
            rounds = self.rollouts.collect(epoch, rollout_model)
        # 2. advantages: the estimator on each whole round; each process keeps its rows
        with self.timer.phase("advantage"), self.nfe.counting("sampling"):
            estimated = self.rollouts.estimate(rounds)
        batch = estimated.batch
        try:
            # 3. update the policy (not while the critic warms up: it learns the policy's values first)
            updated = {"optimizer_steps": 0, "pairs": 0}
            if all(component.trains_policy(epoch) for component in self.components):
                with self.timer.phase("training"), names_the_setting("training", self.pairs_per_forward.setting()), \
                        self.nfe.counting("training"):
                    updated = self.updater.train_epoch(batch, show_progress=self.accelerator.is_local_main_process)
            # warned once: the update is off-policy from its start
            self.on_policy(updated.get("ratio_before_update"), updated.get("clipped_before_update"))
            self.state.global_step += updated.pop("optimizer_steps")
            pairs = updated.pop("pairs")
            # 4. the components' own updates after the policy's: the critic, the KL term's beta and reference, the
            #    estimator's controller, the EMA's metrics, the tree's branch steps
            after = {}
            for component in self.components:
                after.update(component.after_update(epoch, estimated, updated))
        except NonFiniteLossError as error:
            raise self.session.non_finite_loss(error, epoch) from error
        # 5. evaluate when due (after the update, so the checkpoint that follows holds the evaluated weights)
        evaluated = self.evaluations.after_epoch(epoch)
        # 6. log
        metrics = epoch_metrics(epoch, self.state.global_step, estimated, updated, after)
        metrics.update(evaluated)
        metrics.update(self.timing(start))
        metrics.update(self.throughput.metrics(estimated.reward_queries, pairs, metrics["time/sampling"],
                                               metrics["time/training"], batch, self.nfe.take(),
                                               cuda_peak_floor=self.pairs_per_forward.take_seen_peak()))
        with self.timer.phase("logging"):
            self.epoch_logger.log(epoch, metrics, batch)
        for component in self.components:
            if line := component.epoch_line(epoch, metrics):
                self.session.print(line)
        return metrics

    def supervised_epoch(self, epoch: int) -> dict:
        """One of the run's first sft.epochs epochs: sft.data_dir's images and prompts in place of steps 1 and 2 (no
        sampling, no reward: every row advantage 1), the sft objective's matching update as step 3, no component's
        update, then the evaluation and the log of any epoch (its metrics sft/*)."""
        start = time.perf_counter()
        self.model.eval()
        if epoch == 0:
            self.evaluations.before_training()
        with self.timer.phase("sampling"):  # reading the images, encoding them and their prompts
            batch = self.folder.record(epoch)
        try:
            with self.timer.phase("training"), names_the_setting("training", self.pairs_per_forward.setting()):
                updated = self.supervised_updater.train_epoch(batch,
                                                              show_progress=self.accelerator.is_local_main_process)
        except NonFiniteLossError as error:
            raise self.session.non_finite_loss(error, epoch) from error
        steps = updated.pop("optimizer_steps")
        self.state.global_step += steps
        self.state.supervised_steps += steps
        updated.pop("pairs")
        if epoch == self.config.sft.epochs - 1:  # before its checkpoint
            self.start_from_the_fine_tuned_policy()
        metrics = {"epoch": epoch, "global_step": self.state.global_step, **{f"sft/{k}": v for k, v in updated.items()}}
        metrics.update(self.evaluations.after_epoch(epoch))
        metrics.update(self.timing(start))
        with self.timer.phase("logging"):
            self.epoch_logger.log(epoch, metrics, batch)
        return metrics

    def start_from_the_fine_tuned_policy(self) -> None:
        """After the last supervised epoch, reinforcement learning starts from the fine-tuned policy as RLHF starts from
        the SFT model: the KL term's reference and a matching objective's old model are set to it (a LoRA run's
        reference is then an adapter, reference/model.py); the old model's decay counts the steps from here."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        for follower in (self.kl.reference if self.kl is not None else None, self.old.weights if self.old else None):
            if follower is not None and follower.mode != "base":
                follower.mix(unwrapped, 1.0)

    def restore_best(self, after_epoch: int) -> int:
        """guard.on_alarm="restore", after the evaluation of epoch ``after_epoch``: the best evaluation's weights back
        in the policy, with everything else the run had learned then (``learned_state``); returns that evaluation's
        epoch."""
        return self.evaluations.best.restore(after_epoch)

    def learned_state(self) -> dict:
        """A copy of what the run has learned besides the policy's weights, which the guard's restore puts back with
        them (run/best_weights.py): the policy's optimizer, the stat tracker and each component's learned state (the
        counters and the prompt stream are not learned: they go on)."""
        state = copied({"optimizer": self.optimizer.state_dict(), "stat_tracker": self.stat_tracker.state_dict()})
        learned = {component.name: component.learned_state() for component in self.components}  # copies already
        return {**state, **{name: value for name, value in learned.items() if value is not None}}

    def load_learned_state(self, state: dict) -> None:
        if not state:  # a restore point from a checkpoint that kept only its weights: the optimizer's moments cleared
            self.optimizer.optimizer.state.clear()
            return
        self.optimizer.load_state_dict(copied(state["optimizer"]))
        self.stat_tracker.load_state_dict(copied(state["stat_tracker"]))
        for component in self.components:
            if component.name in state:
                component.load_learned_state(state[component.name])

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
