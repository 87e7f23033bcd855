"""Convert a checkpoint you trust whose training state is pickled into the files a resume loads.

    python scripts/convert_checkpoint.py logs/<run>/checkpoints/checkpoint_<epoch>

A resume refuses ``custom_checkpoint_<i>.pkl`` files: loading a pickle can run any code it holds. This script does
load them (so only for a checkpoint you trust), writes them as ``training_state.safetensors`` + ``training_state.json``,
removes them and writes the checkpoint's ``MANIFEST.json`` (ddpo_group/run/persistence/checkpointing.py).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a source checkout too

from ddpo_group.errors import CheckpointError  # noqa: E402
from ddpo_group.run.persistence.checkpointing import convert_pickled_checkpoint  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory (checkpoint_<epoch>) you trust")
    args = parser.parse_args(argv)
    try:
        converted = convert_pickled_checkpoint(args.checkpoint)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"converted {len(converted)} pickled piece(s) of {args.checkpoint}; resume with "
          f"--config.resume_from={args.checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
