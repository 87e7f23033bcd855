"""Image-text embeddings of a transformers CLIPModel, shared by the PickScore and CLIPScore rewards.

    e_img = visual_projection(vision_model(preprocess(image)).pooler_output)     (= get_image_features)
    e_txt = text_projection(text_model(tokens(prompt)).pooler_output)            (= get_text_features)
    cos   = <e_img, e_txt> / (||e_img|| ||e_txt||)

The model is a ``CLIPModel`` checkpoint (hub id or local directory); the tokenizer and the image
settings (``preprocessor_config.json``: shortest edge, crop size, mean, std) come from the
processor source, which may be another checkpoint (PickScore's processor is CLIP-ViT-H-14's).
Images are preprocessed on their own device (``preprocess.resize_shortest_crop``), so the reward
batches on the training GPU; the model runs in ``dtype`` and the cosine is taken in float32.
"""

from __future__ import annotations

import torch

from ddpo_group.rewards.loading import DeviceFollower, load_from_source, resolve_dtype
from ddpo_group.rewards.preprocess import resize_shortest_crop

def image_settings(config: dict, source: str) -> tuple[int, tuple[int, int], tuple, tuple]:
    """(shortest_edge, (crop_h, crop_w), mean, std) of a CLIPImageProcessor config (old int sizes included), read
    through transformers' CLIPImageProcessor, whose defaults fill what the config leaves out."""
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor.from_dict(config)
    size, crop = processor.size, processor.crop_size
    if size.shortest_edge is None:
        raise ValueError(f"image processor of {source!r}: size={config.get('size')} is not a CLIP 'shortest_edge' "
                         "resize")
    if not processor.do_center_crop or not processor.do_resize:
        raise ValueError(f"image processor of {source!r}: a CLIP resize + center crop is expected ({config})")
    mean, std = tuple(processor.image_mean), tuple(processor.image_std)
    if not processor.do_normalize:
        mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    return int(size.shortest_edge), (int(crop.height), int(crop.width)), mean, std


class ClipPair:
    """A CLIPModel with its tokenizer and image settings; ``embeddings(images, prompts)`` -> unit vectors."""

    def __init__(self, model_path, processor_path, reward: str, dtype="float32", device: str | None = None,
                 batch_size: int = 32, model_argument: str = "model_path", processor_argument: str = "processor_path"):
        from transformers import AutoTokenizer, CLIPModel
        from transformers.image_processing_utils import ImageProcessingMixin

        self.dtype = resolve_dtype(dtype, reward)
        processor_path = processor_path or model_path
        what_model = "a transformers CLIPModel checkpoint"
        self.model = load_from_source(CLIPModel.from_pretrained, model_path, model_argument, reward, what_model)
        self.model = self.model.eval().requires_grad_(False).to(self.dtype)
        what_processor = "a CLIP processor (tokenizer and preprocessor_config.json)"
        self.tokenizer = load_from_source(AutoTokenizer.from_pretrained, processor_path, processor_argument, reward,
                                          what_processor)
        config = load_from_source(lambda s: ImageProcessingMixin.get_image_processor_dict(s)[0], processor_path,
                                  processor_argument, reward, what_processor)
        self.shortest_edge, self.crop, self.mean, self.std = image_settings(config, str(processor_path))
        self.max_length = min(self.tokenizer.model_max_length, self.model.config.text_config.max_position_embeddings)
        self.batch_size = batch_size
        self.follower = DeviceFollower(self.model, device)

    @property
    def logit_scale(self) -> torch.Tensor:
        return self.model.logit_scale.detach().float().exp()

    @torch.no_grad()
    def embeddings(self, images: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """L2-normalised float32 embeddings (image [B, d], text [B, d]) on the model's device."""
        with self.follower.lock:
            device = self.follower.place(images)
            image_embeds = self._images(images, device)
            unique = list(dict.fromkeys(prompts))  # a prompt group repeats one prompt: encode it once
            text = torch.cat([self._text(unique[i : i + self.batch_size], device)
                              for i in range(0, len(unique), self.batch_size)])
            text_embeds = text[torch.tensor([unique.index(p) for p in prompts], device=device)]
        return image_embeds, text_embeds

    @torch.no_grad()
    def image_embeddings(self, images: torch.Tensor) -> torch.Tensor:
        """L2-normalised float32 image embeddings [B, d] (a reward's ``image_features``: run/reporting/image_stats.py)."""
        with self.follower.lock:
            return self._images(images, self.follower.place(images))

    def _images(self, images: torch.Tensor, device) -> torch.Tensor:
        return torch.cat([self._image(images[i : i + self.batch_size].to(device))
                          for i in range(0, len(images), self.batch_size)])

    def _image(self, images: torch.Tensor) -> torch.Tensor:
        pixels = resize_shortest_crop(images, self.shortest_edge, self.crop, self.mean, self.std).to(self.dtype)
        embeds = self.model.visual_projection(self.model.vision_model(pixel_values=pixels).pooler_output).float()
        return embeds / embeds.norm(dim=-1, keepdim=True)

    def _text(self, prompts: list[str], device: torch.device) -> torch.Tensor:
        tokens = self.tokenizer(prompts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        out = self.model.text_model(input_ids=tokens["input_ids"].to(device),
                                    attention_mask=tokens["attention_mask"].to(device))
        embeds = self.model.text_projection(out.pooler_output).float()
        return embeds / embeds.norm(dim=-1, keepdim=True)
