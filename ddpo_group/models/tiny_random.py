"""Tiny random pipelines of each model family built from config (no downloads), saved like checkpoints: what the
tests and the benchmarks run on. Their sizes are those of diffusers' own pipeline tests; the tokenizers are built
locally (a byte-level CLIP vocabulary; a T5-style Unigram tokenizer from the ``tokenizers`` library)."""

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
    vae = _sd_vae()
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


def _sd_vae():
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(8, 16),
        layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=16,
    )


def build_tiny_sdxl_pipeline(seed: int = 0):
    """SDXL at about the size of diffusers' own pipeline tests: a UNet with the "text_time" added embedding (pooled
    text embedding and the six size ids), CLIP-L-like and CLIP-G-like text encoders (the second with projection),
    the Stable Diffusion VAE above, DDIM with SDXL's betas; 16 px images (8x8 latents)."""
    from diffusers import StableDiffusionXLPipeline

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, cross_attention_dim=64, norm_num_groups=8,
        addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + 32,  # six size ids of 8 + the pooled projection (32)
    )
    tokenizer, text_encoder = _clip(projection=False)
    tokenizer_2, text_encoder_2 = _clip(projection=True)
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1, timestep_spacing="leading")
    return StableDiffusionXLPipeline(vae=_sd_vae(), text_encoder=text_encoder, text_encoder_2=text_encoder_2,
                                     tokenizer=tokenizer, tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler)


# ----------------------------------------------------------------------------- flow-matching families (SD3, FLUX, Wan)
def t5_tokenizer(max_length: int = 16):
    """A T5-style fast tokenizer built locally: a Unigram model over characters, '</s>' appended, '<pad>' padding."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(c, -1.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    backend = Tokenizer(models.Unigram(pieces, unk_id=2))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", extra_ids=0,
                           model_max_length=max_length)


def _t5_encoder():
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=40, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                   relative_attention_num_buckets=8))


def _clip(projection: bool, max_length: int = 16):
    from transformers import CLIPTextModelWithProjection

    tokenizer = CLIPTokenizer(vocab=byte_level_vocab(), merges=[], model_max_length=max_length)
    config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=max_length, projection_dim=32, bos_token_id=0,
                            eos_token_id=1, pad_token_id=1, hidden_act="gelu")
    return tokenizer, (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def _flow_vae():
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=16, shift_factor=0.0609, scaling_factor=1.5035,
        use_quant_conv=False, use_post_quant_conv=False,
    )


def build_tiny_sd3_pipeline(seed: int = 0, with_t5: bool = False):
    """SD3 at the size of diffusers' own pipeline tests: an SD3Transformer2DModel with one layer, two CLIP text
    encoders with projection, no T5 by default (the pipeline then uses zeros for the T5 part), a 4-channel VAE."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(sample_size=8, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8,
                                        num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
                                        pooled_projection_dim=64, out_channels=4)
    tokenizer, text_encoder = _clip(projection=True)
    tokenizer_2, text_encoder_2 = _clip(projection=True)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=_flow_vae(),
        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        text_encoder_3=_t5_encoder() if with_t5 else None, tokenizer_3=t5_tokenizer() if with_t5 else None,
    )


def build_tiny_flux_pipeline(seed: int = 0, guidance_embeds: bool = True):
    """FLUX.1 at the size of diffusers' own pipeline tests: a FluxTransformer2DModel with one double and one single
    block (packed 16-channel tokens of a 4-channel VAE), a CLIP text encoder and a tiny T5."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
                                         guidance_embeds=guidance_embeds)
    tokenizer, text_encoder = _clip(projection=False)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    return FluxPipeline(transformer=transformer, scheduler=scheduler, vae=_flow_vae(), text_encoder=text_encoder,
                        tokenizer=tokenizer, text_encoder_2=_t5_encoder(), tokenizer_2=t5_tokenizer())


def build_tiny_flux_kontext_pipeline(seed: int = 0, guidance_embeds: bool = True):
    """FLUX.1 Kontext: the tiny FLUX.1's components (``build_tiny_flux_pipeline``) in a FluxKontextPipeline, as
    diffusers' own Kontext pipeline test builds it from the FLUX test's."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**build_tiny_flux_pipeline(seed, guidance_embeds).components)


def build_tiny_wan_pipeline(seed: int = 0, boundary_ratio: float | None = None):
    """Wan2.1 text-to-video at the size of diffusers' own pipeline test: a WanTransformer3DModel with two layers
    (patches 1 x 2 x 2), a tiny AutoencoderKLWan (16 latent channels; time / 4, space / 8), a tiny UMT5 encoder and the
    T5-style tokenizer; the released models' UniPC scheduler (flow_shift 3), which the family replaces by the flow
    Euler one of that shift. 5 frames of 16 x 16 px: latents [16, 2, 2, 2]. With ``boundary_ratio``: Wan2.2-T2V-A14B's
    layout, a second transformer (the low-noise expert ``transformer_2``) for the steps with t < boundary_ratio 1000."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=40, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                               relative_attention_num_buckets=8)).eval()
    def transformer():
        return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                     in_channels=16, out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32,
                                     num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                     rope_max_seq_len=32)

    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return WanPipeline(tokenizer=t5_tokenizer(), text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                       transformer=transformer(), transformer_2=transformer() if boundary_ratio is not None else None,
                       boundary_ratio=boundary_ratio)


def build_tiny_wan_i2v_pipeline(seed: int = 0, boundary_ratio: float | None = None):
    """Wan image-to-video at the size of diffusers' own pipeline test: the tiny Wan text-to-video's text encoder,
    tokenizer, VAE and scheduler (``build_tiny_wan_pipeline``), a WanTransformer3DModel reading 36 channels (the
    noisy latent, the first-frame mask's 4 and the image's latent 16) and, as Wan2.1-I2V, a CLIP vision encoder
    (32 px images in 8 px patches: 17 tokens of width 4) with its image processor, whose tokens the cross-attention
    reads through its added key / value projections (``added_kv_proj_dim``: the transformer then takes the context's
    last 512 tokens as the text's). With ``boundary_ratio``:
    Wan2.2-I2V-A14B's layout, two experts and no image encoder."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    t2v = build_tiny_wan_pipeline(seed)
    torch.manual_seed(seed)
    with_encoder = boundary_ratio is None

    def transformer():
        return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                     in_channels=36, out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32,
                                     num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                     rope_max_seq_len=32, image_dim=4 if with_encoder else None,
                                     added_kv_proj_dim=24 if with_encoder else None)

    image_encoder = image_processor = None
    if with_encoder:
        image_encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=4, num_hidden_layers=2, num_attention_heads=2,
                                                         image_size=32, intermediate_size=16, patch_size=8)).eval()
        image_processor = CLIPImageProcessor(crop_size=32, size=32)
    return WanImageToVideoPipeline(tokenizer=t2v.tokenizer, text_encoder=t2v.text_encoder, vae=t2v.vae,
                                   scheduler=t2v.scheduler, image_processor=image_processor,
                                   image_encoder=image_encoder, transformer=transformer(),
                                   transformer_2=None if with_encoder else transformer(),
                                   boundary_ratio=boundary_ratio)


