"""End-to-end DDPO runs through scripts/train.py under accelerate, on a tiny random model."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.launch_helpers import accelerate_command, start_workers
from helpers.trainer_helpers import MECHANICS, train_in_this_process

ROOT = Path(__file__).resolve().parents[2]


def launch(args, *, num_processes=1, timeout=600):
    cmd, cpu = accelerate_command(num_processes)  # more processes than GPUs: on the CPU (helpers/launch_helpers.py)
    cmd += ["scripts/train.py"] + args
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **cpu}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, f"train.py failed:\nSTDOUT:\n{out.stdout[-4000:]}\nSTDERR:\n{out.stderr[-6000:]}"
    return out.stdout + out.stderr


# runs of 1 and 2 processes compared: both on the CPU (2 processes on one GPU run there: helpers/launch_helpers.py)
SAME_DEVICE = {"device": "cpu"}


def run_processes(args, processes: int, logs: Path, timeout=600) -> None:
    """The run on ``processes`` processes without a launcher: one in this process (train_in_this_process: the 6 s of
    a fresh Python's imports saved), or the workers torchrun would start, each with one thread (launch() keeps the
    launcher's own tests, test_one_epoch_changes_weights_and_resume_continues the 1-process command)."""
    if processes == 1:
        return train_in_this_process(args)
    workers = start_workers(args, processes, logs, timeout=timeout)
    failed = [w for w in workers if w.returncode != 0]
    assert not failed, "\n".join(f"rank {w.rank} exit {w.returncode}:\n{w.stderr[-4000:]}" for w in failed)


def tiny_args(model_dir, logdir, run_name, **extra):
    args = {
        "pretrained.model": model_dir, "logdir": str(logdir), "run_name": run_name, "num_epochs": 1,
        "prompt_fn": "simple_animals", "reward_fn": "jpeg_compressibility", "sample.num_steps": 4,
        "sample.batch_size": 4, "sample.num_batches_per_epoch": 2, "train.batch_size": 4,
        "train.pairs_per_forward": 6, "train.learning_rate": 1e-2, "train.clip_range": 0.2,
        "per_prompt_stat_tracking.min_count": 2, "save_freq": 1, "log_images_every": 1, **MECHANICS,
    }
    args.update(extra)
    return ["--config", "config/base.py:ddpo"] + [f"--config.{k}={v}" for k, v in args.items()]


def read_metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def unet_weights(checkpoint):
    (path,) = [p for p in Path(checkpoint).glob("model*.safetensors")]
    return load_file(str(path))


@pytest.mark.slow
@pytest.mark.parametrize("use_lora", [True, False])
def test_one_epoch_changes_weights_and_resume_continues(tiny_model_dir, tmp_path, use_lora):
    run = f"lora_{use_lora}"
    # LoRA: 2 train batches accumulated into 1 optimizer step; full: 2 optimizer steps
    accumulation = 2 if use_lora else 1
    log = launch(tiny_args(tiny_model_dir, tmp_path, run, use_lora=use_lora,
                           **{"train.gradient_accumulation_steps": accumulation}))
    run_dir = tmp_path / run
    checkpoint = run_dir / "checkpoints" / "checkpoint_00000"
    assert (checkpoint / "COMPLETE").exists(), log
    assert (run_dir / "samples" / "epoch_00000.png").exists()
    (epoch0,) = read_metrics(run_dir)
    assert epoch0["epoch"] == 0 and epoch0["reward_count"] == 8 and epoch0["reward_mean"] < 0
    assert epoch0["global_step"] == 2 // accumulation

    weights = unet_weights(checkpoint)
    base = load_file(str(next(Path(tiny_model_dir, "unet").glob("*.safetensors"))))
    lora_keys = [k for k in weights if "lora" in k]
    if use_lora:
        # peft initialises lora_B to zero: training must have moved it; the frozen base weights are not saved (the
        # pretrained model's, loaded again on resume)
        moved = [k for k in lora_keys if "lora_B" in k and weights[k].abs().max() > 0]
        assert moved, "no LoRA weight changed"
        assert sorted(weights) == sorted(lora_keys) and len(lora_keys) < len(base)
    else:
        assert not lora_keys
        changed = [k for k, v in base.items() if not torch.equal(weights[k], v)]
        assert len(changed) > len(base) // 2, f"only {len(changed)} of {len(base)} tensors changed"

    # resume from the run directory: starts at epoch 1, writes checkpoint 1
    log = launch(tiny_args(tiny_model_dir, tmp_path, run, use_lora=use_lora, num_epochs=2, resume_from=str(run_dir),
                           **{"train.gradient_accumulation_steps": accumulation}))
    assert "finished epoch 0" in log and "epoch 1:" in log and "epoch 0:" not in log, log
    assert [(m["epoch"], m["global_step"]) for m in read_metrics(run_dir)] == [(0, 2 // accumulation), (1, 4 // accumulation)]
    assert (run_dir / "checkpoints" / "checkpoint_00001" / "COMPLETE").exists()


@pytest.mark.slow
def test_two_processes_gather_rewards(tiny_model_dir, tmp_path):
    launch(tiny_args(tiny_model_dir, tmp_path, "ddp", **{"train.group_size": 4}), num_processes=2)
    (epoch0,) = read_metrics(tmp_path / "ddp")
    # each process sampled 2 x 4 images of 4 prompts x 4 copies; advantages used all 16 rewards
    assert epoch0["reward_count"] == 16
    # throughput counts every process: 16 images, 16 x 4 (sample, step) pairs (ddpo trains every step once)
    assert epoch0["perf/images_sampled"] == 16 and epoch0["perf/pairs_trained"] == 64
    assert epoch0["perf/pairs_per_s"] == 64 / epoch0["time/training"]
    assert (tmp_path / "ddp" / "checkpoints" / "checkpoint_00000" / "COMPLETE").exists()


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["group_ppo", "remax", "grpo@flux", "grpo#tree"])
def test_two_processes_and_one_give_the_same_advantages(family_model_dirs, tmp_path, preset):
    """The same global batch (8 samples, per-sample seeded noise) on 1 process x 8 or 2 processes x 4; grpo@flux on
    the tiny FLUX model (flow-matching steps, packed latents); grpo#tree with tree rollouts (a group of 4 is one root
    branching at steps 1 and 2: each process samples whole trees)."""
    from helpers.trainer_helpers import FAMILY_OVERRIDES

    preset, _, shape = preset.partition("#")
    preset, _, family = preset.partition("@")
    tree = {"sample.branch_steps": "(1,2)", "sample.branch_factors": "(2,2)"} if shape == "tree" else {}
    metrics = []
    for processes in (1, 2):
        run = f"{preset}_{family}_{shape}_{processes}"
        args = tiny_args(family_model_dirs[family or "sd"], tmp_path, run, **{
            "sample.batch_size": 8 // processes, "sample.num_batches_per_epoch": 1,
            "train.group_size": 4 if preset in ("group_ppo", "grpo") else 1, "log_images_every": 0,
            **FAMILY_OVERRIDES[family or "sd"], **tree, **SAME_DEVICE})
        args[1] = f"config/base.py:{preset}"
        run_processes(args, processes, tmp_path / f"logs_{run}")
        (epoch0,) = read_metrics(tmp_path / run)
        metrics.append(epoch0)
    one, two = metrics
    assert one["reward_count"] == two["reward_count"] == 8
    if shape == "tree":  # 2 roots: step 0 and the step-1 outputs on 2 rows, step 2 on 4, step 3 on 8 (CFG: x 2)
        assert one["perf/nfe_sampling"] == two["perf/nfe_sampling"] == (2 + 2 + 4 + 8) * 2
    keys = ["reward_mean", "reward_std", "adv/mean", "adv/std", "adv/min", "adv/max"]
    keys += {"group_ppo": ["segment/num_endpoints", "segment/mean_len"], "remax": ["reward/greedy_mean"]}.get(preset, [])
    for key in keys:
        assert one[key] == pytest.approx(two[key], rel=1e-6, abs=1e-9), key


FLAT_PROMPT_REWARD = """import torch

from ddpo_group.rewards.builtin import jpeg_size_kb


def flat_prompt(prompt=""):
    def fn(images, prompts, metadata):
        rewards = -jpeg_size_kb(images)
        rewards[[p == prompt for p in prompts]] = 0.0
        return rewards, {}
    return fn
"""


@pytest.mark.slow
@pytest.mark.parametrize("objective, flat", [("dpo", False), ("dgpo", False), ("dpo", True)])
def test_two_processes_and_one_train_a_preference_objective_alike(family_model_dirs, tmp_path, objective, flat):
    """A preference objective on 1 process x 4 batches of 4 or 2 processes x 2 batches of 4 (2 whole groups of 4 on
    each process), train.batch_size halved on 2 processes: the same rewards, advantages, units, pairs trained and
    optimizer steps. ``flat``: the first group's reward is constant, so it has no dpo pair: process 0 holds 1 pair and
    process 1 2, and process 0 pads a unit (its second train batch is padding only)."""
    from ddpo_group.prompts import PromptSampler
    from helpers.trainer_helpers import FAMILY_OVERRIDES

    # seed 2: copies spread over the processes as the default sampler spreads them would give 6 dpo pairs, not 4
    seed, reward = 2, {}
    if flat:
        prompts = PromptSampler("simple_animals", seed=seed).sample_epoch(4, 4, whole_groups=True)[0]
        assert prompts[::4].count(prompts[0]) == 1, prompts  # the first group's prompt is no other group's
        plugin = tmp_path / "flat_prompt.py"
        plugin.write_text(FLAT_PROMPT_REWARD)
        reward = {"reward_fn": f"{plugin}:flat_prompt", "reward_fn_kwargs": json.dumps({"prompt": prompts[0]})}
    width = 2 if objective == "dpo" else 4  # rows per unit
    metrics = []
    for processes in (1, 2):
        run = f"{objective}_{flat}_{processes}"
        args = tiny_args(family_model_dirs["sd3"], tmp_path, run, **{
            "seed": seed, "sample.batch_size": 4, "sample.num_batches_per_epoch": 4 // processes,
            "train.batch_size": 2 * width // processes, "train.group_size": 4, "log_images_every": 0, "save_freq": 0,
            "sample.deterministic": True, "kl.beta": 0.0, "kl.use_reference_model": True,
            "algorithm.objective": objective, **reward, **FAMILY_OVERRIDES["sd3"], **SAME_DEVICE})
        args[1] = "config/base.py:grpo"
        run_processes(args, processes, tmp_path / f"logs_{run}")
        (epoch0,) = read_metrics(tmp_path / run)
        metrics.append(epoch0)
    one, two = metrics
    for key in ["reward_mean", "reward_std", "reward_max", "adv/mean", "adv/std", "adv/min", "adv/max"]:
        assert one[key] == pytest.approx(two[key], rel=1e-6, abs=1e-9), key
    assert one["reward_count"] == two["reward_count"] == 16
    assert (one["reward_max"] == 0.0) == flat  # the flat group's reward; JPEG sizes are > 0
    units = 3 if flat else 4  # dpo: a pair per group with a preference; dgpo: every group
    assert one["train/preference_units"] == two["train/preference_units"] == units
    assert one["perf/pairs_trained"] == two["perf/pairs_trained"] == units * width * 4  # every unit at its 4 times
    # 2 units a train batch on 1 process, 1 on each of 2 (a padded unit too): 2 optimizer steps
    assert one["global_step"] == two["global_step"] == 2
    assert math.isfinite(two["train/policy_loss"]) and math.isfinite(two["train/accuracy"])
    if flat:  # train/* are process 0's: its one real train batch, the first, at the reference (log 2); its padded
        # batch adds no metric (counted, the mean would be halved)
        assert two["train/policy_loss"] == pytest.approx(math.log(2), abs=1e-4)


@pytest.mark.slow
def test_two_processes_and_one_give_the_same_component_advantages(tiny_model_dir, tmp_path):
    """multi_reward_mix="advantage_aggr" (GDPO) gathers each reward component: 1 process x 8 or 2 processes x 4.

    Two JPEG rewards (sizes at quality 95 and 50) are exact whatever the batch layout; a model reward's float32
    batch dependence (shapes_alignment's classifier: 6e-8) would be magnified by the per-group normalisation."""
    metrics = []
    for processes in (1, 2):
        run = f"gdpo_{processes}"
        args = tiny_args(tiny_model_dir, tmp_path, run, **{
            "sample.batch_size": 8 // processes, "sample.num_batches_per_epoch": 1, "train.group_size": 4,
            "log_images_every": 0, "save_freq": 0,
            "reward_fn": '{"jpeg_compressibility": 1.0, "jpeg_incompressibility": 2.0}',
            "reward_fn_kwargs": '{"jpeg_incompressibility": {"quality": 50}}',
            "algorithm.multi_reward_mix": "advantage_aggr", "algorithm.global_std": True,
            "kl.beta": 0.0, "kl.use_reference_model": False, **SAME_DEVICE})
        args[1] = "config/base.py:grpo"
        run_processes(args, processes, tmp_path / f"logs_{run}")
        (epoch0,) = read_metrics(tmp_path / run)
        metrics.append(epoch0)
    one, two = metrics
    assert one["reward_count"] == two["reward_count"] == 8
    keys = ["reward_mean", "adv/mean", "adv/std", "adv/min", "adv/max"]
    components = ("jpeg_compressibility", "jpeg_incompressibility")
    keys += [f"adv/{c}/{s}" for c in components for s in ("mean", "std", "min", "max")]
    assert one["adv/jpeg_incompressibility/std"] > 0.1 and one["adv/jpeg_compressibility/std"] > 0.1
    # not each other's negative (other qualities): the weighted sum is not one component's multiple
    assert one["adv/jpeg_incompressibility/max"] != pytest.approx(-one["adv/jpeg_compressibility/min"], rel=1e-3)
    for key in keys:
        assert one[key] == pytest.approx(two[key], rel=1e-6, abs=1e-9), key


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["nft"])
def test_two_processes_and_one_sample_and_score_a_matching_objective_alike(family_model_dirs, tmp_path, objective):
    """A matching objective (nft: the old model samples the rollouts, deterministically) on 1 process x 2 batches of 4
    or 2 processes x 1 batch of 4: the same rewards and advantages, every pair trained, the old model mixed on both."""
    from helpers.trainer_helpers import FAMILY_OVERRIDES

    metrics = []
    for processes in (1, 2):
        run = f"{objective}_{processes}"
        args = tiny_args(family_model_dirs["sd3"], tmp_path, run, **{
            "sample.batch_size": 4, "sample.num_batches_per_epoch": 2 // processes, "train.batch_size": 4 // processes,
            "train.group_size": 4, "log_images_every": 0, "sample.deterministic": True, "kl.beta": 0.0,
            "kl.use_reference_model": False, "algorithm.objective": objective, "algorithm.old_decay_ramp": 0.25,
            **FAMILY_OVERRIDES["sd3"], **SAME_DEVICE})
        args[1] = "config/base.py:grpo"
        run_processes(args, processes, tmp_path / f"logs_{run}")
        (epoch0,) = read_metrics(tmp_path / run)
        metrics.append(epoch0)
    one, two = metrics
    for key in ["reward_mean", "reward_std", "adv/mean", "adv/std", "adv/min", "adv/max"]:
        assert one[key] == pytest.approx(two[key], rel=1e-6, abs=1e-9), key
    assert one["perf/pairs_trained"] == two["perf/pairs_trained"] == 8 * 4
    assert one["global_step"] == two["global_step"] == 2
    assert one["train/old_decay"] == two["train/old_decay"] == 0.5


GROUPWISE_PLUGIN = """import json
import os

from ddpo_group.rewards.builtin import jpeg_size_kb


def relative_size(log=""):
    # each image's JPEG size over the largest of its group's: a reward that depends on the group's other images
    def fn(images, prompts, metadata):
        kb = jpeg_size_kb(images)
        rewards = kb / kb.max()
        with open(log, "a") as out:
            out.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), "prompts": prompts,
                                  "rewards": rewards.tolist()}) + "\\n")
        return rewards, {"jpeg_kb": kb}

    fn.groupwise = True
    return fn
"""


@pytest.mark.slow
def test_a_groupwise_plugin_reward_trains_on_one_process_and_two_alike(tiny_model_dir, tmp_path):
    """A groupwise reward from a plugin file (reward_fn=/path/file.py:factory) on 1 process x 6 batches of 2 or 2
    processes x 3: groups of 3 span sampling batches; each group is scored once, by the process that sampled it, and
    the rewards, advantages and evaluations (each prompt's 2 images together) are the same."""
    plugin = tmp_path / "relative_size.py"
    plugin.write_text(GROUPWISE_PLUGIN)
    metrics, evaluations, calls = [], [], []
    for processes in (1, 2):
        run, log = f"groupwise_{processes}", tmp_path / f"calls_{processes}.jsonl"
        args = tiny_args(tiny_model_dir, tmp_path, run, **{
            "reward_fn": f"{plugin}:relative_size", "reward_fn_kwargs": json.dumps({"log": str(log)}),
            "sample.batch_size": 2, "sample.num_batches_per_epoch": 6 // processes, "train.batch_size": 3,
            "train.group_size": 3, "eval_freq": 1, "eval_num_prompts": 3, "eval_num_seeds": 2,
            "log_images_every": 0, "save_freq": 0, **SAME_DEVICE})
        args[1] = "config/base.py:grpo"
        run_processes(args, processes, tmp_path / f"logs_{run}")
        (epoch0,) = read_metrics(tmp_path / run)
        metrics.append(epoch0)
        evaluations.append([json.loads(line) for line in (tmp_path / run / "eval.jsonl").read_text().splitlines()])
        calls.append([json.loads(line) for line in log.read_text().splitlines()])
    # training: 12 samples in 4 groups of 3 (one prompt each), each scored in one call; evaluation: a call per
    # prompt's 2 images (3 prompts; 2 processes: 2 prompts each, the second padded with a copy of the last prompt's)
    for processes, made in zip((1, 2), calls):
        train_calls = [c for c in made if len(c["prompts"]) == 3]
        assert len(train_calls) == 4 and all(len(set(c["prompts"])) == 1 for c in train_calls)
        assert {c["rank"] for c in train_calls} == set(range(processes))
        assert all(max(c["rewards"]) == 1.0 for c in train_calls)  # the group's largest file
        eval_calls = 2 * (3 if processes == 1 else 4)  # before training and after the epoch
        assert sum(len(c["prompts"]) == 2 for c in made) == eval_calls == len(made) - len(train_calls)
    groups = [sorted(json.dumps([c["prompts"], c["rewards"]]) for c in made if len(c["prompts"]) == 3)
              for made in calls]
    assert groups[0] == groups[1]  # the same groups, the same rewards, wherever they were scored
    one, two = metrics
    assert one["reward_count"] == two["reward_count"] == 12
    for key in ["reward_mean", "reward_std", "adv/mean", "adv/std", "adv/min", "adv/max", "reward_info/jpeg_kb"]:
        assert one[key] == pytest.approx(two[key], rel=1e-6, abs=1e-9), key
    assert [e["epoch"] for e in evaluations[0]] == [e["epoch"] for e in evaluations[1]] == [-1, 0]
    for a, b in zip(*evaluations):
        assert a["eval/reward_mean"] == pytest.approx(b["eval/reward_mean"], rel=1e-6)
        assert a["eval/reward_info/jpeg_kb"] == pytest.approx(b["eval/reward_info/jpeg_kb"], rel=1e-6)


@pytest.mark.slow
def test_the_fresh_final_evaluation_is_the_same_on_one_process_and_two(tiny_model_dir, tmp_path):
    """The fresh final evaluation samples its images on every process (each its slice, gathered in order): the base
    model's, the handed-over and the best weights' scores, and the verdict, are those of one process (a learning
    rate that leaves the weights where they start up to rounding: DDP's averaged gradient is not one process's
    bitwise, and the JPEG reward is a step function of the pixels)."""
    records = []
    for processes in (1, 2):
        run = f"fresh_{processes}"
        args = tiny_args(tiny_model_dir, tmp_path, run, **{
            "sample.batch_size": 4, "sample.num_batches_per_epoch": 2 // processes, "train.group_size": 4, "eval_freq": 1, "train.learning_rate": 1e-12,
            "eval_num_prompts": 3, "eval_num_seeds": 2, "final_eval_num_seeds": 3, "log_images_every": 0,
            "save_freq": 0, **SAME_DEVICE})
        args[1] = "config/base.py:grpo"
        run_processes(args, processes, tmp_path / f"logs_{run}")
        records.append(json.loads((tmp_path / run / "summary.json").read_text()))
    one, two = records
    assert one["verdict"] == two["verdict"] == "did_not_learn" and one["fresh"]["images"] == two["fresh"]["images"] == 9
    for weights in ("final", "best"):
        for key in ("before", "after", "change", "se"):
            assert one["fresh"]["reward"][weights][key] == pytest.approx(two["fresh"]["reward"][weights][key],
                                                                        rel=1e-5, abs=1e-7), (weights, key)
