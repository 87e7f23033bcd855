import subprocess
import sys
from pathlib import Path

import pytest

from ddpo_group.run.config_checks import ConfigError, validate_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from config.base import PRESETS, get_config  # noqa: E402


def test_presets_validate():
    for name in PRESETS:
        config = get_config(name)
        validate_config(config)
        assert config.preset == name


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown preset 'nope'; valid presets: .*ddpo"):
        get_config("nope")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"sample.noise_level": 0.0}, r"sample.noise_level=0.0 must be > 0"),
        ({"sample.noise_level": -1.0}, r"sample.noise_level=-1.0"),
        ({"train.step_fraction": 0.0}, r"train.step_fraction=0.0 must be in \(0, 1\]"),
        ({"train.step_fraction": 1.5}, r"train.step_fraction=1.5"),
        ({"train.batch_size": 5}, r"train.batch_size=5 must divide .* = 32"),
        ({"train.gradient_accumulation_steps": 3}, r"train.gradient_accumulation_steps=3 must divide .* = 4"),
        ({"sample.guidance_scale": 1.0}, r"train.cfg=True contradicts sample.guidance_scale=1.0"),
        ({"mixed_precision": "fp8"}, r"mixed_precision='fp8' must be one of"),
        ({"wandb.mode": "maybe"}, r"wandb.mode='maybe'"),
        ({"train.clip_range": 0.0}, r"train.clip_range=0.0 must be > 0"),
        ({"train.group_size": 5}, r"train.group_size=5 must divide the samples per epoch, .* = 32"),
    ],
)
def test_contradictions_fail_naming_the_fields(overrides, message):
    config = get_config("ddpo")
    for key, value in overrides.items():
        section, _, field = key.rpartition(".")
        target = config[section] if section else config
        target[field] = value
    with pytest.raises(ConfigError, match=message):
        validate_config(config)


def test_every_error_is_reported_at_once():
    config = get_config("ddpo")
    config.sample.noise_level = 0.0
    config.train.step_fraction = 2.0
    with pytest.raises(ConfigError) as info:
        validate_config(config)
    assert "sample.noise_level" in str(info.value) and "train.step_fraction" in str(info.value)


def test_command_line_overrides_apply():
    """The absl/ml_collections flag path that scripts/train.py uses."""
    code = (
        "import sys; from absl import flags; from ml_collections import config_flags;"
        "c = config_flags.DEFINE_config_file('config');"
        "flags.FLAGS(sys.argv);"
        "print(c.value.train.learning_rate, c.value.sample.num_steps, c.value.use_lora, c.value.pretrained.model)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, "--config=config/base.py:ddpo", "--config.train.learning_rate=1e-4",
         "--config.sample.num_steps=7", "--config.use_lora=False", "--config.pretrained.model=/some/path"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )
    assert out.stdout.split() == ["0.0001", "7", "False", "/some/path"]


def test_presets_keep_their_field_names_and_defaults():
    for name in PRESETS:
        config = get_config(name)
        for field in ("adv_estimator", "policy_loss", "loss_agg_mode"):
            assert field in config.algorithm
        for field in ("group_size", "clip_range", "scale_rewards"):
            assert field in config.train
        for field in ("beta", "use_reference_model", "reference_mixup_alpha", "reference_update_freq", "kind",
                      "in_reward", "controller", "target", "horizon"):
            assert field in config.kl
        assert config.pretrained.model == "tiny-shapes" and config.reward_fn == "shapes_alignment"
        # the default task (README.md, Quick start): the embedded model's four hardest captions, a 2-step SDE window of
        # 10 steps
        assert config.prompt_fn == "tiny_shapes_hard" and len(config.prompt_fn_kwargs) == 0
        assert (config.sample.num_steps, config.sample.sde_window_start, config.sample.sde_window_size) == (10, 0, 2)
        # group_ppo's hand-over (docs/studies/handover/): evaluated every 5 epochs, the guard's restore at 1 standard
        # error; the other presets evaluate every 10 epochs and warn
        handover = (5, "restore", 1.0) if name == "group_ppo" else (10, "warn", 2.0)
        assert (config.eval_freq, config.guard.on_alarm, config.guard.fall_drop) == handover
        assert config.num_epochs == 40
    g = get_config("group_ppo").group_ppo  # GROUP_PPO.md's defaults
    assert (g.variance_threshold, g.max_segment_steps, g.numerical_floor, g.adaptive_threshold, g.threshold_lr,
            g.min_threshold, g.max_threshold, g.gae_lambda, g.target_explained_variance) == (1.0, 16, 1e-6, True, 0.01, 0.1,
                                                                                      10.0, 1.0, 0.5)
    expected = {"ddpo": "ddpo", "grpo": "grpo", "dr_grpo": "dr_grpo", "rloo": "rloo", "grpo_passk": "grpo_passk",
                "reinforce_pp": "reinforce_plus_plus", "remax": "remax", "ppo_gae": "gae", "group_ppo": "group_ppo"}
    assert {name: get_config(name).algorithm.adv_estimator for name in PRESETS} == expected


