"""The Kandinsky 6 family on a tiny random Kandinsky6TI2VAPipeline (a fused video / audio transformer whose two
latent widths differ, Qwen2.5-VL and CLIP, HunyuanVideo's VAE, MMAudio's VAE and vocoder): the sampler's frames and
audio against the pipeline's own call (CFG with its built-in negative prompt, a given one, none), the joined state,
the recorded log-probs scored again, the refusals (every preset and objective, the LoRA export in the pipeline,
evaluate.py with its audio, trees and two processes: test_family_matrix.py)."""

import wave
from functools import partial

import pytest
import torch
from diffusers import Kandinsky6TI2VAPipeline, PiflowScheduler

from ddpo_group.errors import ConfigError
from ddpo_group.models.families.kandinsky6 import Kandinsky6Family
from ddpo_group.sampling.trajectories import SamplingOptions, sample_trajectories
from helpers import family_checks
from helpers.family_checks import PROMPTS, assert_rescored, generators
from helpers.batch_helpers import batch_of
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_config, tiny_trainer

family_of = partial(family_checks.family_of, "kandinsky6")  # family_of(model_dir, preset="grpo", **overrides)


@pytest.fixture(scope="module")
def kandinsky6_dir(family_model_dirs):
    return family_model_dirs["kandinsky6"]


def sampled(family, guidance, steps=3, rows=4, levels=None, negative=None):
    return sample_trajectories(family, family.model, family.encode(PROMPTS[:rows]),
                               family.negative_condition() if negative is None else negative,
                               SamplingOptions(steps, guidance, levels or [0.0] * steps,
                                               compute_log_prob=levels is not None), generator=generators(rows))


@pytest.mark.parametrize("guidance, negative", [(5.0, ""), (5.0, "blurry"), (1.0, "")])
def test_noise_level_zero_reproduces_the_pipelines_frames_and_audio(guidance, negative, kandinsky6_dir):
    """Same generators, the Euler steps: the pipeline's frames and its audio exactly, with CFG (the call's built-in
    negative prompt, or sample.negative_prompt) and without."""
    family, config = family_of(kandinsky6_dir, **{"sample.guidance_scale": guidance, "train.cfg": guidance > 1,
                                                  "sample.negative_prompt": negative})
    assert isinstance(family, Kandinsky6Family) and family.config_errors(config) == []
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    assert kwargs == {"height": 64, "width": 64, "num_frames": 5, "max_sequence_length": 32}
    family.pipe.set_progress_bar_config(disable=True)
    output = family.pipe(PROMPTS, num_inference_steps=3, guidance_scale=guidance, generator=generators(4),
                         output_type="pt", **kwargs, **family.negative_prompt_kwargs([{}] * 4))
    traj = sampled(family, guidance)
    assert family.video_shape == (2, 2, 2, 4) and family.audio_shape == (27, 6)  # ceil(5 / 24 s * 16000 / 128)
    assert traj.latents.shape == (4, 4, 2 * 2 * 2 * 4 + 27 * 6, 1)
    assert torch.equal(traj.images, output.frames) and traj.images.shape == (4, 5, 3, 64, 64)
    audio = family.decode_audio(traj.latents[:, -1])
    assert audio.shape == (4, 1, output.audio.shape[-1]) and family.audio_sample_rate == 16000
    assert torch.equal(audio, family.pipeline_audio(output)) and float(audio.std()) > 0


def test_the_negative_condition_is_the_calls_built_in_negative_prompt(kandinsky6_dir):
    """With no negative prompt the call encodes its own "Static, 2D cartoon, ..."; the family's default is it."""
    family, _ = family_of(kandinsky6_dir)
    assert family.negative_prompt.startswith("Static, 2D cartoon")
    *_, negative, pooled, _ = family.pipe.encode_prompt(PROMPTS[:1], max_sequence_length=32,
                                                        dtype=family.pipe.transformer.dtype)
    assert torch.equal(family.negative_condition()["prompt_embeds"], negative)
    assert torch.equal(family.negative_condition()["pooled_prompt_embeds"], pooled)


def test_the_recorded_log_probs_come_back_on_the_joined_state(kandinsky6_dir):
    """Stochastic steps over the video's and the audio's elements at once: the recorded log-probs come back bitwise
    in the sampling batch and to 1e-5 in chunks of the training forward (rows whose masks differ)."""
    family, config = family_of(kandinsky6_dir)
    traj = sampled(family, 5.0, steps=3, levels=[0.7] * 3)
    assert (traj.log_probs != 0).all()
    assert_rescored(family, config, traj, batch_of(traj, family.encode(PROMPTS)), tolerance=1e-5)


