"""Audio a person can hear: waveforms as WAV files (evaluation during training, scripts/evaluate.py)."""

from __future__ import annotations

import wave as wav
from pathlib import Path

import torch


def write_wav(path: Path, wave: torch.Tensor, rate: int) -> None:
    """A waveform [channels, samples] in [-1, 1] as a 16-bit PCM WAV file (the standard library's ``wave``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pcm = (wave.float().clamp(-1, 1) * 32767).round().to(torch.int16).T.contiguous().numpy()  # [samples, channels]
    with wav.open(str(path), "wb") as f:
        f.setnchannels(pcm.shape[1])
        f.setsampwidth(2)
        f.setframerate(int(rate))
        f.writeframes(pcm.tobytes())
