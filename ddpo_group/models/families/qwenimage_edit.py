"""Qwen-Image-Edit-Plus (Qwen/Qwen-Image-Edit-2509, -2511): Qwen-Image editing one or several source images, which the
Qwen2.5-VL text encoder sees (its vision tower) and whose packed VAE latents follow the noisy tokens.

    condition   per prompt, its source images (``metadata["image"]``: one path or a list, a .jsonl prompt file's
                ``image``), each resized as the pipeline's ``__call__`` resizes it: to ``CONDITION_IMAGE_SIZE`` pixels
                (384^2, its aspect ratio kept, sides multiples of 32) for the text encoder, to ``VAE_IMAGE_SIZE``
                (1024^2) for the VAE (both read from the pipeline's module when used):
                  prompt_embeds [B, L, D], prompt_embeds_mask [B, L]: Qwen2.5-VL's last hidden states of
                      "Picture 1: <vision tokens of image 1>Picture 2: ...<prompt>" in the pipeline's chat template
                      (its processor: the vision tokens are the image's 14 px patches merged 2x2), the template's
                      first 64 tokens dropped (the pipeline's ``encode_prompt``), zero-padded to L =
                      ``pretrained.max_sequence_length`` (0: 512; the pipeline truncates nothing: a longer condition
                      is an error naming that field);
                  the negative condition is the same of the row's negative prompt (its ``negative_prompt``, else the
                      run's: " ") WITH the row's images, as the pipeline encodes ``negative_prompt``: always one per row
                      (``negative_rows``), stored in the record as ``negative_<key>`` (models/families/base.py);
                  image_latents [B, L_img, 4 C]: each image's VAE latent (mode, (z - latents_mean) / latents_std),
                      packed 2x2 and concatenated over the images; image_shapes [B, K, 2]: each image's packed grid
                      (RoPE positions: the transformer's ``img_shapes`` after the noisy grid)
                Rows of one batch must have the same number of images with the same token counts (the record's
                tensors are stacked); rows whose images have other grids are run as separate transformer calls
    latents     Qwen-Image's (models/families/qwenimage.py): packed [B, (H/2f)(W/2f), 4 C], x_0 = N(0, I)
    schedule    Qwen-Image's: sigmas linspace(1, 1/T, T) shifted by mu of the noisy tokens' count
    output      v(c) = transformer([x; image_latents], t / 1000, prompt_embeds, mask,
                                   img_shapes = [noisy grid, image grids])[:, :L_x]
                with w = ``sample.guidance_scale`` > 1 the pipeline's true CFG with the row's negative condition:
                    v' = v(n) + w (v(c) - v(n)),    v = v' ||v(c)|| / ||v'||   (per token; w <= 1: v = v(c))
    step        flow matching (models/families/flow_matching.py, sampling/flow_steps.py)
    decode      Qwen-Image's: unpack, z * latents_std + latents_mean, the VAE, its one frame

The pipeline's own ``__call__`` gives the same images at noise level 0 with ``pipeline_kwargs`` (height = width =
the resolution, ``true_cfg_scale`` and ``negative_prompt`` " ") and ``pipeline_row_kwargs`` (the row's source images
as loaded: the pipeline resizes them as ``condition`` does). QwenImageEditPlusPipeline takes one prompt a call
(``pipeline_max_batch``). Its text encoder needs the pipeline's ``processor`` (transformers' Qwen2VLProcessor, which
needs torchvision); without it ``condition`` is an error.

Qwen-Image-Edit (Qwen/Qwen-Image-Edit, QwenImageEditPipeline): the family ``qwenimage_edit`` below, the same with
one source image a prompt, resized once (1024^2 px, its aspect ratio) for the text encoder and the VAE, and the
template's one vision slot in place of "Picture 1: ".
"""

from __future__ import annotations

import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus

from ddpo_group.models.families import register_family
from ddpo_group.sampling.family import Capabilities
from ddpo_group.models.families.qwenimage import QwenImageFamily
from ddpo_group.models.source_images import NEGATIVE_PROMPT_KEY, SOURCE_IMAGE_KEY, source_images
from ddpo_group.sampling.trajectories import concatenate_rows


