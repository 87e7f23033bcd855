"""The Wan text-to-video family on a tiny random WanPipeline (5 frames of 16 x 16 px): the sampler against the
pipeline's own call, the unsupported two-expert Wan2.2, the config it reads, the text encoder's own device, the LoRA
export loaded by the pipeline, evaluate() on a video run, the Flow-Factory recipe."""

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanPipeline

from config.base import base as base_config
from ddpo_group.models.families.wan import WanFamily
from ddpo_group.sampling.trajectories import SamplingOptions, sample_trajectories
from helpers.family_checks import PROMPTS, assert_rescored, family_of, full_size_on_meta, generators
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_config, tiny_trainer
from helpers.batch_helpers import batch_of


@pytest.mark.parametrize("guidance, negative", [(5.0, ""), (5.0, "blurred, static"), (1.0, "")])
def test_noise_level_zero_reproduces_the_pipelines_own_call(guidance, negative, tiny_wan_dir):
    """The saved model has the released models' UniPC scheduler; the family replaces it by the flow Euler scheduler
    of the same shift (3), so the pipeline's own __call__ takes the Euler steps our sampler takes at noise level 0:
    same generators, the same frames bitwise, with guidance (the empty negative prompt or sample.negative_prompt)
    and without."""
    assert WanPipeline.load_config(tiny_wan_dir)["scheduler"][1] == "UniPCMultistepScheduler"
    family, config = family_of("wan", tiny_wan_dir, **{"sample.guidance_scale": guidance,
                                                        "sample.negative_prompt": negative})
    assert isinstance(family.pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    assert family.pipe.scheduler.config.shift == 3.0
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    assert kwargs == {"height": 16, "width": 16, "num_frames": 5, "max_sequence_length": 16,
                      **({"negative_prompt": negative} if negative else {})}
    assert torch.equal(family.negative_condition()["prompt_embeds"], family.encode([negative])["prompt_embeds"])
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(PROMPTS, num_inference_steps=4, guidance_scale=guidance, generator=generators(4),
                       output_type="pt", **kwargs).frames
    traj = sample_trajectories(family, family.model, family.encode(PROMPTS), family.negative_condition(),
                               SamplingOptions(4, guidance, [0.0] * 4, compute_log_prob=False), generator=generators(4))
    assert traj.images.shape == (4, 5, 3, 16, 16) and traj.latents.shape == (4, 5, 16, 2, 2, 2)
    assert torch.equal(traj.images, want)
    assert float(traj.images.std()) > 0.01  # not a constant video


def test_the_token_budget_is_the_pipelines_call_default(tiny_wan_dir):
    """pretrained.max_sequence_length=0: the 512 UMT5 tokens of WanPipeline.__call__ (its encode_prompt's own default
    is 226, which the pipeline's call overrides): the condition is as wide as the pipeline's and the sampler gives its
    frames bitwise without a token budget given to either."""
    family, config = family_of("wan", tiny_wan_dir, **{"pretrained.max_sequence_length": 0})
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    assert "max_sequence_length" not in kwargs and family.encode(PROMPTS)["prompt_embeds"].shape == (4, 512, 32)
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(list(PROMPTS), num_inference_steps=2, guidance_scale=5.0, generator=generators(4),
                       output_type="pt", **kwargs).frames
    traj = sample_trajectories(family, family.model, family.encode(PROMPTS), family.negative_condition(),
                               SamplingOptions(2, 5.0, [0.0] * 2, compute_log_prob=False), generator=generators(4))
    assert torch.equal(traj.images, want)


def test_the_scheduler_swap_keeps_the_shift():
    from ddpo_group.models.families.flow_matching import flow_euler_scheduler

    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    with pytest.warns(UserWarning, match=r"wan family samples .* FlowMatchEulerDiscreteScheduler\(shift=5\) in place "
                                         r"of this checkpoint's UniPCMultistepScheduler"):
        euler = flow_euler_scheduler(unipc, "wan")
    assert isinstance(euler, FlowMatchEulerDiscreteScheduler) and euler.config.shift == 5.0
    assert flow_euler_scheduler(euler, "wan") is euler
    euler.set_timesteps(4)
    def shift(s):
        return 5.0 * s / (1 + 4.0 * s)

    sigmas = torch.linspace(1.0, shift(1 / 1000), 4, dtype=torch.float64)  # diffusers': down to its shifted minimum
    shifted = shift(sigmas)
    torch.testing.assert_close(euler.sigmas[:-1].double(), shifted, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_wan22_dir(tmp_path_factory):
    """Wan2.2-T2V-A14B's layout, tiny: two experts switched at boundary_ratio 0.8 (t >= 800: transformer)."""
    from ddpo_group.models.tiny_random import build_tiny_wan_pipeline, save_pipeline

    return save_pipeline(build_tiny_wan_pipeline(boundary_ratio=0.8), tmp_path_factory.mktemp("wan22") / "model")


def test_two_experts_sample_as_the_pipeline_and_only_the_high_noise_steps_are_trained(tiny_wan22_dir):
    """The high-noise expert (transformer) is the trained model; the low-noise steps (t < 800) run on the frozen
    transformer_2 and are deterministic; at noise level 0 the pipeline's own frames bitwise."""
    family, config = family_of("wan", tiny_wan22_dir, **{"sample.sde_window_size": 0})
    assert family.model is family.pipe.transformer and family.boundary == 800.0
    timesteps = family.schedule(4, "cpu")["timesteps"]
    assert (timesteps >= 800).tolist() == [True, True, False, False]  # shift 3: 1000, 858, 602, 9 (rounded)
    assert family.stochastic_steps(config.sample).tolist() == [True, True, False, False]
    assert family.noise_levels(config.sample) == [0.7, 0.7, 0.0, 0.0]
    family.pipe.set_progress_bar_config(disable=True)
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    want = family.pipe(PROMPTS, num_inference_steps=4, guidance_scale=5.0, generator=generators(4), output_type="pt",
                       **kwargs).frames
    traj = sample_trajectories(family, family.model, family.encode(PROMPTS), family.negative_condition(),
                               SamplingOptions(4, 5.0, [0.0] * 4, compute_log_prob=False), generator=generators(4))
    assert torch.equal(traj.images, want)
    one = sample_trajectories(family, family.pipe.transformer_2, family.encode(PROMPTS), family.negative_condition(),
                              SamplingOptions(4, 5.0, [0.0] * 4, compute_log_prob=False), generator=generators(4))
    assert not torch.equal(one.images, want)  # the experts differ: the switch is what makes the frames equal
    # rows of both experts in one training forward: each row as its expert computes it alone
    latents = traj.latents[:, 1]
    mixed = {"timesteps": torch.tensor([857.0, 602.0, 857.0, 602.0])}
    cond = family.encode(PROMPTS)
    out = family.model_output(family.model, latents, mixed, cond, family.negative_condition(), 5.0)
    for row, t in enumerate(mixed["timesteps"].tolist()):
        alone = family.model_output(family.model, latents[row : row + 1], {"timesteps": torch.tensor(t)},
                                    {"prompt_embeds": cond["prompt_embeds"][row : row + 1]},
                                    family.negative_condition(), 5.0)
        torch.testing.assert_close(out[row : row + 1], alone, rtol=1e-4, atol=1e-5)  # other batch sizes round apart

    family, config = family_of("wan", tiny_wan22_dir, **{"sample.sde_window_start": 2, "sample.sde_window_size": 2})
    with pytest.raises(ValueError, match=r"no stochastic step is the trained \(high-noise\) expert's: of "
                                         r"sample.num_steps=4 steps, the first 2 have t >= 800"):
        family.check_trainable(config.sample)


def test_two_experts_recorded_log_probs_equal_a_re_score(tiny_wan22_dir):
    """The trained (high-noise) steps scored again under the sampling policy: the recorded log-probs, bitwise in the
    sampling batch; the low-noise steps record none (deterministic)."""
    family, config = family_of("wan", tiny_wan22_dir, **{"sample.sde_window_size": 0})
    cond = family.encode(PROMPTS)
    traj = sample_trajectories(family, family.model, cond, family.negative_condition(),
                               SamplingOptions(4, 5.0, family.noise_levels(config.sample)), generator=generators(4))
    assert bool((traj.log_probs[:, :2] != 0).all()) and bool((traj.log_probs[:, 2:] == 0).all())
    assert_rescored(family, config, traj, batch_of(traj, cond), steps=2)  # the trained steps, bitwise


def test_an_a14b_like_model_trains_its_high_noise_expert_and_its_lora_loads(tiny_wan22_dir, tmp_path):
    trainer = tiny_trainer("grpo", tiny_wan22_dir, tmp_path, "wan22", **FAMILY_OVERRIDES["wan"], device="cpu")
    low = {k: v.clone() for k, v in trainer.family.pipe.transformer_2.state_dict().items()}
    metrics = trainer.run()
    assert metrics["global_step"] == 2 and torch.isfinite(torch.tensor(metrics["train/policy_loss"]))
    assert all(torch.equal(v, trainer.family.pipe.transformer_2.state_dict()[k]) for k, v in low.items())
    base = WanPipeline.from_pretrained(tiny_wan22_dir)
    base.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    base.set_progress_bar_config(disable=True)
    call = dict(num_inference_steps=4, guidance_scale=5.0, height=16, width=16, num_frames=5, max_sequence_length=16,
                output_type="pt")
    base_frames = base(PROMPTS, generator=generators(4), **call).frames
    base.load_lora_weights(str(tmp_path / "wan22" / "lora"))  # into transformer, the high-noise expert
    loaded = base(PROMPTS, generator=generators(4), **call).frames
    family = trainer.family
    trained = sample_trajectories(family, family.model, family.encode(PROMPTS), family.negative_condition(),
                                  SamplingOptions(4, 5.0, [0.0] * 4, compute_log_prob=False), generator=generators(4)).images
    assert float((trained - base_frames).abs().max()) > 1e-4  # training moved the model, so the check can fail
    torch.testing.assert_close(loaded, trained, rtol=1e-4, atol=1e-5)


def test_a_pipeline_without_its_trained_transformer_is_refused(tiny_wan_dir):
    pipe = WanPipeline.from_pretrained(tiny_wan_dir)
    half = WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae, scheduler=pipe.scheduler,
                       transformer=pipe.transformer, transformer_2=pipe.transformer, boundary_ratio=None)
    with pytest.raises(ValueError, match=r"transformer_2=WanTransformer3DModel and boundary_ratio=None: two experts "
                                         r"need both .*supported: Wan2.1-T2V-1.3B"):
        WanFamily(half, base_config())
    alone = WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae, scheduler=pipe.scheduler,
                        transformer=None, transformer_2=pipe.transformer, boundary_ratio=0.9)
    with pytest.raises(ValueError, match=r"no transformer \(only transformer_2\)"):
        WanFamily(alone, base_config())


