"""The pre-flight check: does the training forward reproduce the sampler's log-probabilities (is the run on-policy)?

    python scripts/check.py --config config/base.py:PRESET [--config.FIELD=VALUE ...]

Builds the run as training would, samples one batch with the training sampler, re-scores it through the training
forward and prints per step the largest |log-prob difference|, |ratio - 1| and the share of pairs outside the policy
loss's trust region, against the precision's tolerance and the clip range; on a mismatch, a random training forward,
the likely cause and what removes it; then the memory a training chunk takes, the seconds an epoch will take and the
config's warnings (ddpo_group/offline/preflight.py).

Exit code 0: consistent; 1: not; 2: a usage error (the config, or the model, reward or prompts it names, cannot be
built); 3: the check failed while it ran (sampling, scoring or re-scoring raised).
"""

import os
import sys

from absl import app, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a source checkout too

from ddpo_group.run.command.cli import config_flag_first, parse_flags_or_exit  # noqa: E402
from ddpo_group.run.command.cli_errors import USAGE_ERROR, exit_with  # noqa: E402
from ddpo_group.run.command.quiet import silence_known_noise  # noqa: E402

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "config", "base.py") + ":group_ppo"
_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT, "Training configuration (path:preset).")
CONSISTENT, NOT_CONSISTENT, CHECK_FAILED = 0, 1, 3


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from ddpo_group.offline.preflight import CheckFailed, run_check

    try:
        result = run_check(_CONFIG.value)
    except CheckFailed as error:  # built, then failed while running: not the user's usage
        exit_with(error, CHECK_FAILED)
    except Exception as error:  # a config, model, reward or prompt function that cannot be built
        exit_with(error, USAGE_ERROR)
    sys.exit(CONSISTENT if result.consistent else NOT_CONSISTENT)


if __name__ == "__main__":
    silence_known_noise()
    sys.argv[:] = config_flag_first(sys.argv)
    app.run(main, flags_parser=parse_flags_or_exit)
