"""CLIP image-text similarity (Radford et al. 2021; CLIPScore, Hessel et al. 2021).

    form="cosine"     reward_i = cos(e_img(image_i), e_txt(prompt_i))            in [-1, 1]
    form="clipscore"  reward_i = 100 * max(cos(e_img(image_i), e_txt(prompt_i)), 0)   in [0, 100]

with the embeddings of :mod:`ddpo_group.rewards.clip_pair`. The "clipscore" form is torchmetrics'
CLIPScore; Hessel et al. weight the clipped cosine by 2.5 instead of 100 (a weighted combination
``{"clipscore": 0.025}`` gives it). ``info["cosine"]`` always holds the cosine.

Default model: ``openai/clip-vit-large-patch14`` (hub id; a local directory runs offline); the
processor (tokenizer and image settings) defaults to the model's own directory.
"""

from __future__ import annotations

from ddpo_group.rewards import register_reward

CLIPSCORE_MODEL = "openai/clip-vit-large-patch14"
FORMS = ("cosine", "clipscore")


@register_reward("clipscore")
def clipscore(model_path: str = CLIPSCORE_MODEL, processor_path: str | None = None, form: str = "cosine",
              dtype: str = "float32", device: str | None = None, batch_size: int = 32):
    """CLIP cosine (or 100 * max(cos, 0)) of each (image, prompt) pair; the model loads once, here."""
    if form not in FORMS:
        raise ValueError(f"clipscore reward: form={form!r} must be one of {FORMS}")
    from ddpo_group.rewards.clip_pair import ClipPair

    clip = ClipPair(model_path, processor_path, "clipscore", dtype=dtype, device=device, batch_size=batch_size)

    def fn(images, prompts, metadata):
        image_embeds, text_embeds = clip.embeddings(images, list(prompts))
        cosine = (image_embeds * text_embeds).sum(dim=-1).double().cpu()
        reward = cosine if form == "cosine" else 100.0 * cosine.clamp(min=0)
        return reward, {"cosine": cosine}

    fn.image_features = clip.image_embeddings  # its CLIP image encoder (eval/diversity: run/reporting/image_stats.py)
    return fn