def save_pipeline(pipe, path) -> str:
    pipe.save_pretrained(str(path))
    return str(path)


TINY_BUILDERS = {"sd": build_tiny_pipeline, "sdxl": build_tiny_sdxl_pipeline, "sd3": build_tiny_sd3_pipeline,
                 "flux": build_tiny_flux_pipeline, "wan": build_tiny_wan_pipeline,
                 "wan_i2v": build_tiny_wan_i2v_pipeline}

# --------------------------------------------------------------- Qwen tokenizers (Z-Image, FLUX.2 klein, Qwen-Image)
# Qwen3's chat template for one user message (no tools, no history): what Z-Image's and FLUX.2 klein's encode_prompt
# render (add_generation_prompt=True; enable_thinking=False adds the empty think block, as klein asks)
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and "
    "enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")


def qwen_tokenizer(max_length: int = 512, template: str = ""):
    """A Qwen2/Qwen3-style byte-level BPE tokenizer built locally: the 256 byte symbols (no merges, so any text
    tokenizes, one token a byte), Qwen's special tokens ('<|endoftext|>' pads, right side) and Qwen3's chat template.
    With a ``template`` (a pipeline's prompt template), BPE merges learned on its words make each of them one token, as
    in Qwen's vocabulary (Qwen-Image drops its template's first tokens by count)."""
    from transformers import Qwen2Tokenizer

    from ddpo_group.models.tokenizer import bytes_to_unicode

    vocab = {symbol: i for i, symbol in enumerate(bytes_to_unicode().values())}
    merges = template_merges(template) if template else []
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=max_length, padding_side="right")
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS[1:])})
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def template_merges(template: str) -> list[tuple[str, str]]:
    """Byte-level BPE merges (``tokenizers``' trainer) that make each word of ``template`` one token."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = template.replace("{}", "\n")
    for token in QWEN_SPECIAL_TOKENS:  # special tokens split the text: the words after them start without a space
        text = text.replace(token, "\n")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=1000, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([text] * 2, trainer)  # each word twice: merged to one token
    return [tuple(pair) for pair in json.loads(backend.to_str())["model"]["merges"]]




# ----------------------------------------------------------------------------- Z-Image (a Qwen3 text encoder)
def build_tiny_zimage_pipeline(seed: int = 0):
    """Z-Image at the size of diffusers' own pipeline test: a ZImageTransformer2DModel of width 32 (2 layers, 1
    refiner layer), a 2-layer Qwen3 text encoder of width 16 with the tokenizer above, the 16-channel VAE of that test,
    Z-Image-Turbo's scheduler (shift 3, no dynamic shifting); 32 px images (16x16 latents: 64 tokens of 2x2 patches)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2,
        n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0,
        axes_dims=[8, 4, 4], axes_lens=[256, 32, 32],
    )
    with torch.no_grad():  # torch.empty in the constructor: fixed values, as diffusers' test does
        transformer.x_pad_token.copy_(torch.ones_like(transformer.x_pad_token))
        transformer.cap_pad_token.copy_(torch.ones_like(transformer.cap_pad_token))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(32, 64), layers_per_block=1,
        latent_channels=16, norm_num_groups=32, sample_size=32, scaling_factor=0.3611, shift_factor=0.1159,
    )
    tokenizer = qwen_tokenizer()
    text_encoder = Qwen3Model(Qwen3Config(
        hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        head_dim=8, vocab_size=len(tokenizer), max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
    ))
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    return ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)


TINY_BUILDERS["zimage"] = build_tiny_zimage_pipeline
TINY_BUILDERS["flux_kontext"] = build_tiny_flux_kontext_pipeline

# ----------------------------------------------------------------------------- FLUX.2 [klein] (flux2)
def build_tiny_flux2_pipeline(seed: int = 0, is_distilled: bool = True):
    """FLUX.2 [klein] at about the size of diffusers' own pipeline test: a Flux2Transformer2DModel with one double and
    one single block on 4-D position ids, a Qwen3 text encoder of 27 layers (the pipeline stacks the hidden states of
    layers 9, 18 and 27: 3 x 16 = the transformer's 48-wide text input), a 4-channel AutoencoderKLFlux2 (16-channel
    packed tokens) whose batch-norm statistics are random (the real ones are not the identity), the dynamic shift.
    ``is_distilled``: klein's step-distilled models (no CFG); False: the base models (CFG with the empty prompt)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=48,
                                          timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4],
                                          guidance_embeds=False)
    tokenizer = qwen_tokenizer()
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=16, num_hidden_layers=27, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=True))
    vae = AutoencoderKLFlux2(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                             latent_channels=4, norm_num_groups=4, sample_size=32, use_quant_conv=False,
                             use_post_quant_conv=False)
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.1 * torch.randn_like(vae.bn.running_mean))
        vae.bn.running_var.copy_(0.5 + torch.rand_like(vae.bn.running_var))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096,
                                                time_shift_type="exponential")
    return Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=is_distilled)


TINY_BUILDERS["flux2"] = build_tiny_flux2_pipeline


# FLUX.2 [dev]: Mistral Small 3.1's chat template for text-only turns (content a string or a list of text parts):
# what Flux2Pipeline renders (a system turn with its SYSTEM_MESSAGE, then the user turn; no generation prompt)
MISTRAL3_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{%- if message['content'] is string %}"
    "{%- set text = message['content'] %}{%- else %}{%- set text = message['content'] | selectattr('type', 'equalto', "
    "'text') | map(attribute='text') | join('') %}{%- endif %}{%- if message['role'] == 'system' %}"
    "{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}{%- elif message['role'] == 'user' %}"
    "{{- '[INST]' + text + '[/INST]' }}{%- else %}{{- text + eos_token }}{%- endif %}{%- endfor %}"
)


def mistral_tokenizer(max_length: int = 512):
    """A Mistral-style byte-level BPE tokenizer built locally (the 256 byte symbols, Mistral's control tokens) with
    Mistral Small 3.1's text chat template. FLUX.2-dev ships a PixtralProcessor around its tokenizer; the processor
    needs torchvision, so the tiny dev pipeline's ``tokenizer`` is the tokenizer itself: for text the two render the
    same template and tokenize the same string (the pipeline only calls ``apply_chat_template``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ddpo_group.models.tokenizer import bytes_to_unicode

    backend = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(bytes_to_unicode().values())}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        model_max_length=max_length, chat_template=MISTRAL3_CHAT_TEMPLATE,
        additional_special_tokens=["[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]",
                                   "[IMG_END]"])


