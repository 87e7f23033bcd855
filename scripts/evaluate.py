"""Compare a fine-tuned model with its base model on the same prompts and seeds.

    python scripts/evaluate.py --finetuned logs/<run>            # the newest checkpoint of a run that verifies
    python scripts/evaluate.py --finetuned logs/<run>/lora --base_model stable-diffusion-v1-5/stable-diffusion-v1-5 \
        --num_prompts 16 --num_seeds 4 --reward_fn '{"aesthetic": 1.0}' --reward_fn_kwargs '{...}'

``--finetuned`` is a run directory, a checkpoint directory or a diffusers LoRA directory. Unset
options come from the run's config.json. Writes report.json (mean, std, 95% interval, paired
difference and per-prompt rewards) and grid.png (per prompt: base images, then fine-tuned) to
``--out`` (default: <run dir>/evaluation).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a source checkout too

from ddpo_group.run.command.quiet import silence_known_noise  # noqa: E402

silence_known_noise()  # before diffusers and transformers load

from config.base import base  # noqa: E402
from ddpo_group.run.command.cli_errors import USAGE_ERROR, exit_with  # noqa: E402
from ddpo_group.offline.comparison import EvaluationRequest, evaluate, format_report  # noqa: E402


class _WithDefaults(argparse.HelpFormatter):
    """Each option's help with its default; an option that defaults to the run's config says so in its help."""

    def _get_help_string(self, action):
        if action.default in (None, argparse.SUPPRESS) or action.required:
            return action.help
        return f"{action.help} (default: %(default)s)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_WithDefaults)
    p.add_argument("--finetuned", required=True, help="a run directory (its newest checkpoint that verifies), a "
                   "checkpoint directory or a diffusers LoRA directory")
    p.add_argument("--base_model", default=None, help="the base model (default: the run's pretrained.model)")
    p.add_argument("--num_prompts", type=int, default=EvaluationRequest.num_prompts, help="prompts drawn from the prompt function")
    p.add_argument("--num_seeds", type=int, default=EvaluationRequest.num_seeds, help="initial noises per prompt (n = prompts x seeds pairs)")
    p.add_argument("--seed", type=int, default=EvaluationRequest.seed, help="first seed; each prompt row takes seeds seed .. seed + "
                   "num_seeds - 1, a prompt drawn again (a prompt set smaller than --num_prompts is cycled) the next "
                   "num_seeds")
    p.add_argument("--prompt_fn", default=None, help="prompt function (default: the run's prompt_fn)")
    p.add_argument("--prompt_fn_kwargs", type=json.loads, default=None,
                   help="its keywords as JSON (default: the run's prompt_fn_kwargs)")
    p.add_argument("--reward_fn", default=None, help="a reward name, module:factory, or JSON {name: weight} (default: the "
                   "run's reward_fn)")
    p.add_argument("--reward_fn_kwargs", type=json.loads, default=None,
                   help="the factory's keywords as JSON (default: the run's reward_fn_kwargs)")
    p.add_argument("--num_steps", type=int, default=None, help="sampling steps (default: the run's sample.eval_num_steps, "
                   "or sample.num_steps)")
    p.add_argument("--guidance_scale", type=float, default=None, help="guidance (default: the run's sample.guidance_scale)")
    p.add_argument("--noise_level", type=float, default=None, help="DDIM's eta for Stable Diffusion (default: the "
                   "run's sample.noise_level); the flow families sample with their pipeline's deterministic sampler")
    p.add_argument("--eta", type=float, default=None, help=argparse.SUPPRESS)  # --noise_level's former name
    p.add_argument("--batch_size", type=int, default=EvaluationRequest.batch_size, help="images per pipeline call")
    p.add_argument("--out", dest="out_dir", default=None, help="output directory (default: <run dir>/evaluation)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: the GPU when there is one)")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    if a.eta is not None:
        print("--eta is now --noise_level; the old name is accepted for one release (use --noise_level)",
              file=sys.stderr)
        a.noise_level = a.eta if a.noise_level is None else a.noise_level
    for name in ("num_prompts", "num_seeds", "batch_size"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name}={getattr(a, name)} must be >= 1")
    try:
        options = {key: value for key, value in vars(a).items() if key != "eta"}
        report = evaluate(EvaluationRequest(**options), base())
    except (FileNotFoundError, ValueError) as error:  # a path or a value of the command line: its one message
        exit_with(error, USAGE_ERROR)
    print(format_report(report))


if __name__ == "__main__":
    main()
