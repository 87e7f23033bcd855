"""Experiment tracking: wandb through accelerate (online, offline or disabled), metrics.jsonl, the reward curve,
sample grids (run/reporting/image_grid.py) and the console line; the evaluations during training (eval.jsonl, their grids)."""

from __future__ import annotations

import netrc
import os
import time

from ddpo_group.run.reporting.audio_files import write_wav
from ddpo_group.run.reporting.image_grid import image_grid, with_sources
from ddpo_group.run.persistence.metrics_log import append_metrics, read_metrics

EVAL_LOG = "eval.jsonl"  # one record per evaluation during training (epoch -1: before the first update)
# reward_curve.png is redrawn after an epoch when this many seconds passed since it was last drawn, and at the run's end
# (a draw costs about 0.3 s: every epoch of a seconds-long epoch would spend a tenth of the run on it)
CURVE_SECONDS = 10.0
from ddpo_group.run.reporting.plots import plot_reward_curve


def wandb_api_key_available() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def resolve_wandb_mode(requested: str) -> tuple[str, str | None]:
    """The mode to run wandb in, and a note when it differs from the requested one.

    WANDB_MODE in the environment wins (wandb's own convention); "online" without an API key
    falls back to "offline" so a run never stops at a login prompt.
    """
    env_mode = os.environ.get("WANDB_MODE")
    if env_mode in ("online", "offline", "disabled"):
        return env_mode, (f"wandb mode {env_mode!r} from WANDB_MODE" if env_mode != requested else None)
    if requested == "online" and not wandb_api_key_available():
        return "offline", "no wandb API key found: logging offline (sync later with `wandb sync`)"
    return requested, None