def build_tiny_flux2_dev_pipeline(seed: int = 0):
    """FLUX.2 [dev] at about the size of diffusers' own pipeline test: the klein transformer above with the guidance
    embedding, a Mistral3ForConditionalGeneration whose language model has 30 layers (the pipeline stacks layers 10,
    20 and 30: 3 x 16 wide) and a one-layer Pixtral vision tower (unused by text-to-image), ``mistral_tokenizer``, the
    FLUX.2 VAE and scheduler above."""
    from diffusers import Flux2Pipeline, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    klein = build_tiny_flux2_pipeline(seed)
    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=48,
                                          timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4],
                                          guidance_embeds=True)
    tokenizer = mistral_tokenizer()
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config={"model_type": "mistral", "vocab_size": len(tokenizer), "hidden_size": 16, "intermediate_size": 37,
                     "max_position_embeddings": 512, "num_attention_heads": 4, "num_hidden_layers": 30,
                     "num_key_value_heads": 2, "head_dim": 4, "rms_norm_eps": 1e-5, "sliding_window": None, **ids},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 4,
                       "intermediate_size": 37, "image_size": 32, "patch_size": 8, "num_channels": 3},
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), vision_feature_layer=-1, **ids))
    return Flux2Pipeline(scheduler=klein.scheduler, vae=klein.vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=transformer)


TINY_BUILDERS["flux2_dev"] = build_tiny_flux2_dev_pipeline

# ----------------------------------------------------------------------------- Qwen-Image
def qwenimage_scheduler():
    """Qwen-Image's scheduler config (Qwen/Qwen-Image's scheduler_config.json, as published): dynamic shifting from
    256 to 8192 image tokens (mu from 0.5 to 0.9), an exponential time shift, the last sigma stretched to 0.02."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
                                           shift=1.0, shift_terminal=0.02, time_shift_type="exponential",
                                           use_dynamic_shifting=True)


def build_tiny_qwenimage_pipeline(seed: int = 0):
    """Qwen-Image at the size of diffusers' own pipeline tests: a QwenImageTransformer2DModel with two blocks on packed
    16-channel tokens of a 4-channel AutoencoderKLQwenImage (latents_mean / latents_std not the identity, so the decode's
    de-normalization is exercised; 4 wide, where diffusers' test's is 24: the pipeline's default 512 px decodes in a
    second on a CPU core), a two-layer Qwen2.5-VL text encoder, ``qwen_tokenizer`` with merges learned on
    the pipeline's prompt template, Qwen-Image's scheduler (dynamic shifting, exponential time shift, shift_terminal
    0.02)."""
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=3, joint_attention_dim=16,
                                              guidance_embeds=False, axes_dims_rope=(8, 4, 4))
    vae = AutoencoderKLQwenImage(base_dim=4, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.1, -0.2, 0.05, 0.3],
                                 latents_std=[1.5, 0.8, 2.0, 1.2])
    scheduler = qwenimage_scheduler()
    # the pipeline sets its prompt template in __init__: read it from a pipeline without components
    template = QwenImagePipeline(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None,
                                 transformer=None).prompt_template_encode
    tokenizer = qwen_tokenizer(template=template)
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "rope_theta": 1000000.0,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                     "vocab_size": len(tokenizer), "bos_token_id": ids("<|endoftext|>"),
                     "eos_token_id": ids("<|im_end|>")},
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        hidden_size=16, vocab_size=len(tokenizer),  # the vision token ids: Qwen's, outside this vocabulary (text only)
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)


TINY_BUILDERS["qwenimage"] = build_tiny_qwenimage_pipeline


# ----------------------------------------------------------------------------- Qwen-Image-Edit(-Plus)
QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def qwen_vl_tokenizer(template: str):
    """``qwen_tokenizer`` (merges learned on the pipeline's ``template``) with Qwen2.5-VL's vision special tokens."""
    tokenizer = qwen_tokenizer(template=template)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS[1:] + QWEN_VISION_TOKENS)})
    return tokenizer


def qwen_vl_processor(tokenizer):
    """A Qwen2VLProcessor built locally: ``tokenizer`` and a Qwen2VLImageProcessor from its constructor (Qwen2.5-VL's
    14 px patches merged 2x2, its normalization), at most 112 x 112 px an image (16 vision tokens; Qwen's own allows
    12.8 MP). transformers' processor needs a video processor, which needs torchvision: ImportError without it."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=112 * 112, patch_size=14, merge_size=2,
                                            temporal_patch_size=2)
    video_processor = Qwen2VLVideoProcessor()  # the processor's third component (the pipelines send no video)
    return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor)


def build_tiny_qwenimage_edit_plus_pipeline(seed: int = 0, pipeline_class=None):
    """Qwen-Image-Edit-Plus (2509 / 2511) at the size of diffusers' own pipeline test: the tiny Qwen-Image's
    transformer, VAE and scheduler (``build_tiny_qwenimage_pipeline``), a two-layer Qwen2.5-VL whose two-block vision
    tower reads the source images (its vision token ids the tokenizer's), ``qwen_vl_processor`` (None without
    torchvision)."""
    from diffusers import QwenImageEditPlusPipeline
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    pipeline_class = pipeline_class or QwenImageEditPlusPipeline
    base = build_tiny_qwenimage_pipeline(seed)
    template = pipeline_class(scheduler=base.scheduler, vae=None, text_encoder=None, tokenizer=None, processor=None,
                              transformer=None).prompt_template_encode
    tokenizer = qwen_vl_tokenizer(template)
    try:
        processor = qwen_vl_processor(tokenizer)
    except ImportError:  # no torchvision: a pipeline without its processor (the family's condition refuses it)
        processor = None
    ids = tokenizer.convert_tokens_to_ids
    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "rope_theta": 1000000.0,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                     "vocab_size": len(tokenizer), "bos_token_id": ids("<|endoftext|>"),
                     "eos_token_id": ids("<|im_end|>")},
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        hidden_size=16, vocab_size=len(tokenizer), image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    return pipeline_class(scheduler=base.scheduler, vae=base.vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          processor=processor, transformer=base.transformer)


