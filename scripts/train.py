"""Fine-tune a diffusion model with RL.

    accelerate launch scripts/train.py --config config/base.py:group_ppo [--config.FIELD=VALUE ...]

A run that does not finish prints one message as its last lines and exits with 1 (a failure while training), 2 (a
usage error: the run did not start) or 128 + signal (130: Ctrl-C); DDPO_GROUP_TRACEBACK=1 adds the traceback
(ddpo_group/run/command/cli_errors.py).
"""

import os
import sys

from absl import app, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a source checkout too

from ddpo_group.distributed import ProcessFailed  # noqa: E402
from ddpo_group.errors import ConfigError, NonFiniteLossError, TrainingInterrupted  # noqa: E402
from ddpo_group.run.command.cli import config_flag_first, parse_flags_or_exit  # noqa: E402
from ddpo_group.run.command.cli_errors import FAILURE, PREFIX, USAGE_ERROR, exit_with, is_main_process  # noqa: E402
from ddpo_group.run.processes.process_failures import exit_launched_process, release_process_group  # noqa: E402
from ddpo_group.run.command.quiet import one_bar_per_phase, silence_known_noise  # noqa: E402

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "config", "base.py") + ":group_ppo"
_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT, "Training configuration (path:preset).")


def main(argv):
    del argv
    try:
        train()
    except SystemExit as stop:  # its message is printed: a launched process leaves before gloo's threads can abort it
        exit_launched_process(stop)
        raise
    finally:  # any other exit: the process group (if any is left) goes before the interpreter does
        release_process_group()
    exit_launched_process(SystemExit(0))  # a finished run: the same (its files are closed, its summary printed)


def train():
    logging.set_verbosity(logging.WARNING)  # accelerate's per-file INFO lines drown the epoch summaries
    try:  # the run starts: the config, then the model, reward and prompts it names (every process alike)
        from ddpo_group.run.trainer import Trainer  # torch, diffusers: imported once the command line is known good

        one_bar_per_phase()
        trainer = Trainer(_CONFIG.value)
    except KeyboardInterrupt:
        print(f"{PREFIX} stopped by SIGINT while starting, before the first epoch", file=sys.stderr, flush=True)
        sys.exit(130)
    except Exception as error:
        # a bad config fails every process alike (the main one speaks); any other error may be this process's own
        exit_with(error, USAGE_ERROR, show=is_main_process() or not isinstance(error, ConfigError))
    try:
        trainer.run()
    except TrainingInterrupted as stopped:  # Ctrl-C / SIGTERM: a checkpoint was written (or not: the message says)
        print(f"{PREFIX} {stopped}", file=sys.stderr, flush=True)
        if stopped.immediate:  # a second signal: do not wait for worker threads (a reward call may hang)
            sys.stdout.flush()
            os._exit(stopped.exit_code)
        sys.exit(stopped.exit_code)
    except NonFiniteLossError as error:  # its message names the step and the checkpoint that is kept
        exit_with(error, FAILURE)
    except ProcessFailed as error:  # another process failed (it reports its own error): the main process says so
        exit_with(error, FAILURE, trainer.session.last_checkpoint_note(), show=is_main_process())
    except KeyboardInterrupt:  # after the last epoch (the export, the summary): its checkpoint is written
        print(f"{PREFIX} stopped by SIGINT after training. {trainer.session.last_checkpoint_note()}",
              file=sys.stderr, flush=True)
        sys.exit(130)
    except Exception as error:  # a reward, a plugin, the hardware: what finished is kept
        exit_with(error, FAILURE, trainer.session.last_checkpoint_note())


if __name__ == "__main__":
    silence_known_noise()
    sys.argv[:] = config_flag_first(sys.argv)  # a sweep may put --config=... after its overrides
    app.run(main, flags_parser=parse_flags_or_exit)
