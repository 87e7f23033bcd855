"""Bad input stops a run with a message naming the culprit, before heavy work where possible.

Covered elsewhere and counted with these: unknown preset, estimator and loss (test_config.py),
config contradictions (test_config.py), reward outputs of the wrong type / shape / value
(rewards/test_rewards_and_tracking.py::test_bad_rewards_get_a_clear_error), bad plugin paths (rewards/test_plugins.py).
"""

from __future__ import annotations

import json
import math
import textwrap
import warnings

import pytest
import torch

from config.base import base
import ddpo_group.run.trainer as trainer_module
from ddpo_group.run.persistence.checkpointing import complete_checkpoints
from ddpo_group.run.config_checks import ConfigError
from ddpo_group.errors import CheckpointError, NonFiniteLossError
from ddpo_group.models import load_pipeline
from ddpo_group.models.families import sd as pipeline_module
from ddpo_group.models.families.sd import encode_prompts
from ddpo_group.run.persistence.manifest import write_manifest
from ddpo_group.run.persistence.state_files import STATE_JSON
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_config, tiny_trainer

PLUGINS = textwrap.dedent(
    """
    import torch

    def empty_prompt(rng=None):
        return "   ", {}

    def bare_string_prompt(rng=None):
        return "a cat"

    def raising_prompt(rng=None):
        raise KeyError("no prompts today")

    def long_prompt(rng=None):
        return "a very long prompt about a cat sitting on a mat in the sun all day long", {}

    def make_nan():
        return lambda images, prompts, metadata: (torch.tensor([float("nan") if i % 3 == 1 else 0.5
                                                                 for i in range(len(prompts))]), {})

    def make_short():
        return lambda images, prompts, metadata: (torch.zeros(len(prompts) - 1), {})

    def make_untupled():
        return lambda images, prompts, metadata: torch.zeros(len(prompts))

    def make_strings():
        return lambda images, prompts, metadata: (["high"] * len(prompts), {})

    def make_picky():
        def picky(images, prompts, metadata):
            if any(p == "cat" for p in prompts):
                raise ValueError("cannot score cats")
            return torch.zeros(len(prompts)), {}
        return picky
    """
)


@pytest.fixture
def plugins(tmp_path):
    path = tmp_path / "bad_plugins.py"
    path.write_text(PLUGINS)
    return f"{path}:"


def no_model_load(monkeypatch):
    """Fail the test if the trainer gets as far as loading the model."""

    def build_policy(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was reported")

    monkeypatch.setattr(trainer_module, "build_policy", build_policy)


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        ({"reward_fn": "nope"}, ValueError, r"unknown reward_fn 'nope'; registered: \[.*'jpeg_compressibility'"),
        ({"prompt_fn": "nope"}, ValueError, r"unknown prompt_fn 'nope'; registered: \[.*'simple_animals'"),
        ({"prompt_fn": ""}, ValueError, r"prompt_fn must be a non-empty string, got ''"),
        ({"prompt_fn": "from_file"}, ValueError, r"prompt_fn from_file needs prompt_fn_kwargs.path"),
        ({"prompt_fn": "simple_animals", "prompt_fn_kwargs": {"colour": "red"}}, ConfigError,
         r"prompt_fn_kwargs.colour: prompt_fn 'simple_animals' takes no keyword 'colour'; its keywords: \[\]"),
        ({"reward_fn": "jpeg_compressibility", "reward_fn_kwargs": {"colour": 5}}, ConfigError,
         r"reward_fn_kwargs.colour: reward_fn 'jpeg_compressibility' takes no keyword 'colour'; its keywords: "
         r"\['quality'\]"),
        ({"prompt_fn": "PLUGINS:empty_prompt"}, ValueError, r"prompt function '.*empty_prompt' returned '   '; expected a non-empty string"),
        ({"prompt_fn": "PLUGINS:bare_string_prompt"}, TypeError, r"prompt function '.*bare_string_prompt' returned 'a cat'; expected a \(prompt, metadata\) pair"),
        ({"prompt_fn": "PLUGINS:raising_prompt"}, KeyError, r"prompt function '.*raising_prompt' raised KeyError: 'no prompts today'"),
        ({"algorithm.adv_estimator": "nope"}, ValueError, r"algorithm.adv_estimator='nope' is unknown; registered: \[.*'grpo'"),
        ({"algorithm.policy_loss": "nope"}, ValueError, r"algorithm.policy_loss='nope' is unknown; registered: \[.*'vanilla'"),
        ({"train.batch_size": 3}, ValueError, r"train.batch_size=3 must divide the samples per process per epoch"),
    ],
)
def test_bad_names_and_prompt_functions_fail_before_the_model_loads(
    overrides, error, message, plugins, tmp_path, monkeypatch
):
    no_model_load(monkeypatch)
    overrides = {k: v.replace("PLUGINS:", plugins) if isinstance(v, str) else v for k, v in overrides.items()}
    with pytest.raises(error, match=message):
        tiny_trainer("ddpo", str(tmp_path / "never_loaded"), tmp_path, **overrides)