TINY_BUILDERS["qwenimage_edit_plus"] = build_tiny_qwenimage_edit_plus_pipeline


def build_tiny_qwenimage_edit_pipeline(seed: int = 0):
    """Qwen-Image-Edit (one source image): ``build_tiny_qwenimage_edit_plus_pipeline``'s components in
    QwenImageEditPipeline (the tokenizer's merges on its template)."""
    from diffusers import QwenImageEditPipeline

    return build_tiny_qwenimage_edit_plus_pipeline(seed, pipeline_class=QwenImageEditPipeline)


TINY_BUILDERS["qwenimage_edit"] = build_tiny_qwenimage_edit_pipeline


# ----------------------------------------------------------------------------- SANA
def gemma_tokenizer(max_length: int = 2048):
    """A Gemma-style tokenizer built locally: Gemma's special tokens ('<bos>' added first, '<pad>' padding), the 256 byte
    fallback tokens and the printable ASCII characters (with Gemma's '▁' for a space) as single tokens, no merges: any
    text tokenizes, one token a character."""
    import string

    from transformers import GemmaTokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
    vocab.update({f"<0x{b:02X}>": 5 + b for b in range(256)})
    for symbol in "\u2581" + string.ascii_letters + string.digits + string.punctuation:
        vocab.setdefault(symbol, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=[], model_max_length=max_length, add_bos_token=True)


def build_tiny_sana_pipeline(seed: int = 0):
    """SANA at about the size of diffusers' own pipeline test: a SanaTransformer2DModel with two blocks (patch 1,
    sample_size 32: the pipeline's 1024 px table), a two-layer Gemma-2 text encoder of width 16 with
    ``gemma_tokenizer``, and a 4-channel AutoencoderDC with SANA's factor 32 (six stages of ResBlocks, 4 to 8 channels:
    its 1024 px default is 32 x 32 latents), the released models' DPM-Solver scheduler (flow prediction, flow shift 3),
    which the family swaps for the flow Euler one of that shift."""
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(seed)
    transformer = SanaTransformer2DModel(patch_size=1, in_channels=4, out_channels=4, num_layers=2,
                                         num_attention_heads=2, attention_head_dim=4, num_cross_attention_heads=2,
                                         cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=16,
                                         sample_size=32)
    stages = 6  # vae_scale_factor 2 ** (stages - 1) = 32
    vae = AutoencoderDC(in_channels=3, latent_channels=4, attention_head_dim=2, encoder_block_types="ResBlock",
                        decoder_block_types="ResBlock", encoder_block_out_channels=(4,) * (stages - 1) + (8,),
                        decoder_block_out_channels=(4,) * (stages - 1) + (8,),
                        encoder_layers_per_block=(0,) + (1,) * (stages - 1),
                        decoder_layers_per_block=(0,) + (1,) * (stages - 1),
                        encoder_qkv_multiscales=((),) * stages, decoder_qkv_multiscales=((),) * stages,
                        decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407)
    tokenizer = gemma_tokenizer()
    text_encoder = Gemma2Model(Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=2048, pad_token_id=0, bos_token_id=2,
        eos_token_id=1, attn_implementation="eager")).eval()
    scheduler = DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return SanaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                        scheduler=scheduler)


TINY_BUILDERS["sana"] = build_tiny_sana_pipeline


def build_tiny_sana_video_pipeline(seed: int = 0, vae: str = "wan"):
    """SANA-Video at a tiny size: a SanaVideoTransformer3DModel with two blocks (2 heads of 12, patches 1 x 2 x 2,
    sample_size 30: the pipeline's 480p table; rotary tables of 32 positions an axis), the tiny SANA's Gemma-2 text
    encoder and ``gemma_tokenizer``, the released DPM-Solver++ scheduler (flow prediction, flow shift 3), which the
    family swaps for the flow Euler one of that shift, and the 480p model's VAE, the tiny Wan's AutoencoderKLWan (16
    channels; time / 4, space / 8: 5 frames of 32 x 32 px are latents [16, 2, 4, 4]). ``vae="ltx2"``: the 720p
    model's layout, the tiny LTX-2's video VAE (4 channels; time / 8, space / 32) under a transformer of patch 1 and
    sample_size 22 (the 720p table)."""
    from diffusers import DPMSolverMultistepScheduler, SanaVideoPipeline, SanaVideoTransformer3DModel

    components = build_tiny_sana_pipeline(seed).components
    autoencoder = (build_tiny_wan_pipeline(seed) if vae == "wan" else build_tiny_ltx2_pipeline(seed)).vae
    channels = autoencoder.config.z_dim if vae == "wan" else autoencoder.config.latent_channels
    if vae != "wan":  # the pipeline reads the factors from the config, where the released 720p VAE states them
        autoencoder.register_to_config(spatial_compression_ratio=autoencoder.spatial_compression_ratio,
                                       temporal_compression_ratio=autoencoder.temporal_compression_ratio)
    torch.manual_seed(seed)
    transformer = SanaVideoTransformer3DModel(
        in_channels=channels, out_channels=channels, num_attention_heads=2, attention_head_dim=12, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=12, cross_attention_dim=24, caption_channels=16,
        sample_size=30 if vae == "wan" else 22, patch_size=(1, 2, 2) if vae == "wan" else (1, 1, 1),
        rope_max_seq_len=32)
    scheduler = DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return SanaVideoPipeline(tokenizer=components["tokenizer"], text_encoder=components["text_encoder"],
                             vae=autoencoder, transformer=transformer, scheduler=scheduler)


TINY_BUILDERS["sana_video"] = build_tiny_sana_video_pipeline


