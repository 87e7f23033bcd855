"""LoRA export round trip: load_lora_weights on the base pipeline reproduces the fine-tuned samples."""

import pytest
import torch
from diffusers import StableDiffusionPipeline
from peft import LoraConfig

from ddpo_group.models.lora_export import LORA_WEIGHT_NAME, is_lora_dir
from ddpo_group.models.families.sd import StableDiffusionFamily


def sample(pipe, seed=0):
    generator = [torch.Generator().manual_seed(seed + i) for i in range(2)]
    return pipe(["a red circle", "a blue square"], num_inference_steps=3, guidance_scale=3.0, eta=1.0,
                generator=generator, output_type="pt").images


def load(model_dir):
    pipe = StableDiffusionPipeline.from_pretrained(model_dir, safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("rank, alpha", [(4, 4), (2, 8)])
def test_exported_lora_reproduces_the_fine_tuned_samples(tiny_model_dir, tmp_path, rank, alpha):
    tuned = load(tiny_model_dir)
    tuned.unet.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian",
                                      target_modules=list(StableDiffusionFamily.lora_target_modules)))
    torch.manual_seed(1)
    with torch.no_grad():  # stand-in for training: every LoRA matrix moves (lora_B starts at 0)
        for name, param in tuned.unet.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 0.3)
    assert tuned.unet.peft_config
    out = StableDiffusionFamily.save_lora(tuned.unet, tmp_path / "lora")  # what a run writes (run/session.py)
    assert is_lora_dir(out) and (out / LORA_WEIGHT_NAME).stat().st_size > 0

    base = load(tiny_model_dir)
    base_images = sample(base)
    base.load_lora_weights(str(out))
    tuned_images = sample(tuned)
    assert (tuned_images - base_images).abs().max() > 1e-3  # the adapter matters, so the check below can fail
    torch.testing.assert_close(sample(base), tuned_images, atol=1e-5, rtol=1e-4)


def test_export_without_adapter_fails_clearly(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="no LoRA adapter 'default'"):
        StableDiffusionFamily.save_lora(load(tiny_model_dir).unet, tmp_path / "lora")