def test_config_errors_and_sizes(tiny_wan_dir):
    """The frames and the size against the model, refused when the family is built (the run's start), each naming
    its field: frames not 4 k + 1, a size not a multiple of 16 (the VAE's 8 times the patch's 2), and the pipeline's
    own 480 x 832 (sample.resolution=0), 52 patches a side, beyond the tiny transformer's RoPE table of 32."""
    from ddpo_group.errors import ConfigError

    config = tiny_config("grpo", tiny_wan_dir, "unused", **{**FAMILY_OVERRIDES["wan"], "sample.num_frames": 4})
    assert any("sample.num_frames=4 must be 4 k + 1" in e for e in WanFamily.config_errors(config))
    with pytest.raises(ConfigError, match=r"sample.num_frames=4 must be 1 more than a multiple of 4"):
        family_of("wan", tiny_wan_dir, **{"sample.num_frames": 4})
    with pytest.raises(ConfigError, match=r"sample.resolution=24 is not a multiple of 16 px"):
        family_of("wan", tiny_wan_dir, **{"sample.resolution": 24})
    with pytest.raises(ConfigError, match=r"sample.resolution=0 \(the pipeline's default, 480 x 832 px\) is 52 "
                                          r"patches of 16 px a side, beyond this model's position table "
                                          r"\(WanTransformer3DModel's rope_max_seq_len=32: 32 patches a side, 512 px\): "
                                          r"set sample.resolution to a multiple of 16 up to 512"):
        family_of("wan", tiny_wan_dir, **{"sample.resolution": 0})
    with pytest.raises(ConfigError, match=r"sample.num_frames=129 is 33 latent frames, beyond .* at most 125"):
        family_of("wan", tiny_wan_dir, **{"sample.num_frames": 129})
    family, config = family_of("wan", tiny_wan_dir, **{"sample.resolution": 32, "sample.num_frames": 9})
    assert WanFamily.config_errors(config) == [] and family.latent_shape() == (16, 3, 4, 4)
    family, _ = family_of("wan", tiny_wan_dir, **{"sample.resolution": 512, "sample.num_frames": 0})
    assert family.latent_shape() == (16, 21, 64, 64)  # the pipeline's 81 frames, the largest size the table takes
    assert family.pipeline_kwargs(family.config.sample, family.config.pretrained)["num_frames"] == 81


