"""Random-weight pipelines at the published models' sizes, built from config (no download): what the GPU benchmarks
measure memory and throughput on when the real weights are not at hand (bench/random_model.py saves them), and what
the family tests check a family against on the meta device (no memory).

sd15: UNet 860M (320/640/1280/1280 channels, cross-attention 768), VAE 84M, a CLIP-L-sized text encoder (12 layers,
768 wide) with the locally built byte-level tokenizer, DDIM. sd35m: SD3Transformer2DModel of SD 3.5 Medium (24 MMDiT-X
layers, 24 heads of 64, dual attention in layers 0-12, RMS q/k norm, 2.5B), CLIP-L and CLIP-G text encoders with
projection, the 16-channel SD3 VAE, no T5 (the pipeline then feeds zeros for its tokens, as with
``text_encoder_3=None``). sdxl: SDXL base's UNet (320/640/1280 channels, 1/2/10 transformer layers, cross-attention
2048, the "text_time" added embedding; 2.6B), a CLIP-L-sized and a CLIP-G-sized text encoder (the second with
projection), the SD VAE with SDXL's scaling factor, DDIM (SDXL base ships Euler; the sdxl family swaps it for DDIM).
wan13b: Wan2.1-T2V-1.3B (``build_wan13b``: the transformer 1.4B, the Wan VAE, a UMT5-XXL-sized encoder 5.7B).
wan21_i2v14b: Wan2.1-I2V-14B-480P (``build_wan21_i2v14b``: the transformer 16.4B, a CLIP ViT-H/14 vision encoder 0.6B,
wan13b's VAE and encoder; ``--blocks`` keeps a fraction of the transformer's layers).
sana: SANA 1.5 1.6B at 1024 px (``build_sana``: the transformer, the DC-AE f32c32, a Gemma-2-2B-sized text encoder).
qwenimage21: Qwen-Image 2.1 (``build_qwenimage21``: the transformer at its released shape, a Qwen3-VL-8B-sized text
encoder in a locally built processor, which needs torchvision without tests/helpers/processor_without_video.py's patch).
hunyuan_video15: HunyuanVideo 1.5 480p text-to-video (``build_hunyuan_video15``: the 8.3B transformer, its VAE, a
Qwen2.5-VL-7B-sized text model, a ByT5-small-sized glyph encoder, its guider).
ltx2: LTX-2 (``build_ltx2``: the 18.9B audio-video transformer, its text connectors, a Gemma-3-12B-sized text encoder,
the video and audio VAEs, the vocoder).
krea2: Krea 2 (``build_krea2``: the 12.8B transformer at the class defaults, a Qwen3-VL-4B-sized text encoder, the
Qwen-Image VAE).
ideogram4: Ideogram 4 (``build_ideogram4``: two 9.3B transformers, the conditional and the unconditional one, a
Qwen3-VL-8B-sized text encoder, the FLUX.2 VAE).
kandinsky6: Kandinsky 6 text-to-video with audio (``build_kandinsky6``: the 48.2B video / audio transformer at the
class defaults, Qwen2.5-VL-7B, a CLIP-L-sized text model, HunyuanVideo's VAE, the MMAudio VAE and vocoder).
hunyuan_image: HunyuanImage 2.1 at 2048 px (``build_hunyuan_image``: the 17.4B transformer, its 32x VAE,
Qwen2.5-VL-7B, a ByT5-small-sized glyph encoder, its guiders).
sana_video: SANA-Video 2B 480p (``build_sana_video``: the 2.1B transformer, Wan2.1's VAE, a Gemma-2-2B-sized text
encoder).
cosmos3: Cosmos 3 (``build_cosmos3``: the 15.2B mixture-of-transformers at the class defaults, reading token ids, with
its sound head; Wan2.2's VAE, the sound tokenizer).
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from ddpo_group.models.tokenizer import byte_level_vocab


def clip_text(hidden: int, layers: int, heads: int, projection: bool):
    tokenizer = CLIPTokenizer(vocab=byte_level_vocab(), merges=[], model_max_length=77)
    config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                            num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=77,
                            projection_dim=hidden, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return tokenizer, (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def vae(latent_channels: int, **extra) -> AutoencoderKL:
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
                         layers_per_block=2, latent_channels=latent_channels, sample_size=512, **extra)


def build_sd15() -> StableDiffusionPipeline:
    tokenizer, text_encoder = clip_text(768, 12, 12, projection=False)
    unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8)  # the rest: SD 1.x's
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    return StableDiffusionPipeline(vae=vae(4, scaling_factor=0.18215), text_encoder=text_encoder, tokenizer=tokenizer,
                                   unet=unet, scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)


def build_sd35m():
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    transformer = SD3Transformer2DModel(
        sample_size=64, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
        joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
        pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
    )
    tokenizer, text_encoder = clip_text(768, 12, 12, projection=True)
    tokenizer_2, text_encoder_2 = clip_text(1280, 32, 20, projection=True)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae(16, shift_factor=0.0609, scaling_factor=1.5305, use_quant_conv=False, use_post_quant_conv=False),
        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        text_encoder_3=None, tokenizer_3=None,
    )


def build_sdxl():
    from diffusers import StableDiffusionXLPipeline

    unet = UNet2DConditionModel(  # the rest: UNet2DConditionModel's defaults, as SDXL base's config
        sample_size=128, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), block_out_channels=(320, 640, 1280),
        transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), use_linear_projection=True,
        cross_attention_dim=2048, addition_embed_type="text_time", addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816,  # six size ids of 256 + CLIP-G's pooled 1280
    )
    tokenizer, text_encoder = clip_text(768, 12, 12, projection=False)
    tokenizer_2, text_encoder_2 = clip_text(1280, 32, 20, projection=True)
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1, timestep_spacing="leading")
    return StableDiffusionXLPipeline(vae=vae(4, scaling_factor=0.13025), text_encoder=text_encoder,
                                     text_encoder_2=text_encoder_2, tokenizer=tokenizer, tokenizer_2=tokenizer_2,
                                     unet=unet, scheduler=scheduler)


def build_wan13b(text_layers: int = 24):
    """Wan2.1-T2V-1.3B: its WanTransformer3DModel (30 layers, 12 heads of 128, FFN 8960, text width 4096), the
    Wan2.1 VAE (AutoencoderKLWan's defaults are its config), a UMT5-XXL-shaped encoder (24 layers of 4096, 64 heads,
    FFN 10240, the 256384-token vocabulary; ``text_layers`` fewer to save memory) with the locally built T5-style
    tokenizer, the released UniPC scheduler (flow_shift 3; the wan family swaps in the flow Euler one)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from ddpo_group.models.tiny_random import t5_tokenizer

    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
                                        in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960,
                                        num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                                        rope_max_seq_len=1024)
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240,
                                               num_layers=text_layers, num_heads=64, feed_forward_proj="gated-gelu",
                                               relative_attention_num_buckets=32))
    with torch.device("cpu"):  # the scheduler's tables (the weights may be built on another device)
        scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return WanPipeline(tokenizer=t5_tokenizer(max_length=512), text_encoder=text_encoder, vae=AutoencoderKLWan(),
                       scheduler=scheduler, transformer=transformer)


