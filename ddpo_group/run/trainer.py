"""The training loop: sample -> reward -> advantages -> policy update -> log -> checkpoint.

Read ``Trainer.run`` top to bottom; every step is a call into a module with one job.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
import uuid
from types import SimpleNamespace
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import ProjectConfiguration, set_seed

from ddpo_group.rollout.estimate import compute_advantages, critic_regression
from ddpo_group.algorithms import CRITIC_ESTIMATORS, GroupThresholdController, get_kl_controller
from ddpo_group.run.checkpointing import (
    TrainingState,
    checkpoint_dir,
    complete_checkpoints,
    later_checkpoints,
    resolve_resume_path,
    run_dir_of_checkpoint,
    save_checkpoint,
)
from ddpo_group.run.config_checks import validate_config
from ddpo_group.update.critic import Critic
from ddpo_group.rollout.dynamic_sampling import group_keep_mask, pool_rows
from ddpo_group.errors import EpochAbandoned, NonFiniteLossError, TrainingInterrupted, signal_name
from ddpo_group.run.interrupts import StopRequest
from ddpo_group.reference.kl_term import rollout_kl
from ddpo_group.models.lora_export import save_lora
from ddpo_group.run.metrics_log import rewind_metrics
from ddpo_group.models.policy import build_policy, lora_config, make_optimizer
from ddpo_group.run.plots import read_metrics
from ddpo_group.update.policy import PolicyUpdater
from ddpo_group.prompts import PromptSampler
from ddpo_group.rewards import make_reward_fn
from ddpo_group.reference.model import ReferenceModel
from ddpo_group.run.resume_check import check_resume, write_state_fields
from ddpo_group.rollout.collect import collect_rollouts, greedy_rewards
from ddpo_group.sampling.noise import group_initial_noise, round_seed, sample_generators
from ddpo_group.sampling.ddim import check_trainable_schedule, stochastic_steps
from ddpo_group.sampling.pipeline import encode_prompts, latent_shape
from ddpo_group.rollout.snapshot import SamplingSnapshot
from ddpo_group.algorithms.stat_tracker import PerPromptStatTracker
from ddpo_group.run.summary import format_summary, group_summary
from ddpo_group.timing import PHASES, PhaseTimer
from ddpo_group.run.epoch_logger import EpochLogger, resolve_wandb_mode

logger = get_logger(__name__)


class Trainer:
    def __init__(self, config):
        self.config = config
        validate_config(config)
        resume_path = resolve_resume_path(config.resume_from) if config.resume_from else None
        if resume_path is not None:
            self.run_dir = run_dir_of_checkpoint(resume_path)
        else:
            name = config.run_name or f"{config.get('preset', 'run')}_{datetime.datetime.now():%Y%m%d_%H%M%S}"
            self.run_dir = Path(config.logdir) / name
        self.wandb_mode, wandb_note = resolve_wandb_mode(config.wandb.mode)
        # everything that can be checked without a model, before any loads: a bad input fails in seconds
        resume_warnings = check_resume(resume_path, config, int(os.environ.get("WORLD_SIZE", "1"))) if resume_path else []
        # the same seed on every process: all draw the same epoch prompt list and take their slice
        self.prompt_sampler = PromptSampler(config.prompt_fn, config.prompt_fn_kwargs.to_dict(), seed=config.seed)
        self.prompt_sampler.probe()
        self.reward_fn = make_reward_fn(config.reward_fn, **config.reward_fn_kwargs.to_dict())

        self.accelerator = Accelerator(
            # several processes without CUDA: accelerate uses gloo only when asked for the CPU
            cpu=int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available(),
            mixed_precision=config.mixed_precision,
            gradient_accumulation_steps=config.train.gradient_accumulation_steps,
            log_with="wandb" if self.wandb_mode != "disabled" else None,
            project_config=ProjectConfiguration(project_dir=str(self.run_dir)),
        )
        validate_config(config, num_processes=self.accelerator.num_processes)
        if wandb_note:
            self._print(wandb_note)
        for warning in resume_warnings:
            self._print(f"warning: {warning}")
        if config.allow_tf32 and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = True
        set_seed(config.seed, device_specific=True)

        self.pipe, params = build_policy(config, self.accelerator.device)
        check_trainable_schedule(self.pipe.scheduler, config.sample.num_steps, config.sample.eta,
                                 stochastic_steps(config.sample))
        # the reference adds its adapter (or copies the UNet) before accelerate wraps the UNet
        self.reference = ReferenceModel.from_config(config, self.pipe.unet, lora_config(config) if config.use_lora else None)
        optimizer = make_optimizer(config, params)
        if config.get("compile_unet", False):  # in place (Module.compile): names, hooks and state dict unchanged
            self.pipe.unet.compile()
        self.unet, self.optimizer = self.accelerator.prepare(self.pipe.unet, optimizer)
        self.negative_prompt_embeds = encode_prompts(self.pipe, [""])

        tracking = config.get("per_prompt_stat_tracking")
        if tracking:
            self.stat_tracker = PerPromptStatTracker(tracking.buffer_size, tracking.min_count, mode="buffer")
        else:  # ddpo-pytorch's per_prompt_stat_tracking=None: whole-batch statistics, always
            self.stat_tracker = PerPromptStatTracker(buffer_size=1, min_count=2**31, mode="buffer")
        self.state = TrainingState()
        self.accelerator.register_for_checkpointing(self.prompt_sampler, self.state, self.stat_tracker)
        a, g = config.algorithm, config.group_params
        self.critic = None
        if a.adv_estimator in CRITIC_ESTIMATORS:
            self.critic = Critic(
                config, self.accelerator, self.pipe.unet.config.in_channels, self.pipe.text_encoder.config.hidden_size
            )
        self.kl_controller = get_kl_controller(a.kl_controller, config.train.beta, a.target_kl, a.kl_horizon)
        self.accelerator.register_for_checkpointing(self.kl_controller)
        self.group_controller = None
        if a.adv_estimator == "group_ppo":
            self.group_controller = GroupThresholdController(
                tau=g.group_variance_threshold, lr=g.threshold_lr, min_tau=g.min_threshold, max_tau=g.max_threshold,
                target_ev=g.target_explained_variance, adaptive=g.adaptive_threshold,
            )
            self.accelerator.register_for_checkpointing(self.group_controller)
        if self.reference is not None:
            self.accelerator.register_for_checkpointing(self.reference)
        self.updater = PolicyUpdater(
            config, self.accelerator, self.unet, self.pipe.scheduler, self.optimizer, params, self.negative_prompt_embeds,
            # KL in the loss, or (kl_in_reward) in the reward: never both
            reference=None if a.kl_in_reward else self.reference,
        )
        self.executor = ThreadPoolExecutor(max_workers=2)
        # wall time per phase (time/<phase> in the metrics; bench/epoch.py reads it with sync on)
        self.timer = PhaseTimer()
        self.updater.timer = self.timer
        self._timer_mark = self.timer.snapshot()
        self.stop = StopRequest()  # installed by run(): Ctrl-C / SIGTERM
        self.saved_epoch = None  # the epoch of the checkpoint last written or resumed from

        if resume_path is not None:
            self.accelerator.load_state(str(resume_path))
            self._print(f"resumed from {resume_path} (finished epoch {self.state.epoch})")
            self.saved_epoch = self.state.epoch
            self._forget_later_epochs(resume_path)
        if not self.state.wandb_run_id:
            self.state.wandb_run_id = uuid.uuid4().hex[:12]  # saved with every checkpoint
        if self.accelerator.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2, default=str))
        if self.wandb_mode != "disabled":
            self.accelerator.init_trackers(
                config.wandb.project,
                config=config.to_dict(),
                init_kwargs={"wandb": {"name": self.run_dir.name, "dir": str(self.run_dir), "mode": self.wandb_mode,
                                       "entity": config.wandb.entity or None,
                                       # a resumed run continues the same wandb run
                                       "id": self.state.wandb_run_id, "resume": "allow"}},
            )
        self.epoch_logger = EpochLogger(self.accelerator, self.run_dir, self.wandb_mode, config.log_images_every,
                                        self._print)

    def _forget_later_epochs(self, resume_path: Path) -> None:
        """After a resume, the run continues from ``resume_path``'s epoch: drop the metrics logged after it
        (they are logged again) and warn about checkpoints of later epochs (a run directory resumes from the latest)."""
        if not self.accelerator.is_main_process:
            return
        dropped = rewind_metrics(self.run_dir / "metrics.jsonl", self.state.epoch)
        if dropped:
            self._print(f"dropped {dropped} metrics line(s) logged after epoch {self.state.epoch} (they are run again)")
        later = later_checkpoints(resume_path)
        if later:
            self._print(
                f"warning: {', '.join(p.name for p in later)} (later epochs of an earlier attempt) stay in "
                f"{resume_path.parent} until overwritten; resuming from the run directory would pick them"
            )

    # ------------------------------------------------------------------ loop
    def run(self) -> dict:
        config = self.config
        self._print(
            f"training {config.pretrained.model} with {config.algorithm.adv_estimator} for epochs "
            f"{self.state.epoch + 1}..{config.num_epochs - 1} on {self.accelerator.num_processes} process(es); "
            f"run dir {self.run_dir}"
        )
        if self.state.epoch >= config.num_epochs - 1:
            self._print(f"nothing to train: the checkpoint finished epoch {self.state.epoch} and num_epochs="
                        f"{config.num_epochs}; raise num_epochs to train further")
        metrics = {}
        stop = self.stop = StopRequest(self.resume_hint())
        try:
            # Ctrl-C / SIGTERM while sampling: drop the epoch; while training: finish it; then checkpoint and stop
            with stop.installed():
                for epoch in range(self.state.epoch + 1, config.num_epochs):
                    try:
                        metrics = self.run_epoch(epoch)
                    except EpochAbandoned:
                        raise self.stopped_in_sampling(epoch) from None
                    self.state.epoch = epoch
                    stopping = self.stop_agreed(stop)
                    last = epoch == config.num_epochs - 1
                    if last or stopping or (config.save_freq > 0 and (epoch + 1) % config.save_freq == 0):
                        path = self.save(epoch)
                    if stopping and not last:
                        if self.accelerator.is_main_process:
                            self.write_summary()
                        signum = stop.signum or signal.SIGTERM
                        raise TrainingInterrupted(
                            signum, f"training stopped by {signal_name(signum)} after epoch {epoch}; "
                            f"checkpoint {path}. {self.resume_hint()}",
                        )
        except BaseException:
            self.executor.shutdown(wait=False, cancel_futures=True)
            for tracker in self.accelerator.trackers:  # flush what was logged (wandb: the same run id resumes)
                tracker.finish()
            raise
        with self.timer.phase("checkpoint"):
            if self.exports_lora and self.accelerator.is_main_process:
                self._print(f"LoRA (diffusers format) in {save_lora(self.unet, self.run_dir / 'lora')}")
            self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
        self.executor.shutdown()
        if self.accelerator.is_main_process:
            with self.timer.phase("logging"):
                self.write_summary()
        return metrics

    def save(self, epoch: int) -> Path:
        """Write the checkpoint of finished epoch ``epoch`` (atomic; rotation keeps num_checkpoint_limit)."""
        def extra(directory: Path) -> None:  # main process, before the checkpoint is marked complete
            write_state_fields(directory, self.config, self.accelerator.num_processes)
            if self.exports_lora:
                save_lora(self.unet, directory / "lora")

        with self.timer.phase("checkpoint"):
            path = save_checkpoint(
                self.accelerator, self.run_dir / "checkpoints", epoch, self.config.num_checkpoint_limit, extra=extra
            )
        self.saved_epoch = epoch
        self._print(f"saved {path}")
        return path

    def stopped_in_sampling(self, epoch: int) -> TrainingInterrupted:
        """The stop after abandoning ``epoch`` in its sampling phase (state already restored to the previous
        epoch's end): checkpoint the last finished epoch unless that checkpoint exists."""
        signum = self.stop.signum or signal.SIGTERM
        what = f"training stopped by {signal_name(signum)} while sampling epoch {epoch}; the epoch was dropped " \
               "before any update"
        if self.state.epoch < 0:
            return TrainingInterrupted(signum, f"{what}. No epoch had finished, so there is nothing to checkpoint: "
                                               "start the run again (without resume_from).")
        what += " and runs again on resume"
        if self.saved_epoch == self.state.epoch:
            path = checkpoint_dir(self.run_dir / "checkpoints", self.state.epoch)
        else:
            path = self.save(self.state.epoch)
        return TrainingInterrupted(signum, f"{what}; checkpoint {path} (epoch {self.state.epoch}). {self.resume_hint()}")

    def stop_agreed(self, stop: StopRequest) -> bool:
        """True when any process got a stop signal (all processes must stop at the same point)."""
        if self.accelerator.num_processes == 1:
            return stop.requested
        return bool(self.gather(torch.tensor([1.0 if stop.requested else 0.0])).max() > 0)

    def resume_hint(self) -> str:
        return (f"Resume with the same command plus --config.resume_from={self.run_dir} "
                "(it continues from the latest complete checkpoint).")

    def last_checkpoint_note(self) -> str:
        checkpoints = complete_checkpoints(self.run_dir / "checkpoints")
        if not checkpoints:
            return "No checkpoint was written yet."
        return f"The last complete checkpoint, {checkpoints[-1]}, is kept. {self.resume_hint()}"

    @property
    def exports_lora(self) -> bool:
        return bool(self.config.use_lora and self.config.get("export_lora", True))

    def write_summary(self) -> str:
        """Print the one-screen summary of the run and write it to summary.txt."""
        run = self.run_dir
        checkpoints = sorted((run / "checkpoints").glob("checkpoint_*"))
        paths = {
            "run directory": run, "config": run / "config.json", "metrics": run / "metrics.jsonl",
            "reward curve": run / "reward_curve.png", "sample grids": run / "samples",
            "last checkpoint": checkpoints[-1] if checkpoints else None, "LoRA (diffusers)": run / "lora",
        }
        text = format_summary(read_metrics(run / "metrics.jsonl"), paths)
        (run / "summary.txt").write_text(text + "\n")
        print(text, flush=True)
        return text

    def run_epoch(self, epoch: int) -> dict:
        config, accelerator = self.config, self.accelerator
        start = time.perf_counter()
        self.unet.eval()
        # a stop signal while sampling drops the epoch: the snapshot undoes what sampling changed
        snapshot = SamplingSnapshot(self.prompt_sampler, self.stat_tracker)
        try:
            rounds = [self.sample_round(epoch, 0)]
            if config.algorithm.filter_groups:  # DAPO: more rounds until every process holds a full batch of kept groups
                while len(rounds) < config.algorithm.max_num_gen_batches and self.short_of_kept_rows(rounds):
                    rounds.append(self.sample_round(epoch, len(rounds)))
            if self.stop_agreed(self.stop):
                raise EpochAbandoned(f"epoch {epoch} sampled; stopped before its update")
        except EpochAbandoned:
            snapshot.restore()
            raise
        if config.algorithm.filter_groups:
            batch = pool_rows([r.batch for r in rounds], [self.local_rows(r.keep).bool() for r in rounds], self.local)
        else:
            batch = rounds[0].batch
        out = rounds[0].out
        rewards = torch.cat([r.gathered["rewards"] for r in rounds])

        # ---- policy (and critic) update ----
        self.updater.beta = self.kl_controller.value
        try:
            with self.timer.phase("training"):
                train_metrics = self.updater.train_epoch(batch, show_progress=accelerator.is_local_main_process)
            self.state.global_step += train_metrics.pop("optimizer_steps")
            critic_metrics = {}
            if self.critic is not None:
                with self.timer.phase("critic"):
                    mask = batch["critic_mask"] * batch["row_mask"][:, None] if "row_mask" in batch else batch["critic_mask"]
                    critic_metrics = self.critic.train_epoch(batch, batch["critic_targets"], mask, config.train.batch_size)
        except NonFiniteLossError as error:
            if error.optimizer_steps is None:  # the critic's update, after the policy steps of the epoch
                where = f"after global step {self.state.global_step}"
            else:
                where = f"global step {self.state.global_step + error.optimizer_steps + 1}"
            raise NonFiniteLossError(
                f"{error} at epoch {epoch} ({where}); training stopped before that optimizer step and "
                f"nothing of epoch {epoch} was saved. {self.last_checkpoint_note()} Lower train.learning_rate or "
                "check the reward scale before resuming.", error.optimizer_steps,
            ) from error

        # ---- controllers and reference, after the epoch ----
        metrics = {
            "epoch": epoch,
            "global_step": self.state.global_step,
            "reward_mean": float(rewards.mean()),
            "reward_count": int(rewards.numel()),
            "reward_queries": sum(r.reward_queries for r in rounds),  # every reward evaluation of the epoch
            "reward_std": float(rewards.std(unbiased=False)),
            **{f"train/{k}": v for k, v in train_metrics.items()},
            **{k: float(v) for k, v in out.metrics.items()},
            **critic_metrics,
        }
        if self.reference is not None:
            metrics["train/beta"] = self.kl_controller.value
            if config.algorithm.kl_in_reward:  # the KL of the sampled steps, measured for the reward
                kl = torch.cat([r.gathered["step_kl"] for r in rounds]).mean()
            else:  # the KL of the trained steps, measured in the loss (not measured when beta = 0: 0)
                kl = self.gather(torch.tensor([train_metrics.get("kl", 0.0)])).mean()
            metrics["ref/kl"] = float(kl)
            self.kl_controller.update(float(kl), self.local * accelerator.num_processes)
            with self.timer.phase("reference"):
                self.reference.maybe_update(accelerator.unwrap_model(self.unet), epoch)
                metrics.update(self.reference.metrics(accelerator.unwrap_model(self.unet)))
        if config.algorithm.filter_groups:
            groups = sum(r.num_groups for r in rounds)
            metrics["filter/dropped_share"] = sum(r.dropped_share * r.num_groups for r in rounds) / groups
            metrics["filter/rounds"] = len(rounds)
            metrics["filter/batch_fill"] = float(self.gather(batch["row_mask"]).mean())
        if self.group_controller is not None:  # EV over the kept endpoint targets of every round
            with self.timer.phase("advantage"):
                pairs = [critic_regression(config, r.out) + (r.gathered["values"], r.keep) for r in rounds]
                self.group_controller.update(
                    torch.cat([t[k] for t, _, _, k in pairs]), torch.cat([v[k] for _, _, v, k in pairs]),
                    torch.cat([m[k] for _, m, _, k in pairs]),
                )
            metrics["group/critic_ev"] = self.group_controller.last_ev
            metrics["group/next_tau"] = self.group_controller.tau
        for key, value in batch["reward_info"].items():
            metrics[f"reward_info/{key}"] = float(self.gather(value).float().mean())
        # wall time per phase since the previous epoch's metrics (so time/logging and time/checkpoint are the
        # previous epoch's: they run after its metrics are written)
        now = self.timer.snapshot()
        spent = PhaseTimer.since(self._timer_mark, now)
        self._timer_mark = now
        metrics.update({f"time/{phase}": spent.get(phase, 0.0) for phase in PHASES})
        metrics["time/epoch"] = time.perf_counter() - start
        with self.timer.phase("logging"):
            self.epoch_logger.log(epoch, metrics, batch)
        if self.group_controller is not None and epoch % 10 == 0:
            self._print(group_summary(epoch, metrics))
        return metrics

    # ------------------------------------------------------------------ pieces
    def sample_round(self, epoch: int, round_index: int) -> SimpleNamespace:
        """Sample one round of the epoch (P prompts x group_size copies over all processes), score it, gather
        the rewards (and values, baselines, step rewards) and compute the advantages on the gathered round.

        Returns batch (this process's rows, with advantages, critic_targets and critic_mask), out (the
        estimator's output on the gathered round), gathered, keep [B_global] (groups with reward variance).
        """
        config, accelerator, local = self.config, self.accelerator, self.local
        group_size = config.train.group_size
        prompts, metadata, groups = self.prompt_sampler.sample_epoch(local * accelerator.num_processes // group_size, group_size)
        mine = slice(accelerator.process_index * local, (accelerator.process_index + 1) * local)
        seed = round_seed(config.seed, epoch, round_index)
        initial_noise = None
        if config.sample.same_initial_noise:
            initial_noise = group_initial_noise(seed, groups[mine], latent_shape(self.pipe.unet), accelerator.device)
        with accelerator.autocast():  # the precision the training forward recomputes log-probs in
            batch = collect_rollouts(
                self.pipe, prompts[mine], metadata[mine], self.reward_fn, config.reward_fn, self.executor,
                config.sample, self.negative_prompt_embeds, show_progress=accelerator.is_local_main_process,
                desc=f"epoch {epoch}: sampling", generators=sample_generators(seed, mine, accelerator.device),
                critic=self.critic, should_stop=lambda: self.stop_agreed(self.stop), timer=self.timer,
                initial_noise=initial_noise,
            )
            extra = self.baselines_and_step_rewards(epoch, batch, groups[mine], initial_noise)
        with self.timer.phase("advantage"):
            return self._advantages(batch, extra, prompts, groups, mine)

    def _advantages(self, batch, extra, prompts, groups, mine) -> SimpleNamespace:
        """Gather the round, compute the advantages on it; each process keeps its own rows."""
        config = self.config
        gathered = {key: self.gather(value) for key, value in {"rewards": batch["rewards"], **extra}.items()}
        out = compute_advantages(
            config, gathered["rewards"], torch.tensor(groups), prompts, batch["log_probs"].shape[1], self.stat_tracker,
            values=gathered.get("values"), step_rewards=gathered.get("step_rewards"),
            greedy_rewards=gathered.get("greedy_rewards"),
            tau=self.group_controller.tau if self.group_controller is not None else None,
        )
        batch["advantages"] = self.local_rows(out.advantages)
        if self.critic is not None:
            targets, mask = critic_regression(config, out)
            batch["critic_targets"], batch["critic_mask"] = self.local_rows(targets), self.local_rows(mask)
        keep, dropped_share = group_keep_mask(gathered["rewards"], groups)
        if not config.algorithm.filter_groups:
            keep = torch.ones_like(keep)
        queries = len(groups)
        if "greedy_rewards" in extra:  # ReMax's greedy samples are reward queries too
            queries += int(self.gather(torch.tensor([len(set(groups[mine]))])).sum())
        return SimpleNamespace(batch=batch, out=out, gathered=gathered, keep=keep, dropped_share=dropped_share,
                               num_groups=len(set(groups)), reward_queries=queries)

    def short_of_kept_rows(self, rounds: list) -> bool:
        """True while some process holds fewer than a batch of rows from groups with reward variance."""
        kept = sum(int(self.local_rows(r.keep).sum()) for r in rounds)
        return bool(self.gather(torch.tensor([kept])).min() < self.local)

    def baselines_and_step_rewards(self, epoch: int, batch: dict, groups: list[int],
                                   initial_noise: torch.Tensor | None = None) -> dict:
        """Per-sample extras the estimator needs: critic values, ReMax's greedy rewards, KL-in-reward step rewards.

        With shared initial noise, ReMax's greedy sample of a group starts from the group's x_T too.
        """
        config, extra = self.config, {}
        if self.critic is not None:
            extra["values"] = batch["values"]
        if config.algorithm.adv_estimator == "remax":
            with self.timer.phase("sampling"):  # greedy samples and their rewards
                extra["greedy_rewards"] = greedy_rewards(
                    self.pipe, batch["prompts"], batch["metadata"], groups, self.reward_fn, config.reward_fn, config.sample,
                    self.negative_prompt_embeds, seed=config.seed * 1_000_003 + epoch, initial_noise=initial_noise,
                )
        if config.algorithm.kl_in_reward:
            guidance = config.sample.guidance_scale if config.train.cfg else 1.0
            with self.timer.phase("reference"):
                kl = rollout_kl(
                    batch, self.pipe.unet, self.reference, self.pipe.scheduler, self.negative_prompt_embeds, guidance,
                    config.sample.eta, config.algorithm.kl_type, config.sample.log_prob_reduce,
                    config.train.pairs_per_forward, steps=stochastic_steps(config.sample),
                )
            extra["step_kl"] = kl
            extra["step_rewards"] = -self.kl_controller.value * kl
        return extra

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate a per-process tensor over processes, in process order, on the CPU."""
        return self.accelerator.gather(tensor.contiguous().to(self.accelerator.device)).cpu()

    @property
    def local(self) -> int:
        """Samples per process per round."""
        return self.config.sample.batch_size * self.config.sample.num_batches_per_epoch

    def local_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """This process's rows of a tensor over the gathered batch, on its device as float32."""
        rank = self.accelerator.process_index
        return tensor[rank * self.local : (rank + 1) * self.local].float().to(self.accelerator.device)

    def _print(self, message: str) -> None:
        if self.accelerator.is_main_process:
            print(f"[ddpo_group] {message}", flush=True)
