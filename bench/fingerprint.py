"""The fingerprint of the trainer's behaviour, for a change that must not alter it (a refactor): every run below trains
a few epochs in this process and records, epoch by epoch, the hash of each tensor of the batch the epoch trained on
(trajectories, log-probs, rewards, advantages, the estimator's outputs), every non-timing metric, every evaluation,
and at the end the hash of the trained weights (the policy's trainable parameters, the critic's).

    python bench/fingerprint.py --write before.json [--only NAME ...]
    python bench/fingerprint.py --check before.json [--only NAME ...]

``--check`` runs again and lists what differs (nothing: "bitwise equal"); exit status 1 when something does. The runs
cover the presets, the recipes on the embedded models (evaluation, the guard and its restore included), the objectives,
tree rollouts, the KL term's variants, the EMA, dynamic sampling and a few model families, on tiny random models built
here (nothing is downloaded). Run it alone on the machine: two torch jobs side by side change nothing but the time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from _common import setup_threads  # noqa: E402

# metrics that measure time, speed or memory: the only ones a refactor may change
VOLATILE = ("time/", "perf/", "memory/", "train/pairs_per_forward")
# a name a change gave a metric or a batch field (its value stays): a fingerprint written before reads as after it
RENAMED = {"group/": "segment/", "steps.": "times."}

TINY_SD = {"sample.sde_window_size": 0}
TINY_FLOW = {"sample.resolution": 32, "pretrained.max_sequence_length": 16}
EMBEDDED = {"num_epochs": 2, "sample.num_batches_per_epoch": 1, "save_freq": 0, "log_images_every": 0,
            "wandb.mode": "disabled", "eval_freq": 1, "eval_num_prompts": 2, "eval_num_seeds": 2, "device": "cpu"}

# name: (preset, model: a tiny_random family or an embedded model, overrides)
RUNS = {
    "ddpo": ("ddpo", "sd", {}),
    "grpo": ("grpo", "sd", {}),
    "dr_grpo": ("dr_grpo", "sd", {}),
    "rloo": ("rloo", "sd", {}),
    "grpo_passk": ("grpo_passk", "sd", {}),
    "reinforce_pp": ("reinforce_pp", "sd", {}),
    "remax": ("remax", "sd", {}),
    "ppo_gae": ("ppo_gae", "sd", {}),
    "group_ppo": ("group_ppo", "sd", {}),
    "group_ppo_adaptive_tree": ("group_ppo", "sd", {"group_ppo.value_source": "tree", "sample.branch_steps": (0, 2),
                                                  "sample.branch_factors": (2, 2), "sample.adaptive_branching": True}),
    "group_ppo_tree": ("group_ppo", "sd", {"group_ppo.value_source": "tree", "sample.branch_steps": (1,),
                                         "sample.branch_factors": (2,)}),
    "grpo_kl_loss": ("grpo", "sd", {"kl.beta": 0.04, "kl.use_reference_model": True}),
    "reinforce_pp_kl_reward": ("reinforce_pp", "sd", {"kl.beta": 0.04, "kl.use_reference_model": True, "kl.in_reward": True}),
    "grpo_kl_below_start": ("grpo", "sd", {"kl.beta": 0.5, "kl.use_reference_model": True,
                                           "kl.only_below_start": True}),
    "grpo_kl_moving_ref": ("grpo", "sd", {"kl.beta": 0.04, "kl.use_reference_model": True,
                                          "kl.reference_update_freq": 1}),
    "grpo_ema": ("grpo", "sd", {"train.ema": True}),
    "grpo_dapo": ("grpo", "sd", {"algorithm.filter_groups": True, "algorithm.max_num_gen_batches": 2}),
    "grpo_gspo": ("grpo", "sd", {"algorithm.policy_loss": "gspo"}),
    "grpo_ratio_norm": ("grpo", "sd", {"algorithm.policy_loss": "ratio_norm"}),
    "grpo_full": ("grpo", "sd", {"use_lora": False, "train.learning_rate": 1e-4}),
    "grpo_restore": ("grpo", "sd", {"eval_freq": 1, "eval_num_prompts": 2, "eval_num_seeds": 2, "device": "cpu",
                                    "num_epochs": 4, "guard.on_alarm": "restore", "train.ema": True,
                                    "train.ema_eval": True}),
    "grpo_sd3": ("grpo", "sd3", TINY_FLOW),
    "grpo_flux": ("grpo", "flux", {**TINY_FLOW, "sample.guidance_scale": 3.5, "train.cfg": False}),
    "grpo_wan": ("grpo", "wan", {"sample.resolution": 16, "sample.num_frames": 5,
                                 "pretrained.max_sequence_length": 16}),
    "grpo_ltx2": ("grpo", "ltx2", {"sample.resolution": 64, "sample.num_frames": 17,
                                   "pretrained.max_sequence_length": 16, "reward_fn": "tests/plugins/audio_reward.py:make_loudness"}),
    "group_ppo_embedded": ("group_ppo", "embedded", {**EMBEDDED, "num_epochs": 3}),
    "group_ppo_flow": ("group_ppo_flow", "embedded", {**EMBEDDED, "num_epochs": 3}),
    "awm": ("awm", "embedded", EMBEDDED),
    "nft": ("nft", "embedded", EMBEDDED),
    "dpo": ("dpo", "embedded", EMBEDDED),
    "dgpo": ("dgpo", "embedded", EMBEDDED),
    "grpo_flow_dppo": ("grpo_flow", "embedded", {**EMBEDDED, "algorithm.policy_loss": "dppo"}),
}
SCRIPTED_FALLS = {"grpo_restore": {1, 3}}  # the runs whose evaluation is lowered after these epochs (the guard fires)


def digest(tensor: torch.Tensor) -> str:
    tensor = tensor.detach().cpu().contiguous()
    data = tensor.view(torch.uint8) if tensor.dtype != torch.bool and tensor.numel() else tensor.to(torch.uint8)
    return f"{tensor.dtype}{tuple(tensor.shape)}:" + hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]


def flatten(value, prefix: str, out: dict) -> None:
    """Every tensor, number and string of a batch field (dicts and lists walked), under its path."""
    if isinstance(value, torch.Tensor):
        out[prefix] = digest(value)
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            flatten(value[key], f"{prefix}.{key}", out)
    elif isinstance(value, (list, tuple)):
        out[prefix] = hashlib.sha256(repr(value).encode()).hexdigest()[:16] if not any(
            isinstance(v, (torch.Tensor, dict)) for v in value) else None
        if out[prefix] is None:
            del out[prefix]
            for i, v in enumerate(value):
                flatten(v, f"{prefix}[{i}]", out)
    elif value is not None:
        out[prefix] = repr(value)


def number(value):
    if isinstance(value, float):
        return repr(value) if not math.isfinite(value) else value.hex()
    return value if isinstance(value, (int, str, bool)) or value is None else repr(value)


def steady(metrics: dict) -> dict:
    return {key: number(value) for key, value in sorted(metrics.items())
            if not key.startswith(VOLATILE) and isinstance(value, (int, float, str, bool))}


def model_dir(name: str, cache: dict, tmp: Path) -> str:
    from ddpo_group.models.tiny_random import TINY_BUILDERS, save_pipeline

    if name not in cache:
        cache[name] = save_pipeline(TINY_BUILDERS[name](), tmp / f"tiny_{name}" / "model")
    return cache[name]


def one_run(name: str, tmp: Path, models: dict) -> dict:
    from accelerate.state import AcceleratorState, GradientState

    from config.base import get_config
    from ddpo_group.run.periodic_eval import PeriodicEvaluation
    from ddpo_group.run.reporting import epoch_logger
    from ddpo_group.run.trainer import Trainer
    from ddpo_group.update.critic import Critic
    from helpers.trainer_helpers import TINY, set_fields

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    preset, model, overrides = RUNS[name]
    config = get_config(preset)
    values = {"logdir": str(tmp), "run_name": name}
    if model != "embedded":
        values.update({**TINY, "num_epochs": 2, "pretrained.model": model_dir(model, models, tmp)})
        if config.train.group_size > 1:
            values["train.group_size"] = 4
        values.update(TINY_SD if model == "sd" else {})
    values.update(overrides)
    set_fields(config, values)

    record = {"epochs": [], "evaluations": []}
    log, log_evaluation, run_evaluation = (epoch_logger.EpochLogger.log, epoch_logger.EpochLogger.log_evaluation,
                                           PeriodicEvaluation.run)
    falls, lowered = SCRIPTED_FALLS.get(name, set()), set()

    def logged(self, epoch, metrics, batch):
        fields = {}
        for field in dataclasses.fields(batch):
            flatten(getattr(batch, field.name), field.name, fields)
        record["epochs"].append({"epoch": epoch, "metrics": steady(metrics), "batch": fields})
        return log(self, epoch, metrics, batch)

    def evaluated(self, epoch, metrics, *args, **kwargs):
        record["evaluations"].append({"epoch": epoch, "metrics": steady(metrics)})
        return log_evaluation(self, epoch, metrics, *args, **kwargs)

    def evaluation_run(self, epoch):
        result = run_evaluation(self, epoch)
        if epoch in falls and epoch not in lowered:  # the scripted fall: the guard's fall rule fires
            lowered.add(epoch)
            for key in ("eval/reward_mean", "eval/select_half/reward_mean", "eval/report_half/reward_mean"):
                result.metrics[key] -= 1.0
        return result

    epoch_logger.EpochLogger.log, epoch_logger.EpochLogger.log_evaluation = logged, evaluated
    PeriodicEvaluation.run = evaluation_run
    plot = epoch_logger.plot_reward_curve
    epoch_logger.plot_reward_curve = lambda *args, **kwargs: None
    try:
        torch.manual_seed(0)
        with open(tmp / f"{name}.log", "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            trainer = Trainer(config)
            trainer.run()
    except BaseException:
        print((tmp / f"{name}.log").read_text()[-4000:], file=sys.stderr)
        raise
    finally:
        epoch_logger.EpochLogger.log, epoch_logger.EpochLogger.log_evaluation = log, log_evaluation
        PeriodicEvaluation.run = run_evaluation
        epoch_logger.plot_reward_curve = plot
    weights = {"policy": [digest(p) for p in trainer.params]}
    critics = [value for value in walk(trainer) if isinstance(value, Critic)]
    if critics:  # a critic's weights where the run has one
        weights["critic"] = [digest(p) for p in critics[0].module.parameters()]
    record["weights"] = weights
    record["files"] = sorted(str(p.relative_to(tmp / name)) for p in (tmp / name).rglob("*")
                             if p.is_file() and "checkpoints" not in p.parts)
    return record


def walk(trainer):
    """The trainer's attributes, and the entries of those that are dicts, lists or tuples (wherever a piece is held)."""
    for value in vars(trainer).values():
        yield value
        if isinstance(value, dict):
            yield from value.values()
        elif isinstance(value, (list, tuple)):
            yield from value