BUILDERS = {"sd15": build_sd15, "sd35m": build_sd35m, "sdxl": build_sdxl, "wan13b": build_wan13b}


def build_wan21_i2v14b(blocks: float = 1.0, text_layers: int = 24):
    """Wan2.1-I2V-14B-480P (720P: the same shapes): its WanTransformer3DModel (40 layers of 40 heads of 128, FFN 13824,
    36 input channels: the latent, the first-frame mask and the image's latent; CLIP image tokens of width 1280 through
    the cross-attention's added key / value projections), a CLIP ViT-H/14-shaped vision encoder (32 layers of 1280,
    224 px in 14 px patches: 257 tokens) with its image processor, build_wan13b's Wan VAE, UMT5-XXL-shaped encoder and
    scheduler; ``blocks``: the fraction of the transformer's layers kept."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    t2v = build_wan13b(text_layers)
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128,
                                        in_channels=36, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824,
                                        num_layers=max(1, round(40 * blocks)), cross_attn_norm=True,
                                        qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=1280,
                                        added_kv_proj_dim=5120, rope_max_seq_len=1024)
    image_encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                                     num_attention_heads=16, image_size=224, patch_size=14,
                                                     hidden_act="gelu"))
    image_processor = CLIPImageProcessor(crop_size=224, size=224)
    return WanImageToVideoPipeline(tokenizer=t2v.tokenizer, text_encoder=t2v.text_encoder, vae=t2v.vae,
                                   scheduler=t2v.scheduler, image_processor=image_processor,
                                   image_encoder=image_encoder, transformer=transformer)


BUILDERS["wan21_i2v14b"] = build_wan21_i2v14b


def build_zimage():
    """Z-Image(-Turbo)'s shapes: ZImageTransformer2DModel at its defaults (dim 3840, 30 layers and 2 + 2 refiner layers,
    30 heads, caption width 2560: 6.2B), a Qwen3-4B-sized text encoder (36 layers, 2560 wide, 32 query / 8 key-value
    heads of 128, vocabulary 151936: 4.0B) with the locally built byte-level Qwen tokenizer and chat template, the
    16-channel FLUX VAE with Z-Image's scaling and shift, Z-Image-Turbo's scheduler (shift 3)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from ddpo_group.models.tiny_random import qwen_tokenizer

    text_encoder = Qwen3Model(Qwen3Config(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
        tie_word_embeddings=True,
    ))
    return ZImagePipeline(
        transformer=ZImageTransformer2DModel(), text_encoder=text_encoder, tokenizer=qwen_tokenizer(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False),
        vae=vae(16, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False),
    )


BUILDERS["zimage"] = build_zimage


