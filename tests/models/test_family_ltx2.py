"""The LTX-2 family on a tiny random LTX2Pipeline (a Gemma-3 text encoder, its connectors, video and audio VAEs, a
vocoder): the sampler against the pipeline's own call, frames and audio (CFG and none); the video and audio latents
one state of the trajectory (one Gaussian step, one log-probability); the decoded audio reaching a reward (an audio
reward plugin, the built-in CLAP reward beside a frame reward) and the files evaluate.py writes; what it refuses; the
full-size shape; the Flow-Factory recipe (every preset and objective, the LoRA in the pipeline, trees and two
processes: test_family_matrix.py)."""

import wave

import pytest
import torch
from diffusers import LTX2Pipeline

from config.base import base as base_config
from ddpo_group.errors import ConfigError
from ddpo_group.models.families.ltx2 import LTX2Family
from ddpo_group.sampling.gaussian import gaussian_log_prob
from ddpo_group.sampling.trajectories import SamplingOptions, sample_trajectories
from helpers.batch_helpers import batch_of
from helpers.family_checks import (PROMPTS, assert_rescored, assert_the_float32_state_is_the_pipelines, bf16_family_of,
                                   family_of, full_size_on_meta, generators)
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_trainer


@pytest.fixture(scope="module")
def ltx2_dir(family_model_dirs):
    return family_model_dirs["ltx2"]


OFF = {"audio_guidance_scale": 1.0, "stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0,
       "audio_modality_scale": 1.0, "guidance_rescale": 0.0, "audio_guidance_rescale": 0.0}  # Flow-Factory's recipe's


@pytest.mark.parametrize("guidance, negative, passes", [
    # the call's defaults: CFG 3, the audio's 7, STG 1, modality 3, rescale 0.7, STG's block the tiny model's last (the
    # call's 28 is past its 2 blocks: no pass would skip anything there)
    (3.0, "", {"spatio_temporal_guidance_blocks": [1]}),
    (2.0, "static", {"spatio_temporal_guidance_blocks": [0], "audio_guidance_scale": 0.0, "modality_scale": 2.0,
                     "audio_stg_scale": 0.5, "guidance_rescale": 0.3}),  # STG at a block the tiny model has
    (1.0, "", OFF),  # no pass at all (Flow-Factory's)
])
def test_noise_level_zero_reproduces_the_pipelines_frames_and_audio(guidance, negative, passes, ltx2_dir):
    """The pipeline's own call and our sampler at noise level 0: the same frames and the same audio, bitwise, at the
    call's defaults (every guidance pass: CFG with the audio at its own scale, spatio-temporal guidance, modality
    isolation, the rescale; the call given no guidance keyword), with the passes set otherwise, and without any."""
    family, config = family_of("ltx2", ltx2_dir, **{"sample.guidance_scale": guidance, "train.cfg": guidance > 1
                                                    or not passes, "sample.negative_prompt": negative,
                                                    "sample.pipeline_guidance": passes})
    assert isinstance(family, LTX2Family) and LTX2Family.config_errors(config) == []
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    size = {"height": 64, "width": 64, "num_frames": 17, "max_sequence_length": 16}
    assert kwargs == {**size, **LTX2Family.guidance_values(config.sample)}
    # at the defaults: the call given no guidance keyword but STG's block
    call = {**size, **passes} if set(passes) == {"spatio_temporal_guidance_blocks"} else kwargs
    rows = family.pipeline_row_kwargs([{}] * 4)
    family.pipe.set_progress_bar_config(disable=True)
    out = family.pipe(PROMPTS, num_inference_steps=3, generator=generators(4), output_type="pt",
                      **family.guidance_kwargs(guidance), **call, **rows)
    traj = sample_trajectories(family, family.model, family.encode(PROMPTS), family.negative_condition(),
                               SamplingOptions(3, guidance, [0.0] * 3, compute_log_prob=False), generator=generators(4))
    (lv, cv), (la, ca) = family.parts()
    assert traj.latents.shape == (4, 4, lv + la, cv) and (lv, la, cv, ca) == (12, 18, 4, 4)  # 3 x 2 x 2 video, 18 audio
    assert traj.images.shape == (4, 17, 3, 64, 64) and torch.equal(traj.images, out.frames)
    assert traj.audio.shape == out.audio.shape and torch.equal(traj.audio, out.audio)
    assert traj.audio_sample_rate == 16000 and float(traj.audio.std()) > 0
    if passes != OFF:  # the passes change the samples: without them, other frames and other audio; STG alone too
        for off in ({**OFF, "audio_guidance_scale": 0.0}, {"stg_scale": 0.0, "audio_stg_scale": 0.0}):
            plain = family.pipe(PROMPTS, num_inference_steps=3, generator=generators(4), output_type="pt",
                                **family.guidance_kwargs(guidance), **{**kwargs, **off}, **rows)
            assert float((plain.frames - out.frames).abs().max()) > 1e-3, off
            assert float((plain.audio - out.audio).abs().max()) > 1e-4, off