def test_the_text_encoder_runs_where_it_is(tiny_wan_dir):
    """pretrained.text_encoder_device: the prompts meet UMT5 on its device, the embeddings move to the transformer's
    (here the meta device)."""
    family, _ = family_of("wan", tiny_wan_dir)
    on_cpu = family.encode(PROMPTS)
    assert on_cpu["prompt_embeds"].shape == (4, 16, 32)
    tokens = len(family.pipe.tokenizer("x").input_ids)  # "x" and "</s>": zeros after the prompt's tokens
    assert float(on_cpu["prompt_embeds"][3, tokens:].abs().sum()) == 0
    assert bool((on_cpu["prompt_embeds"][3, :tokens].abs().sum(-1) > 0).all())
    torch.nn.Module.to(family.pipe.transformer, "meta")
    cond = family.encode(PROMPTS)
    assert family.pipe.text_encoder.device.type == "cpu" and cond["prompt_embeds"].device.type == "meta"


def test_exported_lora_loads_in_the_pipeline_and_evaluate_runs_on_the_video_run(tiny_wan_dir, tmp_path):
    # on the CPU: the pipeline's frames and ours are compared to float precision
    trainer = tiny_trainer("grpo", tiny_wan_dir, tmp_path, "lora", **FAMILY_OVERRIDES["wan"], device="cpu",
                           log_images_every=1, eval_freq=1)
    metrics = trainer.run()
    assert metrics["eval/num_images"] > 0 and metrics["eval/reward_std"] > 0  # the evaluation during training
    for grid in ("epoch_00000", "eval_before", "eval_epoch_00000"):  # frame strips of the samples and evaluations
        assert (tmp_path / "lora" / "samples" / f"{grid}.png").exists()
    lora = tmp_path / "lora" / "lora"
    assert (lora / "pytorch_lora_weights.safetensors").exists()
    base = WanPipeline.from_pretrained(tiny_wan_dir)
    base.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)  # the family's Euler scheduler
    base.set_progress_bar_config(disable=True)
    guidance = trainer.config.sample.guidance_scale
    call = dict(num_inference_steps=4, guidance_scale=guidance, height=16, width=16, num_frames=5,
                max_sequence_length=16, output_type="pt")
    base_frames = base(PROMPTS, generator=generators(4), **call).frames
    base.load_lora_weights(str(lora))
    loaded = base(PROMPTS, generator=generators(4), **call).frames
    family = trainer.family
    trained = sample_trajectories(family, family.model, family.encode(PROMPTS), family.negative_condition(),
                                  SamplingOptions(4, guidance, [0.0] * 4, compute_log_prob=False),
                                  generator=generators(4)).images
    assert float((trained - base_frames).abs().max()) > 1e-4  # training moved the model, so the check can fail
    torch.testing.assert_close(loaded, trained, rtol=1e-4, atol=1e-5)

    from PIL import Image

    from config.base import base as base_config
    from ddpo_group.offline.comparison import EvaluationRequest, evaluate

    report = evaluate(EvaluationRequest(str(tmp_path / "lora"), num_prompts=2, num_seeds=2, batch_size=4,
                                        show_progress=False), base_config())
    assert report["family"] == "wan" and report["loaded"].startswith("lora:") and report["num_steps"] == 4
    difference = report["rewards"]["reward"]["difference"]
    assert difference["n"] == 4 and difference["std"] > 0
    grid = Image.open(tmp_path / "lora" / "evaluation" / "grid.png")
    assert grid.width == 4 * 5 * 16 * 6  # 2 x 2 videos a row, each a strip of 5 frames of 16 px upscaled 6 times