@pytest.mark.parametrize(
    "preset, overrides, message",
    [
        ("grpo", {"train.group_size": 1}, r"adv_estimator='grpo' compares the samples of a prompt group and needs "
                                          r"train.group_size >= 2 .* got train.group_size=1"),
        ("group_ppo", {"train.group_size": 1}, r"'group_ppo' .* train.group_size >= 2"),
        ("ddpo", {"algorithm.adv_estimator": "nope"}, r"algorithm.adv_estimator='nope' is unknown; registered: .*grpo"),
        ("ddpo", {"algorithm.policy_loss": "nope"}, r"algorithm.policy_loss='nope' is unknown; registered: .*gspo"),
        ("ddpo", {"algorithm.loss_agg_mode": "nope"}, r"algorithm.loss_agg_mode: unknown loss_agg_mode 'nope'"),
        ("ddpo", {"kl.beta": 0.1}, r"kl.beta=0.1 asks for a KL term but kl.use_reference_model=False"),
        ("grpo", {"kl.in_reward": True}, r"kl.in_reward=True needs a step-level estimator .*adv_estimator='grpo'"),
        ("ppo_gae", {"kl.in_reward": True}, r"kl.in_reward=True needs kl.beta > 0"),
        ("grpo", {"kl.reference_mixup_alpha": 1.5}, r"kl.reference_mixup_alpha=1.5 must be in \[0, 1\]"),
        ("ddpo", {"kl.reference_update_freq": 2}, r"reference_update_freq=2 updates a reference model, but "
                                                     r"kl.use_reference_model=False"),
        ("rloo", {"train.scale_rewards": True}, r"train.scale_rewards=True contradicts algorithm.adv_estimator='rloo'"),
        ("grpo", {"kl.kind": "nope"}, r"kl.kind='nope' must be one of"),
        ("grpo", {"kl.controller": "adaptive", "kl.beta": 0.0}, r"needs an initial kl.beta > 0"),
        ("ppo_gae", {"algorithm.filter_groups": True}, r"filter_groups=True .* needs a group estimator"),
        ("group_ppo", {"group_ppo.min_threshold": 5.0, "group_ppo.max_threshold": 1.0},
         r"min_threshold <= group_ppo.max_threshold"),
        ("group_ppo", {"group_ppo.max_segment_steps": 0}, r"group_ppo.max_segment_steps=0 must be >= 1"),
        ("group_ppo", {"group_ppo.variance_threshold": 20.0},
         r"group_ppo.variance_threshold=20.0 lies outside \[group_ppo.min_threshold, group_ppo.max_threshold\] = "
         r"\[0.1, 10.0\].*adaptive_threshold=False"),
        ("group_ppo", {"group_ppo.variance_threshold": 0.0}, r"group_ppo.variance_threshold=0.0 lies outside"),
        ("group_ppo", {"group_ppo.target_explained_variance": 0.0}, r"target_explained_variance=0.0 must be > 0"),
        ("ppo_gae", {"critic.learning_rate": 0.0}, r"critic.learning_rate=0.0 must be > 0"),
        ("group_ppo", {"critic.input": "clean"}, r"critic.input='clean' is not one of \['latent', 'latent_clean_hat'\]"),
        ("ddpo", {"train.clip_range": -0.1}, r"train.clip_range=-0.1 must be > 0"),
    ],
)
def test_algorithm_contradictions_are_named(preset, overrides, message):
    config = get_config(preset)
    for key, value in overrides.items():
        section, _, field = key.rpartition(".")
        config[section][field] = value
    with pytest.raises(ConfigError, match=message):
        validate_config(config)


def test_a_field_under_its_former_name_is_renamed_with_a_message_naming_the_new_one():
    code = (
        "import sys; from absl import flags; from ml_collections import config_flags;"
        "from ddpo_group.run.command.cli import parse_flags_or_exit;"
        "c = config_flags.DEFINE_config_file('config');"
        "parse_flags_or_exit(sys.argv);"
        "print(c.value.train.clip_range, c.value.kl.beta, c.value.group_ppo.max_segment_steps,"
        "c.value.sample.noise_level, c.value.preset)"
    )
    for flags, message in ((["--config.train.clip_range=0.2", "--config.kl.beta=0.5",
                             "--config.group_ppo.max_segment_steps=3", "--config.sample.noise_level=0.5"], ""),
                           (["--config.train.epsilon=0.2", "--config.train.beta=0.5",
                             "--config.group_params.group_max_size=3", "--config.sample.eta=0.5"],
                            "train.epsilon is now train.clip_range")):
        out = subprocess.run([sys.executable, "-c", code, "--config=config/base.py:grpo", *flags],
                             cwd=ROOT, capture_output=True, text=True, check=True)
        assert out.stdout.split() == ["0.2", "0.5", "3", "0.5", "grpo"]
        assert message in out.stderr
        if message:  # every former name is named with its new one, once
            assert "train.beta is now kl.beta" in out.stderr
            assert "group_params.group_max_size is now group_ppo.max_segment_steps" in out.stderr
            assert "sample.eta is now sample.noise_level" in out.stderr
            assert out.stderr.count("is now") == 4
        else:
            assert "is now" not in out.stderr