def test_an_empty_prompt_file_fails_before_the_model_loads(tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match=rf"prompt function 'from_file' raised ValueError: prompt_fn from_file: "
                                         rf"'{empty}' holds no prompt"):
        tiny_trainer("ddpo", "unused", tmp_path, prompt_fn="from_file", prompt_fn_kwargs={"path": str(empty)})


def test_missing_model_path_is_named(tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(FileNotFoundError, match=rf"pretrained.model='{missing}': no such directory"):
        load_pipeline(missing, config=base())
    with pytest.raises(FileNotFoundError, match=r"pretrained.model=.*no_such_model"):
        tiny_trainer("ddpo", missing, tmp_path)


@pytest.mark.parametrize(
    "reward, error, message",
    [
        ("make_nan", ValueError, r"reward function '.*make_nan' returned non-finite rewards at indices \[1\]: \[nan\]"),
        ("make_short", ValueError, r"reward function '.*make_short' returned shape \(3,\) for 4 images; expected \(4,\)"),
        ("make_untupled", TypeError, r"reward function '.*make_untupled' returned Tensor; expected a \(rewards, info\) pair"),
        ("make_strings", TypeError, r"reward function '.*make_strings' returned an array of dtype <U4; expected numbers"),
        ("make_picky", RuntimeError,
         r"reward function '.*make_picky' raised ValueError: cannot score cats \(it raised on batch indices \[(\d, )*\d\] "
         r"of the batch of 4 images, prompts \['cat'(, 'cat')*\]\)"),
    ],
)
def test_bad_reward_outputs_stop_the_first_epoch_with_the_reward_named(reward, error, message, plugins, tiny_model_dir,
                                                                       tmp_path):
    overrides = {"reward_fn": plugins + reward, "sample.batch_size": 4, "sample.num_batches_per_epoch": 1}
    if reward == "make_picky":  # a fixed prompt list where "cat" sits at known places
        path = tmp_path / "prompts.txt"
        path.write_text("cat\ndog\n")
        overrides.update({"prompt_fn": "from_file", "prompt_fn_kwargs": {"path": str(path)}})
    trainer = tiny_trainer("ddpo", tiny_model_dir, tmp_path, **overrides)
    with pytest.raises(error, match=message):
        trainer.run()
    assert not complete_checkpoints(tmp_path / "run" / "checkpoints")


def test_failing_images_are_the_ones_the_reward_raises_on():
    from ddpo_group.rollout.reward_scorer import RewardScorer

    def picky(images, prompts, metadata):
        if any(p.startswith("bad") for p in prompts):
            raise ValueError("unscorable")
        return [0.0] * len(prompts), {}

    prompts = ["ok", "bad 1", "ok", "bad 3"]
    with pytest.raises(RuntimeError, match=r"batch indices \[1, 3\] of the batch of 4 images, prompts \['bad 1', 'bad 3'\]"):
        RewardScorer(picky, "picky")(torch.zeros(4, 3, 2, 2), prompts, [{}] * 4)
    with pytest.raises(RuntimeError, match=r"on the whole batch of the batch of 2 images but on no single image"):
        RewardScorer(lambda i, p, m: 1 / 0 if len(p) > 1 else ([0.0], {}), "batchy")(torch.zeros(2, 3, 2, 2),
                                                                                  ["a", "b"], [{}] * 2)


def test_long_prompts_warn_once_and_are_truncated(tiny_pipe, monkeypatch):
    monkeypatch.setattr(pipeline_module, "_TRUNCATION_WARNED", set())
    limit = tiny_pipe.tokenizer.model_max_length
    long = "a cat sitting on a mat in the sun"  # longer than 16 byte-level tokens
    assert len(tiny_pipe.tokenizer(long).input_ids) > limit
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = encode_prompts(tiny_pipe, [long, "cat"])
        second = encode_prompts(tiny_pipe, [long + " all day long", "dog"])
        encode_prompts(tiny_pipe, ["cat"])
    messages = [str(w.message) for w in caught if "tokenizer limit" in str(w.message)]
    assert messages == [
        f"prompt {long!r} (and any other prompt over the limit) is longer than the tokenizer limit of {limit} tokens "
        f"and is truncated to its first {limit} tokens; this warning is shown once"
    ]
    assert torch.equal(first[0], second[0])  # both read as their first 16 tokens
    assert not torch.equal(first[1], second[1])


def test_long_prompts_in_a_run_warn_once(plugins, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline_module, "_TRUNCATION_WARNED", set())
    trainer = tiny_trainer("ddpo", tiny_model_dir, tmp_path, prompt_fn=plugins + "long_prompt", num_epochs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = trainer.run()
    assert sum("tokenizer limit" in str(w.message) for w in caught) == 1
    assert math.isfinite(metrics["reward_mean"])


@pytest.mark.parametrize("where", ["policy", "critic"])
def test_a_non_finite_loss_stops_naming_epoch_and_step_and_keeps_the_last_checkpoint(where, tiny_model_dir, tmp_path,
                                                                                     monkeypatch):
    preset = "ddpo" if where == "policy" else "group_ppo"
    trainer = tiny_trainer(preset, tiny_model_dir, tmp_path, num_epochs=3, save_freq=1)
    poisoned = {"on": False}
    if where == "policy":
        import dataclasses

        real = trainer.updater.loss.fn

        def loss(*args, **kwargs):
            value, info = real(*args, **kwargs)
            return (value * float("nan") if poisoned["on"] else value), info

        monkeypatch.setattr(trainer.updater, "loss", dataclasses.replace(trainer.updater.loss, fn=loss))
    else:
        import ddpo_group.update.critic as module

        real = module.clipped_value_loss

        def value_loss(*args, **kwargs):
            loss, info = real(*args, **kwargs)
            return (loss + float("inf") if poisoned["on"] else loss), info

        monkeypatch.setattr(module, "clipped_value_loss", value_loss)
    real_epoch = trainer.train_epoch

    def train_epoch(epoch):
        poisoned["on"] = epoch == 1
        return real_epoch(epoch)

    monkeypatch.setattr(trainer, "train_epoch", train_epoch)
    with pytest.raises(NonFiniteLossError) as caught:
        trainer.run()
    message = str(caught.value)
    checkpoint = tmp_path / "run" / "checkpoints" / "checkpoint_00000"
    if where == "policy":  # epoch 0 took 2 optimizer steps: the first of epoch 1 is global step 3
        assert message.startswith("non-finite policy_loss=nan in train batch 0 of inner epoch 0 at epoch 1 (global step 3)")
    else:
        assert message.startswith("non-finite critic value loss=inf in critic batch 0 at epoch 1 (after global step 4)")
    assert f"The last complete checkpoint, {checkpoint} (epoch 0), is kept" in message
    assert f"--config.resume_from={tmp_path / 'run'}" in message
    assert complete_checkpoints(tmp_path / "run" / "checkpoints") == [checkpoint]
    if where == "policy":  # stopped before backward: the weights in memory never saw the NaN
        unet = trainer.accelerator.unwrap_model(trainer.model)
        assert all(torch.isfinite(p).all() for p in unet.parameters())

    resumed = tiny_trainer(preset, tiny_model_dir, tmp_path, num_epochs=3, save_freq=1,
                           resume_from=str(tmp_path / "run"))
    assert resumed.state.epoch == 0 and resumed.state.global_step == 2
    resumed.rollouts.close()


def test_config_with_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match=r"unknown preset 'nope'; valid presets: .*group_ppo"):
        tiny_config("nope", "unused", "unused")


def test_resuming_with_a_config_whose_state_differs_names_the_fields_before_the_model_loads(tiny_model_dir, tmp_path,
                                                                                              monkeypatch, capsys):
    tiny_trainer("ddpo", tiny_model_dir, tmp_path, save_freq=1).run()
    saved = json.loads((tmp_path / "run" / "checkpoints" / "checkpoint_00000" / "state_fields.json").read_text())
    assert saved["use_lora"] is True and saved["algorithm.adv_estimator"] == "ddpo" and saved["num_processes"] == 1

    real_build_policy = trainer_module.build_policy
    no_model_load(monkeypatch)
    with pytest.raises(ConfigError) as caught:
        tiny_trainer("ddpo", tiny_model_dir, tmp_path, num_epochs=2, resume_from=str(tmp_path / "run"),
                     use_lora=False, lora_rank=8, **{"kl.controller": "adaptive", "kl.beta": 0.1,
                                                     "kl.use_reference_model": True})
    message = str(caught.value)
    assert "cannot be resumed with this config; these fields differ" in message
    for line in ["use_lora: checkpoint True, config False", "lora_rank: checkpoint 4, config 8",
                 "kl.controller: checkpoint 'fixed', config 'adaptive'",
                 "kl.use_reference_model: checkpoint False, config True"]:
        assert f"  - {line}\n" in message
    assert "start a new run" in message

    # another path to the same model only warns
    monkeypatch.setattr(trainer_module, "build_policy", real_build_policy)
    moved = tmp_path / "moved_model"
    moved.symlink_to(tiny_model_dir)
    resumed = tiny_trainer("ddpo", str(moved), tmp_path, num_epochs=2, resume_from=str(tmp_path / "run"))
    assert resumed.state.epoch == 0
    assert f"warning: pretrained.model is {str(moved)!r}; the checkpoint was trained from" in capsys.readouterr().out
    resumed.rollouts.close()


def test_a_checkpoint_of_another_preset_or_model_family_is_refused_by_name(tiny_model_dir, tiny_sd3_dir, tmp_path,
                                                                           monkeypatch):
    tiny_trainer("ddpo", tiny_model_dir, tmp_path, save_freq=1).run()
    no_model_load(monkeypatch)
    run = str(tmp_path / "run")
    with pytest.raises(ConfigError) as caught:
        tiny_trainer("group_ppo", tiny_model_dir, tmp_path, num_epochs=2, resume_from=run)
    assert "  - algorithm.adv_estimator: checkpoint 'ddpo', config 'group_ppo'\n" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        tiny_trainer("ddpo", tiny_sd3_dir, tmp_path, num_epochs=2, resume_from=run, **FAMILY_OVERRIDES["sd3"])
    assert "  - model family: checkpoint 'sd', config 'sd3'\n" in str(caught.value)


def test_a_resume_skips_a_checkpoint_that_fails_to_verify_and_each_error_gives_the_command_to_paste(
        tiny_model_dir, tmp_path, capsys):
    tiny_trainer("ddpo", tiny_model_dir, tmp_path, num_epochs=2, save_freq=1).run()
    root = tmp_path / "run" / "checkpoints"
    weights = root / "checkpoint_00001" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF  # one weight changed on disk: same size, other contents
    weights.write_bytes(bytes(data))
    capsys.readouterr()

    resumed = tiny_trainer("ddpo", tiny_model_dir, tmp_path, num_epochs=3, resume_from=str(tmp_path / "run"))
    out = capsys.readouterr().out
    assert f"warning: skipped checkpoint_00001: {weights} does not match its sha256 in MANIFEST.json" in out
    assert f"resumed from {root / 'checkpoint_00000'} (finished epoch 0)" in out and resumed.state.epoch == 0
    resumed.rollouts.close()

    previous = root / "checkpoint_00000"
    command = f"python scripts/train.py --config=config/base.py:ddpo --config.resume_from={previous}"
    with pytest.raises(CheckpointError) as caught:  # that checkpoint named: refused before the model loads
        tiny_trainer("ddpo", tiny_model_dir, tmp_path, num_epochs=3, resume_from=str(weights.parent))
    assert str(caught.value).endswith(f"resume from checkpoint_00000, the newest earlier checkpoint that verifies: "
                                      f"{command}")

    # verified, yet not this run's state: the load error names the file and gives the same next step
    state_file = weights.parent / STATE_JSON
    state_file.write_text(json.dumps({"pieces": []}))
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    write_manifest(weights.parent)
    with pytest.raises(CheckpointError) as caught:
        tiny_trainer("ddpo", tiny_model_dir, tmp_path, num_epochs=3, resume_from=str(weights.parent))
    message = str(caught.value)
    assert message.startswith(f"{state_file} holds the pieces []; this run has ['prompt_sampler', 'counters', ")
    assert message.endswith(f"resume from checkpoint_00000, the newest earlier checkpoint that verifies: {command}")
