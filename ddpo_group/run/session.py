"""The lifecycle of a run around its epochs: run directory, resume, stop signals, checkpoints, summary.

The trainer owns the algorithm; the session owns everything that makes a run survivable:

* start: the run directory, the wandb mode, a resume checked against the checkpoint's state fields (and the launch:
  FSDP or not, the process count) before any model loads; once the processes have met, the run directory the main
  process named, taken by every process before anything is written (a name from each process's clock would part
  processes started on either side of a second); once the pieces exist, their registration for checkpoints, the
  resume itself (state loaded, metrics.jsonl rewound to the checkpoint's epoch) and the trackers;
* the epoch loop: Ctrl-C / SIGTERM while sampling drops the epoch, while updating finishes it; every process
  agrees on a stop; a checkpoint every ``save_freq`` epochs, at the last epoch and at a stop (atomic, rotated,
  never the one just written);
* the messages: what stopped the run, which checkpoint is kept, the exact resume command;
* a fresh run that stops before its first epoch finished leaves no run directory behind (it would hold only
  config.json);
* the end: the LoRA export, the trackers closed, the one-screen summary.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import shutil
import signal
import sys
import uuid
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from accelerate.utils import DistributedType, broadcast_object_list

from ddpo_group.distributed import check_peers
from ddpo_group.errors import CheckpointError, GuardStopped, NonFiniteLossError, TrainingInterrupted, signal_name
from ddpo_group.run.persistence.checkpointing import (
    TrainingState,
    best_weights,
    checkpoint_dir,
    complete_checkpoints,
    fallback_hint,
    later_checkpoints,
    load_checkpoint,
    resolve_resume_path,
    run_dir_of_checkpoint,
    save_checkpoint,
)
from ddpo_group.run.command.cli_errors import is_main_process
from ddpo_group.run.processes.cpu_fsdp import launch_shards
from ddpo_group.run.reporting.epoch_logger import EVAL_LOG, resolve_wandb_mode
from ddpo_group.run.processes.interrupts import StopRequest
from ddpo_group.run.persistence.metrics_log import read_metrics, rewind_metrics
from ddpo_group.run.processes.process_failures import share_failure
from ddpo_group.run.persistence.resume_check import STATE_FIELDS_FILE, check_resume, write_state_fields
from ddpo_group.run.reporting.summary import SUMMARY_RECORD, format_summary, summary_record, wandb_summary
from ddpo_group.run.persistence.write_errors import writing
from ddpo_group.timing import NULL_TIMER


class RunSession:
    """Start (``__init__``, then ``attach``), the epoch loop's context (``running``, ``remaining_epochs``,
    ``end_of_epoch``) and the end (``finish``) of a run."""

    def __init__(self, config):
        """Everything that can be checked without a model, before any loads: a bad resume fails in seconds."""
        self.config = config
        self.accelerator = None
        self.resume_path = None
        if config.resume_from:  # verified before anything loads; newer checkpoints that fail to verify are skipped
            self.resume_path, skipped = resolve_resume_path(config.resume_from, next_step=self.resume_command)
            for note in skipped:
                self.print(f"warning: {note}")
        if self.resume_path is not None:
            self.run_dir = run_dir_of_checkpoint(self.resume_path)
        else:  # the main process's name is the run's (agree_on_run_dir): the processes' clocks may differ
            name = config.run_name or f"{config.preset or 'run'}_{datetime.datetime.now():%Y%m%d_%H%M%S}"
            self.run_dir = Path(config.logdir) / name
        # this attempt creates the run directory: it may remove it again if no epoch finishes
        self.creates_run_dir = self.resume_path is None and not self.run_dir.exists()
        self.run_dir_removed = False
        self.wandb_mode, self.wandb_note = resolve_wandb_mode(config.wandb.mode)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        sharded = launch_shards(world, on_gpu=config.device != "cpu" and torch.cuda.is_available())
        self.resume_warnings = check_resume(self.resume_path, config, world, sharded) if self.resume_path else []
        self.state = TrainingState()
        self.stop = StopRequest()  # installed by running(): Ctrl-C / SIGTERM
        self.saved_epoch = None  # the epoch of the checkpoint last written or resumed from
        self.guard_stop: str | None = None  # the guard's stop message (stop_by_guard)
        self.guard_notes: list[str] = []  # the guard's alarms, for the summary
        self.pieces = {}  # {name: piece}: the training state a checkpoint holds besides accelerate's (attach)
        self.model = self.family = None  # the policy model (accelerate-wrapped) and its family, for the LoRA export
        self.timer = NULL_TIMER
        self.lora_weights = nullcontext  # a context in which the model holds the weights to export (attach)

    def attach(self, accelerator, model, family, stateful: dict, timer=NULL_TIMER, lora_weights=nullcontext) -> None:
        """Register the run's state for checkpoints, resume it, write config.json and start the trackers.
        ``family`` exports ``model``'s LoRA adapter in its pipeline's diffusers format, with the weights ``model``
        holds inside ``lora_weights()`` (the EMA's with train.ema_export)."""
        self.accelerator, self.model, self.family, self.timer = accelerator, model, family, timer
        self.lora_weights = lora_weights
        self.agree_on_run_dir()
        if self.wandb_note:
            self.print(self.wandb_note)
        for warning in self.resume_warnings:
            self.print(f"warning: {warning}")
        self.pieces = dict(stateful)
        if self.resume_path is not None:
            try:
                load_checkpoint(accelerator, self.resume_path, self.pieces)
            except CheckpointError as error:
                raise CheckpointError(f"{error}. {fallback_hint(self.resume_path, self.resume_command)}") from error
            self.print(f"resumed from {self.resume_path} (finished epoch {self.state.epoch})")
            self.saved_epoch = self.state.epoch
            self._forget_later_epochs()
        if not self.state.wandb_run_id:
            self.state.wandb_run_id = uuid.uuid4().hex[:12]  # saved with every checkpoint
        config = self.config
        if accelerator.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with writing(self.run_dir / "config.json", "the run's config"):
                (self.run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2, default=str))
        if self.wandb_mode != "disabled":
            try:
                self._init_trackers()
            except BaseException:
                self.discard_unstarted_run()
                raise

    def agree_on_run_dir(self) -> None:
        """Every process takes the main process's run directory (and whether this attempt creates it), before anything
        is written: each named one from its own clock, and processes started on either side of a second would write
        their parts of a checkpoint to two directories."""
        accelerator = self.accelerator
        if accelerator.num_processes == 1:
            return
        decided = broadcast_object_list([str(self.run_dir), self.creates_run_dir])
        self.run_dir, self.creates_run_dir = Path(decided[0]), bool(decided[1])
        accelerator.project_configuration.project_dir = str(self.run_dir)  # accelerate's own paths (trackers)
        accelerator.project_configuration.logging_dir = str(self.run_dir)

    def _init_trackers(self) -> None:
        """wandb through accelerate, in the run directory; a resumed run continues the same wandb run."""
        import wandb

        config = self.config
        self.accelerator.init_trackers(
            config.wandb.project, config=config.to_dict(),
            init_kwargs={"wandb": {"name": self.run_dir.name, "dir": str(self.run_dir), "mode": self.wandb_mode,
                                   "entity": config.wandb.entity or None,
                                   "id": self.state.wandb_run_id, "resume": "allow",
                                   # no history / summary table at the end: the run's summary says it all
                                   "settings": wandb.Settings(quiet=True)}},
        )

    def _forget_later_epochs(self) -> None:
        """After a resume, the run continues from the checkpoint's epoch: drop the metrics logged after it (they are
        logged again) and warn about checkpoints of later epochs (a run directory resumes from the latest)."""
        if not self.accelerator.is_main_process:
            return
        dropped = rewind_metrics(self.run_dir / "metrics.jsonl", self.state.epoch)
        rewind_metrics(self.run_dir / EVAL_LOG, self.state.epoch)  # the evaluations after it run again too
        if dropped:
            self.print(f"dropped {dropped} metrics line(s) logged after epoch {self.state.epoch} (they are run again)")
        later = later_checkpoints(self.resume_path)
        if later:
            self.print(
                f"warning: {', '.join(p.name for p in later)} (later epochs of an earlier attempt) stay in "
                f"{self.resume_path.parent} until overwritten; resuming from the run directory would pick them"
            )

    @property
    def resumed(self) -> bool:
        """The run continues from a checkpoint (resume_from)."""
        return self.resume_path is not None

    # ------------------------------------------------------------------ the loop
    def remaining_epochs(self) -> range:
        """The epochs still to train: after the resumed checkpoint's, up to num_epochs - 1."""
        return range(self.state.epoch + 1, self.config.num_epochs)

    @contextmanager
    def running(self, close):
        """The epoch loop's context: Ctrl-C / SIGTERM while sampling drops the epoch, while updating finishes it, then
        checkpoint and stop (``end_of_epoch``); any error is shared with the other processes (they stop at their next
        collective), ``close()`` cancels the reward workers, the trackers flush what was logged."""
        config = self.config
        threads = f" x {torch.get_num_threads()} CPU thread(s)" if self.accelerator.device.type == "cpu" else ""
        self.print(
            f"training {config.pretrained.model} with {config.algorithm.adv_estimator}"
            f"{'' if config.algorithm.objective == 'policy_gradient' else f' ({config.algorithm.objective})'} for epochs "
            f"{self.state.epoch + 1}..{config.num_epochs - 1}"
            f"{f' (epochs 0..{config.sft.epochs - 1} supervised on {config.sft.data_dir})' if config.sft.epochs else ''}"
            f" on {self.accelerator.num_processes} process(es)"
            f"{threads}; run dir {self.run_dir}"
        )
        if self.state.epoch >= config.num_epochs - 1:
            self.print(f"nothing to train: the checkpoint finished epoch {self.state.epoch} and num_epochs="
                       f"{config.num_epochs}; raise num_epochs to train further")
        stop = self.stop = StopRequest(self.resume_hint())
        try:
            with stop.installed():
                yield
        except BaseException as error:
            share_failure(self.accelerator, error)  # the other processes stop at their next collective
            close()
            for tracker in self.accelerator.trackers:  # flush what was logged (wandb: the same run id resumes)
                tracker.finish()
            self.discard_unstarted_run()
            raise

    def end_of_epoch(self, epoch: int) -> None:
        """``epoch`` finished: checkpoint when due; after a stop signal, checkpoint and raise TrainingInterrupted; after
        the guard's stop (``stop_by_guard``), checkpoint and raise GuardStopped."""
        self.state.epoch = epoch
        config = self.config
        stopping = self.stop_agreed()
        last = epoch == config.num_epochs - 1
        if last or stopping or self.guard_stop or (config.save_freq > 0 and (epoch + 1) % config.save_freq == 0):
            path = self.save(epoch)
        if (stopping or self.guard_stop) and not last:
            if self.accelerator.is_main_process:
                self.write_summary()
            if self.guard_stop:  # every process decided it from the same evaluation
                raise GuardStopped(f"{self.guard_stop}; checkpoint {path} (epoch {epoch}). {self.resume_hint()}")
            signum = self.stop.signum or signal.SIGTERM
            raise TrainingInterrupted(signum, f"training stopped by {signal_name(signum)} after epoch {epoch}; "
                                              f"checkpoint {path}. {self.resume_hint()}")

    def evaluations(self) -> list[dict]:
        """The run's evaluation records so far (eval.jsonl; a resumed run's, rewound to its checkpoint)."""
        return read_metrics(self.run_dir / EVAL_LOG)

    def stop_by_guard(self, message: str) -> None:
        """Stop after this epoch, with a checkpoint and a clean exit: the guard's alarm (run/guard.py)."""
        self.guard_stop = f"training stopped by the guard after an alarm: {message}"

    def stop_agreed(self) -> bool:
        """True when any process got a stop signal (all processes must stop at the same point)."""
        if self.accelerator.num_processes == 1:
            return self.stop.requested
        check_peers(self.accelerator)
        flag = torch.tensor([1.0 if self.stop.requested else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.gather(flag).max() > 0)

    def save(self, epoch: int) -> Path:
        """Write the checkpoint of finished epoch ``epoch`` (atomic; rotation keeps num_checkpoint_limit)."""
        def extra(directory: Path) -> None:  # main process, before the checkpoint is marked complete
            with writing(directory / STATE_FIELDS_FILE, "the config fields a resume checks"):
                write_state_fields(directory, self.config, self.accelerator.num_processes,
                                   sharded=self.accelerator.distributed_type == DistributedType.FSDP)
            if self.exports_lora:
                with self.lora_weights(), writing(directory / "lora", "the LoRA in diffusers format"):
                    self.family.save_lora(self.model, directory / "lora")

        with self.timer.phase("checkpoint"):
            path = save_checkpoint(self.accelerator, self.run_dir / "checkpoints", epoch,
                                   self.config.num_checkpoint_limit, pieces=self.pieces, extra=extra)
        self.saved_epoch = epoch
        self.print(f"saved {path}")
        return path

    def finish(self, close, fresh: dict | None = None) -> None:
        """After the last epoch: the LoRA export, the verdict in wandb's run summary, the trackers closed, ``close()``
        (the reward workers), the summary (``fresh``: the fresh final evaluation's report, run/fresh_evaluation.py)."""
        record = summary_record(fresh or {})
        with self.timer.phase("checkpoint"):
            if self.exports_lora and self.accelerator.is_main_process:
                with self.lora_weights(), writing(self.run_dir / "lora", "the LoRA in diffusers format"):
                    path = self.family.save_lora(self.model, self.run_dir / "lora")
                self.print(f"LoRA (diffusers format) in {path}")
            self.accelerator.wait_for_everyone()
        if self.wandb_mode != "disabled" and self.accelerator.is_main_process:
            summary = getattr(self.accelerator.get_tracker("wandb", unwrap=True), "summary", None)
            if summary is not None:  # a wandb run (accelerate's placeholder tracker has none)
                summary.update(wandb_summary(record))
        self.accelerator.end_training()
        close()
        if self.accelerator.is_main_process:
            with self.timer.phase("logging"):
                self.write_summary(record)

    # ------------------------------------------------------------------ messages
    def stopped_in_sampling(self, epoch: int) -> TrainingInterrupted:
        """The stop after abandoning ``epoch`` in its sampling phase (state already restored to the previous
        epoch's end): checkpoint the last finished epoch unless that checkpoint exists."""
        signum = self.stop.signum or signal.SIGTERM
        what = f"training stopped by {signal_name(signum)} while sampling epoch {epoch}; the epoch was dropped " \
               "before any update"
        if self.state.epoch < 0:
            removed = f" and the run directory {self.run_dir} is removed" if self.creates_run_dir else ""
            return TrainingInterrupted(signum, f"{what}. No epoch had finished, so there is nothing to checkpoint"
                                               f"{removed}: start the run again (without resume_from).")
        what += " and runs again on resume"
        if self.saved_epoch == self.state.epoch:
            path = checkpoint_dir(self.run_dir / "checkpoints", self.state.epoch)
        else:
            path = self.save(self.state.epoch)
        return TrainingInterrupted(signum, f"{what}; checkpoint {path} (epoch {self.state.epoch}). {self.resume_hint()}")

    def non_finite_loss(self, error: NonFiniteLossError, epoch: int) -> NonFiniteLossError:
        """The error of a NaN / inf loss, naming the epoch, the global step and the checkpoint that is kept."""
        if error.optimizer_steps is None:  # the critic's update, after the policy steps of the epoch
            where = f"after global step {self.state.global_step}"
        else:
            where = f"global step {self.state.global_step + error.optimizer_steps + 1}"
        return NonFiniteLossError(
            f"{error} at epoch {epoch} ({where}); training stopped before that optimizer step and nothing of epoch "
            f"{epoch} was saved. {self.last_checkpoint_note()} Lower train.learning_rate or check the reward scale "
            "before resuming.", error.optimizer_steps,
        )

    def resume_hint(self) -> str:
        return f"Resume with: {self.resume_command()} (it continues from the newest checkpoint that verifies)."

    def resume_command(self, target: Path | None = None) -> str:
        """The command that resumes this run, to paste: this process's command line (scripts/train.py) without its
        resume_from, plus ``--config.resume_from=<target>`` (the run directory unless given); a run started from
        Python gets the preset's command."""
        argv = list(sys.argv)
        if argv and Path(argv[0]).name == "train.py":
            program, args = argv[0], [a for a in argv[1:] if not a.startswith("--config.resume_from")]
        else:
            preset = f":{self.config.preset}" if self.config.preset else ""  # none: the script's default preset
            program, args = "scripts/train.py", [f"--config=config/base.py{preset}"]
        world = int(os.environ.get("WORLD_SIZE", "1"))
        launcher = ["accelerate", "launch", "--num_processes", str(world)] if world > 1 else ["python"]
        return shlex.join([*launcher, program, *args, f"--config.resume_from={target or self.run_dir}"])

    def last_checkpoint_note(self) -> str:
        """Which checkpoint a stopped run keeps, the epochs that run again on resume, and the resume command."""
        if self.run_dir_removed:
            return (f"No epoch had finished, so the run directory {self.run_dir} was removed (it held only its "
                    "config); start the run again.")
        checkpoints = complete_checkpoints(self.run_dir / "checkpoints")
        finished = self.state.epoch
        if not checkpoints:
            if finished < 0:
                return "No epoch had finished and no checkpoint was written."
            return (f"No checkpoint was written yet (epochs up to {finished} finished; save_freq="
                    f"{self.config.save_freq}); their metrics are in {self.run_dir / 'metrics.jsonl'}.")
        kept = checkpoints[-1]
        kept_epoch = int(kept.name.rsplit("_", 1)[1])
        later = ""
        if finished == kept_epoch + 1:
            later = f" Epoch {finished} finished after it and runs again on resume."
        elif finished > kept_epoch + 1:
            later = f" Epochs {kept_epoch + 1}..{finished} finished after it and run again on resume."
        return f"The last complete checkpoint, {kept} (epoch {kept_epoch}), is kept.{later} {self.resume_hint()}"

    def discard_unstarted_run(self) -> None:
        """Remove the run directory this attempt created when no epoch finished (main process): it would hold
        only config.json (and an empty wandb run), an orphan among the real runs."""
        if not self.creates_run_dir or self.state.epoch >= 0 or self.run_dir_removed:
            return
        if self.accelerator is None or self.accelerator.is_main_process:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir_removed = True

    @property
    def exports_lora(self) -> bool:
        return bool(self.config.use_lora and self.config.export_lora)

    def write_summary(self, record: dict | None = None) -> str:
        """Print the one-screen summary of the run and write it to summary.txt; ``record`` (summary.json's, at the
        run's end) to summary.json."""
        run = self.run_dir
        checkpoints = sorted((run / "checkpoints").glob("checkpoint_*"))
        paths = {
            "run directory": run, "config": run / "config.json", "metrics": run / "metrics.jsonl",
            "reward curve": run / "reward_curve.png", "sample grids": run / "samples", "evaluations": run / EVAL_LOG,
            "last checkpoint": checkpoints[-1] if checkpoints else None, "LoRA (diffusers)": run / "lora",
        }
        best = best_weights(run)
        notes = ([f"{'best evaluation':<17}{best}"] if best else []) + [f"{'guard':<17}{line}"
                                                                        for line in self.guard_notes]
        text = format_summary(read_metrics(run / "metrics.jsonl"), paths, read_metrics(run / EVAL_LOG), notes, record)
        with writing(run / "summary.txt", "the run's summary"):
            (run / "summary.txt").write_text(text + "\n")
        if record is not None:
            with writing(run / SUMMARY_RECORD, "the run's summary record"):
                (run / SUMMARY_RECORD).write_text(json.dumps(record, indent=1) + "\n")
        print(text, flush=True)
        return text

    def print(self, message: str) -> None:
        """On the main process (before the accelerator exists: the launcher's rank 0)."""
        if is_main_process() if self.accelerator is None else self.accelerator.is_main_process:
            print(f"[ddpo_group] {message}", flush=True)
