"""The embedded flow-matching model "tiny-shapes-flow": an SD3-format pipeline that loads offline, the condition its
pretraining built is the one the pipeline and the sd3 family build, its one T5 token is the family's default, and its
measured quality is in the range the RL task needs."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from ddpo_group.models import (CLASSIFIER_DIR, TINY_SHAPES_DIR, TINY_SHAPES_FLOW, TINY_SHAPES_FLOW_DIR,
                               TINY_SHAPES_FLOW_T5_TOKENS, default_max_sequence_length, load_family)
from ddpo_group.models import shapes_data as shapes
from ddpo_group.models.families.flow_matching import sequence_length
from ml_collections import ConfigDict

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["a red circle on a blue background", "a green triangle on a yellow background", ""]

pytestmark = pytest.mark.skipif(not (TINY_SHAPES_FLOW_DIR / "model_index.json").is_file(),
                                reason="the embedded tiny-shapes-flow model is not installed")


def pretrain_script():
    spec = importlib.util.spec_from_file_location("pretrain_tiny", ROOT / "scripts" / "pretrain_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pipe():
    # SD3 without T5, as diffusers documents it: the two absent components named
    pipe = StableDiffusion3Pipeline.from_pretrained(str(TINY_SHAPES_FLOW_DIR), local_files_only=True,
                                                    text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_the_pipeline_loads_offline_and_draws_images_of_the_shapes_size(pipe, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert pipe.text_encoder_3 is None and pipe.transformer.config.in_channels == 4
    out = pipe(PROMPTS[:2], num_inference_steps=3, max_sequence_length=TINY_SHAPES_FLOW_T5_TOKENS, output_type="pt",
               generator=torch.Generator().manual_seed(0)).images
    assert out.shape == (2, 3, shapes.RESOLUTION, shapes.RESOLUTION)
    assert float(out.min()) >= 0.0 and float(out.max()) <= 1.0 and float(out.std()) > 0.05


def test_its_one_t5_token_is_the_default_and_an_explicit_count_wins():
    assert default_max_sequence_length(TINY_SHAPES_FLOW) == TINY_SHAPES_FLOW_T5_TOKENS == 1
    assert sequence_length(ConfigDict({"model": TINY_SHAPES_FLOW, "max_sequence_length": 0})) == 1
    assert sequence_length(ConfigDict({"model": TINY_SHAPES_FLOW, "max_sequence_length": 7})) == 7
    assert sequence_length(ConfigDict({"model": "stabilityai/stable-diffusion-3.5-medium", "max_sequence_length": 0})) is None


def test_pretraining_condition_equals_the_pipelines_and_the_familys(pipe):
    """The pretraining loss saw exactly the tokens and pooled vector the pipeline and the sampler give the model."""
    from config.base import get_config

    tokenizer = pipe.tokenizer
    ids = tokenizer(PROMPTS, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                    return_tensors="pt").input_ids
    with torch.no_grad():
        trained, trained_pooled = pretrain_script().clip_condition([pipe.text_encoder, pipe.text_encoder_2], ids, 1)
        embeds, _, pooled, _ = pipe.encode_prompt(PROMPTS, None, None, do_classifier_free_guidance=False,
                                                  max_sequence_length=1)
    config = get_config("grpo")
    config.pretrained.model = TINY_SHAPES_FLOW
    family = load_family(TINY_SHAPES_FLOW, config=config)
    cond = family.encode(PROMPTS)
    assert family.name == "sd3" and trained.shape == (3, tokenizer.model_max_length + 1, 128)
    torch.testing.assert_close(trained, embeds, rtol=0, atol=0)
    torch.testing.assert_close(trained_pooled, pooled, rtol=0, atol=0)
    torch.testing.assert_close(cond["prompt_embeds"], embeds, rtol=0, atol=0)
    torch.testing.assert_close(cond["pooled_prompt_embeds"], pooled, rtol=0, atol=0)
    assert float(trained[:, -1].abs().max()) == 0.0  # the zero "T5" token


def test_training_noise_levels_follow_the_schedulers_shift():
    """s = 3u / (1 + 2u) with u logit-normal: the median of s is the shifted median of u, 3 * 0.5 / 2 = 0.75."""
    s = pretrain_script().flow_sigmas(20000, torch.Generator().manual_seed(0))
    assert float(s.min()) > 0.0 and float(s.max()) < 1.0
    assert abs(float(s.median()) - 0.75) < 0.01


def test_quality_report_leaves_room_for_rl_and_the_shipped_models_stay_small():
    report = json.loads((TINY_SHAPES_FLOW_DIR / "pretrain_report.json").read_text())
    train, held = report["base_model_sample_accuracy_train"], report["base_model_sample_accuracy_held_out"]
    assert 0.5 <= train["shape"] <= 0.85 and train["color"] > 0.9, train  # recognisable but imperfect
    assert held["shape"] < train["shape"]
    size = sum(f.stat().st_size for d in (TINY_SHAPES_DIR, TINY_SHAPES_FLOW_DIR, CLASSIFIER_DIR)
               for f in d.rglob("*") if f.is_file())
    assert size <= 30e6, f"the embedded models and judge are {size / 1e6:.1f} MB"
