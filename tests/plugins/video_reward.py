"""A video reward plugin: it declares ``takes_videos = True``, so it receives whole videos [B, F, 3, H, W] (each
video [F, 3, H, W]) instead of single frames (ddpo_group/rewards/__init__.py). Used as
``reward_fn="tests/plugins/video_reward.py:make_stillness"``.

``stillness``: minus the mean absolute change between consecutive frames (0 for a still video), a temporal score no
per-frame reward can give.
"""


def make_stillness(scale: float = 1.0):
    def stillness(videos, prompts, metadata):
        change = (videos[:, 1:] - videos[:, :-1]).abs().double().mean(dim=(1, 2, 3, 4))
        return -scale * change, {"frames": [videos.shape[1]] * len(prompts)}

    stillness.takes_videos = True
    return stillness