def flux_components(blocks: float = 1.0) -> dict:
    """FLUX.1 [dev]'s components: FluxTransformer2DModel with 19 double and 38 single blocks (24 heads of 128, guidance
    embedding; 11.9B), CLIP-L, a T5-XXL-sized encoder (24 layers, 4096 wide, gated GELU; 4.8B) with the locally built
    T5 tokenizer, the 16-channel FLUX VAE, the dynamic shift. ``blocks`` < 1 keeps that fraction of the transformer's
    and T5's blocks (at least one each), widths unchanged."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    from ddpo_group.models.tiny_random import t5_tokenizer

    def kept(n):
        return max(1, round(n * blocks))

    transformer = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=kept(19), num_single_layers=kept(38),
                                         attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                                         pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    tokenizer, text_encoder = clip_text(768, 12, 12, projection=False)
    t5 = T5EncoderModel(T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=kept(24), num_heads=64,
                                 feed_forward_proj="gated-gelu", tie_word_embeddings=False))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    return dict(scheduler=scheduler, vae=vae(16, shift_factor=0.1159, scaling_factor=0.3611, use_quant_conv=False,
                                             use_post_quant_conv=False),
                text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=t5, tokenizer_2=t5_tokenizer(512),
                transformer=transformer)


def build_flux(blocks: float = 1.0):
    """FLUX.1 [dev] text-to-image (FluxPipeline): ``flux_components``."""
    from diffusers import FluxPipeline

    return FluxPipeline(**flux_components(blocks))


def build_flux_kontext(blocks: float = 1.0):
    """FLUX.1 Kontext [dev]: FLUX.1 [dev]'s shapes (``flux_components``) in FluxKontextPipeline."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**flux_components(blocks))


BUILDERS["flux"] = build_flux
BUILDERS["flux_kontext"] = build_flux_kontext


def build_flux2_klein4b(double_blocks: int = 5, single_blocks: int = 20, text_layers: int = 36):
    """FLUX.2 [klein] 4B (step-distilled): Flux2Transformer2DModel with 5 double and 20 single blocks of 24 heads of 128
    (3.9B), a Qwen3-4B-sized text encoder (36 layers, 2560 wide, 32 / 8 heads of 128, 151936 embeddings; layers 9, 18,
    27 stacked: the 7680-wide text input) with the locally built byte-level tokenizer, the 32-channel FLUX.2 VAE, the
    dynamic shift; fewer blocks or text layers give a stated fraction (at least 27 text layers)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ddpo_group.models.tiny_random import qwen_tokenizer

    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=128, num_layers=double_blocks,
                                          num_single_layers=single_blocks, attention_head_dim=128,
                                          num_attention_heads=24, joint_attention_dim=7680, timestep_guidance_channels=256,
                                          mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6,
                                          guidance_embeds=False)
    tokenizer = qwen_tokenizer()
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=text_layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000}, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096,
                                                time_shift_type="exponential")
    return Flux2KleinPipeline(scheduler=scheduler, vae=AutoencoderKLFlux2(), text_encoder=text_encoder,
                              tokenizer=tokenizer, transformer=transformer, is_distilled=True)


BUILDERS["flux2_klein4b"] = build_flux2_klein4b


def build_qwenimage(layers: int = 60):
    """Qwen-Image: its QwenImageTransformer2DModel (60 MMDiT blocks of 24 heads of 128 on 64-channel packed tokens,
    text width 3584; 20.4B; ``layers`` fewer for a fraction), Qwen2.5-VL-7B as its text encoder (28 layers of 3584,
    28 heads with 4 key-value heads, and the 32-block vision tower the pipeline loads but does not run; 8.3B) with the
    locally built Qwen tokenizer, merges learned on the prompt template (its token ids below its small vocabulary),
    the 16-channel AutoencoderKLQwenImage (its defaults are Qwen-Image's latents_mean / latents_std), Qwen-Image's
    scheduler."""
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from ddpo_group.models.tiny_random import qwen_tokenizer, qwenimage_scheduler

    scheduler = qwenimage_scheduler()
    template = QwenImagePipeline(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None,
                                 transformer=None).prompt_template_encode
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=layers,
                                              attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                                              guidance_embeds=False, axes_dims_rope=(16, 56, 56))
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                     "num_attention_heads": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
                     "max_position_embeddings": 128000, "rope_theta": 1000000.0,
                     "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
        vision_config={"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                       "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31]},
        vocab_size=152064, hidden_size=3584, tie_word_embeddings=False,
    )
    return QwenImagePipeline(scheduler=scheduler, vae=AutoencoderKLQwenImage(), transformer=transformer,
                             tokenizer=qwen_tokenizer(template=template),
                             text_encoder=Qwen2_5_VLForConditionalGeneration(config))


BUILDERS["qwenimage"] = build_qwenimage


def build_qwenimage_edit_plus(blocks: float = 1.0):
    """Qwen-Image-Edit-Plus (2509 / 2511): Qwen-Image's components (``build_qwenimage``: the Edit models share its
    transformer and Qwen2.5-VL-7B, whose vision tower now runs on the source images; ``blocks``: the fraction of the
    60 transformer blocks kept), the tokenizer with the vision tokens (merges on the Edit template) and its
    Qwen2VLProcessor (None without torchvision, which transformers' processor needs)."""
    from diffusers import QwenImageEditPlusPipeline

    from ddpo_group.models.tiny_random import qwen_vl_processor, qwen_vl_tokenizer

    base = build_qwenimage(layers=max(1, round(60 * blocks)))
    template = QwenImageEditPlusPipeline(scheduler=base.scheduler, vae=None, text_encoder=None, tokenizer=None,
                                         processor=None, transformer=None).prompt_template_encode
    tokenizer = qwen_vl_tokenizer(template)
    config = base.text_encoder.config
    for key, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                       ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):
        setattr(config, key, tokenizer.convert_tokens_to_ids(token))  # this tokenizer's ids, not Qwen's 151652...
    try:
        processor = qwen_vl_processor(tokenizer)
    except ImportError:
        processor = None
    return QwenImageEditPlusPipeline(scheduler=base.scheduler, vae=base.vae, text_encoder=base.text_encoder,
                                     tokenizer=tokenizer, processor=processor, transformer=base.transformer)


