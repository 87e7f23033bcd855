import io

import numpy as np
import pytest
import torch
from PIL import Image

from ddpo_group.prompts import PromptSampler, get_prompt_fn
from ddpo_group.rewards import check_rewards, make_reward_fn
from ddpo_group.run.reporting.epoch_logger import resolve_wandb_mode


def test_jpeg_rewards_are_the_quality_95_file_size_in_kb():
    torch.manual_seed(0)
    images = torch.stack([torch.full((3, 32, 32), 0.5), torch.rand(3, 32, 32)])
    rewards, info = make_reward_fn("jpeg_compressibility")(images, ["a", "b"], [{}, {}])
    buffer = io.BytesIO()
    array = (images[1] * 255).round().byte().permute(1, 2, 0).numpy()
    Image.fromarray(array).save(buffer, format="JPEG", quality=95)
    assert rewards[1].item() == pytest.approx(-buffer.tell() / 1000)
    # a flat image compresses better than noise
    assert rewards[0] > rewards[1]
    incompressible, _ = make_reward_fn("jpeg_incompressibility")(images, ["a", "b"], [{}, {}])
    torch.testing.assert_close(incompressible, -rewards)
    torch.testing.assert_close(info["jpeg_kb"], -rewards)


def test_unknown_reward_and_prompt_names_list_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown reward_fn 'nope'; registered: .*jpeg_compressibility"):
        make_reward_fn("nope")
    with pytest.raises(ValueError, match=r"unknown prompt_fn 'nope'; registered: .*simple_animals"):
        get_prompt_fn("nope")


@pytest.mark.parametrize(
    "rewards, error, message",
    [
        (torch.tensor([1.0, float("nan"), 2.0, float("inf")]), ValueError, r"'r' returned non-finite rewards at indices \[1, 3\]"),
        (torch.ones(3), ValueError, r"returned shape \(3,\) for 4 images; expected \(4,\)"),
        (torch.ones(4, 1), ValueError, r"returned shape \(4, 1\)"),
        ("high", TypeError, r"returned str"),
        (np.array(["a"] * 4), TypeError, r"dtype <U1"),
    ],
)
def test_bad_rewards_get_a_clear_error(rewards, error, message):
    with pytest.raises(error, match=message):
        check_rewards(rewards, 4, "r")


def test_rewards_accepted_as_list_array_or_tensor():
    for value in ([1, 2], np.array([1.0, 2.0]), torch.tensor([1.0, 2.0])):
        out = check_rewards(value, 2, "r")
        assert out.dtype == torch.float64 and out.tolist() == [1.0, 2.0]


def test_prompt_sampler_is_reproducible_and_resumable():
    a = PromptSampler("simple_animals", seed=3)
    first = a.sample(5)
    state = a.state_dict()
    following = a.sample(5)
    b = PromptSampler("simple_animals", seed=0)
    b.load_state_dict(state)
    assert b.sample(5) == following
    assert PromptSampler("simple_animals", seed=3).sample(5) == first


def test_wandb_mode_falls_back_to_offline_without_api_key(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "missing"))
    assert resolve_wandb_mode("online")[0] == "offline"
    assert resolve_wandb_mode("disabled") == ("disabled", None)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_wandb_mode("online") == ("online", None)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_wandb_mode("online")[0] == "disabled"


def test_epoch_prompts_are_groups_of_copies_identical_on_every_process():
    a, b = PromptSampler("simple_animals", seed=5), PromptSampler("simple_animals", seed=5)
    prompts, metadata, groups = a.sample_epoch(num_groups=4, group_size=3)
    assert (prompts, groups) == b.sample_epoch(4, 3)[::2]
    assert len(prompts) == len(metadata) == 12 and sorted(groups) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    for g in range(4):
        assert len({p for p, gi in zip(prompts, groups) if gi == g}) == 1
    assert groups != sorted(groups)  # shuffled, so a group's copies spread over processes and batches
    assert groups == [0, 1, 1, 1, 3, 0, 2, 2, 0, 2, 3, 3]  # the draw of earlier runs and their checkpoints


def test_whole_groups_keep_each_groups_copies_together():
    """sample_epoch(whole_groups=True) (preference objectives): every slice of k * G rows holds whole groups."""
    a, b = PromptSampler("simple_animals", seed=5), PromptSampler("simple_animals", seed=5)
    prompts, metadata, groups = a.sample_epoch(num_groups=4, group_size=3, whole_groups=True)
    assert (prompts, metadata, groups) == b.sample_epoch(4, 3, whole_groups=True)
    assert groups == [2, 2, 2, 3, 3, 3, 1, 1, 1, 0, 0, 0]  # the groups shuffled, each group's copies consecutive
    assert len(prompts) == len(metadata) == 12 and sorted(groups) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    for k in (1, 2):  # slices of k groups (one process's rows with 4 / k processes)
        for start in range(0, 12, 3 * k):
            part = groups[start:start + 3 * k]
            assert all(part.count(g) == 3 for g in part), (k, start, part)
    for g in range(4):
        assert len({p for p, gi in zip(prompts, groups) if gi == g}) == 1
    assert a.sample_epoch(4, 3, whole_groups=True)[2] != groups  # the next epoch draws another order


def test_reward_scorer_names_the_reward_on_errors_and_checks_the_output():
    import pytest
    import torch

    from ddpo_group.rollout.reward_scorer import RewardScorer

    images = torch.zeros(2, 3, 4, 4)

    def broken(images, prompts, metadata):
        raise KeyError("missing attribute")

    with pytest.raises(RuntimeError, match="reward function 'broken' raised KeyError"):
        RewardScorer(broken, "broken")(images, ["a", "b"], [{}, {}])
    with pytest.raises(ValueError, match=r"'short' returned shape \(1,\) for 2 images"):
        RewardScorer(lambda *_: ([1.0], {}), "short")(images, ["a", "b"], [{}, {}])
    rewards, info = RewardScorer(lambda *_: ([1, 2], None), "ok")(images, ["a", "b"], [{}, {}])
    assert rewards.dtype == torch.float64 and rewards.tolist() == [1.0, 2.0] and info == {}
