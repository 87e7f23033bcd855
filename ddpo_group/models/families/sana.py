"""SANA (SanaPipeline: Sana 0.6B / 1.6B, SANA 1.5 1.6B / 4.8B): a linear-attention DiT on the 32x DC-AE latent, a
Gemma-2 text encoder.

    condition   prompt_embeds [B, L, D] and prompt_attention_mask [B, L]: Gemma-2's last hidden states of the prompt
                (lower-cased) after the pipeline's complex human instruction (its call's default), of which the
                pipeline keeps the first token and the last L - 1 (L = ``pretrained.max_sequence_length``, 0: the
                call's 300), exactly ``encode_prompt``. The unconditional condition is base.py's negative prompt
                ("" by default, the pipeline's), encoded as the pipeline encodes a negative prompt: without the
                instruction (``encode_negative``)
    latents     [B, C, H/f, W/f] (f = the DC-AE's factor, 32), x_0 = N(0, I) drawn in float32 (``prepare_latents``)
    schedule    the released checkpoints ship DPMSolverMultistepScheduler (flow prediction, a flow shift): a multistep
                solver, whose step reads the previous steps' outputs and so is no one-step policy. ``load_pipeline``
                swaps it for the flow Euler scheduler of the checkpoint's own ``flow_shift``, in training and evaluation
                alike, and says so in a warning (flow_matching.py's ``flow_euler_scheduler``: a scheduler that is no
                flow solver, or has no shift, is refused; no shift is assumed), so the pipeline's own ``__call__``
                and our sampler at noise level 0 take the same Euler steps, bitwise (Cosmos-RL's SANA recipe samples
                its rollouts with an Euler solver too); the released pipeline's DPM-Solver++ samples another trajectory
    output      v = transformer(x, t * timestep_scale, prompt_embeds, mask), CFG as the pipeline computes it: one
                forward of [negative; conditional], v = v_n + w (v_c - v_n) (w <= 1: no guidance); a learned-sigma
                transformer's (out_channels = 2 C) first half
    size        the pipeline maps the size it is asked for to its aspect-ratio table (``use_resolution_binning``, on
                by default) and resizes the decoded image back to the asked size: the family samples the size it asks
                for and passes ``use_resolution_binning=False``. ``sample.resolution=0`` is what the call samples given
                no size: its 1024 x 1024 mapped by that table (1024 px for a transformer of sample_size 32, 512 px for
                16, 2048 for 64, 4096 for 128); the transformer has no position table (any multiple of f)
    step        flow matching (models/families/flow_matching.py, sampling/flow_steps.py)
    decode      latents / scaling_factor, AutoencoderDC.decode, the image processor's [0, 1]

A guidance-distilled SANA (SANA-Sprint: ``guidance_embeds``) is SanaSprintPipeline's and is refused.
"""

from __future__ import annotations

import inspect

import torch
from diffusers import SanaPipeline
from diffusers.image_processor import PixArtImageProcessor
from diffusers.pipelines.sana import pipeline_sana

from ddpo_group.models.families import register_family
from ddpo_group.models.families.flow_matching import FlowMatchingFamily, flow_euler_scheduler



def call_default(pipeline_class, name: str):
    """A keyword's default in a pipeline's own ``__call__``."""
    return inspect.signature(pipeline_class.__call__).parameters[name].default


