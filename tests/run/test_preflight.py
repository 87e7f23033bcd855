"""The pre-flight check (scripts/check.py, offline/preflight.py): consistent on every family's tiny model and both embedded
models, a matching objective's steps included; on a mismatch built for the test it fails and names the cause."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

import ddpo_group.sampling.trajectories as trajectories
from ddpo_group.models.families import get_family
from ddpo_group.models.tiny_random import TINY_BUILDERS
from ddpo_group.offline.preflight import NAMED_SHARE, run_check
from ddpo_group.update.on_policy import CLIPPED_SHARE
from ddpo_group.sampling.trajectories import TransitionScorer
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_config

SMALL = {"sample.num_steps": 3, "sample.sde_window_size": 2, "device": "cpu"}


def check(preset, model, tmp_path, **overrides):
    said = []
    result = run_check(tiny_config(preset, model, tmp_path, **{**SMALL, **overrides}), say=said.append)
    return result, "\n".join(said)


def edits(folder: Path) -> dict:
    """A two-row .jsonl editing dataset: each prompt with a 32 x 32 px source image."""
    rows = []
    for i, color in enumerate(("red", "blue")):
        path = folder / f"source_{i}.png"
        Image.new("RGB", (32, 32), color).save(path)
        rows.append({"prompt": f"make it {color}", "image": str(path)})
    (folder / "edits.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return {"prompt_fn": "from_file", "prompt_fn_kwargs": {"path": str(folder / "edits.jsonl")}}


@pytest.mark.parametrize("name", sorted(TINY_BUILDERS))
def test_every_familys_tiny_model_is_consistent(name, family_model_dirs, tmp_path, monkeypatch):
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus

    # the Qwen-Image-Edit pipelines encode their source images at 1 MP: 32^2 px here (as tests/models do)
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "CONDITION_IMAGE_SIZE", 64 * 64)
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", 32 * 32)
    original = pipeline_qwenimage_edit.calculate_dimensions
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions",
                        lambda area, ratio: original(area * 32 * 32 // (1024 * 1024), ratio))
    editing = edits(tmp_path) if get_family(name).capabilities.image_conditioning else {}  # source images from a .jsonl file
    result, report = check("grpo", family_model_dirs[name], tmp_path, **FAMILY_OVERRIDES.get(name, {}), **editing)
    assert result.consistent and result.worst < 1e-5, report
    assert "verdict: consistent" in report and "an epoch, on one process: about" in report


@pytest.mark.parametrize("preset, model, overrides", [
    ("grpo", "tiny-shapes", {}),
    ("grpo", "tiny-shapes", {"mixed_precision": "bf16"}),
    ("grpo_flow", "tiny-shapes-flow", {"mixed_precision": "bf16", "prompt_fn": "tiny_shapes_flow_hard"}),
    ("nft", "tiny-shapes-flow", {"prompt_fn": "tiny_shapes_flow_hard"}),
])
def test_the_embedded_models_are_consistent(preset, model, overrides, tmp_path):
    result, report = check(preset, model, tmp_path, **overrides)
    assert result.consistent, report
    if preset == "nft":  # no log-probabilities: each recorded deterministic step taken again
        assert "deterministic step" in result.checks and len(result.per_step) == 3


def test_a_training_forward_with_another_guidance_scale_fails_and_guidance_is_named(tiny_model_dir, tmp_path,
                                                                                      monkeypatch):
    """A mismatch far above every bound (|ratio - 1| ~ 1e-2 against the tolerance 1e-4) that one change removes
    entirely: guidance is named, and nothing else removes most of it."""
    made = TransitionScorer.from_config

    def other_guidance(config, family):
        scorer = made(config, family)
        scorer.guidance_scale += 2.0
        return scorer

    monkeypatch.setattr(TransitionScorer, "from_config", staticmethod(other_guidance))
    result, report = check("grpo", tiny_model_dir, tmp_path)
    assert not result.consistent and result.worst > 1e-3
    assert result.named() == [cause for cause in result.causes if cause.startswith("guidance")], report
    worst, clipped = result.causes[result.named()[0]]
    assert worst < 1e-5 and clipped == 0.0
    assert "likely cause: guidance" in report and "verdict: NOT consistent" in report
    assert "train.clip_range >" in report  # the clip range that would leave at most 1% of the pairs clipped


def test_bf16_latents_recorded_unrounded_fail_and_precision_is_named(tmp_path, monkeypatch):
    """The rollouts as they were recorded before: the float32 x_{n+1} while the sampler went on from its bf16
    rounding (the check's own finding on the embedded models). One sample a sampling batch and one pair a training
    forward: the training forward runs the sampler's layout, so bf16's arithmetic adds nothing (with other layouts it
    left 5.7e-3 of a 1e-2 mismatch on one CPU and less on another, which decided whether a cause was named); the
    mismatch is the rounding alone (~3e-3, within bf16's tolerance 5e-3 but 30 times the default clip range 1e-4, so
    the clip would act on it), and rounding the recorded latents removes all of it."""
    step = trajectories.stochastic_step

    def unrounded(family, output, latents, step_tensors, options, n, generator, dtype):
        out, next_latents = step(family, output, latents, step_tensors, options, n, generator, latents.new_zeros(0).float().dtype)
        return out, next_latents.to(dtype)

    monkeypatch.setattr(trajectories, "stochastic_step", unrounded)
    result, report = check("grpo", "tiny-shapes", tmp_path, mixed_precision="bf16",
                           **{"sample.num_steps": 4, "sample.sde_window_size": 0, "sample.batch_size": 1,
                              "train.pairs_per_forward": 1, "train.group_size": 2, "train.batch_size": 2,
                              "train.clip_range": 1e-4})
    assert not result.consistent and result.worst > 10 * 1e-4 and result.clipped > 10 * CLIPPED_SHARE, report
    assert result.named() and result.named()[0].startswith("precision"), report
    assert result.causes[result.named()[0]][0] < (1 - NAMED_SHARE) * result.worst / 10, report  # far from the line


def tiny_model_with_dropout(folder: Path, p: float = 0.3) -> str:
    """The tiny SD pipeline with dropout p in its UNet's ResNet blocks (active in training mode)."""
    from diffusers import UNet2DConditionModel

    from ddpo_group.models.tiny_random import build_tiny_pipeline, save_pipeline

    pipe = build_tiny_pipeline()
    config = {key: value for key, value in pipe.unet.config.items() if key != "_use_default_values"}
    pipe.unet = UNet2DConditionModel.from_config({**config, "dropout": p})
    return save_pipeline(pipe, folder / "dropout")


def test_a_random_training_forward_is_named_with_its_layers(tmp_path):
    """A UNet with dropout in training mode: two passes over the same pairs differ, the check says the training forward
    is random, by how much and which layers, and names no other cause (the differences are noise)."""
    model = tiny_model_with_dropout(tmp_path)
    result, report = check("grpo", model, tmp_path)
    assert not result.consistent and result.random > 1e-3, report
    assert "the training forward is random" in report and "dropout (p=0.3)" in report, report
    assert result.causes == {}, report


def test_a_bf16_sampler_is_checked_as_the_run_samples_and_named(tiny_model_dir, tmp_path):
    """sample.precision="bf16": the check samples under it as the run does, so a float32 training forward is not on
    the sampler's policy; the report names sample.precision and the rollout correction."""
    matched, _ = check("grpo", tiny_model_dir, tmp_path)
    result, report = check("grpo", tiny_model_dir, tmp_path, **{"sample.precision": "bf16"})
    assert matched.consistent and not result.consistent and result.worst > 100 * max(matched.worst, 1e-9), report
    assert "the sampler runs under sample.precision='bf16'" in report and "algorithm.rollout_correction" in report


def test_a_matching_objective_whose_training_forward_differs_fails(tmp_path, monkeypatch):
    """nft's deterministic steps taken again with a training guidance other than the sampler's: the relative step
    error is far above the tolerance (1e-4 in float32), NOT consistent."""
    from ddpo_group.update.forward_process import ForwardProcess

    made = ForwardProcess.__init__

    def other_guidance(self, config, family, objective):
        made(self, config, family, objective)
        self.guidance_scale += 3.0

    monkeypatch.setattr(ForwardProcess, "__init__", other_guidance)
    result, report = check("nft", "tiny-shapes-flow", tmp_path, **{"prompt_fn": "tiny_shapes_flow_hard"})
    assert not result.consistent and result.worst > 100 * result.tolerance, report
    assert "verdict: NOT consistent" in report


def test_the_command_exits_0_1_2_and_3(tmp_path):
    """0: consistent; 1: not (a random training forward); 2: a usage error (a config value out of range); 3: the check
    failed while it ran (the reward raised on its first call), not called a usage error."""
    root = Path(__file__).resolve().parents[2]
    small = ["--config.sample.num_steps=2", "--config.sample.batch_size=2", "--config.train.batch_size=2",
             "--config.train.group_size=2", "--config.device=cpu", "--config.sample.sde_window_size=0"]

    def command(*args, env=None):
        import os

        out = subprocess.run([sys.executable, "scripts/check.py", "--config", "config/base.py:grpo", *small, *args],
                             cwd=root, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
        return out.returncode, out.stdout + out.stderr

    code, text = command()
    assert code == 0 and "verdict: consistent" in text and "max |ratio - 1|" in text, text
    code, text = command(f"--config.pretrained.model={tiny_model_with_dropout(tmp_path)}",
                         "--config.reward_fn=jpeg_compressibility", "--config.prompt_fn=simple_animals")
    assert code == 1 and "verdict: NOT consistent" in text and "the training forward is random" in text, text
    code, text = command("--config.sample.num_steps=0")
    assert code == 2 and "sample.num_steps=0 must be >= 1" in text, text
    failing = f"{root / 'tests' / 'plugins' / 'failing_reward.py'}:make"
    code, text = command(f"--config.reward_fn={failing}", env={"FAIL_REWARD_AT": "0"})
    assert code == 3 and "the check failed while it ran" in text and "refused call 0" in text, text