BUILDERS["qwenimage_edit_plus"] = build_qwenimage_edit_plus


def describe(shape: str, blocks: float, pipe) -> dict:
    """The shape's description (``--count-only``, ``--json``): the pipeline's class, and the parameter count and config
    of each component that is a torch module."""
    modules = {name: module for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}
    return {"shape": shape, "blocks": blocks, "pipeline": type(pipe).__name__,
            "parameters": {name: sum(p.numel() for p in module.parameters()) for name, module in modules.items()},
            "configs": {name: module.config.to_dict() if hasattr(module.config, "to_dict") else dict(module.config)
                        for name, module in modules.items()}}


def build_sana(layers: int = 20, text_layers: int = 26):
    """SANA 1.5 1.6B at 1024 px (Efficient-Large-Model/SANA1.5_1.6B_1024px_diffusers, diffusers' conversion script's
    shapes): its SanaTransformer2DModel (20 blocks of linear self-attention, 70 heads of 32, cross-attention 20 heads of
    112 over the 2304-wide text, RMS q/k norm across heads, 32 latent channels, patch 1, sample_size 32; ``layers``
    fewer for a fraction), the 32-channel DC-AE f32c32 (three ResBlock stages and three EfficientViT stages), a
    Gemma-2-2B-sized decoder as its text encoder (26 layers of 2304, 8 query / 4 key-value heads of 256, vocabulary
    256000; ``text_layers`` fewer to save memory) with the locally built Gemma-style tokenizer, the released flow
    DPM-Solver scheduler (shift 3; the sana family swaps in the flow Euler one)."""
    from diffusers import AutoencoderDC, SanaPipeline, SanaTransformer2DModel

    from ddpo_group.models.tiny_random import gemma_tokenizer

    transformer = SanaTransformer2DModel(in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32,
                                         num_layers=layers, num_cross_attention_heads=20, cross_attention_head_dim=112,
                                         cross_attention_dim=2240, caption_channels=2304, mlp_ratio=2.5,
                                         sample_size=32, patch_size=1, qk_norm="rms_norm_across_heads")
    blocks = ("ResBlock",) * 3 + ("EfficientViTBlock",) * 3
    vae = AutoencoderDC(latent_channels=32, encoder_block_types=blocks, decoder_block_types=blocks,
                        downsample_block_type="conv", upsample_block_type="interpolate", scaling_factor=0.41407)
    text_encoder, scheduler = sana_text_and_scheduler(text_layers, flow_shift=3.0)
    return SanaPipeline(tokenizer=gemma_tokenizer(), text_encoder=text_encoder, vae=vae, transformer=transformer,
                        scheduler=scheduler)


def sana_text_and_scheduler(text_layers: int, flow_shift: float) -> tuple:
    """SANA's and SANA-Video's Gemma-2-2B-sized text encoder (26 layers of 2304, 8 query / 4 key-value heads of 256,
    vocabulary 256000; ``text_layers`` of them) and their released flow DPM-Solver scheduler of ``flow_shift``."""
    from diffusers import DPMSolverMultistepScheduler
    from transformers import Gemma2Config, Gemma2Model

    text_encoder = Gemma2Model(Gemma2Config(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=text_layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192))
    with torch.device("cpu"):  # the scheduler's tables (the weights may be built on another device)
        scheduler = DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                flow_shift=flow_shift)
    return text_encoder, scheduler


BUILDERS["sana"] = build_sana


def build_qwenimage21(layers: int = 32, text_layers: int = 36):
    """Qwen-Image 2.1: its QwenImage21Transformer2DModel at the class defaults, the released configuration (32
    single-stream blocks of 32 heads of 128, SwiGLU x3, 64 latent channels, text width 4096; ``layers`` fewer for a
    fraction), a Qwen3-VL-8B-sized text encoder (36 layers of 4096, 32 query / 8 key-value heads of 128, FFN 12288,
    vocabulary 151936, and a 27-block vision tower the text-to-image pipeline does not run; ``text_layers`` fewer to
    save memory) in a locally built Qwen3VLProcessor, the 64-channel AutoencoderKLQwenImage21 at its defaults (16x,
    RGBA), Qwen-Image's scheduler."""
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Pipeline, QwenImage21Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from ddpo_group.models.tiny_random import (QWEN_IMAGE21_TEMPLATE, qwen3_vl_processor, qwen_vl_tokenizer,
                                               qwenimage_scheduler)

    tokenizer = qwen_vl_tokenizer(QWEN_IMAGE21_TEMPLATE)
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen3VLConfig(
        text_config={"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
                     "num_hidden_layers": text_layers, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "head_dim": 128, "max_position_embeddings": 262144,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                         "mrope_section": [24, 20, 20], "mrope_interleaved": True}},
        vision_config={"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                       "out_hidden_size": 4096, "patch_size": 16, "deepstack_visual_indexes": [8, 16, 24]},
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )
    return QwenImage21Pipeline(scheduler=qwenimage_scheduler(), vae=AutoencoderKLQwenImage21(),
                               text_encoder=Qwen3VLForConditionalGeneration(config),
                               processor=qwen3_vl_processor(tokenizer),
                               transformer=QwenImage21Transformer2DModel(num_layers=layers))