@register_family("sana", SanaPipeline)
class SanaFamily(FlowMatchingFamily):
    cond_keys = ("prompt_embeds", "prompt_attention_mask")
    patch_size = 1  # set from the transformer in __init__ (the released models' 1)
    # SanaPipeline's call keeps its latents in float32 (the transformer reads a copy in its dtype)
    latents_dtype = torch.float32
    # the self- and cross-attention projections of every block: Cosmos-RL's SANA LoRA targets
    lora_target_modules = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                           "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")

    # the pipeline's aspect-ratio tables by the transformer's sample_size (SanaPipeline.__call__'s choice)
    resolution_bins = {128: pipeline_sana.ASPECT_RATIO_4096_BIN, 64: pipeline_sana.ASPECT_RATIO_2048_BIN,
                       32: pipeline_sana.ASPECT_RATIO_1024_BIN, 16: pipeline_sana.ASPECT_RATIO_512_BIN}

    def __init__(self, pipe, config):
        if pipe.transformer.config.guidance_embeds:
            raise ValueError(f"this {type(pipe.transformer).__name__} has guidance_embeds=True (a guidance-distilled "
                             "model: SANA-Sprint's, sampled by SanaSprintPipeline); the sana families train "
                             f"{self.pipeline_class.__name__}'s models, guided by CFG (guidance_embeds=False)")
        patch = pipe.transformer.config.patch_size  # a video transformer's (frames, rows, columns): its rows'
        self.patch_size = patch[1] if isinstance(patch, (tuple, list)) else patch
        super().__init__(pipe, config)

    @classmethod
    def load_pipeline(cls, path, local, revision, dtype_kwargs):
        pipe = super().load_pipeline(path, local, revision, dtype_kwargs)
        pipe.scheduler = flow_euler_scheduler(pipe.scheduler, cls.name)
        return pipe

    # ------------------------------------------------------------------ size
    def default_size(self) -> tuple[int, int]:
        """The call's 1024 x 1024 mapped by the pipeline's aspect-ratio table of this transformer's sample_size (what
        ``__call__`` samples given no size); the call's own size for a sample_size without a table (the call refuses
        to bin it)."""
        height, width = call_default(self.pipeline_class, "height"), call_default(self.pipeline_class, "width")
        table = self.resolution_bins.get(self.pipe.transformer.config.sample_size)
        if table is None:
            return height, width
        return PixArtImageProcessor.classify_height_width_bin(height, width, ratios=table)

    # ------------------------------------------------------------------ condition
    @property
    def text_length(self) -> int:
        """L, the tokens of a condition: ``pretrained.max_sequence_length``, else the call's default (300)."""
        return self.max_sequence_length or call_default(self.pipeline_class, "max_sequence_length")

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        """The pipeline's ``encode_prompt`` of the prompts after its call's complex human instruction."""
        return self._encoded(prompts, call_default(self.pipeline_class, "complex_human_instruction"))

    @torch.no_grad()
    def encode_negative(self, prompts: list[str]) -> dict:
        """A negative prompt as the pipeline encodes one: without the complex human instruction."""
        return self._encoded(prompts, None)

    def _encoded(self, prompts: list[str], instruction) -> dict:
        embeds, mask, _, _ = self.encode_quietly(prompts, do_classifier_free_guidance=False,
                                                 max_sequence_length=self.text_length,
                                                 complex_human_instruction=instruction)
        return {"prompt_embeds": embeds.to(self.device), "prompt_attention_mask": mask.to(self.device)}

    # ------------------------------------------------------------------ latents, model, decode
    @property
    def latent_channels(self) -> int:
        return self.pipe.transformer.config.in_channels

    def latent_shape(self) -> tuple:
        height, width = self.height_width
        factor = self.pipe.vae_scale_factor
        return self.latent_channels, height // factor, width // factor

    def draw_noise(self, batch, generator, device, dtype):
        height, width = self.height_width
        latents = self.pipe.prepare_latents(batch, self.latent_channels, height, width, torch.float32, device,
                                            generator)
        return latents.to(dtype)

    def model_output(self, model, latents, times, cond, negative, guidance_scale):
        batch_rows = latents.shape[0]
        t = torch.as_tensor(times["timesteps"], device=latents.device)
        t = t.expand(batch_rows) if t.ndim == 0 else t
        embeds, mask = cond["prompt_embeds"], cond["prompt_attention_mask"]
        guided = guidance_scale > 1.0 and negative is not None
        if guided:  # one forward of [negative; conditional], as the pipeline
            latents, t = torch.cat([latents, latents]), torch.cat([t, t])
            embeds = torch.cat([negative["prompt_embeds"].expand(batch_rows, -1, -1), embeds])
            mask = torch.cat([negative["prompt_attention_mask"].expand(batch_rows, -1), mask])
        dtype = self.pipe.transformer.dtype
        out = model(latents.to(dtype), encoder_hidden_states=embeds.to(dtype), encoder_attention_mask=mask,
                    timestep=self.timestep_input(t), return_dict=False)[0].float()
        if guided:
            uncond, conditional = out.chunk(2)
            out = uncond + guidance_scale * (conditional - uncond)
        if self.pipe.transformer.config.out_channels // 2 == self.latent_channels:  # a learned sigma: its first half
            out = out.chunk(2, dim=1)[0]
        return out

    def timestep_input(self, t: torch.Tensor) -> torch.Tensor:
        """The transformer's timestep: t times its ``timestep_scale``, as SanaPipeline passes it."""
        return t * self.pipe.transformer.config.timestep_scale

    @torch.no_grad()
    def clean_latents(self, images):
        return self.vae_latents(images) * self.pipe.vae.config.scaling_factor

    @torch.no_grad()
    def decode(self, latents):
        vae = self.pipe.vae
        image = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="pt").float()

    # ------------------------------------------------------------------ config
    @classmethod
    def config_errors(cls, config) -> list[str]:
        return super().config_errors(config) + cls.guidance_errors(config)

    def pipeline_kwargs(self, sample_config, pretrained) -> dict:
        """The size (its binning off: the size asked is the size sampled), the token count, the negative prompt."""
        kwargs = {**self.size_kwargs(), "use_resolution_binning": False, "max_sequence_length": self.text_length}
        if sample_config.negative_prompt:
            kwargs["negative_prompt"] = sample_config.negative_prompt
        return kwargs
