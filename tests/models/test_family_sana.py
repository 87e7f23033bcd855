"""The SANA family on a tiny random SanaPipeline (a 32x DC-AE, a Gemma-2 text encoder): the sampler against the
pipeline's own call (at its defaults, and with CFG, a negative prompt and none), the scheduler swap, the condition
(the complex human instruction on the prompts, not on the negative prompt), the resolution binning, the refused
SANA-Sprint, the full-size shape, the Cosmos-RL recipe (every preset and objective, the LoRA export in the pipeline,
evaluate.py, trees and two processes: test_family_matrix.py)."""

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, SanaPipeline

from config.base import base as base_config
from ddpo_group.models.families.sana import SanaFamily, call_default
from ddpo_group.sampling.trajectories import SamplingOptions, sample_trajectories
from helpers.family_checks import (PROMPTS, assert_the_float32_state_is_the_pipelines, bf16_family_of, family_of,
                                   full_size_on_meta, generators)
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_trainer


@pytest.fixture(scope="module")
def sana_dir(family_model_dirs):
    return family_model_dirs["sana"]


@pytest.mark.parametrize("guidance, negative", [(4.5, ""), (4.5, "blurry"), (1.0, "")])
def test_noise_level_zero_reproduces_the_pipelines_own_call(guidance, negative, sana_dir):
    """The saved model has the released DPM-Solver scheduler; the family swaps it for the flow Euler one of the same
    shift, so the pipeline's own __call__ takes our sampler's Euler steps at noise level 0: the same images bitwise,
    with CFG (the empty negative prompt or sample.negative_prompt) and without."""
    assert SanaPipeline.load_config(sana_dir)["scheduler"][1] == "DPMSolverMultistepScheduler"
    family, config = family_of("sana", sana_dir, **{"sample.guidance_scale": guidance, "train.cfg": guidance > 1,
                                                    "sample.negative_prompt": negative})
    assert isinstance(family, SanaFamily) and SanaFamily.config_errors(config) == []
    assert isinstance(family.pipe.scheduler, FlowMatchEulerDiscreteScheduler) and family.pipe.scheduler.config.shift == 3
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    assert kwargs == {"height": 64, "width": 64, "use_resolution_binning": False, "max_sequence_length": 16,
                      **({"negative_prompt": negative} if negative else {})}
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(PROMPTS, num_inference_steps=3, guidance_scale=guidance, generator=generators(4),
                       output_type="pt", **kwargs).images
    traj = sample_trajectories(family, family.model, family.encode(PROMPTS), family.negative_condition(),
                               SamplingOptions(3, guidance, [0.0] * 3, compute_log_prob=False), generator=generators(4))
    assert traj.images.shape == (4, 3, 64, 64) and traj.latents.shape == (4, 4, 4, 2, 2)
    assert torch.equal(traj.images, want)
    assert float(traj.images.std()) > 0.01


def test_the_sampler_is_the_call_at_its_own_defaults(sana_dir):
    """No size, token count or binning given to either: the pipeline bins its 1024 x 1024 by the transformer's
    sample_size 32 (1024 px) and encodes 300 tokens after its instruction; the family's resolution 0 and
    max_sequence_length 0 sample the same images bitwise. Asked for 512 px with its binning on, the pipeline samples
    1024 px and resizes: another image than 512 px sampled, which is why the family's keywords turn binning off."""
    family, config = family_of("sana", sana_dir, **{"sample.resolution": 0, "pretrained.max_sequence_length": 0})
    assert family.height_width == (1024, 1024) and family.latent_shape() == (4, 32, 32)
    assert family.encode(["a cat"])["prompt_embeds"].shape == (1, 300, 16)
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(PROMPTS[:2], num_inference_steps=2, generator=generators(2), output_type="pt").images
    traj = sample_trajectories(family, family.model, family.encode(PROMPTS[:2]), family.negative_condition(),
                               SamplingOptions(2, 4.5, [0.0] * 2, compute_log_prob=False), generator=generators(2))
    assert traj.images.shape == (2, 3, 1024, 1024) and torch.equal(traj.images, want)
    binned = family.pipe(PROMPTS[:2], num_inference_steps=2, generator=generators(2), output_type="pt", height=512,
                         width=512).images
    unbinned = family.pipe(PROMPTS[:2], num_inference_steps=2, generator=generators(2), output_type="pt", height=512,
                           width=512, use_resolution_binning=False).images
    assert binned.shape == unbinned.shape == (2, 3, 512, 512) and not torch.equal(binned, unbinned)


def test_the_condition_is_the_pipelines(sana_dir):
    """The prompts are encoded after the call's complex human instruction, the negative prompt without it, each as
    the pipeline's encode_prompt gives them (the mask marks the kept tokens)."""
    family, config = family_of("sana", sana_dir, **{"sample.negative_prompt": "blurry"})
    instruction = call_default(SanaPipeline, "complex_human_instruction")  # __call__'s (encode_prompt's own: none)
    want, want_mask, negative, negative_mask = family.pipe.encode_prompt(
        PROMPTS, do_classifier_free_guidance=True, negative_prompt="blurry", max_sequence_length=16,
        complex_human_instruction=instruction)
    cond = family.encode(PROMPTS)
    assert torch.equal(cond["prompt_embeds"], want) and torch.equal(cond["prompt_attention_mask"], want_mask)
    assert torch.equal(family.negative_condition()["prompt_embeds"], negative[:1])
    assert torch.equal(family.negative_condition()["prompt_attention_mask"], negative_mask[:1])
    plain = family.encode_negative(PROMPTS)["prompt_embeds"]  # the instruction changes the prompts' condition
    assert plain.shape == want.shape and not torch.equal(plain, want)


