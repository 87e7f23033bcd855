"""PickScore (Kirstain et al. 2023): a CLIP-H fine-tuned on Pick-a-Pic human preferences.

    reward_i = exp(logit_scale) * cos(e_img(image_i), e_txt(prompt_i))

with the embeddings of :mod:`ddpo_group.rewards.clip_pair` (PickScore's own scoring: the
diagonal of ``logits_per_image``): the cosine times the checkpoint's learned temperature, so the
scale is the checkpoint's (CLIP models clamp exp(logit_scale) at 100). Flow-GRPO trains on
``reward / 26``; here that scale is a weighted combination: ``reward_fn = {"pickscore": 0.03846}``
(1/26). ``info["cosine"]`` holds the unscaled cosine.

Defaults: model ``yuvalkirstain/PickScore_v1`` and processor ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``
(hub ids, downloaded by transformers into its cache when online); give local directories to run
offline.
"""

from __future__ import annotations

from ddpo_group.rewards import register_reward

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"


@register_reward("pickscore")
def pickscore(model_path: str = PICKSCORE_MODEL, processor_path: str = PICKSCORE_PROCESSOR, dtype: str = "float32",
              device: str | None = None, batch_size: int = 32):
    """PickScore of each (image, prompt) pair; the model loads once, here (``device=None``: the images' device)."""
    from ddpo_group.rewards.clip_pair import ClipPair

    clip = ClipPair(model_path, processor_path, "pickscore", dtype=dtype, device=device, batch_size=batch_size)

    def fn(images, prompts, metadata):
        image_embeds, text_embeds = clip.embeddings(images, list(prompts))
        cosine = (image_embeds * text_embeds).sum(dim=-1)
        return (clip.logit_scale.to(cosine.device) * cosine).double().cpu(), {"cosine": cosine.double().cpu()}

    fn.image_features = clip.image_embeddings  # its CLIP image encoder (eval/diversity: run/reporting/image_stats.py)
    return fn
