"""Rewards of videos (rewards/base.py's ``scores_frames``): an image reward scores each frame, averaged per video; a
reward function with ``takes_videos = True`` (tests/plugins/video_reward.py) receives the videos whole; the grids show
a video as a strip of its frames."""

import os

import pytest
import torch

from ddpo_group.rewards import make_reward_fn
from ddpo_group.rewards.combine import make_combined_reward
from ddpo_group.run.reporting.image_grid import image_grid

PLUGIN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "plugins", "video_reward.py")


def videos(b=2, f=3, side=4):
    """Video k's frame j is the constant (k + 1) * (j + 1) / 10: mean brightness known by hand."""
    values = torch.tensor([[(k + 1) * (j + 1) / 10 for j in range(f)] for k in range(b)])
    return values[:, :, None, None, None].expand(b, f, 3, side, side).clone()


def make_brightness_with_log():
    calls = []

    def brightness(images, prompts, metadata):
        calls.append((tuple(images.shape), list(prompts), [m["k"] for m in metadata]))
        mean = images.double().mean(dim=(1, 2, 3))
        return mean, {"twice": 2 * mean, "batch": "size"}

    brightness.calls = calls
    return brightness


def test_an_image_reward_scores_every_frame_and_is_averaged_per_video(monkeypatch):
    from ddpo_group.rewards import base

    fn = make_brightness_with_log()
    monkeypatch.setattr(base.REWARD_REGISTRY, "resolve", lambda name: lambda: fn)
    reward = make_reward_fn("brightness")
    rewards, info = reward(videos(), ["a", "b"], [{"k": 0}, {"k": 1}])
    # by hand: video 0 has frames 0.1, 0.2, 0.3 (mean 0.2); video 1 has 0.2, 0.4, 0.6 (mean 0.4)
    torch.testing.assert_close(rewards, torch.tensor([0.2, 0.4], dtype=torch.float64))
    torch.testing.assert_close(info["twice"], torch.tensor([0.4, 0.8], dtype=torch.float64))
    assert info["batch"] == "size"  # not per frame: kept as it is
    assert fn.calls == [((6, 3, 4, 4), ["a", "a", "a", "b", "b", "b"], [0, 0, 0, 1, 1, 1])]
    images = videos()[:, 0]  # images [B, 3, H, W] pass through
    torch.testing.assert_close(reward(images, ["a", "b"], [{"k": 0}, {"k": 1}])[0],
                               torch.tensor([0.1, 0.2], dtype=torch.float64))


def test_a_video_reward_plugin_receives_whole_videos():
    reward = make_reward_fn(f"{PLUGIN}:make_stillness", scale=2.0)
    rewards, info = reward(videos(f=3), ["a", "b"], [{}, {}])
    # frames change by 0.1 (video 0) and 0.2 (video 1) per step: minus twice the change
    torch.testing.assert_close(rewards, torch.tensor([-0.2, -0.4], dtype=torch.float64))
    assert info["frames"] == [3, 3]
    with pytest.raises(ValueError, match=r"takes videos \[B, F, 3, H, W\] \(takes_videos=True\); this model makes "
                                         r"images of shape \(2, 3, 4, 4\)"):
        reward(videos()[:, 0], ["a", "b"], [{}, {}])


def test_a_combination_mixes_a_video_reward_and_an_image_reward():
    combined = make_combined_reward({f"{PLUGIN}:make_stillness": 1.0, "jpeg_compressibility": 0.5})
    total, info = combined(videos(side=16), ["a", "b"], [{}, {}])
    assert total.shape == (2,) and len(info) >= 2
    stillness = info[[label for label in info if "stillness" in label and "/" not in label][0]]
    torch.testing.assert_close(stillness, torch.tensor([-0.1, -0.2], dtype=torch.float64))


def test_a_video_is_shown_as_a_strip_of_its_frames():
    grid = image_grid(videos(b=2, f=3, side=16), ["first", "second"], columns=2)
    scale = 96 // 16  # frames upscaled toward MIN_TILE by their own width
    assert grid.width == 2 * 3 * 16 * scale
    pixels = grid.load()
    # video 1 (second tile): frames of brightness 0.2, 0.4, 0.6 left to right
    left = 3 * 16 * scale
    assert [pixels[left + j * 16 * scale + 5, 5][0] for j in range(3)] == [round(v * 255) for v in (0.2, 0.4, 0.6)]


def test_a_long_video_shows_eight_evenly_spaced_frames_and_a_row_about_columns_frames_wide():
    long = videos(b=3, f=15, side=16) / 2  # frame j of video 0: (j + 1) / 20
    grid = image_grid(long, ["a", "b", "c"])  # by default about 8 frames a row: one video of 8 shown frames
    scale = 96 // 16
    assert grid.width == 8 * 16 * scale and grid.height > 3 * 16 * scale  # three rows of one strip
    shown = [0, 2, 4, 6, 8, 10, 12, 14]  # linspace(0, 14, 8) rounded
    pixels = grid.load()
    assert [pixels[j * 16 * scale + 5, 5][0] for j in range(8)] == [round((n + 1) / 20 * 255) for n in shown]
