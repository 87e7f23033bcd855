"""config.prompt_fn_kwargs are the chosen prompt function's overrides of its registration's defaults: a default's
keywords never reach another prompt function, and a keyword the chosen function does not take is a clear error."""

import random
import re

import pytest

from config.base import PRESETS, get_config
from ddpo_group.errors import ConfigError
from ddpo_group.prompts import PROMPT_REGISTRY, PromptSampler, from_file, get_prompt_fn, register_prompt_fn
from ddpo_group.run.config_checks import prompt_and_reward_errors, validate_config


@pytest.fixture
def hard_prompts(tmp_path, monkeypatch):
    """A registration with default keywords (a prompt file), as a preset's default prompt set would be."""
    path = tmp_path / "hard.txt"
    path.write_text("a blue triangle on a red background\n")
    monkeypatch.setattr(PROMPT_REGISTRY, "_items", dict(PROMPT_REGISTRY._items))  # undone after the test
    register_prompt_fn("hard_for_test", defaults={"path": str(path)})(from_file)
    return str(path)


def test_a_registrations_defaults_apply_to_it_and_leak_nowhere(hard_prompts, tmp_path):
    assert PromptSampler("hard_for_test", seed=0).sample(3)[0] == ["a blue triangle on a red background"] * 3
    assert get_prompt_fn("hard_for_test")(rng=random.Random(0))[0] == "a blue triangle on a red background"
    other = tmp_path / "other.txt"
    other.write_text("a green circle\n")
    overridden = PromptSampler("hard_for_test", {"path": str(other)}, seed=0)  # the user's keyword wins
    assert overridden.kwargs == {"path": str(other)} and overridden.sample(1)[0] == ["a green circle"]
    # the default run names the registration; --config.prompt_fn=simple_animals gets none of its keywords
    config = get_config("grpo")
    config.prompt_fn = "hard_for_test"
    assert prompt_and_reward_errors(config) == []
    config.prompt_fn = "simple_animals"
    assert prompt_and_reward_errors(config) == []
    sampler = PromptSampler(config.prompt_fn, config.prompt_fn_kwargs.to_dict(), seed=0)
    assert sampler.kwargs == {} and len(sampler.sample(4)[0]) == 4
    # the registered function itself keeps its own defaults
    assert PromptSampler("from_file", {"path": hard_prompts}).kwargs == {"path": hard_prompts}


def test_the_default_prompt_set_is_the_four_hard_captions_and_its_keyword_stays_with_it():
    from ddpo_group.models.shapes_data import HARD_CAPTIONS, caption

    config = get_config("group_ppo")
    sampler = PromptSampler(config.prompt_fn, config.prompt_fn_kwargs.to_dict(), seed=0)
    prompts, metadata = sampler.sample(200)
    assert sorted(set(prompts)) == sorted(caption(*triple) for triple in HARD_CAPTIONS) and len(HARD_CAPTIONS) == 4
    assert all(caption(m["color"], m["shape"], m["background"]) == p and not m["held_out"]
               for p, m in zip(prompts, metadata))  # shapes_alignment reads the metadata
    # the same function under its own name draws every caption (hard=True belongs to the registration only)
    assert len(set(PromptSampler("tiny_shapes", seed=0).sample(200)[0])) > 40
    assert PromptSampler("tiny_shapes_hard", {"shapes": "square"}, seed=0).sample(5)[0] == [
        "a purple square on a blue background"] * 5
    with pytest.raises(ValueError, match="hard=True .* held_out=True cannot be combined"):
        PromptSampler("tiny_shapes_hard", {"held_out": True}, seed=0).sample(1)


def test_the_flow_models_hard_prompt_set_and_a_wrong_hard_value():
    from ddpo_group.models.shapes_data import HARD_CAPTIONS, HARD_CAPTIONS_FLOW, caption

    prompts, _ = PromptSampler("tiny_shapes_flow_hard", seed=0).sample(200)
    assert sorted(set(prompts)) == sorted(caption(*triple) for triple in HARD_CAPTIONS_FLOW)
    assert len(HARD_CAPTIONS_FLOW) == 4 and not set(HARD_CAPTIONS_FLOW) & set(HARD_CAPTIONS)
    with pytest.raises(ValueError, match="hard='sdxl'; allowed: False, True"):
        PromptSampler("tiny_shapes", {"hard": "sdxl"}, seed=0).sample(1)


def test_a_keyword_the_chosen_function_does_not_take_is_named_with_the_allowed_ones():
    config = get_config("grpo")
    config.prompt_fn, config.prompt_fn_kwargs = "simple_animals", {"path": "hard.txt"}
    message = "prompt_fn_kwargs.path: prompt_fn 'simple_animals' takes no keyword 'path'; its keywords: []"
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config(config)
    config.prompt_fn, config.prompt_fn_kwargs = "tiny_shapes", {"held_out": True, "colour": "red"}
    assert prompt_and_reward_errors(config) == [
        "prompt_fn_kwargs.colour: prompt_fn 'tiny_shapes' takes no keyword 'colour'; its keywords: "
        "['held_out', 'shapes', 'hard']"]
    with pytest.raises(ConfigError, match=r"prompt_fn 'tiny_shapes' takes no keyword 'colour'"):
        PromptSampler("tiny_shapes", {"colour": "red"})
    with pytest.raises(ValueError, match=r"register_prompt_fn\('bad'\): defaults the function does not take"):
        register_prompt_fn("bad", defaults={"colour": "red"})(from_file)
    assert "bad" not in PROMPT_REGISTRY


def test_reward_keywords_are_checked_per_component():
    config = get_config("grpo")
    config.reward_fn, config.reward_fn_kwargs = "jpeg_compressibility", {"colour": 5}
    assert prompt_and_reward_errors(config) == [
        "reward_fn_kwargs.colour: reward_fn 'jpeg_compressibility' takes no keyword 'colour'; its keywords: "
        "['quality']"]
    config.reward_fn = '{"jpeg_compressibility": 1.0, "aesthetic": 2.0}'
    config.reward_fn_kwargs = {"jpeg_compressibility": {"quality": 80, "size": 3}}
    assert prompt_and_reward_errors(config) == [
        "reward_fn_kwargs.jpeg_compressibility.size: reward_fn 'jpeg_compressibility' takes no keyword 'size'; its "
        "keywords: ['quality']"]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_no_preset_sets_keywords_another_function_would_inherit(preset):
    """A preset's default prompt set or reward arguments belong to a registration (prompts.py), not to
    prompt_fn_kwargs / reward_fn_kwargs, which a --config.prompt_fn / reward_fn override would otherwise keep."""
    config = get_config(preset)
    assert config.prompt_fn_kwargs.to_dict() == {} and config.reward_fn_kwargs.to_dict() == {}