@pytest.mark.parametrize("guidance", [4.5, 1.0])
def test_in_bf16_the_state_stays_in_float32_as_the_pipelines(guidance, sana_dir):
    """Loaded in bfloat16, the pipeline keeps its latents in float32 (the transformer reads a bf16 copy, its output
    cast back to float32 for CFG and the step): our sampler at noise level 0 gives its images bitwise, with CFG and
    without; rounding the state to bf16 every step would not."""
    family, config = bf16_family_of("sana", sana_dir, **{"sample.guidance_scale": guidance,
                                                         "train.cfg": guidance > 1})
    kwargs = family.pipeline_kwargs(config.sample, config.pretrained)
    family.pipe.set_progress_bar_config(disable=True)
    want = family.pipe(PROMPTS, num_inference_steps=3, guidance_scale=guidance, generator=generators(4),
                       output_type="pt", **kwargs).images
    assert want.dtype == torch.bfloat16
    assert_the_float32_state_is_the_pipelines(family, lambda: sample_trajectories(
        family, family.model, family.encode(PROMPTS), family.negative_condition(),
        SamplingOptions(3, guidance, [0.0] * 3, compute_log_prob=False), generator=generators(4)), want)


def test_a_guidance_distilled_sana_is_refused(sana_dir):
    pipe = SanaPipeline.from_pretrained(sana_dir)
    pipe.transformer.register_to_config(guidance_embeds=True)
    with pytest.raises(ValueError, match=r"guidance_embeds=True \(a guidance-distilled model: SANA-Sprint's, sampled "
                                         "by SanaSprintPipeline"):
        SanaFamily(pipe, base_config())


def test_the_scheduler_swap_is_stated_and_assumes_no_shift():
    """The released DPM-Solver++ is swapped for the flow Euler scheduler of its own shift, with a warning that says so;
    a scheduler without a shift, or one that is no flow solver, is refused by name (no shift of 3 assumed)."""
    from ddpo_group.models.families.flow_matching import flow_euler_scheduler

    dpm = DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=4.0)
    with pytest.warns(UserWarning, match=r"sana family samples .* FlowMatchEulerDiscreteScheduler\(shift=4\) in place "
                                         r"of this checkpoint's DPMSolverMultistepScheduler \(flow_shift=4\)"):
        euler = flow_euler_scheduler(dpm, "sana")
    assert isinstance(euler, FlowMatchEulerDiscreteScheduler) and euler.config.shift == 4.0
    assert euler.config.num_train_timesteps == dpm.config.num_train_timesteps
    assert flow_euler_scheduler(euler, "sana") is euler
    unshifted = DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True)
    unshifted.register_to_config(flow_shift=None)
    with pytest.raises(ValueError, match=r"DPMSolverMultistepScheduler has flow_shift=None; .*assumes none"):
        flow_euler_scheduler(unshifted, "sana")
    with pytest.raises(ValueError, match=r"DPMSolverMultistepScheduler has use_flow_sigmas=False, "
                                         r"prediction_type='epsilon'"):
        flow_euler_scheduler(DPMSolverMultistepScheduler(), "sana")


def test_a_checkpoint_without_a_shift_is_refused_at_load(sana_dir, tmp_path):
    """The user's path: a saved SANA whose scheduler config has no flow_shift stops at load, naming it."""
    import json
    import shutil

    copy = tmp_path / "sana"
    shutil.copytree(sana_dir, copy)
    path = copy / "scheduler" / "scheduler_config.json"
    config = json.loads(path.read_text())
    config["flow_shift"] = None
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"flow_shift=None"):
        SanaFamily.load_pipeline(str(copy), True, None, {})


def test_the_full_size_bench_shape_builds():
    """models/full_size.py's sana, on the meta device: SANA 1.5 1.6B's parameter counts, and the family reads its
    sizes (the pipeline's 1024 px: 32 x 32 latents of 32 channels)."""
    from ddpo_group.models.full_size import build_sana

    pipe, millions = full_size_on_meta(build_sana)
    assert 1550 < millions["transformer"] < 1700, millions
    assert 2550 < millions["text_encoder"] < 2650, millions  # Gemma-2-2B's decoder
    assert 250 < millions["vae"] < 350, millions
    family = SanaFamily(pipe, base_config())
    assert family.height_width == (1024, 1024) and family.latent_shape() == (32, 32, 32)


@pytest.mark.slow
def test_the_cosmos_rl_recipe_runs_on_the_tiny_model(sana_dir, tmp_path):
    """Cosmos-RL's SANA DiffusionNFT recipe (its model replaced by the tiny one, its sizes by tiny ones)."""
    overrides = {**FAMILY_OVERRIDES["sana"], "sample.num_steps": 3, "train.pairs_per_forward": 4,
                 "train.gradient_checkpointing": True, "mixed_precision": "no"}
    trainer = tiny_trainer("cosmos_rl_sana_nft", sana_dir, tmp_path, "recipe", **overrides)
    config = trainer.config
    assert (config.lora_rank, config.lora_alpha, config.train.group_size) == (4, 4, 4)
    assert config.algorithm.objective == "nft" and config.sample.guidance_scale == 1.0 and not config.train.cfg
    assert trainer.family.name == "sana" and trainer.family.model.is_gradient_checkpointing
    metrics = trainer.run()
    assert metrics["global_step"] >= 1 and torch.isfinite(torch.tensor(metrics["train/policy_loss"]))