@pytest.mark.parametrize("guidance, passes", [(3.0, {"spatio_temporal_guidance_blocks": [1]}), (1.0, OFF)])
def test_in_bf16_the_state_stays_in_float32_as_the_pipelines(guidance, passes, ltx2_dir):
    """Loaded in bfloat16, LTX2Pipeline keeps the video's and the audio's latents in float32 (the transformer reads
    copies in the prompt embeddings' dtype, its outputs cast to float32 for every guidance pass and the step): our
    sampler at noise level 0 gives its frames and its audio bitwise, at the call's defaults and with every pass off;
    rounding the state to bf16 every step would not."""
    family, config = bf16_family_of("ltx2", ltx2_dir, **{"sample.guidance_scale": guidance, "train.cfg": True,
                                                         "sample.pipeline_guidance": passes})
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    family.pipe.set_progress_bar_config(disable=True)
    out = family.pipe(PROMPTS, num_inference_steps=3, generator=generators(4), output_type="pt",
                      **family.guidance_kwargs(guidance), **kwargs, **family.pipeline_row_kwargs([{}] * 4))
    traj = assert_the_float32_state_is_the_pipelines(family, lambda: sample_trajectories(
        family, family.model, family.encode(PROMPTS), family.negative_condition(),
        SamplingOptions(3, guidance, [0.0] * 3, compute_log_prob=False), generator=generators(4)), out.frames)
    assert torch.equal(traj.audio, out.audio.float())


def test_the_guidance_keywords_are_checked(ltx2_dir):
    """Keywords the call does not take are refused with the ones it does; STG without blocks is refused; the training
    forward must guide when the audio's scale alone guides; another family takes none."""
    from ddpo_group.run.config_checks import family_errors

    config = base_config()
    config.pretrained.model = ltx2_dir
    config.sample.pipeline_guidance = {"stg_sclae": 1.0}
    (error,) = family_errors(config)
    assert "sample.pipeline_guidance sets ['stg_sclae']" in error and "'spatio_temporal_guidance_blocks'" in error
    config.sample.pipeline_guidance = {"spatio_temporal_guidance_blocks": []}
    assert any("spatio_temporal_guidance_blocks is empty" in e for e in family_errors(config))
    config.sample.pipeline_guidance = {}
    config.sample.guidance_scale, config.train.cfg = 1.0, False  # the audio's CFG at the call's 7 still guides
    assert any("train.cfg=False contradicts sample.guidance_scale=1.0 with the audio's scale 7.0" in e
               for e in family_errors(config))
    config.sample.pipeline_guidance = {"audio_guidance_scale": 1.0}
    assert family_errors(config) == []
    other = base_config()
    other.sample.pipeline_guidance = {"stg_scale": 0.0}
    assert family_errors(other) == ["sample.pipeline_guidance sets ['stg_scale']: the sd family's call takes none of "
                                    "its own"]


