"""LAION aesthetic score: CLIP image embedding -> linear or MLP head (as in DDPO).

    e_i = CLIP_image_embeds(preprocess(image_i));   e_i <- e_i / ||e_i||;   reward_i = head(e_i)

Both models are loaded from local paths (nothing downloads):

* ``clip_model_path``: a transformers CLIP checkpoint directory, e.g. a local copy of
  ``openai/clip-vit-large-patch14`` (a full CLIPModel or a CLIPVisionModelWithProjection);
* ``head_path``: the head's state dict (``.pth``/``.pt`` or ``.safetensors``), either LAION's
  improved-aesthetic-predictor MLP (``sac+logos+ava1-l14-linearMSE.pth``: keys ``layers.{0,2,4,6,7}``,
  Linear(d, 1024) -> Linear(1024, 128) -> Linear(128, 64) -> Linear(64, 16) -> Linear(16, 1),
  dropouts between and no activations) or LAION's linear head (``sa_0_4_vit_l_14_linear.pth``:
  keys ``weight``, ``bias`` of Linear(d, 1)).

Preprocessing follows CLIPImageProcessor: bicubic resize of the short side to the model's
image size, center crop, normalisation with the checkpoint's mean/std (CLIP's by default).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ddpo_group.rewards import register_reward

MLP_LAYOUT = (1024, 128, 64, 16, 1)  # output sizes of layers.0, .2, .4, .6, .7


class AestheticMLP(nn.Module):
    """LAION improved-aesthetic-predictor head (the layout of its state dict, dropouts inert at eval)."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _require(path, what: str, argument: str) -> Path:
    if not path:
        raise ValueError(
            f"the aesthetic reward needs reward_fn_kwargs.{argument}: the local path of {what} (nothing is downloaded)"
        )
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"aesthetic reward: {argument}={str(path)!r} does not exist ({what})")
    return path


def load_head(path: str | Path) -> nn.Module:
    """The linear or MLP head whose state dict is at ``path`` (layout told apart by its keys)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    keys = set(state)
    if keys == {"weight", "bias"}:
        head = nn.Linear(state["weight"].shape[1], state["weight"].shape[0])
    elif "layers.0.weight" in keys:
        head = AestheticMLP(state["layers.0.weight"].shape[1])
    else:
        raise ValueError(
            f"aesthetic reward: head_path={str(path)!r} holds keys {sorted(keys)[:8]}; expected the LAION MLP "
            "(layers.0.weight ... layers.7.bias) or linear head (weight, bias)"
        )
    head.load_state_dict(state)  # strict: a wrong layout fails here, naming the keys
    return head.eval().requires_grad_(False)


def preprocess(images: torch.Tensor, size: int, mean, std) -> torch.Tensor:
    """Images [B, 3, H, W] in [0, 1] -> CLIP pixel values [B, 3, size, size]."""
    images = images.float()
    h, w = images.shape[-2:]
    scale = size / min(h, w)
    new_h, new_w = max(size, round(h * scale)), max(size, round(w * scale))
    images = F.interpolate(images, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)
    top, left = (new_h - size) // 2, (new_w - size) // 2
    images = images[..., top : top + size, left : left + size].clamp(0, 1)
    mean = torch.tensor(mean, dtype=images.dtype, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(std, dtype=images.dtype, device=images.device).view(1, 3, 1, 1)
    return (images - mean) / std


class AestheticScorer(nn.Module):
    """CLIP image embedding (normalised) -> head; ``forward(images in [0, 1]) -> scores [B]``."""

    def __init__(self, clip_model_path, head_path, device: str | None = None):
        super().__init__()
        from transformers import CLIPVisionModelWithProjection

        clip_path = _require(clip_model_path, "a CLIP checkpoint directory (e.g. openai/clip-vit-large-patch14)", "clip_model_path")
        head_file = _require(head_path, "the LAION aesthetic head's state dict (.pth or .safetensors)", "head_path")
        self.clip = CLIPVisionModelWithProjection.from_pretrained(str(clip_path)).eval().requires_grad_(False)
        self.head = load_head(head_file)
        if self.head_input_size != self.clip.config.projection_dim:
            raise ValueError(
                f"aesthetic reward: the head at {str(head_file)!r} takes {self.head_input_size}-d embeddings but the "
                f"CLIP at {str(clip_path)!r} gives {self.clip.config.projection_dim}-d ones (ViT-L/14 gives 768)"
            )
        self.size = self.clip.config.image_size
        # the checkpoint's normalisation, read through transformers' CLIPImageProcessor (its defaults, CLIP's, fill
        # what the file leaves out, or stand for a checkpoint without one)
        from transformers import CLIPImageProcessor

        processor_config = clip_path / "preprocessor_config.json"
        settings = json.loads(processor_config.read_text()) if processor_config.exists() else {}
        processor = CLIPImageProcessor.from_dict(settings)
        self.mean, self.std = tuple(processor.image_mean), tuple(processor.image_std)
        self.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))

    @property
    def head_input_size(self) -> int:
        first = self.head if isinstance(self.head, nn.Linear) else self.head.layers[0]
        return first.in_features

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(images)).squeeze(-1)

    @torch.no_grad()
    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """L2-normalised CLIP image embeddings [B, d] (float32)."""
        device = next(self.parameters()).device
        pixels = preprocess(images.to(device), self.size, self.mean, self.std)
        embeds = self.clip(pixel_values=pixels.to(self.clip.dtype)).image_embeds.float()
        return embeds / embeds.norm(dim=-1, keepdim=True)


@register_reward("aesthetic")
def aesthetic(clip_model_path: str = "", head_path: str = "", batch_size: int = 32, device: str | None = None):
    """LAION aesthetic score of each image (higher is more aesthetic); models loaded once, here."""
    scorer = AestheticScorer(clip_model_path, head_path, device=device)

    def fn(images, prompts, metadata):
        scores = torch.cat([scorer(images[i : i + batch_size]) for i in range(0, len(images), batch_size)])
        return scores.double().cpu(), {}

    # its CLIP image encoder (eval/diversity: run/reporting/image_stats.py)
    fn.image_features = lambda images: torch.cat([scorer.embed(images[i : i + batch_size])
                                                 for i in range(0, len(images), batch_size)])
    return fn