def renamed(key):
    """A key of a fingerprint written before a rename, under its name now (RENAMED: by prefix)."""
    if not isinstance(key, str):
        return key
    return next((new + key[len(old):] for old, new in RENAMED.items() if key.startswith(old)), key)


def compare(expected, got, path: str, out: list) -> None:
    if isinstance(expected, dict) and isinstance(got, dict):
        expected = {renamed(key): value for key, value in expected.items()}
        for key in sorted(set(expected) | set(got), key=str):
            if key not in got:
                out.append(f"{path}.{key}: missing now")
            elif key not in expected:
                out.append(f"{path}.{key}: new")
            else:
                compare(expected[key], got[key], f"{path}.{key}", out)
    elif isinstance(expected, list) and isinstance(got, list) and len(expected) == len(got):
        for i, (a, b) in enumerate(zip(expected, got)):
            compare(a, b, f"{path}[{i}]", out)
    elif expected != got:
        out.append(f"{path}: {str(expected)[:80]} -> {str(got)[:80]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", help="write the fingerprint to this JSON file")
    action.add_argument("--check", help="run again and compare with this JSON file")
    parser.add_argument("--only", nargs="*", default=None, help="these runs only (names: see RUNS)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    setup_threads(args.threads)
    names = args.only or list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown runs {unknown}; known: {', '.join(RUNS)}")
    expected = json.loads(Path(args.check).read_text()) if args.check else {}
    results, differences, models = {}, [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            start = time.perf_counter()
            results[name] = one_run(name, Path(tmp), models)
            line = f"{name}: {time.perf_counter() - start:.1f} s"
            if args.check:
                found = []
                if name not in expected:
                    found.append(f"{name}: not in {args.check}")
                else:
                    compare(expected[name], results[name], name, found)
                differences += found
                line += f", {'bitwise equal' if not found else f'{len(found)} differences'}"
            print(line, flush=True)
    if args.write:
        Path(args.write).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.write}: {len(results)} runs")
        return 0
    for line in differences:
        print("  " + line)
    print("bitwise equal" if not differences else f"{len(differences)} differences")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