def test_the_video_and_the_audio_are_one_state_of_the_policy(ltx2_dir):
    """A stochastic step draws the joint state's noise in one Gaussian: its log-probability is the density of the
    video's and the audio's next latents together (the mean over both), which the training forward gives again; a
    next state that differs in its audio only has another log-probability."""
    family, config = family_of("ltx2", ltx2_dir, **{"sample.sde_window_size": 0})
    cond = family.encode(PROMPTS)
    traj = sample_trajectories(family, family.model, cond, family.negative_condition(),
                               SamplingOptions(4, 5.0, family.noise_levels(config.sample), record_means=True),
                               generator=generators(4))
    x, x_next = traj.latents[:, 0], traj.latents[:, 1]
    times = {key: values[:, 0] for key, values in traj.times.items()}
    out = family.step(family.model_output(family.model, x, times, cond, family.negative_condition(), 5.0), x, times,
                      family.noise_level(config.sample), next_latents=x_next)
    assert torch.equal(out.mean, traj.means[:, 0])
    assert torch.allclose(traj.log_probs[:, 0], gaussian_log_prob(x_next, out.mean, out.std, "mean"), atol=0)
    (lv, _), _ = family.parts()
    moved = x_next.clone()
    moved[:, lv:] += 0.5 * out.std[:, None, None]  # the audio tokens only
    audio_moved = family.step(family.model_output(family.model, x, times, cond, family.negative_condition(), 5.0), x,
                              times, family.noise_level(config.sample), next_latents=moved).log_prob
    assert bool((audio_moved < traj.log_probs[:, 0]).all())
    assert_rescored(family, config, traj, batch_of(traj, cond))  # every step, bitwise in the sampling batch


def test_the_training_forward_guides_the_audio_with_the_rows_own_negative_prompts(ltx2_dir):
    """The video unguided (scale 1) and the audio at the call's 7: sampling guides with each row's own negative prompt
    (metadata), and the training forward scores the recorded transitions with the same ones, bitwise, though its
    video scale is 1; scored with the run's one negative prompt instead, the log-probabilities differ."""
    family, config = family_of("ltx2", ltx2_dir, **{"sample.guidance_scale": 1.0, "train.cfg": True,
                                                    "sample.sde_window_size": 0})
    assert LTX2Family.config_errors(config) == [] and family.guidance["audio_guidance_scale"] == 7.0
    cond = family.encode(PROMPTS)
    negative = family.negative_rows([{"negative_prompt": text} for text in ("loud", "static", "", "noise")])
    traj = sample_trajectories(family, family.model, cond, negative,
                               SamplingOptions(4, 1.0, family.noise_levels(config.sample)), generator=generators(4))
    scorer = assert_rescored(family, config, traj, batch_of(traj, cond, negative=negative))
    assert scorer.guidance_scale == 1.0
    one = scorer(family.model, batch_of(traj, cond), torch.arange(4), torch.zeros(4, dtype=torch.long)).log_prob
    assert not torch.equal(one, traj.log_probs[:, 0])


def test_the_decoded_audio_reaches_a_reward_written_outside_the_package(ltx2_dir, tmp_path):
    """A grpo epoch rewarded by tests/plugins/audio_reward.py (the audio's level): every sample's reward call got its
    waveform [channels, samples] and sample rate, and the epoch trained."""
    trainer = tiny_trainer("grpo", ltx2_dir, tmp_path, "audio", device="cpu", **FAMILY_OVERRIDES["ltx2"],
                           reward_fn="tests/plugins/audio_reward.py:make_loudness")
    metrics = trainer.run()
    assert metrics["global_step"] == 2 and torch.isfinite(torch.tensor(metrics["train/policy_loss"]))
    # every sample's waveform: 276 samples of 2 channels at 16 kHz (17 frames at 24 fps)
    assert metrics["reward_info/samples"] == 276 and metrics["reward_info/channels"] == 2
    assert metrics["reward_info/seconds"] == pytest.approx(276 / 16000)
    assert metrics["reward_std"] > 0  # the level differs between samples: it is their audio's