class EpochLogger:
    """What every epoch leaves behind: a metrics.jsonl line (and wandb's), the reward curve so far (redrawn at most
    every CURVE_SECONDS, and by ``draw_reward_curve`` at the end), a grid of the epoch's samples every
    ``log_images_every`` epochs (0: never), and one console line. ``run_dir``: the run directory, or a function that
    returns it (the session's, which the processes agree on when the run starts)."""

    def __init__(self, accelerator, run_dir, wandb_mode: str, log_images_every: int, print_fn):
        self.accelerator = accelerator
        self.where = run_dir if callable(run_dir) else lambda: run_dir
        self.wandb_mode = wandb_mode
        self.log_images_every = log_images_every
        self.print = print_fn
        self.drawn_at, self.undrawn = time.monotonic(), False

    @property
    def run_dir(self):
        return self.where()

    def log(self, epoch: int, metrics: dict, batch) -> None:
        main = self.accelerator.is_main_process
        if main:
            append_metrics(self.run_dir / "metrics.jsonl", metrics)
            self.undrawn = True
            if time.monotonic() - self.drawn_at >= CURVE_SECONDS:
                self.draw_reward_curve()
        if self.wandb_mode != "disabled":
            self.accelerator.log(metrics, step=epoch)
        every = self.log_images_every
        if main and every and epoch % every == 0:
            n = min(16, len(batch.prompts))
            captions = [f"{p}\nreward {r:.3f}" if "reward_mean" in metrics else f"{p}\n(sft.data_dir's image)"
                        for p, r in zip(batch.prompts[:n], batch.rewards[:n].tolist())]  # a supervised epoch's: data
            grid = image_grid(with_sources(batch.images[:n], batch.metadata), captions)
            samples_dir = self.run_dir / "samples"
            samples_dir.mkdir(parents=True, exist_ok=True)
            grid.save(samples_dir / f"epoch_{epoch:05d}.png")
            if self.wandb_mode != "disabled":
                import wandb

                self.accelerator.get_tracker("wandb").log({"images": wandb.Image(grid)}, step=epoch)
        evaluated = f"eval {metrics['eval/reward_mean']:.4f} | " if "eval/reward_mean" in metrics else ""
        if "reward_mean" not in metrics:  # a supervised epoch (sft.epochs): its images' matching loss
            self.print(f"epoch {epoch} (supervised on sft.data_dir): {evaluated}matching loss "
                       f"{metrics['sft/policy_loss']:.4g} | grad norm {metrics.get('sft/grad_norm', float('nan')):.3g}")
            return
        distilled = f"teachers' KL {metrics['train/opd_kl']:.4g} | " if "train/opd_kl" in metrics else ""
        policy = "" if distilled and "train/policy_loss" not in metrics else (
            f"loss {metrics.get('train/policy_loss', float('nan')):.3g} | "
            f"clipfrac {metrics.get('train/clipfrac', float('nan')):.3f} | ")
        self.print(f"epoch {epoch}: reward {metrics['reward_mean']:.4f} ± {metrics['reward_std']:.4f} | {evaluated}"
                   f"{distilled}{policy}" + perf_line(metrics))


    def draw_reward_curve(self) -> None:
        """reward_curve.png from metrics.jsonl and eval.jsonl, whatever the wandb mode, when an epoch was logged
        since the last draw (on the main process)."""
        if not (self.undrawn and self.accelerator.is_main_process):
            return
        try:
            plot_reward_curve(read_metrics(self.run_dir / "metrics.jsonl"), self.run_dir / "reward_curve.png",
                              title=f"{self.run_dir.name}: reward per epoch", evaluations=read_metrics(self.run_dir / EVAL_LOG))
        except Exception as error:  # a plotting problem must not stop training
            self.print(f"could not plot the reward curve: {type(error).__name__}: {error}")
        self.drawn_at, self.undrawn = time.monotonic(), False

    def save_image(self, grid, stem: str) -> None:
        """A grid (main process; None elsewhere) as samples/<stem>.png (the fresh final evaluation's)."""
        if self.accelerator.is_main_process and grid is not None:
            (self.run_dir / "samples").mkdir(parents=True, exist_ok=True)
            grid.save(self.run_dir / "samples" / f"{stem}.png")

    def log_evaluation(self, epoch: int, metrics: dict, grid, weights: str, audio=None, audio_sample_rate: int = 0
                       ) -> None:
        """An evaluation during training (run/periodic_eval.py): its eval.jsonl record (with ``weights``: "ema" or
        "training"), its grid as samples/eval_before.png (epoch -1) or samples/eval_epoch_<epoch>.png and the grid's
        rows' ``audio`` [rows, channels, samples] (a family with audio) as WAV files in the folder of that name without
        .png (row_<r>.wav, the grid's order), and for the one before the first update, wandb's ``eval_before/*`` at
        step 0 (the later ones are in their epoch's metrics). The evaluation of weights the guard restored after the
        last epoch (``guard/restored_epoch``) is eval_epoch_<epoch>_restored.png, beside the one that fell."""
        stem = "eval_before" if epoch < 0 else f"eval_epoch_{epoch:05d}"
        if "guard/restored_epoch" in metrics:
            stem += "_restored"
        if self.accelerator.is_main_process:
            append_metrics(self.run_dir / EVAL_LOG, {"epoch": epoch, "weights": weights, **metrics})
            samples_dir = self.run_dir / "samples"
            if grid is not None:
                samples_dir.mkdir(parents=True, exist_ok=True)
                grid.save(samples_dir / f"{stem}.png")
            for row, wave in enumerate(audio if audio is not None else []):
                write_wav(samples_dir / stem / f"row_{row:02d}.wav", wave, audio_sample_rate)
        if self.wandb_mode != "disabled":
            prefix = "eval_before" if epoch < 0 else "eval"
            # eval/x -> eval_before/x, eval_stochastic/x -> eval_before_stochastic/x
            logged = {"eval_before" + key[len("eval"):]: value for key, value in metrics.items()} if epoch < 0 else {}
            if self.accelerator.is_main_process and grid is not None:
                import wandb

                logged[f"{prefix}/images"] = wandb.Image(grid)
                # each grid row's WAV file, a key a row: wandb needs soundfile for raw audio and for a list of clips
                for row in range(len(audio) if audio is not None else 0):
                    logged[f"{prefix}/audio/row_{row:02d}"] = wandb.Audio(
                        str(self.run_dir / "samples" / stem / f"row_{row:02d}.wav"), caption=f"row {row}")
            if logged:
                self.accelerator.log(logged, step=max(epoch, 0))
        if epoch < 0:
            self.print(f"evaluation before training: reward {metrics['eval/reward_mean']:.4f} ± "
                       f"{metrics['eval/reward_std']:.4f} ({metrics['eval/num_images']} images, {weights} weights)")


def perf_line(metrics: dict) -> str:
    """The console's throughput part: phase times with their rates, peak memory, MFU (when logged)."""

    def rate(key: str, unit: str) -> str:
        return f" ({metrics[key]:.3g} {unit})" if key in metrics else ""

    parts = [f"sampling {metrics['time/sampling']:.1f}s{rate('perf/images_per_s', 'img/s')}, "
             f"training {metrics['time/training']:.1f}s{rate('perf/pairs_per_s', 'pairs/s')}"]
    memory = [f"{metrics[key]:.2f} GiB {name}" for key, name in
              (("perf/cuda_max_allocated_gb", "CUDA"), ("perf/rss_gb", "RSS")) if key in metrics]
    if memory:
        parts.append("peak " + ", ".join(memory))
    mfu = [f"{100 * metrics[key]:.3g}% {name}" for key, name in
           (("perf/mfu_training", "training"), ("perf/mfu_sampling", "sampling")) if key in metrics]
    if mfu:
        parts.append("MFU " + ", ".join(mfu))
    return " | ".join(parts)
