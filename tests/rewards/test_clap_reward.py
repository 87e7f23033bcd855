"""The CLAP text-audio reward (rewards/clap.py) on a tiny random ClapModel built from config (the tokenizer and the
feature extractor locally, no download): the cosine it returns is the model's, the audio's channels, rate and length
are handled as documented, a sample without audio is refused by name, and it combines with a video reward."""

import numpy as np
import pytest
import torch

from ddpo_group.rewards.base import get_reward_factory
from ddpo_group.rewards.clap import AUDIO_KEY, AUDIO_RATE_KEY, mono_at
from ddpo_group.rewards.combine import make_combined_reward

PROMPTS = ["a dog barks", "rain on a roof", "a violin"]


@pytest.fixture(scope="module")
def clap_dir(tmp_path_factory):
    from helpers.clap_helpers import save_tiny_clap

    return save_tiny_clap(tmp_path_factory.mktemp("clap") / "model")


def waves():
    t = torch.arange(12000) / 16000
    return [torch.stack([torch.sin(2 * torch.pi * 440 * t), torch.sin(2 * torch.pi * 440 * t)]),  # stereo, same
            0.3 * torch.randn(1, 9000, generator=torch.Generator().manual_seed(1)),
            torch.sin(2 * torch.pi * 220 * torch.arange(16000) / 16000)[None]]


def metadata_of(audio, rate=16000):
    return [{AUDIO_KEY: a, AUDIO_RATE_KEY: rate} for a in audio]


def test_the_reward_is_the_models_text_audio_cosine(clap_dir):
    """The reward, against the cosine of the model's own normalised features of the same processed inputs."""
    from transformers import ClapModel, ClapProcessor

    reward_fn = get_reward_factory("clap")(model_path=clap_dir)
    videos = torch.rand(3, 2, 3, 8, 8)  # the frames are not read
    rewards, info = reward_fn(videos, PROMPTS, metadata_of(waves()))
    model, processor = ClapModel.from_pretrained(clap_dir).eval(), ClapProcessor.from_pretrained(clap_dir)
    mono = [w.mean(dim=0).numpy() for w in waves()]
    inputs = processor(audio=mono, text=PROMPTS, sampling_rate=16000, return_tensors="pt", padding=True)
    with torch.no_grad():
        a = model.get_audio_features(input_features=inputs["input_features"], is_longer=inputs["is_longer"])
        t = model.get_text_features(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    a = getattr(a, "pooler_output", a)
    t = getattr(t, "pooler_output", t)
    want = torch.nn.functional.cosine_similarity(a, t, dim=-1).double()
    assert rewards.shape == (3,) and torch.allclose(rewards, want, atol=1e-6)
    assert torch.equal(info["cosine"], rewards) and float(rewards.std()) > 0  # the samples differ
    again, _ = reward_fn(videos, PROMPTS, metadata_of(waves()))
    assert torch.equal(again, rewards)  # deterministic (the extractor's random window never used)


def test_channels_rate_and_length_are_handled_as_documented(clap_dir):
    reward_fn = get_reward_factory("clap")(model_path=clap_dir)
    videos = torch.rand(1, 2, 3, 8, 8)
    tone = waves()[2]  # 1 s at 16 kHz, mono
    base, _ = reward_fn(videos, PROMPTS[:1], metadata_of([tone]))
    stereo, _ = reward_fn(videos, PROMPTS[:1], metadata_of([tone.expand(2, -1)]))
    longer, _ = reward_fn(videos, PROMPTS[:1], metadata_of([torch.cat([tone, torch.randn(1, 8000)], dim=1)]))
    assert torch.equal(stereo, base) and torch.equal(longer, base)  # the channels' mean; the first second kept
    resampled = mono_at(torch.sin(2 * torch.pi * 220 * torch.arange(32000) / 32000)[None], 32000, 16000, 16000)
    assert resampled.shape == (16000,) and float((resampled - tone[0]).abs().max()) < 0.05  # half a sample late
    at_32k, _ = reward_fn(videos, PROMPTS[:1], [{AUDIO_KEY: torch.sin(2 * torch.pi * 220 * torch.arange(32000) / 32000)[None],
                                                AUDIO_RATE_KEY: 32000}])
    assert abs(float(at_32k - base)) < 1e-2


def test_a_sample_without_audio_is_refused_by_name(clap_dir):
    reward_fn = get_reward_factory("clap")(model_path=clap_dir)
    with pytest.raises(ValueError, match=r"scores each sample's audio \(metadata\[i\]\['audio'\].*samples \[1\] have "
                                         r"none: this model makes no audio"):
        reward_fn(torch.rand(2, 2, 3, 8, 8), PROMPTS[:2], [metadata_of(waves()[:1])[0], {}])
    with pytest.raises(FileNotFoundError, match=r"clap reward: model_path='/no/such/clap' does not exist"):
        get_reward_factory("clap")(model_path="/no/such/clap")


def test_it_combines_with_a_video_reward(clap_dir):
    """{"clap": 1.0, stillness: 0.5}: the weighted sum of the components, each in the info."""
    spec = {"clap": 1.0, "tests/plugins/video_reward.py:make_stillness": 0.5}
    combined = make_combined_reward(spec, {"clap": {"model_path": clap_dir}})
    videos = torch.rand(3, 4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    rewards, info = combined(videos, PROMPTS, metadata_of(waves()))
    clap_alone, _ = get_reward_factory("clap")(model_path=clap_dir)(videos, PROMPTS, metadata_of(waves()))
    still = -(videos[:, 1:] - videos[:, :-1]).abs().double().mean(dim=(1, 2, 3, 4))
    assert torch.allclose(torch.as_tensor(rewards, dtype=torch.float64), clap_alone + 0.5 * still, atol=1e-9)
    assert np.allclose(np.asarray(info["clap"], dtype=np.float64), clap_alone.numpy())