def test_the_audio_reaches_a_groupwise_reward_and_the_tweedie_values(ltx2_dir, tmp_path):
    """Every path a reward is called on hears the audio (the plugin reads metadata["audio"] and fails without it): a
    groupwise reward in rollouts and in the evaluation during training; GROUP_PPO's Tweedie values, whose predicted
    clean latents' audio is decoded as the samples' own."""
    trainer = tiny_trainer("grpo", ltx2_dir, tmp_path, "groupwise", device="cpu", **FAMILY_OVERRIDES["ltx2"],
                           reward_fn="tests/plugins/audio_reward.py:make_loudness_in_group", eval_freq=1,
                           eval_num_prompts=2, eval_num_seeds=2)
    metrics = trainer.run()
    assert metrics["global_step"] == 2 and metrics["reward_info/loudness"] > 0
    assert abs(metrics["reward_mean"]) < 1e-12  # centred in each group
    assert metrics["eval/reward_info/loudness"] > 0
    assert metrics["eval/audio/level"] > 0 and 0 < metrics["eval/audio/flatness"] <= 1  # the audio's statistics
    assert "eval/drift/audio/level" in metrics and "eval/drift/brightness" in metrics
    # a person hears each evaluation: the grid's rows' audio beside its picture, as WAV files
    samples = tmp_path / "groupwise" / "samples"
    for stem in ("eval_before", "eval_epoch_00000"):
        assert (samples / f"{stem}.png").is_file()
        assert sorted(path.name for path in (samples / stem).iterdir()) == [f"row_{r:02d}.wav" for r in range(4)]
    with wave.open(str(samples / "eval_before" / "row_03.wav")) as f:
        assert (f.getnchannels(), f.getframerate(), f.getnframes()) == (2, 16000, 276)
    trainer = tiny_trainer("group_ppo", ltx2_dir, tmp_path, "tweedie", device="cpu", **FAMILY_OVERRIDES["ltx2"],
                           reward_fn="tests/plugins/audio_reward.py:make_loudness", **{"group_ppo.value_source":
                                                                                        "tweedie"})
    batch = trainer.rollouts.estimate(trainer.rollouts.collect(0)).batch
    values = batch.tweedie_values[:, 1]  # step 1's prediction of the clean sample, its audio's level
    assert bool(torch.isfinite(values).all()) and bool((values > 0).all())
    assert not torch.equal(values, batch.rewards.double())  # the prediction's audio, not the sample's


def test_clap_beside_a_frame_reward_trains_and_evaluate_writes_the_audio(ltx2_dir, tmp_path):
    """reward_fn {"clap": 1, "jpeg_compressibility": 1} on the tiny LTX-2 with a tiny CLAP model: an epoch trains with
    both components logged; scripts/evaluate.py's comparison scores the pipeline's audio and writes each row's base and
    fine-tuned audio as WAV files beside its grid of frames."""
    from helpers.clap_helpers import save_tiny_clap
    from ddpo_group.offline.comparison import EvaluationRequest, evaluate

    clap_dir = save_tiny_clap(tmp_path / "clap_model")
    trainer = tiny_trainer("grpo", ltx2_dir, tmp_path, "clap", device="cpu", **FAMILY_OVERRIDES["ltx2"],
                           reward_fn={"clap": 1.0, "jpeg_compressibility": 1.0},
                           reward_fn_kwargs={"clap": {"model_path": clap_dir}})
    metrics = trainer.run()
    assert metrics["global_step"] == 2
    assert -1 <= metrics["reward_info/clap"] <= 1 and "reward_info/jpeg_compressibility" in metrics
    report = evaluate(EvaluationRequest(str(tmp_path / "clap"), num_prompts=2, num_seeds=1, batch_size=2,
                                        show_progress=False, device="cpu"), base_config())
    assert report["family"] == "ltx2" and report["rewards"]["clap"]["difference"]["n"] == 2
    audio_dir = tmp_path / "clap" / "evaluation" / "audio"
    files = sorted(path.name for path in audio_dir.iterdir())
    assert files == ["base_000.wav", "base_001.wav", "finetuned_000.wav", "finetuned_001.wav"]
    with wave.open(str(audio_dir / "base_000.wav")) as f:
        assert (f.getnchannels(), f.getframerate(), f.getnframes()) == (2, 16000, 276)