BUILDERS["qwenimage21"] = build_qwenimage21


def build_hunyuan_video15(layers: int = 54, text_layers: int = 28):
    """HunyuanVideo 1.5 480p text-to-video: its HunyuanVideo15Transformer3DModel (54 dual-stream blocks of 16 heads of
    128, two refiner blocks, 32 latent channels read beside the condition latent and mask: 65 input channels; text
    widths 3584 and 1472, target_size 480, task t2v; ``layers`` fewer for a fraction), the 32-channel
    AutoencoderKLHunyuanVideo15 at its defaults (16x, 4x), a Qwen2.5-VL-7B-sized text model (28 layers of 3584, 28
    query / 4 key-value heads, FFN 18944, vocabulary 152064; ``text_layers`` fewer to save memory) with the locally
    built Qwen tokenizer, a ByT5-small-sized encoder (12 layers of 1472, 6 heads of 64, FFN 3584) with ByT5's byte
    tokenizer, the flow Euler scheduler of shift 5 and a ClassifierFreeGuidance guider at 6."""
    from diffusers import (AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline,
                           HunyuanVideo15Transformer3DModel)
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    from ddpo_group.models.tiny_random import qwen_tokenizer

    transformer = HunyuanVideo15Transformer3DModel(num_layers=layers, target_size=480, task_type="t2v")
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=text_layers,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}))
    tokenizer_2 = ByT5Tokenizer()
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=12,
                                             num_heads=6, feed_forward_proj="gated-gelu"))
    with torch.device("cpu"):  # the scheduler's tables (the weights may be built on another device)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    return HunyuanVideo15Pipeline(text_encoder=text_encoder, tokenizer=qwen_tokenizer(max_length=2048),
                                  transformer=transformer, vae=AutoencoderKLHunyuanVideo15(), scheduler=scheduler,
                                  text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
                                  guider=ClassifierFreeGuidance(guidance_scale=6.0))


BUILDERS["hunyuan_video15"] = build_hunyuan_video15


def build_ltx2(layers: int = 48, text_layers: int = 48):
    """LTX-2: its LTX2VideoTransformer3DModel at the class defaults (48 blocks; video 32 heads of 128, audio 32 heads of
    64, 128 latent channels each, Gemma-3's 3840-wide text through the connectors; ``layers`` fewer for a fraction),
    the text connectors at their defaults, a Gemma-3-12B-sized text encoder (48 layers of 3840, 16 query / 8 key-value
    heads of 256, FFN 15360, vocabulary 262208, and a SigLIP-400M-sized vision tower the pipeline does not run;
    ``text_layers`` fewer to save memory) with the locally built Gemma-style tokenizer, the LTX-2 video VAE at its
    defaults with LTX-2's 32x / 8x factors, the audio VAE and vocoder at their defaults, the flow Euler scheduler."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2Pipeline, LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from ddpo_group.models.tiny_random import gemma_tokenizer

    tokenizer = gemma_tokenizer(max_length=1024)
    text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config={"vocab_size": 262208, "hidden_size": 3840, "intermediate_size": 15360,
                     "num_hidden_layers": text_layers, "num_attention_heads": 16, "num_key_value_heads": 8,
                     "head_dim": 256, "max_position_embeddings": 131072},
        vision_config={"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                       "num_attention_heads": 16, "image_size": 896, "patch_size": 14}))
    with torch.device("cpu"):  # the scheduler's tables (the weights may be built on another device)
        scheduler = FlowMatchEulerDiscreteScheduler()
    return LTX2Pipeline(transformer=LTX2VideoTransformer3DModel(num_layers=layers),
                        vae=AutoencoderKLLTX2Video(spatial_compression_ratio=32, temporal_compression_ratio=8),
                        audio_vae=AutoencoderKLLTX2Audio(), scheduler=scheduler, text_encoder=text_encoder,
                        tokenizer=tokenizer,
                        connectors=LTX2TextConnectors(text_proj_in_factor=text_layers + 1), vocoder=LTX2Vocoder())


BUILDERS["ltx2"] = build_ltx2


def qwen3_vl_config(hidden: int, ffn: int, vision: dict):
    """A Qwen3-VL's config at a released size: 36 text layers of ``hidden``, 32 query / 8 key-value heads of 128, FFN
    ``ffn``, vocabulary 151936, interleaved M-RoPE; ``vision``: its vision tower's shape (the text-to-image pipelines
    do not run it)."""
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config={"vocab_size": 151936, "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": 36,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                     "max_position_embeddings": 262144,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                         "mrope_section": [24, 20, 20], "mrope_interleaved": True}},
        vision_config={"num_heads": 16, "out_hidden_size": hidden, "patch_size": 16, **vision})


QWEN3_VL_4B_VISION = {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096,
                      "deepstack_visual_indexes": [5, 11, 17]}
QWEN3_VL_8B_VISION = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
                      "deepstack_visual_indexes": [8, 16, 24]}


def qwen25_vl_7b(tokenizer, text_layers: int = 28):
    """Qwen2.5-VL-7B (Qwen2_5_VLForConditionalGeneration): 28 layers of 3584 (``text_layers`` fewer to save memory),
    28 query / 4 key-value heads, FFN 18944, vocabulary 152064, and its 32-block vision tower (not run by the
    text-to-video / image pipelines); ``tokenizer``'s vision token ids where it has them."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.get_vocab()
    tokens = {key: ids[token] for key, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")) if token in ids}
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                     "num_hidden_layers": text_layers, "num_attention_heads": 28, "num_key_value_heads": 4,
                     "rms_norm_eps": 1e-6, "max_position_embeddings": 128000, "rope_theta": 1000000.0,
                     "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
        vision_config={"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                       "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31]},
        vocab_size=152064, hidden_size=3584, tie_word_embeddings=False, **tokens))


