"""What an evaluation's audio (a family with audio: LTX-2) shows besides its rewards, as image_stats.py for its frames:
how its sound moves from the audio before training (a hacked audio reward turns speech or music into noise or
silence).

    eval/audio/<statistic>         each statistic's mean over the samples (their channels averaged):
                                   level     the waveform's root mean square (0: silence)
                                   flatness  the spectral flatness of its power spectrum, the geometric over the
                                             arithmetic mean, in [0, 1]: 1 white noise, near 0 tones and voices
    eval/audio_spread/<statistic>  each statistic's standard deviation over the samples
    eval/drift/audio/<statistic>   eval/audio/<statistic> minus its value at the evaluation before training; the guard
                                   reads it in units of the spread before training, as the frames' drift
"""

from __future__ import annotations

import torch

AUDIO_STATISTICS = ("level", "flatness")


def per_sample_statistics(audio: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each statistic of AUDIO_STATISTICS of each waveform of ``audio`` [N, channels, samples], [N] each."""
    mono = audio.double().mean(dim=1)
    power = torch.fft.rfft(mono - mono.mean(dim=1, keepdim=True)).abs().square()[:, 1:] + 1e-20  # no DC term
    flatness = power.log().mean(dim=1).exp() / power.mean(dim=1)
    return {"level": mono.square().mean(dim=1).sqrt(), "flatness": flatness}


def audio_metrics(audio: torch.Tensor, start: dict[str, float] | None) -> tuple[dict[str, float], dict[str, float]]:
    """(eval/audio/*, eval/audio_spread/* and, given ``start`` (the statistics before training), eval/drift/audio/*
    of ``audio``; its statistics, the origin of a later drift)."""
    values = per_sample_statistics(audio)
    statistics = {name: float(v.mean()) for name, v in values.items()}
    out = {f"eval/audio/{name}": value for name, value in statistics.items()}
    out.update({f"eval/audio_spread/{name}": float(v.std()) if len(v) > 1 else 0.0 for name, v in values.items()})
    if start:
        out.update({f"eval/drift/audio/{name}": statistics[name] - start[name] for name in AUDIO_STATISTICS
                    if name in start})
    return out, statistics