def test_a_saved_config_under_former_names_is_read_with_the_current_ones():
    from ddpo_group.run.command.renamed_fields import translate_saved

    saved = {"seed": 3, "train": {"beta": 0.1, "epsilon": 0.2, "learning_rate": 1e-3},
             "algorithm": {"kl_type": "k3", "adv_estimator": "grpo"},
             "group_params": {"lam": 0.9, "value_source": "tweedie"}, "compile_unet": True}
    now = translate_saved(saved)
    assert now == {"seed": 3, "train": {"clip_range": 0.2, "learning_rate": 1e-3},
                   "algorithm": {"adv_estimator": "grpo"}, "kl": {"beta": 0.1, "kind": "k3"},
                   "group_ppo": {"gae_lambda": 0.9, "value_source": "tweedie"}, "compile_denoiser": True}
    assert saved["train"]["beta"] == 0.1  # the input is left as it was
    # a run saved with both noise fields: DDIM's eta is the level its evaluation samples with
    assert translate_saved({"sample": {"eta": 0.5, "noise_level": 0.7}}) == {"sample": {"noise_level": 0.5}}


def test_an_unset_noise_level_is_the_familys_standard_one():
    from ml_collections import ConfigDict

    from ddpo_group.models.families.flow_matching import FlowMatchingFamily
    from ddpo_group.models.families.sd import StableDiffusionFamily

    assert get_config("ddpo").sample.noise_level is None
    unset, set_ = ConfigDict({"noise_level": None}), ConfigDict({"noise_level": 0.3})
    assert StableDiffusionFamily.noise_level(unset) == 1.0  # DDPO's eta
    assert FlowMatchingFamily.noise_level(unset) == 0.7  # Flow-GRPO's level on SD3.5
    assert StableDiffusionFamily.noise_level(set_) == FlowMatchingFamily.noise_level(set_) == 0.3
    assert get_config("flow_grpo_flux").sample.noise_level == 0.9


def test_a_reference_model_nothing_runs_is_warned_about_and_no_recipe_holds_one():
    """kl.use_reference_model with kl.beta=0 holds a reference no forward reads (a float32 copy of the denoiser under
    full fine-tuning), unless a preference objective compares with it: warned, and no recipe or preset does it."""
    from config.recipes import RECIPES
    from ddpo_group.run.config_checks import config_warnings

    config = get_config("grpo")
    assert config.kl.use_reference_model and config.kl.beta > 0 and config_warnings(config) == []
    config.kl.beta = 0.0
    (warning,) = config_warnings(config)
    assert "kl.use_reference_model=True with kl.beta=0" in warning and "'policy_gradient'" in warning
    assert config_warnings(get_config("dpo")) == []  # beta 0, and DPO compares with the reference
    from config.base import PRESETS

    for name in {**PRESETS, **RECIPES}:
        assert not any("reference model is held" in w for w in config_warnings(get_config(name))), name


def test_the_flow_model_on_the_sd_models_task_is_warned_about_and_its_recipe_is_not():
    from config.recipes import RECIPES
    from ddpo_group.run.config_checks import config_warnings

    config = get_config("grpo")
    assert config_warnings(config) == []
    config.pretrained.model = "tiny-shapes-flow"
    (warning,) = config_warnings(config)
    assert "prompt_fn='tiny_shapes_hard'" in warning and "config/base.py:grpo_flow" in warning
    assert "train.learning_rate=0.003" in warning
    for name in ("grpo_flow", "group_ppo_flow"):
        recipe = get_config(name)
        assert name in RECIPES and config_warnings(recipe) == []
        assert (recipe.pretrained.model, recipe.prompt_fn, recipe.train.learning_rate) == (
            "tiny-shapes-flow", "tiny_shapes_flow_hard", 1.5e-3)
        validate_config(recipe)
    recipe = get_config("group_ppo_flow")
    assert recipe.algorithm.adv_estimator == "group_ppo" and recipe.group_ppo.critic_weight_by_ev
    assert (recipe.lora_rank, recipe.kl.beta, recipe.kl.use_reference_model, recipe.kl.only_below_start) == (
        16, 1.0, True, True)
