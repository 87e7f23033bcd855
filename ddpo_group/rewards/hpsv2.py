"""HPSv2 / HPSv2.1 (Wu et al. 2023): an OpenCLIP ViT-H-14 fine-tuned on human preference pairs.

    reward_i = < f_img(image_i), f_txt(prompt_i) >,    f = L2-normalised open_clip features

i.e. the cosine, with no temperature: the diagonal of ``image_features @ text_features.T`` as the
hpsv2 package scores it. HPSv2.1 scores of generated images lie roughly in 0.2-0.3.

The architecture is open_clip's ``model_name`` config (``ViT-H-14``), and its weights are the HPS
checkpoint (``{"state_dict": ...}`` or a bare state dict, e.g. ``HPS_v2.1_compressed.pt`` of the
hub repository xswu/HPSv2) loaded strictly by open_clip from the local file ``checkpoint_path``:
nothing downloads (HPSv2's own code first downloads the LAION weights that this replaces). Text goes through open_clip's tokenizer of that
model (its BPE vocabulary ships in the open_clip package). Images follow HPSv2's validation
transform, done on the images' device: bicubic resize of the long side to the model's image size,
centered black padding to a square, normalisation with the model's mean/std
(:func:`ddpo_group.rewards.preprocess.resize_longest_pad`).

Needs ``pip install "ddpo_group[hps]"`` (open_clip_torch, and a torchvision built for the installed torch).
"""

from __future__ import annotations

import torch

from ddpo_group.rewards import register_reward
from ddpo_group.rewards.loading import DeviceFollower, require_file, resolve_dtype
from ddpo_group.rewards.preprocess import resize_longest_pad

CHECKPOINT_HINT = "the HPSv2 checkpoint, e.g. HPS_v2.1_compressed.pt from the hub repository xswu/HPSv2"


def import_open_clip():
    """open_clip, or an ImportError that says how to install it (a torchvision that does not match torch
    fails at import with a RuntimeError, reported the same way)."""
    try:
        import open_clip
    except Exception as error:
        raise ImportError(
            "the hpsv2 reward needs open_clip: pip install 'ddpo_group[hps]' (open_clip_torch with a torchvision "
            f"built for your torch {torch.__version__}); importing it failed with {type(error).__name__}: {error}"
        ) from error
    return open_clip


class HPSv2Scorer:
    """open_clip model + tokenizer; ``scores(images, prompts)`` -> cosines [B] (float32, on the model's device)."""

    def __init__(self, checkpoint_path, model_name: str = "ViT-H-14", dtype="float32", device: str | None = None,
                 batch_size: int = 32):
        file = require_file(checkpoint_path, "checkpoint_path", "hpsv2", CHECKPOINT_HINT)
        open_clip = import_open_clip()
        if model_name not in open_clip.list_models():
            raise ValueError(f"hpsv2 reward: model_name={model_name!r} is not an open_clip model config "
                             f"(HPSv2 uses 'ViT-H-14'; see open_clip.list_models())")
        self.dtype = resolve_dtype(dtype, "hpsv2")
        try:  # open_clip's own checkpoint loading: unwraps {"state_dict": ...}, strict, weights only
            model = open_clip.create_model(model_name, pretrained=str(file), device="cpu", output_dict=True)
        except (RuntimeError, KeyError, ValueError) as error:  # a checkpoint of another architecture fails here
            raise ValueError(f"hpsv2 reward: checkpoint_path={str(checkpoint_path)!r} does not fit open_clip's "
                             f"{model_name!r}: {str(error).strip().splitlines()[0]} ...") from error
        self.model = model.eval().requires_grad_(False).to(self.dtype)
        self.tokenizer = open_clip.get_tokenizer(model_name)
        size = model.visual.image_size
        self.size = size if isinstance(size, int) else size[0]
        if not isinstance(size, int) and size[0] != size[1]:
            raise ValueError(f"hpsv2 reward: {model_name!r} has a non-square image size {size}")
        from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

        self.mean = tuple(getattr(model.visual, "image_mean", None) or OPENAI_DATASET_MEAN)
        self.std = tuple(getattr(model.visual, "image_std", None) or OPENAI_DATASET_STD)
        self.batch_size = batch_size
        self.follower = DeviceFollower(self.model, device)

    @torch.no_grad()
    def scores(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        with self.follower.lock:
            device = self.follower.place(images)
            out = []
            for i in range(0, len(images), self.batch_size):
                pixels = resize_longest_pad(images[i : i + self.batch_size].to(device), self.size, self.mean, self.std)
                image_features = self.model.encode_image(pixels.to(self.dtype), normalize=True).float()
                text_features = self.model.encode_text(self.tokenizer(prompts[i : i + self.batch_size]).to(device),
                                                       normalize=True).float()
                out.append((image_features * text_features).sum(dim=-1))
        return torch.cat(out)


@register_reward("hpsv2")
def hpsv2(checkpoint_path: str = "", model_name: str = "ViT-H-14", dtype: str = "float32", device: str | None = None,
          batch_size: int = 32):
    """HPSv2(.1) score of each (image, prompt) pair; the model loads once, here (``device=None``: the images' device)."""
    scorer = HPSv2Scorer(checkpoint_path, model_name=model_name, dtype=dtype, device=device, batch_size=batch_size)

    def fn(images, prompts, metadata):
        return scorer.scores(images, list(prompts)).double().cpu(), {}

    return fn