@pytest.mark.slow
def test_the_flow_factory_wan_recipe_runs_on_the_tiny_model(tiny_wan_dir, tmp_path):
    """Flow-Factory's Wan2.1 LoRA recipe (its model replaced by the tiny one, its sizes by tiny ones)."""
    overrides = {**FAMILY_OVERRIDES["wan"], "sample.text_embedding_cache": 16, "sample.decode_batch_size": 3,
                 "sample.num_steps": 3, "train.pairs_per_forward": 4, "train.gradient_checkpointing": True,
                 "mixed_precision": "no", "sample.sde_window_size": 0}
    trainer = tiny_trainer("flow_factory_wan21", tiny_wan_dir, tmp_path, "recipe", **overrides)
    config = trainer.config
    assert (config.lora_rank, config.lora_alpha, config.train.group_size) == (64, 128, 4)  # group 16 in the recipe
    assert config.sample.noise_level == 0.9 and config.sample.guidance_scale == 5.0 and config.train.cfg
    assert trainer.family.name == "wan" and trainer.family.model.is_gradient_checkpointing
    metrics = trainer.run()
    assert metrics["global_step"] == 2 and torch.isfinite(torch.tensor(metrics["train/policy_loss"]))
    assert len(trainer.rollouts.sampler.text_cache.entries) > 0