# ----------------------------------------------------------------------------- Qwen-Image 2.1
# Qwen3-VL's chat template for text turns (content a string or a list of text parts): what QwenImage21Pipeline renders
# to count its system turn's tokens
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}{%- if message['content'] is string %}"
    "{{- message['content'] }}{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}"
    "{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwen3_vl_processor(tokenizer):
    """A Qwen3VLProcessor built locally: ``tokenizer`` (its chat template Qwen3-VL's for text), a Qwen2VLImageProcessor
    with Qwen3-VL's 16 px patches merged 2 x 2 (at most 128 x 128 px an image) and, with torchvision, a
    Qwen3VLVideoProcessor; without torchvision the processor is built without one
    (tests/helpers/processor_without_video.py: the pipeline sends no video), which transformers itself refuses."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor

    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    image_processor = Qwen2VLImageProcessor(min_pixels=32 * 32, max_pixels=128 * 128, patch_size=16, merge_size=2,
                                            temporal_patch_size=2)
    try:
        from transformers import Qwen3VLVideoProcessor

        video_processor = Qwen3VLVideoProcessor()
    except ImportError:
        video_processor = None
    try:
        return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
                                chat_template=QWEN3_VL_CHAT_TEMPLATE)
    except AttributeError as error:  # transformers' check of the missing video processor
        raise ImportError('transformers\' Qwen3VLProcessor needs torchvision for its video processor: pip install -e '
                          '".[models]" (torchvision built for your torch)') from error


def tiny_qwen3_vl_config(tokenizer, **extra):
    """A Qwen3-VL of width 16: two text layers (2 heads of 8, interleaved M-RoPE), a one-block vision tower the
    text-to-image pipelines do not run; ``extra``: the config's other fields (the vision token ids)."""
    from transformers import Qwen3VLConfig

    ids = tokenizer.convert_tokens_to_ids
    return Qwen3VLConfig(
        text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "head_dim": 8, "vocab_size": len(tokenizer),
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 1, 1],
                                         "mrope_interleaved": True},
                     "bos_token_id": ids("<|endoftext|>"), "eos_token_id": ids("<|im_end|>")},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16,
                       "patch_size": 16, "deepstack_visual_indexes": [0]}, **extra)


def build_tiny_qwenimage21_pipeline(seed: int = 0):
    """Qwen-Image 2.1 at a tiny size: a QwenImage21Transformer2DModel with two single-stream blocks (2 heads of 16) on
    8-channel latents, an AutoencoderKLQwenImage21 with its 16x spatial factor and its four (RGBA) image channels
    (base width 4; latents_mean / latents_std not the identity), a two-layer Qwen3-VL of width 16 (a one-block vision
    tower the text-to-image pipeline does not run) with ``qwen_vl_tokenizer`` (merges learned on the pipeline's
    template) in ``qwen3_vl_processor``, Qwen-Image's scheduler. Its 1024 px default is 64 x 64 latent tokens."""
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Pipeline, QwenImage21Transformer2DModel
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    transformer = QwenImage21Transformer2DModel(patch_size=1, in_channels=8, out_channels=8, num_layers=2,
                                                attention_head_dim=16, num_attention_heads=2, context_in_dim=16,
                                                mlp_ratio=2, axes_dims_rope=(4, 6, 6))
    channels = 8
    vae = AutoencoderKLQwenImage21(base_dim=4, decoder_base_dim=4, z_dim=channels, dim_mult=[1, 1, 1, 1, 1],
                                   num_res_blocks=1, temperal_downsample=[False, True, True, True],
                                   latents_mean=[0.1 * (i % 3) - 0.1 for i in range(channels)],
                                   latents_std=[1.0 + 0.25 * (i % 4) for i in range(channels)])
    scheduler = qwenimage_scheduler()
    tokenizer = qwen_vl_tokenizer(QWEN_IMAGE21_TEMPLATE)
    processor = qwen3_vl_processor(tokenizer)
    ids = tokenizer.convert_tokens_to_ids
    config = tiny_qwen3_vl_config(
        tokenizer, image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    text_encoder = Qwen3VLForConditionalGeneration(config).eval()
    return QwenImage21Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, processor=processor,
                               transformer=transformer)


# QwenImage21Pipeline's text-to-image prompt template (set in its __init__, which needs a processor: restated here for
# the tokenizer's merges; tests/models/test_family_qwenimage21.py checks it against the pipeline's)
QWEN_IMAGE21_TEMPLATE = ("<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n"
                         "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")

TINY_BUILDERS["qwenimage21"] = build_tiny_qwenimage21_pipeline


# ----------------------------------------------------------------------------- HunyuanVideo 1.5
def build_tiny_hunyuan_video15_pipeline(seed: int = 0):
    """HunyuanVideo 1.5 text-to-video at a tiny size: a HunyuanVideo15Transformer3DModel with one dual-stream block and
    one refiner block (2 heads of 8) on 4 latent channels (its input: latent, condition latent and mask, 9 channels;
    target_size 32: a small default size), an AutoencoderKLHunyuanVideo15 with the 16x / 4x factors (8 channels a
    stage), a three-layer Qwen2.5-VL text model of width 16 (the pipeline reads the third-to-last hidden states) with
    ``qwen_tokenizer`` (merges learned on the pipeline's system message), a two-layer ByT5-shaped T5 encoder of width 8
    with ByT5's byte tokenizer, a flow Euler scheduler of shift 5 and a ClassifierFreeGuidance guider at 6."""
    from diffusers import (AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline,
                           HunyuanVideo15Transformer3DModel)
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    channels = 4
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=2 * channels + 1, out_channels=channels, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16, text_embed_2_dim=8,
        image_embed_dim=8, rope_axes_dim=(2, 2, 4), target_size=32, task_type="t2v")
    vae = AutoencoderKLHunyuanVideo15(latent_channels=channels, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1,
                                      spatial_compression_ratio=16, temporal_compression_ratio=4)
    import inspect

    system_message = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters[
        "system_message"].default
    tokenizer = qwen_tokenizer(max_length=2048, template=system_message)
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]})).eval()
    tokenizer_2 = ByT5Tokenizer()
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), d_model=8, d_kv=4, d_ff=16, num_layers=2,
                                             num_heads=2, relative_attention_num_buckets=8)).eval()
    return HunyuanVideo15Pipeline(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
                                  scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder_2=text_encoder_2,
                                  tokenizer_2=tokenizer_2, guider=ClassifierFreeGuidance(guidance_scale=6.0))