def build_krea2(layers: int = 28):
    """Krea 2 (Krea2Pipeline; no hub repo yet: diffusers' docstring loads a local conversion): its
    Krea2Transformer2DModel at the class defaults, taken as the released shape (28 single-stream blocks of 48 query /
    12 key-value heads of 128, SwiGLU 16384, 64-channel 2x2-packed latents, a text fusion of two layerwise and two
    refiner blocks over 12 tapped layers of width 2560; ``layers`` fewer for a fraction), a Qwen3-VL-4B-sized text
    encoder (Qwen3VLModel: 36 layers of 2560, 32 query / 8 key-value heads of 128, FFN 9728, vocabulary 151936, and a
    24-block vision tower the pipeline does not run; the pipeline taps hidden states 2, 5, ..., 35, so all 36 layers
    are kept) with ``qwen_tokenizer`` (merges learned on the pipeline's template), the 16-channel
    AutoencoderKLQwenImage at its defaults, Krea 2's scheduler (dynamic shifting from 256 to 6400 image tokens, mu 0.5
    to 1.15)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Pipeline
    from diffusers import Krea2Transformer2DModel
    from transformers import Qwen3VLModel

    from ddpo_group.models.tiny_random import qwen_tokenizer

    with torch.device("cpu"):  # the scheduler's tables (the weights may be built on another device)
        scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_image_seq_len=256,
                                                    max_image_seq_len=6400, base_shift=0.5, max_shift=1.15)
    layout = Krea2Pipeline(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    tokenizer = qwen_tokenizer(template=layout.prompt_template_encode_prefix + "{}"
                               + layout.prompt_template_encode_suffix)
    return Krea2Pipeline(scheduler=scheduler, vae=AutoencoderKLQwenImage(), tokenizer=tokenizer,
                         text_encoder=Qwen3VLModel(qwen3_vl_config(2560, 9728, QWEN3_VL_4B_VISION)),
                         transformer=Krea2Transformer2DModel(num_layers=layers))


BUILDERS["krea2"] = build_krea2


def build_ideogram4(layers: int = 34):
    """Ideogram 4 (Ideogram4Pipeline, ideogram-ai/ideogram-v4): two Ideogram4Transformer2DModel at the class defaults,
    taken as the released shape (34 blocks of 18 heads of 256: width 4608, FFN 12288, 128-channel 2x2-packed
    latents, the 13 x 4096 = 53248 text features a token; ``layers`` fewer for a fraction), the
    conditional ``transformer`` and the ``unconditional_transformer`` of its asymmetric CFG; a Qwen3-VL-8B-sized text
    encoder (Qwen3VLModel: 36 layers of 4096, 32 query / 8 key-value heads of 128, FFN 12288, vocabulary 151936, and
    a 27-block vision tower the pipeline does not run; it taps layers 0, 3, ..., 33 and 35, so all 36 are kept) with
    ``qwen_tokenizer`` and Qwen3-VL's chat template, the 32-channel FLUX.2 VAE at its defaults, the flow Euler
    scheduler (the pipeline gives it its logit-normal sigmas); no prompt-enhancer head."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline
    from diffusers import Ideogram4Transformer2DModel
    from transformers import Qwen3VLModel

    from ddpo_group.models.tiny_random import QWEN3_VL_CHAT_TEMPLATE, qwen_tokenizer

    tokenizer = qwen_tokenizer(max_length=4096)
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    with torch.device("cpu"):  # the scheduler's tables (the weights may be built on another device)
        scheduler = FlowMatchEulerDiscreteScheduler()
    return Ideogram4Pipeline(scheduler=scheduler, vae=AutoencoderKLFlux2(), tokenizer=tokenizer,
                             text_encoder=Qwen3VLModel(qwen3_vl_config(4096, 12288, QWEN3_VL_8B_VISION)),
                             transformer=Ideogram4Transformer2DModel(num_layers=layers),
                             unconditional_transformer=Ideogram4Transformer2DModel(num_layers=layers))


