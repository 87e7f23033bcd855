"""The training loop: sample -> reward -> advantages -> policy update -> log -> checkpoint.

Read ``Trainer.run`` top to bottom; every step is a call into a module with one job.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import ProjectConfiguration, set_seed

from ddpo_group.algorithms import AdvantageInputs, get_adv_estimator
from ddpo_group.checkpointing import (
    TrainingState,
    resolve_resume_path,
    run_dir_of_checkpoint,
    save_checkpoint,
)
from ddpo_group.config_validation import validate_config
from ddpo_group.lora_export import save_lora
from ddpo_group.model_setup import build_policy, make_optimizer
from ddpo_group.plots import plot_reward_curve, read_metrics
from ddpo_group.policy_update import PolicyUpdater
from ddpo_group.prompts import PromptSampler
from ddpo_group.rewards import make_reward_fn
from ddpo_group.rollout import collect_rollouts
from ddpo_group.sampling.ddim import check_trainable_schedule
from ddpo_group.sampling.pipeline import encode_prompts
from ddpo_group.stat_tracking import PerPromptStatTracker
from ddpo_group.summary import format_summary
from ddpo_group.tracking import image_grid, resolve_wandb_mode

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
        if config.allow_tf32 and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = True
        set_seed(config.seed, device_specific=True)

        self.pipe, params = build_policy(config, self.accelerator.device)
        check_trainable_schedule(self.pipe.scheduler, config.sample.num_steps, config.sample.eta)
        optimizer = make_optimizer(config, params)
        self.unet, self.optimizer = self.accelerator.prepare(self.pipe.unet, optimizer)
        self.negative_prompt_embeds = encode_prompts(self.pipe, [""])

        self.reward_fn = make_reward_fn(config.reward_fn, **config.reward_fn_kwargs.to_dict())
        # the same seed on every process: all draw the same epoch prompt list and take their slice
        self.prompt_sampler = PromptSampler(config.prompt_fn, config.prompt_fn_kwargs.to_dict(), seed=config.seed)
        tracking = config.get("per_prompt_stat_tracking")
        if tracking:
            self.stat_tracker = PerPromptStatTracker(tracking.buffer_size, tracking.min_count, mode="buffer")
        else:  # ddpo-pytorch's per_prompt_stat_tracking=None: whole-batch statistics, always
            self.stat_tracker = PerPromptStatTracker(buffer_size=1, min_count=2**31, mode="buffer")
        self.state = TrainingState()
        self.accelerator.register_for_checkpointing(self.prompt_sampler, self.state, self.stat_tracker)
        self.updater = PolicyUpdater(
            config, self.accelerator, self.unet, self.pipe.scheduler, self.optimizer, params, self.negative_prompt_embeds
        )
        self.executor = ThreadPoolExecutor(max_workers=2)

        if resume_path is not None:
            self.accelerator.load_state(str(resume_path))
            self._print(f"resumed from {resume_path} (finished epoch {self.state.epoch})")
        if self.accelerator.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2, default=str))
        if self.wandb_mode != "disabled":
            self.accelerator.init_trackers(
                config.wandb.project,
                config=config.to_dict(),
                init_kwargs={"wandb": {"name": self.run_dir.name, "dir": str(self.run_dir), "mode": self.wandb_mode,
                                       "entity": config.wandb.entity or None}},
            )

    # ------------------------------------------------------------------ loop
    def run(self) -> dict:
        config = self.config
        self._print(
            f"training {config.pretrained.model} with {config.algorithm.adv_estimator} for epochs "
            f"{self.state.epoch + 1}..{config.num_epochs - 1} on {self.accelerator.num_processes} process(es); "
            f"run dir {self.run_dir}"
        )
        metrics = {}
        for epoch in range(self.state.epoch + 1, config.num_epochs):
            metrics = self.run_epoch(epoch)
            self.state.epoch = epoch
            last = epoch == config.num_epochs - 1
            if last or (config.save_freq > 0 and (epoch + 1) % config.save_freq == 0):
                path = save_checkpoint(
                    self.accelerator, self.run_dir / "checkpoints", epoch, config.num_checkpoint_limit,
                    extra=(lambda directory: save_lora(self.unet, directory / "lora")) if self.exports_lora else None,
                )
                self._print(f"saved {path}")
        if self.exports_lora and self.accelerator.is_main_process:
            self._print(f"LoRA (diffusers format) in {save_lora(self.unet, self.run_dir / 'lora')}")
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
        self.executor.shutdown()
        if self.accelerator.is_main_process:
            self.write_summary()
        return metrics

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
        timings = {}
        start = time.perf_counter()
        self.unet.eval()
        local = self.config.sample.batch_size * self.config.sample.num_batches_per_epoch
        group_size = self.config.train.group_size
        prompts, metadata, groups = self.prompt_sampler.sample_epoch(
            local * self.accelerator.num_processes // group_size, group_size
        )
        mine = slice(self.accelerator.process_index * local, (self.accelerator.process_index + 1) * local)
        with self.accelerator.autocast():  # the precision the training forward recomputes log-probs in
            batch = collect_rollouts(
                self.pipe, prompts[mine], metadata[mine], self.reward_fn, self.config.reward_fn, self.executor,
                self.config.sample, self.negative_prompt_embeds, show_progress=self.accelerator.is_local_main_process,
                desc=f"epoch {epoch}: sampling",
            )
        timings["time/sampling"] = time.perf_counter() - start

        start = time.perf_counter()
        global_rewards = self.accelerator.gather(batch["rewards"].to(self.accelerator.device)).cpu()
        batch["advantages"], adv_metrics = self.compute_advantages(batch, global_rewards, prompts, groups)
        timings["time/advantages"] = time.perf_counter() - start

        start = time.perf_counter()
        train_metrics = self.updater.train_epoch(batch, show_progress=self.accelerator.is_local_main_process)
        timings["time/training"] = time.perf_counter() - start
        self.state.global_step += train_metrics.pop("optimizer_steps")

        metrics = {
            "epoch": epoch,
            "global_step": self.state.global_step,
            "reward_mean": float(global_rewards.mean()),
            "reward_count": int(global_rewards.numel()),
            "reward_std": float(global_rewards.std(unbiased=False)),
            **{f"train/{k}": v for k, v in train_metrics.items()},
            **adv_metrics,
            **timings,
        }
        for key, value in batch["reward_info"].items():
            metrics[f"reward_info/{key}"] = float(self.accelerator.gather(value.to(self.accelerator.device)).float().mean())
        self.log(epoch, metrics, batch)
        return metrics

    # ------------------------------------------------------------------ pieces
    def compute_advantages(
        self, batch: dict, rewards: torch.Tensor, prompts: list[str], groups: list[int]
    ) -> tuple[torch.Tensor, dict]:
        """Advantages [B_global, T] from the rewards gathered in process order; returns this process's rows."""
        num_steps = batch["log_probs"].shape[1]
        inputs = AdvantageInputs(
            rewards=rewards.double(),
            step_mask=torch.ones(len(prompts), num_steps, dtype=torch.float64),
            group_index=torch.tensor(groups, dtype=torch.long),
            prompts=prompts,
            stat_tracker=self.stat_tracker,
        )
        estimator = get_adv_estimator(self.config.algorithm.adv_estimator)
        out = estimator(inputs, adv_clip_max=self.config.train.adv_clip_max)
        local = len(batch["prompts"])
        rank = self.accelerator.process_index
        advantages = out.advantages[rank * local : (rank + 1) * local].float().to(self.accelerator.device)
        return advantages, {k: float(v) for k, v in out.metrics.items()}

    def log(self, epoch: int, metrics: dict, batch: dict) -> None:
        if self.accelerator.is_main_process:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics) + "\n")
            try:  # the reward curve so far, whatever the wandb mode
                plot_reward_curve(read_metrics(self.run_dir / "metrics.jsonl"), self.run_dir / "reward_curve.png",
                                  title=f"{self.run_dir.name}: reward per epoch")
            except Exception as error:  # a plotting problem must not stop training
                self._print(f"could not plot the reward curve: {type(error).__name__}: {error}")
        if self.wandb_mode != "disabled":
            self.accelerator.log(metrics, step=epoch)
        every = self.config.log_images_every
        if self.accelerator.is_main_process and every and epoch % every == 0:
            n = min(16, len(batch["prompts"]))
            captions = [f"{p} | {r:.3f}" for p, r in zip(batch["prompts"][:n], batch["rewards"][:n].tolist())]
            grid = image_grid(batch["images"][:n], captions)
            samples_dir = self.run_dir / "samples"
            samples_dir.mkdir(parents=True, exist_ok=True)
            grid.save(samples_dir / f"epoch_{epoch:05d}.png")
            if self.wandb_mode != "disabled":
                import wandb

                self.accelerator.get_tracker("wandb").log({"images": wandb.Image(grid)}, step=epoch)
        self._print(
            f"epoch {epoch}: reward {metrics['reward_mean']:.4f} ± {metrics['reward_std']:.4f} | "
            f"loss {metrics.get('train/policy_loss', float('nan')):.3g} | "
            f"clipfrac {metrics.get('train/clipfrac', float('nan')):.3f} | "
            f"sampling {metrics['time/sampling']:.1f}s, training {metrics['time/training']:.1f}s"
        )

    def _print(self, message: str) -> None:
        if self.accelerator.is_main_process:
            print(f"[ddpo_group] {message}", flush=True)