TINY_BUILDERS["hunyuan_video15"] = build_tiny_hunyuan_video15_pipeline


# ----------------------------------------------------------------------------- LTX-2
def build_tiny_ltx2_pipeline(seed: int = 0):
    """LTX-2 at about the size of diffusers' own pipeline tests: an LTX2VideoTransformer3DModel with two blocks (video 2
    heads of 8, audio 2 heads of 4, 4 latent channels each; LTX-2.3's perturbable self-attention, which the call's
    spatio-temporal guidance skips), a 4-wide LTX-2 video VAE with the real one's 32x / 8x
    factors (the pipeline's 121 frames of 512 x 768 px decode in seconds), the audio VAE (8 mel bins, 2 latent
    channels) and vocoder (stereo at 16 kHz) of that test, its text connectors,
    a two-layer Gemma-3 of width 32 (a one-layer vision tower the pipeline does not run; diffusers' test loads one
    from the hub) with ``gemma_tokenizer``, the flow Euler scheduler."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2Pipeline, LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = gemma_tokenizer(max_length=1024)
    torch.manual_seed(seed)
    text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                     "max_position_embeddings": 2048, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1,
                     "sliding_window": 64},
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 32, "patch_size": 8},
        mm_tokens_per_image=4)).eval()
    hidden = text_encoder.config.text_config.hidden_size
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
        caption_channels=hidden, rope_double_precision=False, rope_type="split", perturbed_attn=True)
    connectors = LTX2TextConnectors(
        caption_channels=hidden, text_proj_in_factor=text_encoder.config.text_config.num_hidden_layers + 1,
        video_connector_num_attention_heads=4, video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1, audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32, rope_theta=10000.0, rope_double_precision=False,
        causal_temporal_positioning=False, rope_type="split")
    vae = AutoencoderKLLTX2Video(  # LTX-2's factors, 32x in space (patches of 4 and three 2x stages) and 8x in time
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(4, 4, 4),
        decoder_block_out_channels=(4, 4, 4), layers_per_block=(1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True), decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(False,) * 4, downsample_type=("spatiotemporal",) * 3,
        upsample_type=("spatiotemporal",) * 3, upsample_residual=(False,) * 3, upsample_factor=(1, 1, 1),
        timestep_conditioning=False, patch_size=4, patch_size_t=1, encoder_causal=True, decoder_causal=False,
        decoder_spatial_padding_mode="zeros")  # (a one-latent-pixel frame cannot be reflect-padded)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8)
    vocoder = LTX2Vocoder(
        in_channels=audio_vae.config.output_channels * audio_vae.config.mel_bins, hidden_channels=32, out_channels=2,
        upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1, output_sampling_rate=16000)
    return LTX2Pipeline(transformer=transformer, vae=vae, audio_vae=audio_vae,
                        scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder=text_encoder, tokenizer=tokenizer,
                        connectors=connectors, vocoder=vocoder)


TINY_BUILDERS["ltx2"] = build_tiny_ltx2_pipeline


# ----------------------------------------------------------------------------- Krea 2
def build_tiny_krea2_pipeline(seed: int = 0, is_distilled: bool = False):
    """Krea 2 at a tiny size: a Krea2Transformer2DModel with two blocks (2 heads of 16, grouped-query) on 2x2-packed
    16-channel tokens of a tiny Qwen-Image VAE with the real one's 8x factor (4 channels, base width 4, latents_mean /
    latents_std not the identity: the call's 1024 px are 64 x 64 tokens, a few seconds a step on a CPU), its text
    fusion over K = 2 tapped layers (one layerwise and one refiner block), a two-layer Qwen3-VL text model of width 16
    whose hidden states 1 and 2 are tapped, ``qwen_tokenizer`` with merges learned on the pipeline's template (its
    34-token prefix and 5-token suffix are 34 and 5 tokens here too, as the pipeline's fixed layout counts them), and
    Krea 2's scheduler (dynamic shifting from 256 to 6400 image tokens, mu 0.5 to 1.15). ``is_distilled``: the Turbo
    layout (mu fixed at 1.15)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Pipeline
    from diffusers import Krea2Transformer2DModel
    from transformers import Qwen3VLModel

    torch.manual_seed(seed)
    transformer = Krea2Transformer2DModel(
        in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=32, timestep_embed_dim=16, text_hidden_dim=16, num_text_layers=2,
        text_num_attention_heads=2, text_num_key_value_heads=2, text_intermediate_size=16,
        num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 6, 6))
    vae = AutoencoderKLQwenImage(base_dim=4, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.05, 0.3],
                                 latents_std=[1.5, 0.8, 2.0, 1.2])
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_image_seq_len=256,
                                                max_image_seq_len=6400, base_shift=0.5, max_shift=1.15)
    layout = Krea2Pipeline(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    tokenizer = qwen_tokenizer(template=layout.prompt_template_encode_prefix + "{}"
                               + layout.prompt_template_encode_suffix)
    text_encoder = Qwen3VLModel(tiny_qwen3_vl_config(tokenizer)).eval()
    return Krea2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=transformer, text_encoder_select_layers=(1, 2), is_distilled=is_distilled)


TINY_BUILDERS["krea2"] = build_tiny_krea2_pipeline