BUILDERS["ideogram4"] = build_ideogram4


def build_kandinsky6(layers: int = 60, text_layers: int = 28):
    """Kandinsky 6 text-to-video with audio (Kandinsky6TI2VAPipeline): its Kandinsky6Transformer3DModel at the class
    defaults, taken as the released shape (60 fused video / audio blocks and 4 text blocks a modality, width 4096, FFN
    16384, heads of 128, 16 video and 20 audio latent channels; ``layers`` fewer fused blocks for a fraction) with the
    released checkpoints' text padding, cross-modal RoPE, gates and fixed modulation (the class's docstring: True in
    every released config), Qwen2.5-VL-7B (``qwen25_vl_7b``: the pipeline reads its last hidden states; ``text_layers``
    fewer to save memory) with ``qwen_vl_tokenizer`` (merges on the pipeline's template; the released tokenizer is a
    Qwen2_5_VLProcessor, which needs torchvision), a CLIP-L-sized text model for the pooled embedding (77 tokens), the
    16-channel AutoencoderKLHunyuanVideo at its defaults (8x, 4x), the MMAudio VAE at its defaults (128 mel bins at
    44.1 kHz, a latent frame every 1024 samples) but for its latent width, the transformer's 20 audio channels (its
    default 40 is MMAudio-44k's), the MMAudio vocoder at its defaults, the flow Euler scheduler (shift 5)."""
    from diffusers import (AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, Kandinsky6TI2VAPipeline,
                           Kandinsky6Transformer3DModel, MMAudioVAE, MMAudioVocoder)
    from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_ti2va import _PROMPT_TEMPLATE

    from ddpo_group.models.tiny_random import qwen_vl_tokenizer

    transformer = Kandinsky6Transformer3DModel(num_visual_blocks=layers, text_token_padding=True, ca_rope=True,
                                               cross_gates=True, fix_modulation=True)
    tokenizer = qwen_vl_tokenizer(_PROMPT_TEMPLATE)
    tokenizer_2, text_encoder_2 = clip_text(768, 12, 12, projection=False)
    with torch.device("cpu"):  # the scheduler's tables (the weights may be built on another device)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    return Kandinsky6TI2VAPipeline(transformer=transformer, vae=AutoencoderKLHunyuanVideo(),
                                   text_encoder=qwen25_vl_7b(tokenizer, text_layers), tokenizer=tokenizer,
                                   text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, scheduler=scheduler,
                                   audio_vae=mel_module(MMAudioVAE, latent_channels=transformer.config.in_audio_dim),
                                   vocoder=MMAudioVocoder())


def mel_module(cls, **kwargs):
    """``cls(**kwargs)`` for a module that computes a mel filterbank when it is made (MMAudio's VAE): under the meta
    device its weights on it and its filterbank computed on the CPU (on the meta device the computation fails)."""
    from accelerate import init_empty_weights

    if torch.get_default_device().type != "meta":
        return cls(**kwargs)
    with torch.device("cpu"), init_empty_weights():
        return cls(**kwargs)


BUILDERS["kandinsky6"] = build_kandinsky6


def build_hunyuan_image(layers: int = 20, single_layers: int = 40, text_layers: int = 28):
    """HunyuanImage 2.1 at 2048 px (HunyuanImagePipeline, hunyuanvideo-community/HunyuanImage-2.1-Diffusers; diffusers'
    conversion script's shapes): its HunyuanImageTransformer2DModel at the class defaults (20 dual-stream and 40
    single-stream blocks of 28 heads of 128, two refiner blocks, 64 latent channels, patch 1; ``layers`` and
    ``single_layers`` fewer for a fraction) with the ByT5 input the class leaves unset (1472 wide), the 64-channel
    AutoencoderKLHunyuanImage of the script (32x: 128 to 1024 channels in six stages, scaling factor 0.75289),
    Qwen2.5-VL-7B (``qwen25_vl_7b``, the pipeline's Qwen2_5_VLForConditionalGeneration, which it reads three layers
    from the top; ``text_layers`` fewer to save memory, at least 3) with ``qwen_tokenizer`` (merges learned on its
    template), a ByT5-small-sized encoder (12 layers of 1472, 6 heads of 64, FFN 3584) with ByT5's byte tokenizer,
    the flow Euler scheduler of shift 5 (HunyuanImage 2.1's own inference default), and the released guiders' kind:
    AdaptiveProjectedMixGuidance (CFG at 3.5 to step 5, then APG at 10 with momentum -0.5 and rescale 10) and an OCR
    guider (APG at 4 from step 2, rescale 5) for prompts with quoted text."""
    from diffusers import (AutoencoderKLHunyuanImage, FlowMatchEulerDiscreteScheduler, HunyuanImagePipeline,
                           HunyuanImageTransformer2DModel)
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    from ddpo_group.models.tiny_random import hunyuan_image_guiders, qwen_tokenizer

    transformer = HunyuanImageTransformer2DModel(num_layers=layers, num_single_layers=single_layers,
                                                 text_embed_2_dim=1472)
    vae = AutoencoderKLHunyuanImage(in_channels=3, out_channels=3, latent_channels=64,
                                    block_out_channels=(128, 256, 512, 512, 1024, 1024), layers_per_block=2,
                                    spatial_compression_ratio=32, sample_size=384, scaling_factor=0.75289)
    layout = HunyuanImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                                  tokenizer_2=None, transformer=None)
    tokenizer = qwen_tokenizer(max_length=2048, template=layout.prompt_template_encode)
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=12,
                                             num_heads=6, feed_forward_proj="gated-gelu"))
    guider, ocr = hunyuan_image_guiders()
    with torch.device("cpu"):  # the scheduler's tables (the weights may be built on another device)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    return HunyuanImagePipeline(scheduler=scheduler, vae=vae, text_encoder=qwen25_vl_7b(tokenizer, text_layers),
                                tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=ByT5Tokenizer(),
                                transformer=transformer, guider=guider, ocr_guider=ocr)


