"""A tiny random Stable Diffusion pipeline built from config (no downloads), saved like a checkpoint."""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from ddpo_group.models.tokenizer import byte_level_vocab


def build_tiny_pipeline(seed: int = 0, prediction_type: str = "epsilon", max_length: int = 16) -> StableDiffusionPipeline:
    torch.manual_seed(seed)
    tokenizer = CLIPTokenizer(vocab=byte_level_vocab(), merges=[], model_max_length=max_length)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=max_length, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        )
    )
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(8, 16),
        layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=16,
    )
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=4, norm_num_groups=8,
    )
    scheduler = DDIMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
        set_alpha_to_one=False, steps_offset=1, prediction_type=prediction_type,
    )
    return StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )


def save_tiny_pipeline(path, **kwargs) -> str:
    build_tiny_pipeline(**kwargs).save_pretrained(str(path))
    return str(path)
