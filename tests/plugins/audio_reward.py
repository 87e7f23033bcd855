"""An audio reward plugin written outside the package: it declares ``takes_videos = True`` (one call a video) and
scores each sample's audio, ``metadata[i]["audio"]`` [channels, samples] at ``metadata[i]["audio_sample_rate"]`` Hz,
which a model with audio (ltx2) hands the rewards. Used as ``reward_fn="tests/plugins/audio_reward.py:make_loudness"``.

``loudness``: the audio's root mean square (its level); its info: the audio's duration, samples and channels.
"""

import torch


def make_loudness(scale: float = 1.0):
    def loudness(videos, prompts, metadata):
        rewards, info = [], {"seconds": [], "samples": [], "channels": []}
        for row in metadata:
            audio, rate = row["audio"], row["audio_sample_rate"]
            rewards.append(scale * float(audio.double().square().mean().sqrt()))
            info["seconds"].append(audio.shape[-1] / rate)
            info["samples"].append(audio.shape[-1])
            info["channels"].append(audio.shape[0])
        return rewards, {key: torch.tensor(values, dtype=torch.float64) for key, values in info.items()}

    loudness.takes_videos = True
    return loudness


def make_loudness_in_group():
    """Groupwise: each video's audio level less its prompt group's mean level (one call a group); its info entry
    ``loudness`` is each video's own level (the reward's pointwise score)."""
    def loudness_in_group(videos, prompts, metadata):
        levels = torch.tensor([float(row["audio"].double().square().mean().sqrt()) for row in metadata],
                              dtype=torch.float64)
        return (levels - levels.mean()).tolist(), {"loudness": levels}

    loudness_in_group.takes_videos = True
    loudness_in_group.groupwise = True
    loudness_in_group.pointwise_score = "loudness"
    return loudness_in_group