def test_the_full_size_bench_shape_builds():
    """models/full_size.py's wan13b, built on the meta device (no memory, no weights): Wan2.1-T2V-1.3B's
    parameter counts, and the family reads its sizes."""
    from ddpo_group.models.full_size import build_wan13b

    pipe, millions = full_size_on_meta(build_wan13b)
    assert 1410 < millions["transformer"] < 1430 and 120 < millions["vae"] < 135  # 1.42B, 127M
    assert 5600 < millions["text_encoder"] < 5750  # UMT5-XXL's encoder
    assert WanFamily(pipe, base_config()).latent_shape() == (16, 21, 60, 104)  # 81 frames of 480 x 832


def test_per_token_timesteps_of_wan22_ti2v_reproduce_the_pipeline(tmp_path):
    """Wan2.2-TI2V-5B's pipeline has expand_timesteps: the transformer reads t per latent token (text-to-video: every
    token at t). The tiny model with that flag, 32 px: the pipeline's frames bitwise at noise level 0."""
    from ddpo_group.models.tiny_random import build_tiny_wan_pipeline, save_pipeline

    pipe = build_tiny_wan_pipeline()
    pipe.register_to_config(expand_timesteps=True)
    family, config = family_of("wan", save_pipeline(pipe, tmp_path / "ti2v"), **{"sample.resolution": 32})
    assert family.pipe.config.expand_timesteps
    latents = torch.zeros(2, *family.latent_shape())
    assert family.timestep(torch.tensor(500.0), latents).shape == (2, 2 * 2 * 2)  # F' (h / 2) (w / 2) tokens
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(PROMPTS, num_inference_steps=3, guidance_scale=5.0, generator=generators(4), output_type="pt",
                       **family.pipeline_kwargs(config.sample, config.pretrained)).frames
    traj = sample_trajectories(family, family.model, family.encode(PROMPTS), family.negative_condition(),
                               SamplingOptions(3, 5.0, [0.0] * 3, compute_log_prob=False), generator=generators(4))
    assert traj.images.shape == (4, 5, 3, 32, 32) and torch.equal(traj.images, want)


def test_a_matching_objective_is_refused_on_two_experts(tiny_wan22_dir, tmp_path):
    """AWM trains at any time of the forward process; Wan2.2-A14B's low-noise steps run its frozen expert."""
    from ddpo_group.errors import ConfigError

    with pytest.raises(ConfigError, match=r"algorithm.objective='awm' trains at any time of the forward process; this "
                                          r"'wan' model runs some steps with a frozen module"):
        tiny_trainer("grpo", tiny_wan22_dir, tmp_path, "awm", **FAMILY_OVERRIDES["wan"], **{
            "algorithm.objective": "awm", "sample.deterministic": True, "kl.beta": 0.0})