@register_family("qwenimage_edit_plus", QwenImageEditPlusPipeline)
class QwenImageEditPlusFamily(QwenImageFamily):
    cond_keys = ("prompt_embeds", "prompt_embeds_mask", "image_latents", "image_shapes")
    capabilities = Capabilities(image_conditioning=True)
    pipeline_max_batch = 1  # QwenImageEditPlusPipeline.__call__ refuses more than one prompt
    pipeline_module = pipeline_qwenimage_edit_plus  # where the pipeline's image sizes live

    # ------------------------------------------------------------------ the condition: prompts with their images
    @torch.no_grad()
    def condition(self, prompts: list[str], metadata: list[dict] | None = None) -> dict:
        metadata = metadata if metadata is not None else [{}] * len(prompts)
        rows = [self.row_condition(prompt, meta) for prompt, meta in zip(prompts, metadata)]
        return concatenate_rows(rows, prompts, self.device)

    def sources(self, prompt: str, metadata: dict) -> list:
        """The source images of a prompt (PIL, as loaded); an error when it has none (the pipeline edits images)."""
        images = source_images(metadata)
        if not images:
            raise ValueError(f"{self.name} edits source images: prompt {prompt!r} has none "
                             f"(metadata[{SOURCE_IMAGE_KEY!r}], a .jsonl prompt file's 'image': one path or a list)")
        return images

    def sizes(self, image) -> tuple[tuple[int, int], tuple[int, int]]:
        """(width, height) of an image for the text encoder and for the VAE, as the pipeline's ``__call__`` computes
        them (``calculate_dimensions`` of its module's CONDITION_IMAGE_SIZE and VAE_IMAGE_SIZE, the aspect ratio)."""
        module = self.pipeline_module
        ratio = image.size[0] / image.size[1]
        return (module.calculate_dimensions(module.CONDITION_IMAGE_SIZE, ratio),
                module.calculate_dimensions(module.VAE_IMAGE_SIZE, ratio))

    def row_condition(self, prompt: str, metadata: dict) -> dict:
        """One row's condition (see the module docstring): ``prompt`` seeing the row's source images."""
        if self.pipe.processor is None:
            raise ValueError(f"{self.name}: the pipeline has no processor (transformers' Qwen2VLProcessor, which needs "
                             "torchvision): its text encoder cannot see the source images")
        condition_images, images = self.image_condition(self.sources(prompt, metadata))
        return {**self.text_condition(prompt, condition_images), **images}

    def image_condition(self, images: list) -> tuple[list, dict]:
        """(the images resized for the text encoder, {image_latents [1, L_img, 4 C], image_shapes [1, K, 2]}) of one
        row's source images (PIL), as the pipeline's ``__call__`` and ``prepare_latents`` make them."""
        pipe = self.pipe
        condition_images, latents, shapes = [], [], []
        for image in images:
            (cw, ch), (vw, vh) = self.sizes(image)
            condition_images.append(pipe.image_processor.resize(image, ch, cw))
            latents.append(self.encode_image(image, vw, vh))
            shapes.append((vh // pipe.vae_scale_factor // 2, vw // pipe.vae_scale_factor // 2))
        return condition_images, {"image_latents": torch.cat(latents, dim=1).to(self.device),
                                  "image_shapes": torch.tensor([shapes], dtype=torch.long, device=self.device)}

    def text_condition(self, prompt: str, condition_images: list) -> dict:
        """prompt_embeds and its mask of one prompt seeing its images, padded to ``text_length`` (an error beyond)."""
        embeds, mask = self.encode_quietly([prompt], image=self.text_images(condition_images))
        if embeds.shape[1] > self.text_length:
            raise ValueError(f"prompt {prompt!r} with its {len(condition_images)} source image(s) is {embeds.shape[1]} "
                             f"text and vision tokens, more than pretrained.max_sequence_length={self.text_length} "
                             "(the pipeline truncates nothing): raise it (at most 1024)")
        return self.padded_condition(embeds, mask)

    @staticmethod
    def text_images(condition_images: list):
        """What ``encode_prompt`` gets as ``image``: the list ("Picture 1: ...Picture 2: ..." in the prompt)."""
        return condition_images

    @torch.no_grad()
    def encode_image(self, image, width: int, height: int) -> torch.Tensor:
        """The packed VAE latent [1, L, 4 C] of one source image at the pipeline's VAE size, as ``prepare_latents``."""
        pipe = self.pipe
        pixels = pipe.image_processor.preprocess(image, height, width).unsqueeze(2)
        pixels = pixels.to(device=pipe.vae.device, dtype=pipe.text_encoder.dtype)  # the pipeline's prompt_embeds dtype
        latents = pipe._encode_vae_image(image=pixels, generator=None)
        return pipe._pack_latents(latents, 1, latents.shape[1], latents.shape[3], latents.shape[4])

    def encode(self, prompts: list[str]) -> dict:
        raise ValueError(f"{self.name} conditions on the prompts' source images: condition(prompts, metadata) with "
                         f"metadata[{SOURCE_IMAGE_KEY!r}], not encode(prompts)")

    def negative_condition(self) -> dict:
        """Nothing: the unconditional branch of each row is its own (``negative_rows``: the negative prompt with the
        row's images; Qwen-Image-Edit's template has no text-only form). Read only when there is no CFG."""
        return {}

    @torch.no_grad()
    def negative_rows(self, metadata: list[dict] | None) -> dict:
        """The negative condition of every row, always per row: its negative prompt (``metadata["negative_prompt"]``,
        else ``run_negative_prompt``: " ") seeing the row's source images, as the pipeline encodes ``negative_prompt``
        with ``image``; each distinct (negative prompt, images) encoded once a call, and kept for the last
        ``sample.text_embedding_cache`` of them."""
        metadata = metadata or []
        texts = [self.run_negative_prompt if (meta or {}).get(NEGATIVE_PROMPT_KEY) is None else meta[NEGATIVE_PROMPT_KEY]
                 for meta in metadata]
        size = int(self.config.sample.text_embedding_cache)
        rows, fresh = [], {}
        for text, meta in zip(texts, metadata):
            key = self.condition_key(text, meta)
            if key in self._negatives:
                self._negatives[key] = self._negatives.pop(key)  # most recently used last
            elif key not in fresh:
                fresh[key] = {k: v.cpu() for k, v in self.row_condition(text, meta).items()}
                if size:
                    self._negatives[key] = fresh[key]
                    while len(self._negatives) > size:
                        self._negatives.pop(next(iter(self._negatives)))
            rows.append(self._negatives.get(key, fresh.get(key)))
        return concatenate_rows(rows, texts, self.device)

    @property
    def text_dim(self) -> int:
        """The width of ``prompt_embeds`` (the critic's text input): Qwen2.5-VL's hidden size."""
        return int(self.pipe.text_encoder.config.text_config.hidden_size)

    def pipeline_row_kwargs(self, metadata: list[dict]) -> dict:
        """The source images of a call's row (one prompt a call), as loaded: the pipeline resizes them; the row's
        negative prompt when it has one."""
        if len(metadata) != 1:
            raise ValueError(f"{type(self.pipe).__name__} takes one prompt a call; got {len(metadata)} rows")
        return {**self.negative_prompt_kwargs(metadata), "image": self.sources("", metadata[0])}

    # ------------------------------------------------------------------ latents, model
    def draw_noise(self, batch, generator, device, dtype):
        latents, _ = self.pipe.prepare_latents(None, batch, self.pipe.transformer.config.in_channels // 4,
                                               self.resolution, self.resolution, dtype, device, generator)
        return latents

    def transformer_output(self, model, latents, timestep, cond: dict) -> torch.Tensor:
        """The noisy tokens' output of one forward on rows (of a condition or a negative one) whose images have the
        same grids."""
        embeds, mask = self.text_inputs(cond["prompt_embeds"], cond["prompt_embeds_mask"])
        side = self.resolution // self.pipe.vae_scale_factor // 2
        grids = [(1, h, w) for h, w in cond["image_shapes"][0].tolist()]
        hidden = torch.cat([latents, cond["image_latents"].to(latents.dtype)], dim=1)
        return model(hidden_states=hidden, timestep=timestep, guidance=None, encoder_hidden_states_mask=mask,
                     encoder_hidden_states=embeds, img_shapes=[[(1, side, side), *grids]] * latents.shape[0],
                     return_dict=False)[0][:, : latents.shape[1]]

    def guided_output(self, model, latents, timestep, cond: dict, negative: dict, guidance_scale: float):
        conditional = self.transformer_output(model, latents, timestep, cond)
        if guidance_scale <= 1.0:
            return conditional
        return self.true_cfg(conditional, self.transformer_output(model, latents, timestep, negative), guidance_scale)

    def model_output(self, model, latents, times, cond, negative, guidance_scale):
        batch_rows = latents.shape[0]
        t = torch.as_tensor(times["timesteps"], device=latents.device)
        t = (t.expand(batch_rows) if t.ndim == 0 else t).to(latents.dtype) / 1000
        shapes = cond["image_shapes"]
        if bool((shapes == shapes[:1]).all()):
            return self.guided_output(model, latents, t, cond, negative, guidance_scale)
        out = torch.empty_like(latents)  # rows whose images have other grids: one forward per grid
        for grid in torch.unique(shapes, dim=0):
            rows = (shapes == grid).flatten(1).all(dim=1).nonzero().squeeze(1)
            part = {key: value[rows] for key, value in cond.items()}
            negative_part = {key: value[rows] for key, value in negative.items()}
            out[rows] = self.guided_output(model, latents[rows], t[rows], part, negative_part,
                                           guidance_scale).to(out.dtype)
        return out


EDIT_AREA = 1024 * 1024  # QwenImageEditPipeline.__call__'s pixel count of the source (a literal there)


@register_family("qwenimage_edit", QwenImageEditPipeline)
class QwenImageEditFamily(QwenImageEditPlusFamily):
    """Qwen-Image-Edit (Qwen/Qwen-Image-Edit): the Plus family with one source image a prompt, which the text encoder
    and the VAE both see at one size, ``calculate_dimensions`` of 1024^2 px and its aspect ratio (the pipeline's), and
    a template with one vision slot (no "Picture 1: ")."""

    pipeline_module = pipeline_qwenimage_edit

    def sources(self, prompt: str, metadata: dict) -> list:
        images = super().sources(prompt, metadata)
        if len(images) > 1:
            raise ValueError(f"{self.name} edits one source image a prompt; prompt {prompt!r} has {len(images)} "
                             f"({metadata[SOURCE_IMAGE_KEY]}): qwenimage_edit_plus (Qwen-Image-Edit-2509) takes several")
        return images

    def sizes(self, image) -> tuple[tuple[int, int], tuple[int, int]]:
        width, height, _ = self.pipeline_module.calculate_dimensions(EDIT_AREA, image.size[0] / image.size[1])
        return (width, height), (width, height)

    def image_condition(self, images: list) -> tuple[list, dict]:
        """As the Plus family's, the VAE reading the image resized for the text encoder (the pipeline's order)."""
        pipe = self.pipe
        (width, height), _ = self.sizes(images[0])
        resized = pipe.image_processor.resize(images[0], height, width)
        latents = self.encode_image(resized, width, height)
        shapes = [(height // pipe.vae_scale_factor // 2, width // pipe.vae_scale_factor // 2)]
        return [resized], {"image_latents": latents.to(self.device),
                           "image_shapes": torch.tensor([shapes], dtype=torch.long, device=self.device)}

    @staticmethod
    def text_images(condition_images: list):
        return condition_images[0]  # one image: the template's one vision slot

    def pipeline_row_kwargs(self, metadata: list[dict]) -> dict:
        """The row's source image itself (the pipeline's ``image_processor.resize`` takes one image, not a list)."""
        kwargs = super().pipeline_row_kwargs(metadata)
        return {**kwargs, "image": kwargs["image"][0]}