def test_what_the_family_refuses_is_named(kandinsky6_dir):
    """Frames that are not 4 k + 1, a distilled checkpoint (PiflowScheduler) and a pipeline without its audio."""
    with pytest.raises(ConfigError, match=r"sample.num_frames=6 must be 1 more than a multiple of 4"):
        family_of(kandinsky6_dir, **{"sample.num_frames": 6})
    config = tiny_config("grpo", kandinsky6_dir, "unused", **FAMILY_OVERRIDES["kandinsky6"])
    pipe = Kandinsky6TI2VAPipeline.from_pretrained(kandinsky6_dir)
    scheduler = pipe.scheduler
    pipe.scheduler = PiflowScheduler()
    with pytest.raises(ValueError, match="samples with PiflowScheduler \\(a distilled model"):
        Kandinsky6Family(pipe, config)
    pipe.scheduler, pipe.vocoder = scheduler, None
    with pytest.raises(ValueError, match="has no audio_vae or vocoder"):
        Kandinsky6Family(pipe, config)


def test_the_audio_reaches_a_reward_written_outside_and_evaluate_writes_it(kandinsky6_dir, tmp_path):
    """A grpo epoch rewarded by tests/plugins/audio_reward.py (the audio's level): every reward call got the mono
    waveform [1, samples] at 16 kHz, the epoch trained; scripts/evaluate.py's comparison scores the pipeline's audio
    (its [B, samples] read as [B, 1, samples]) and writes each row's base and fine-tuned audio as WAV files."""
    from config.base import base as base_config
    from ddpo_group.offline.comparison import EvaluationRequest, evaluate

    reward = "tests/plugins/audio_reward.py:make_loudness"
    trainer = tiny_trainer("grpo", kandinsky6_dir, tmp_path, "audio", device="cpu", reward_fn=reward,
                           **FAMILY_OVERRIDES["kandinsky6"])
    metrics = trainer.run()
    assert metrics["global_step"] == 2 and torch.isfinite(torch.tensor(metrics["train/policy_loss"]))
    samples = 27 * 128  # 27 audio latent frames of 128 samples
    assert metrics["reward_info/samples"] == samples and metrics["reward_info/channels"] == 1
    assert metrics["reward_info/seconds"] == pytest.approx(samples / 16000) and metrics["reward_std"] > 0
    report = evaluate(EvaluationRequest(str(tmp_path / "audio"), num_prompts=2, num_seeds=1, batch_size=2,
                                        show_progress=False, device="cpu"), base_config())
    assert report["family"] == "kandinsky6" and report["rewards"]["reward"]["difference"]["n"] == 2
    audio_dir = tmp_path / "audio" / "evaluation" / "audio"
    assert sorted(path.name for path in audio_dir.iterdir()) == ["base_000.wav", "base_001.wav", "finetuned_000.wav",
                                                                 "finetuned_001.wav"]
    with wave.open(str(audio_dir / "base_000.wav")) as f:
        assert (f.getnchannels(), f.getframerate(), f.getnframes()) == (1, 16000, samples)


def test_a_missing_torchvision_names_the_extra(kandinsky6_dir, monkeypatch):
    """The released tokenizer is transformers' Qwen2_5_VLProcessor, whose video processor needs torchvision: the load's
    ImportError names the extra (the tiny model's plain tokenizer made to fail as the processor does)."""
    from transformers import Qwen2Tokenizer

    def without_torchvision(*args, **kwargs):
        raise ImportError("Qwen2VLVideoProcessor requires the Torchvision library")

    monkeypatch.setattr(Qwen2Tokenizer, "from_pretrained", classmethod(without_torchvision))
    with pytest.raises(ImportError, match=r"Kandinsky 6's tokenizer .* needs torchvision, which is not installed: "
                                          r'pip install -e "\.\[models\]"'):
        Kandinsky6Family.load_pipeline(kandinsky6_dir, True, None, {})


def test_the_full_size_bench_shape_builds():
    """models/full_size.py's kandinsky6, on the meta device: Kandinsky 6's transformer (the class defaults),
    Qwen2.5-VL-7B and a CLIP-L-sized text model; the family reads its sizes (121 frames of 512 x 768: 31 x 64 x 96
    video latents of 16 channels, 218 audio latent frames of 20)."""
    from config.base import base as base_config
    from ddpo_group.models.full_size import build_kandinsky6

    pipe, millions = family_checks.full_size_on_meta(build_kandinsky6)
    assert 45800 < millions["transformer"] < 50600, millions
    assert 7900 < millions["text_encoder"] < 8700, millions  # Qwen2.5-VL-7B with its vision tower and LM head
    assert 81 < millions["text_encoder_2"] < 90, millions
    family = Kandinsky6Family(pipe, base_config())
    assert family.frames == 121 and family.height_width == (512, 768)
    assert family.video_shape == (31, 64, 96, 16) and family.audio_shape == (218, 20)