def test_the_text_encoder_runs_where_it_is(ltx2_dir):
    """pretrained.text_encoder_device: the prompts meet Gemma-3 on its device, its hidden states the connectors on the
    denoiser's (here the meta device), where the condition is."""
    family, _ = family_of("ltx2", ltx2_dir)
    for module in (family.pipe.transformer, family.pipe.connectors):
        torch.nn.Module.to(module, "meta")
    cond = family.encode(PROMPTS[:2])
    assert family.pipe.text_encoder.device.type == "cpu"
    assert {value.device.type for value in cond.values()} == {"meta"} and cond["prompt_embeds"].shape[:2] == (2, 16)


def test_what_the_family_refuses(ltx2_dir):
    config = base_config()
    config.sample.num_frames = 20
    assert any("sample.num_frames=20 must be 8 k + 1" in e for e in LTX2Family.config_errors(config))
    pipe = LTX2Pipeline.from_pretrained(ltx2_dir)
    pipe.duration_head = torch.nn.Identity()  # a checkpoint that predicts its videos' length (LTX-2.5)
    with pytest.raises(ConfigError, match=r"has a duration head, .* set sample.num_frames"):
        LTX2Family(pipe, base_config())


def test_the_full_size_bench_shape_builds():
    """models/full_size.py's ltx2, on the meta device: LTX-2's transformer (the class defaults) and a Gemma-3-12B-sized
    text encoder; the family reads its sizes (121 frames of 512 x 768: 16 x 16 x 24 video tokens, 126 audio)."""
    from ddpo_group.models.full_size import build_ltx2

    pipe, millions = full_size_on_meta(build_ltx2)
    assert 18000 < millions["transformer"] < 20000, millions
    assert 11000 < millions["text_encoder"] < 13000, millions
    family = LTX2Family(pipe, base_config())
    (lv, cv), (la, ca) = family.parts()
    assert (lv, cv, la) == (16 * 16 * 24, 128, 126)


@pytest.mark.slow
def test_the_flow_factory_recipe_runs_on_the_tiny_model(ltx2_dir, tmp_path):
    """Flow-Factory's LTX-2 text-to-audio-video recipe (its model replaced by the tiny one, its sizes by tiny ones,
    its rewards by the jpeg one)."""
    overrides = {**FAMILY_OVERRIDES["ltx2"], "sample.num_steps": 3, "sample.sde_window_size": 2,
                 "sample.num_batches_per_epoch": 2, "train.gradient_accumulation_steps": 2, "mixed_precision": "no",
                 "sample.batch_size": 2, "train.batch_size": 2, "reward_fn": "jpeg_compressibility",
                 "reward_fn_kwargs": {}, "algorithm.multi_reward_mix": "reward_aggr"}
    trainer = tiny_trainer("flow_factory_ltx2", ltx2_dir, tmp_path, "recipe", **overrides)
    config = trainer.config
    assert (config.lora_rank, config.lora_alpha, config.sample.sde_type) == (64, 128, "cps")
    assert trainer.family.name == "ltx2" and trainer.family.model.is_gradient_checkpointing
    metrics = trainer.run()
    assert metrics["global_step"] >= 1 and torch.isfinite(torch.tensor(metrics["train/policy_loss"]))