# ----------------------------------------------------------------------------- Ideogram 4
def build_tiny_ideogram4_pipeline(seed: int = 0):
    """Ideogram 4 at a tiny size: two Ideogram4Transformer2DModel of two layers (2 heads of 16, interleaved M-RoPE
    sections 4 / 2 / 2), the conditional ``transformer`` and the ``unconditional_transformer`` of its asymmetric CFG,
    reading the 13 tapped layers (0, 3, ..., 33, 35) of a 36-layer Qwen3-VL text model of width 16 (13 x 16 = 208
    features a token) with ``qwen_tokenizer`` and Qwen3-VL's chat template; an AutoencoderKLFlux2 of five stages (16x,
    4 channels: 16-channel tokens of 2 x 2 patches; batch-norm statistics not the identity), so the call's 2048 px are
    64 x 64 tokens; the flow Euler scheduler, which the pipeline gives its logit-normal sigmas."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline
    from diffusers import Ideogram4Transformer2DModel
    from transformers import Qwen3VLModel

    torch.manual_seed(seed)
    tokenizer = qwen_tokenizer(max_length=4096)
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    config = tiny_qwen3_vl_config(tokenizer)
    config.text_config.num_hidden_layers = 36  # the pipeline taps layers 0 to 35 (QWEN3_VL_ACTIVATION_LAYERS)
    config.text_config.layer_types = ["full_attention"] * 36
    text_encoder = Qwen3VLModel(config).eval()
    features = 13 * config.text_config.hidden_size

    def transformer():
        return Ideogram4Transformer2DModel(in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
                                           intermediate_size=32, adaln_dim=16, llm_features_dim=features,
                                           mrope_section=(4, 2, 2))

    vae = AutoencoderKLFlux2(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 5,
                             up_block_types=("UpDecoderBlock2D",) * 5, block_out_channels=(4, 4, 4, 4, 8),
                             layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=32,
                             use_quant_conv=False, use_post_quant_conv=False)
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.1 * torch.randn_like(vae.bn.running_mean))
        vae.bn.running_var.copy_(0.5 + torch.rand_like(vae.bn.running_var))
    return Ideogram4Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                             tokenizer=tokenizer, transformer=transformer(), unconditional_transformer=transformer())


TINY_BUILDERS["ideogram4"] = build_tiny_ideogram4_pipeline


# ----------------------------------------------------------------------------- Kandinsky 6
def build_tiny_kandinsky6_pipeline(seed: int = 0):
    """Kandinsky 6 text-to-video with audio at a tiny size: a Kandinsky6Transformer3DModel with one text block and two
    fused video / audio blocks (width 32, 2 heads of 16; the released checkpoints' text padding, cross-modal RoPE,
    gates and fixed modulation; 4 video and 6 audio latent channels, widths that differ as the real 16 and 20 do), a
    two-layer Qwen2.5-VL of width 16 with ``qwen_vl_tokenizer`` (merges on the pipeline's template) in
    ``qwen_vl_processor``, the tiny CLIP-L text model (77 tokens, the pipeline's), an AutoencoderKLHunyuanVideo of 4
    channels with 32x / 4x factors (the call's 121 frames of 512 x 768 px are 31 x 16 x 24 latents, 2976 tokens), an
    MMAudio VAE and vocoder (8 mel bins at 16 kHz, a hop of 64 samples: a latent frame every 128), the flow Euler
    scheduler (shift 5)."""
    from diffusers import (AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, Kandinsky6TI2VAPipeline,
                           Kandinsky6Transformer3DModel, MMAudioVAE, MMAudioVocoder)
    from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_ti2va import _PROMPT_TEMPLATE
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    transformer = Kandinsky6Transformer3DModel(
        in_visual_dim=4, out_visual_dim=4, in_text_dim=16, in_text_dim2=32, time_dim=16, patch_size=(1, 2, 2),
        model_dim=32, ff_dim=64, num_text_blocks=1, num_visual_blocks=2, axes_dims=(4, 6, 6), visual_cond=True,
        in_audio_dim=6, out_audio_dim=6, text_token_padding=True, ca_rope=True, cross_gates=True,
        fix_modulation=True)
    tokenizer = qwen_vl_tokenizer(_PROMPT_TEMPLATE)
    ids = tokenizer.convert_tokens_to_ids
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "rope_theta": 1000000.0,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                     "vocab_size": len(tokenizer), "bos_token_id": ids("<|endoftext|>"),
                     "eos_token_id": ids("<|im_end|>"), "max_position_embeddings": 4096},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        hidden_size=16, vocab_size=len(tokenizer), image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"))).eval()
    tokenizer_2, text_encoder_2 = _clip(projection=False, max_length=77)
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 6,
        up_block_types=("HunyuanVideoUpBlock3D",) * 6, block_out_channels=(4,) * 6, layers_per_block=1,
        norm_num_groups=2, spatial_compression_ratio=32, temporal_compression_ratio=4, mid_block_add_attention=False)
    audio_vae = MMAudioVAE(mel_bins=8, latent_channels=6, hidden_channels=8, channel_multipliers=(1, 2),
                           layers_per_block=1, sample_rate=16000, n_fft=256, hop_length=64)
    vocoder = MMAudioVocoder(num_mels=8, upsample_initial_channel=16, upsample_rates=(4, 4, 4),
                             upsample_kernel_sizes=(8, 8, 8), resblock_kernel_sizes=(3,),
                             resblock_dilation_sizes=((1, 3),))
    return Kandinsky6TI2VAPipeline(transformer=transformer, vae=vae, text_encoder=text_encoder,
                                   tokenizer=tokenizer, text_encoder_2=text_encoder_2,
                                   tokenizer_2=tokenizer_2, scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
                                   audio_vae=audio_vae, vocoder=vocoder)


TINY_BUILDERS["kandinsky6"] = build_tiny_kandinsky6_pipeline


# ----------------------------------------------------------------------------- HunyuanImage 2.1
def hunyuan_image_guiders(ocr_guider: bool = True) -> tuple:
    """HunyuanImage 2.1's guiders as its pipeline ships them: adaptive projected guidance from step 5, and the OCR
    guider for quoted text from step 2 (None without it)."""
    from diffusers.guiders import AdaptiveProjectedMixGuidance

    guider = AdaptiveProjectedMixGuidance(guidance_scale=3.5, adaptive_projected_guidance_scale=10.0,
                                          adaptive_projected_guidance_momentum=-0.5,
                                          adaptive_projected_guidance_rescale=10.0,
                                          adaptive_projected_guidance_start_step=5)
    ocr = AdaptiveProjectedMixGuidance(guidance_scale=3.5, adaptive_projected_guidance_scale=4.0,
                                       adaptive_projected_guidance_momentum=-0.5,
                                       adaptive_projected_guidance_rescale=5.0,
                                       adaptive_projected_guidance_start_step=2) if ocr_guider else None
    return guider, ocr


def build_tiny_hunyuan_image_pipeline(seed: int = 0, ocr_guider: bool = True):
    """HunyuanImage 2.1 at a tiny size: a HunyuanImageTransformer2DModel with one dual-stream, one single-stream and one
    refiner block (2 heads of 8, patch 1) on 8 latent channels, an AutoencoderKLHunyuanImage with the real one's 32x
    factor (its 2048 px default is 64 x 64 latents), a three-layer Qwen2.5-VL of width 16 (the pipeline reads the
    third-to-last hidden states) with ``qwen_tokenizer`` (merges learned on its template: the 34 tokens it drops are
    its system turn), a two-layer ByT5-shaped T5 encoder of width 8 with ByT5's byte tokenizer, the flow Euler
    scheduler of shift 4, and the released guiders' kind: AdaptiveProjectedMixGuidance (CFG at 3.5 to step 5, then APG
    at 10 with momentum -0.5 and rescale 10), an OCR guider of other scales for prompts with quoted text."""
    from diffusers import (AutoencoderKLHunyuanImage, FlowMatchEulerDiscreteScheduler, HunyuanImagePipeline,
                           HunyuanImageTransformer2DModel)
    from transformers import ByT5Tokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, T5Config
    from transformers import T5EncoderModel

    torch.manual_seed(seed)
    channels = 8
    transformer = HunyuanImageTransformer2DModel(
        in_channels=channels, out_channels=channels, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=(1, 1), text_embed_dim=16,
        text_embed_2_dim=8, rope_axes_dim=(4, 4))
    vae = AutoencoderKLHunyuanImage(in_channels=3, out_channels=3, latent_channels=channels,
                                    block_out_channels=(32,) * 6, layers_per_block=1,
                                    spatial_compression_ratio=32, sample_size=64, scaling_factor=0.75)
    layout = HunyuanImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                                  tokenizer_2=None, transformer=None)
    tokenizer = qwen_tokenizer(max_length=2048, template=layout.prompt_template_encode)
    ids = tokenizer.convert_tokens_to_ids
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "rope_theta": 1000000.0, "max_position_embeddings": 2048,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                     "vocab_size": len(tokenizer), "bos_token_id": ids("<|endoftext|>"),
                     "eos_token_id": ids("<|im_end|>")},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        hidden_size=16, vocab_size=len(tokenizer))).eval()
    tokenizer_2 = ByT5Tokenizer()
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), d_model=8, d_kv=4, d_ff=16, num_layers=2,
                                             num_heads=2, relative_attention_num_buckets=8)).eval()
    guider, ocr = hunyuan_image_guiders(ocr_guider)
    return HunyuanImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=4.0), vae=vae,
                                text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2,
                                tokenizer_2=tokenizer_2, transformer=transformer, guider=guider, ocr_guider=ocr)


TINY_BUILDERS["hunyuan_image"] = build_tiny_hunyuan_image_pipeline



# ----------------------------------------------------------------------------- Cosmos 3
# the texts Cosmos3OmniPipeline tokenizes around a prompt (its system prompts and its duration / resolution sentences),
# on which the tiny tokenizer learns its merges
COSMOS3_TEMPLATE_TEXT = (
    "You are a helpful assistant who will generate images from a give prompt.\n"
    "You are a helpful assistant who will generate videos from a give prompt.\n"
    "The video is seconds long and is of FPS. The video is not seconds long and is not of FPS.\n"
    "This image is of resolution. This image is not of resolution.\n"
    "This video is of resolution. This video is not of resolution.\n"
    "system user assistant\n")
# the released checkpoints' UniPC scheduler (flow prediction on Karras sigmas between 0.147 and 200 mapped by
# s / (1 + s): 0.995 down to 0.128, then 0; order 2), which the cosmos3 family swaps for Euler steps on its sigmas
COSMOS3_UNIPC = dict(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=1.0,
                     use_karras_sigmas=True, sigma_min=0.147, sigma_max=200.0, solver_order=2, solver_type="bh2",
                     lower_order_final=True, final_sigmas_type="zero", timestep_spacing="linspace")


def build_tiny_cosmos3_pipeline(seed: int = 0, sound: bool = True):
    """Cosmos 3 at a tiny size: a Cosmos3OmniTransformer of width 32 (two mixture-of-transformers layers, 4 query and 2
    key / value heads of 8, 3D M-RoPE sections 2 / 1 / 1) on 16 latent channels in 2 x 2 patches, reading token ids
    of ``qwen_vl_tokenizer`` (merges learned on the pipeline's system prompts and sentences; ``<|vision_start|>`` its
    start of generation); the tiny Wan's AutoencoderKLWan (16 channels, time / 4, space / 8) with per-channel latent
    statistics; the released UniPC scheduler's config; with ``sound``, the transformer's sound head (8 channels at 25
    latent frames a second) and a Cosmos3AVAEAudioTokenizer at the released 48 kHz and hop of 1920 samples (stereo,
    width 4); no safety checker."""
    from diffusers import (AutoencoderKLWan, Cosmos3AVAEAudioTokenizer, Cosmos3OmniPipeline, Cosmos3OmniTransformer,
                           UniPCMultistepScheduler)

    torch.manual_seed(seed)
    tokenizer = qwen_vl_tokenizer(COSMOS3_TEMPLATE_TEXT)
    channels, patch, sound_dim = 16, 2, 8
    transformer = Cosmos3OmniTransformer(
        hidden_size=32, intermediate_size=64, head_dim=8, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, latent_channel=channels, latent_patch_size=patch, patch_latent_dim=channels * patch * patch,
        vocab_size=len(tokenizer), rope_axes_dim=[2, 1, 1], dtype="float32", sound_gen=sound,
        sound_dim=sound_dim if sound else None, sound_latent_fps=25.0).eval()
    vae = AutoencoderKLWan(base_dim=3, z_dim=channels, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], scale_factor_spatial=8, scale_factor_temporal=4)
    vae.register_to_config(latents_mean=(0.1 * torch.randn(channels)).tolist(),
                           latents_std=(0.5 + torch.rand(channels)).tolist())
    sound_tokenizer = Cosmos3AVAEAudioTokenizer(
        sampling_rate=48000, vocoder_input_dim=sound_dim, dec_dim=4, dec_c_mults=(1, 1, 1, 1, 1),
        dec_strides=(2, 4, 5, 6, 8), dec_out_channels=2, stereo=True, enc_dim=4, enc_num_blocks=1,
        enc_latent_dim=2 * sound_dim, enc_c_mults=(1, 1, 1), enc_strides=(4, 5, 6)).eval() if sound else None
    return Cosmos3OmniPipeline(transformer=transformer, text_tokenizer=tokenizer, vae=vae.eval(),
                               scheduler=UniPCMultistepScheduler(**COSMOS3_UNIPC), sound_tokenizer=sound_tokenizer,
                               safety_checker=None, enable_safety_checker=False)


TINY_BUILDERS["cosmos3"] = build_tiny_cosmos3_pipeline