BUILDERS["hunyuan_image"] = build_hunyuan_image


def build_sana_video(layers: int = 20, text_layers: int = 26):
    """SANA-Video 2B 480p (Efficient-Large-Model/SANA-Video_2B_480p_diffusers, diffusers' conversion script's shapes):
    its SanaVideoTransformer3DModel (20 blocks of linear self-attention, 20 heads of 112, cross-attention 20 heads of
    112 over the 2304-wide text, Mix-FFN ratio 3 where the class's default is 2.5, 16 latent channels in 1 x 2 x 2
    patches, sample_size 30: the 480p table; ``layers`` fewer for a fraction), build_sana's Gemma-2-2B-sized decoder
    (``text_layers`` fewer to save memory) and Gemma-style tokenizer, Wan2.1's VAE (AutoencoderKLWan's defaults, as
    build_wan13b), the released flow DPM-Solver++ scheduler (flow shift 8, the script's; the sana_video family swaps
    in the flow Euler one)."""
    from diffusers import AutoencoderKLWan, SanaVideoPipeline, SanaVideoTransformer3DModel

    from ddpo_group.models.tiny_random import gemma_tokenizer

    text_encoder, scheduler = sana_text_and_scheduler(text_layers, flow_shift=8.0)
    return SanaVideoPipeline(tokenizer=gemma_tokenizer(), text_encoder=text_encoder, vae=AutoencoderKLWan(),
                             transformer=SanaVideoTransformer3DModel(num_layers=layers, mlp_ratio=3.0),
                             scheduler=scheduler)


BUILDERS["sana_video"] = build_sana_video


def build_cosmos3(layers: int = 36, sound: bool = True):
    """Cosmos 3 (Cosmos3OmniPipeline): its Cosmos3OmniTransformer at the class defaults, taken as the released shape
    (36 mixture-of-transformers layers of 4096, 32 query / 8 key-value heads of 128, FFN 12288, its own 151936-token
    embedding and head: the model reads token ids, no text encoder; 48 latent channels in 2 x 2 patches; ``layers``
    fewer for a fraction), with ``sound`` its sound head (64 channels, 25 latent frames a second) and the
    Cosmos3AVAEAudioTokenizer at its defaults (diffusers' conversion script's: 48 kHz stereo, a hop of 1920 samples);
    ``qwen_vl_tokenizer`` (merges learned on the pipeline's system prompts and sentences) for the released Qwen3-VL
    tokenizer; Wan2.2-TI2V-5B's VAE, the script's (AutoencoderKLWan: 48 channels, 16x / 4x, base widths 160 and 256;
    latents_mean / latents_std 0 and 1, not the released statistics); the released UniPC scheduler's config; no
    safety checker."""
    from diffusers import AutoencoderKLWan, Cosmos3AVAEAudioTokenizer, Cosmos3OmniPipeline, Cosmos3OmniTransformer
    from diffusers import UniPCMultistepScheduler

    from ddpo_group.models.tiny_random import COSMOS3_TEMPLATE_TEXT, COSMOS3_UNIPC, qwen_vl_tokenizer

    transformer = Cosmos3OmniTransformer(num_hidden_layers=layers, sound_gen=sound, sound_dim=64 if sound else None)
    channels = transformer.config.latent_channel
    vae = AutoencoderKLWan(base_dim=160, decoder_base_dim=256, z_dim=channels, dim_mult=[1, 2, 4, 4],
                           num_res_blocks=2, temperal_downsample=[False, True, True], is_residual=True,
                           in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
                           scale_factor_temporal=4, latents_mean=[0.0] * channels, latents_std=[1.0] * channels)
    with torch.device("cpu"):  # the scheduler's tables (the weights may be built on another device)
        scheduler = UniPCMultistepScheduler(**COSMOS3_UNIPC)
    return Cosmos3OmniPipeline(transformer=transformer, text_tokenizer=qwen_vl_tokenizer(COSMOS3_TEMPLATE_TEXT),
                               vae=vae, scheduler=scheduler,
                               sound_tokenizer=Cosmos3AVAEAudioTokenizer() if sound else None,
                               safety_checker=None, enable_safety_checker=False)


BUILDERS["cosmos3"] = build_cosmos3
