"""Fine-tune a diffusion model with RL.

    accelerate launch scripts/train.py --config config/base.py:ddpo [--config.FIELD=VALUE ...]
"""

import os
import sys

from absl import app, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a source checkout too

from ddpo_group.run.cli import config_flag_first  # noqa: E402
from ddpo_group.errors import NonFiniteLossError, TrainingInterrupted  # noqa: E402
from ddpo_group.run.trainer import Trainer  # noqa: E402

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "config", "base.py") + ":ddpo"
_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT, "Training configuration (path:preset).")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # accelerate's per-file INFO lines drown the epoch summaries
    try:
        Trainer(_CONFIG.value).run()
    except TrainingInterrupted as stopped:  # Ctrl-C / SIGTERM: a checkpoint was written (or not: the message says)
        print(f"[ddpo_group] {stopped}", file=sys.stderr, flush=True)
        if stopped.immediate:  # a second signal: do not wait for worker threads (a reward call may hang)
            sys.stdout.flush()
            os._exit(stopped.exit_code)
        sys.exit(stopped.exit_code)
    except NonFiniteLossError as error:  # the last complete checkpoint is kept
        print(f"[ddpo_group] {error}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    sys.argv[:] = config_flag_first(sys.argv)  # a sweep may put --config=... after its overrides
    app.run(main)
