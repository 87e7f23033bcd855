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
from ddpo_group.offline.preflight import run_check
from ddpo_group.sampling.trajectories import TransitionScorer
from trainer_helpers import FAMILY_OVERRIDES, tiny_config

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
    editing = edits(tmp_path) if get_family(name).takes_images else {}  # source images from a .jsonl file
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
    made = TransitionScorer.from_config

    def other_guidance(config, family):
        scorer = made(config, family)
        scorer.guidance_scale += 2.0
        return scorer

    monkeypatch.setattr(TransitionScorer, "from_config", staticmethod(other_guidance))
    result, report = check("grpo", tiny_model_dir, tmp_path)
    assert not result.consistent and result.worst > 1e-3
    named = [cause for cause, worst in result.causes.items() if worst <= result.tolerance]
    assert len(named) == 1 and named[0].startswith("guidance"), report
    assert "likely cause: guidance" in report and "verdict: NOT consistent" in report


def test_bf16_latents_recorded_unrounded_fail_and_precision_is_named(tmp_path, monkeypatch):
    """The rollouts as they were recorded before: the float32 x_{n+1} while the sampler went on from its bf16
    rounding (the check's own finding on the embedded models)."""
    step = trajectories.stochastic_step

    def unrounded(family, output, latents, step_tensors, options, n, generator, dtype):
        out, next_latents = step(family, output, latents, step_tensors, options, n, generator, latents.new_zeros(0).float().dtype)
        return out, next_latents.to(dtype)

    monkeypatch.setattr(trajectories, "stochastic_step", unrounded)
    result, report = check("grpo", "tiny-shapes", tmp_path, mixed_precision="bf16", **{"sample.num_steps": 4,
                                                                                      "sample.sde_window_size": 0})
    assert not result.consistent, report
    named = [cause for cause, worst in result.causes.items() if worst <= result.tolerance]
    assert named and named[0].startswith("precision"), report


def test_the_command_exits_0_when_consistent(tmp_path):
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "scripts/check.py", "--config", "config/base.py:grpo",
                          "--config.sample.num_steps=3", "--config.sample.batch_size=4", "--config.train.batch_size=4",
                          "--config.train.group_size=4", "--config.device=cpu"],
                         cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verdict: consistent" in out.stdout and "max |ratio - 1|" in out.stdout
