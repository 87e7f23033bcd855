"""Text-audio similarity under CLAP (LAION's contrastive language-audio pretraining, Wu et al. 2023), for a model that
makes audio with its video (LTX-2):

    reward_i = cos(e_audio(audio_i), e_text(prompt_i))            in [-1, 1]

with e_audio and e_text a transformers ``ClapModel``'s projected audio and text features. A sample's audio is
``metadata[i]["audio"]``, a float tensor [channels, samples] at ``metadata[i]["audio_sample_rate"]`` Hz (what an audio
family hands the rewards); it is mixed to mono, resampled to the feature extractor's rate by linear interpolation and
cut to the extractor's ``max_length_s`` seconds, its first ones (for longer audio the extractor would pick a random
window), then turned into features by the model's ``ClapProcessor``. The reward takes whole videos
(``takes_videos``): it reads their audio and not their frames, so it combines with a frame or video reward in one
``reward_fn`` ({name: weight}); ``info["cosine"]`` holds the cosine.

Default model: ``laion/larger_clap_general`` (Flow-Factory's LTX-2 audio-text reward; a hub id, or a local directory
that runs offline); the processor (tokenizer and feature extractor) defaults to the model's own directory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddpo_group.rewards import register_reward
from ddpo_group.rewards.loading import DeviceFollower, load_from_source, resolve_dtype

CLAP_MODEL = "laion/larger_clap_general"
AUDIO_KEY = "audio"  # metadata[i][AUDIO_KEY]: a sample's audio, a float tensor [channels, samples]
AUDIO_RATE_KEY = "audio_sample_rate"  # metadata[i][AUDIO_RATE_KEY]: its samples per second


def features(output) -> torch.Tensor:
    """A ClapModel's ``get_*_features`` result as unit vectors: transformers 5 returns an output whose
    ``pooler_output`` holds them, 4.x the projected tensor."""
    tensor = output.pooler_output if hasattr(output, "pooler_output") else output
    return F.normalize(tensor.float(), dim=-1)


def mono_at(audio: torch.Tensor, rate: float, target_rate: int, max_samples: int) -> torch.Tensor:
    """``audio`` [channels, samples] (or [samples]) at ``rate`` Hz -> [samples'] at ``target_rate``, mono, at most
    ``max_samples``: the channels' mean, linear interpolation, the first samples kept."""
    audio = torch.as_tensor(audio).float()
    mono = audio.mean(dim=0) if audio.ndim == 2 else audio.reshape(-1)
    if int(rate) != int(target_rate):
        length = max(1, round(mono.shape[0] * target_rate / float(rate)))
        mono = F.interpolate(mono[None, None], size=length, mode="linear", align_corners=False)[0, 0]
    return mono[:max_samples]


@register_reward("clap")
def clap(model_path: str = CLAP_MODEL, processor_path: str | None = None, dtype: str = "float32",
         device: str | None = None, batch_size: int = 8):
    """CLAP cosine of each sample's audio (``metadata["audio"]``) and prompt; the model loads once, here."""
    from transformers import ClapModel, ClapProcessor

    torch_dtype = resolve_dtype(dtype, "clap")
    model = load_from_source(ClapModel.from_pretrained, model_path, "model_path", "clap",
                             "a transformers ClapModel checkpoint").eval().requires_grad_(False).to(torch_dtype)
    processor = load_from_source(ClapProcessor.from_pretrained, processor_path or model_path, "processor_path", "clap",
                                 "a ClapProcessor (tokenizer and feature extractor)")
    extractor = processor.feature_extractor
    rate, max_samples = int(extractor.sampling_rate), int(extractor.nb_max_samples)
    follower = DeviceFollower(model, device)

    def fn(videos, prompts, metadata):
        missing = [i for i, row in enumerate(metadata) if row is None or AUDIO_KEY not in row]
        if missing:
            raise ValueError(f"the clap reward scores each sample's audio (metadata[i][{AUDIO_KEY!r}] with "
                             f"{AUDIO_RATE_KEY!r}); samples {missing[:8]} have none: this model makes no audio (the "
                             "ltx2 family does)")
        waves = [mono_at(row[AUDIO_KEY], row[AUDIO_RATE_KEY], rate, max_samples).numpy() for row in metadata]
        cosines = []
        with follower.lock:
            place = follower.place(videos)
            for start in range(0, len(waves), batch_size):
                rows = slice(start, start + batch_size)
                inputs = processor(audio=waves[rows], text=list(prompts[rows]), sampling_rate=rate,
                                   return_tensors="pt", padding=True)
                with torch.no_grad():
                    audio = features(model.get_audio_features(
                        input_features=inputs["input_features"].to(place, torch_dtype),
                        is_longer=inputs["is_longer"].to(place) if "is_longer" in inputs else None))
                    text = features(model.get_text_features(input_ids=inputs["input_ids"].to(place),
                                                            attention_mask=inputs["attention_mask"].to(place)))
                cosines.append((audio * text).sum(dim=-1).double().cpu())
        cosine = torch.cat(cosines)
        return cosine, {"cosine": cosine}

    fn.takes_videos = True  # one call a video: its audio, not its frames
    return fn
