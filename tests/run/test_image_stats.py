"""The evaluation's diversity and drift statistics (run/reporting/image_stats.py) against hand computations and limits."""

import pytest
import torch

from ddpo_group.run.reporting.image_stats import diversity, drift, image_statistics, pixel_features


def test_statistics_by_hand():
    gray = torch.full((1, 3, 8, 8), 0.25)
    red = torch.zeros(1, 3, 8, 8)
    red[:, 0] = 1.0
    stats = image_statistics(torch.cat([gray, red]))
    assert stats["brightness"] == pytest.approx((0.25 + 0.299) / 2)  # Y of gray and of pure red
    assert stats["saturation"] == pytest.approx(0.5) and stats["contrast"] == pytest.approx(0.0, abs=1e-7)
    checker = ((torch.arange(8)[:, None] + torch.arange(8)[None, :]) % 2).float().expand(1, 3, 8, 8)
    ramp = torch.linspace(0, 1, 8)[None, :].expand(8, 8).expand(1, 3, 8, 8)
    assert image_statistics(checker)["high_frequency"] == pytest.approx(1.0)  # all energy at Nyquist
    assert image_statistics(ramp)["high_frequency"] < 0.2 < image_statistics(torch.rand(4, 3, 8, 8))["high_frequency"]
    assert image_statistics(checker)["contrast"] == pytest.approx(0.5)
    uint8 = (checker * 255).round().to(torch.uint8)
    assert image_statistics(uint8) == pytest.approx(image_statistics(checker))
    video = torch.stack([gray[0], red[0]])[None]  # [1, F, 3, H, W]: its frames' means
    assert image_statistics(video) == pytest.approx(stats)


def test_an_image_against_itself_drifts_by_nothing_and_equal_images_have_no_diversity():
    images = torch.rand(6, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    stats = image_statistics(images)
    assert set(drift(stats, stats).values()) == {0.0} and drift(stats, None) == {}
    moved = drift(image_statistics(images * 0.5), stats)
    assert moved["eval/drift/brightness"] == pytest.approx(-stats["brightness"] / 2)
    same = images[:2].repeat_interleave(3, dim=0)  # 2 prompts x 3 equal images
    assert diversity(pixel_features(same), 3, cosine=False) == 0.0
    assert diversity(pixel_features(same), 3, cosine=True) == pytest.approx(0.0, abs=1e-6)
    a, b = torch.zeros(1, 3, 32, 32), torch.ones(1, 3, 32, 32)
    assert diversity(pixel_features(torch.cat([a, b])), 2, cosine=False) == pytest.approx(1.0)  # RMS difference 1
    assert diversity(pixel_features(images), 1, cosine=False) == 0.0  # one image a prompt


def test_audio_statistics_of_noise_a_tone_and_silence():
    """level: a tone of amplitude a has RMS a / sqrt(2), silence 0; flatness: white noise near 1, a tone near 0; the
    drift is the statistics' move from the origin, none without one."""
    from ddpo_group.run.reporting.audio_stats import audio_metrics, per_sample_statistics

    t = torch.arange(16000) / 16000
    tone = 0.5 * torch.sin(2 * torch.pi * 440 * t)
    noise = torch.randn(16000, generator=torch.Generator().manual_seed(0))
    audio = torch.stack([tone.expand(2, -1), noise.expand(2, -1), torch.zeros(2, 16000)])  # [3, 2 channels, samples]
    values = per_sample_statistics(audio)
    assert values["level"].tolist() == pytest.approx([0.5 / 2 ** 0.5, 1.0, 0.0], abs=0.02)
    assert float(values["flatness"][0]) < 1e-3 and 0.4 < float(values["flatness"][1]) <= 1.0
    first, start = audio_metrics(audio[:2], None)
    assert not any(key.startswith("eval/drift/") for key in first)
    assert first["eval/audio/level"] == pytest.approx((0.5 / 2 ** 0.5 + 1.0) / 2, abs=0.02)
    later, _ = audio_metrics(audio[:2] * 0.5, start)
    assert later["eval/drift/audio/level"] == pytest.approx(-first["eval/audio/level"] / 2, rel=1e-6)
    assert later["eval/drift/audio/flatness"] == pytest.approx(0.0, abs=1e-9)  # a level change keeps the shape
