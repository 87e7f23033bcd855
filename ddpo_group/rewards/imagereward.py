"""ImageReward (Xu et al. 2023): a BLIP ViT-L image encoder and a BERT text encoder that cross-attends to it, with
an MLP head, trained on 137k human preference rankings of generated images.

    h_i      = text_encoder(tokens(prompt_i), encoder_hidden_states = vit(preprocess(image_i)))[:, 0]   ([CLS])
    reward_i = (mlp(h_i) - 0.16717362830052426) / 1.0333394966054072

exactly as the image-reward package's ``ImageReward.score`` / ``inference_rank`` compute it: its MLP is five
linear layers without activations (768 -> 1024 -> 128 -> 64 -> 16 -> 1), and the two constants standardise the
scores (roughly mean 0, std 1 over its training set; higher is preferred).

The model is built on transformers' BLIP modules (``BlipVisionModel``, and ``BlipTextModel`` with cross-attention,
as in ``BlipForImageTextRetrieval``): the image-reward package itself cannot be installed beside this project (it
pins timm 0.6.13 and fairscale, and pip then replaces torch). Its weights are ImageReward's released checkpoint
(``ImageReward.pt`` of the hub repository THUDM/ImageReward, a state dict in the package's layout:
``blip.visual_encoder.*``, ``blip.text_encoder.*``, ``mlp.layers.*``) with the text encoder's config
(``med_config.json`` of the same repository). The checkpoint's keys are renamed to transformers' layout (the
renames of transformers' BLIP conversion script: ``blocks`` -> ``encoder.layers``, ``attn.proj`` ->
``self_attn.projection``, ``norm1/2`` -> ``layer_norm1/2``, ``norm`` -> ``post_layernorm``, ``cls_token`` /
``pos_embed`` / ``patch_embed.proj`` -> ``embeddings.class_embedding`` / ``position_embedding`` /
``patch_embedding``; the text encoder's names are already transformers'), and loaded strictly: every weight the
model has must come from the checkpoint; a checkpoint key it does not use is left out with a warning naming it (the
package loads with strict=False), except BLIP's contrastive projections ``blip.vision_proj`` / ``blip.text_proj``
(unused by the score) and ``position_ids`` buffers, left out silently.
The vision transformer's size is read from the checkpoint's shapes (width, depth, patch and image size); its
number of heads is not in the checkpoint: ``vision_heads`` (default width / 64, i.e. 16 for ViT-L).

Text: BERT's uncased tokenizer (``bert-base-uncased``) with BLIP's two added special tokens ([DEC], [ENC]),
padded to 35 tokens and truncated there. Images follow the package's transform, done on the images' device:
bicubic resize of the short side to the model's image size (224), center crop, CLIP's mean/std (the package
converts a PIL image, so its input is 8-bit; here the float image is resized directly, antialiased as PIL is).
"""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ddpo_group.rewards import register_reward
from ddpo_group.rewards.loading import DeviceFollower, load_from_source, resolve_dtype
from ddpo_group.rewards.preprocess import normalise

IMAGEREWARD_MODEL = "THUDM/ImageReward"
CHECKPOINT_NAME = "ImageReward.pt"
MED_CONFIG_NAME = "med_config.json"
TOKENIZER = "bert-base-uncased"
MAX_LENGTH = 35  # the package's padding="max_length", truncation, max_length=35
REWARD_MEAN = 0.16717362830052426  # ImageReward.mean / ImageReward.std of the package
REWARD_STD = 1.0333394966054072
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)  # the package's Normalize (CLIP's)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
VIT_LAYER_NORM_EPS = 1e-6  # BLIP's VisionTransformer: partial(nn.LayerNorm, eps=1e-6)
MLP_WIDTHS = (1024, 128, 64, 16, 1)  # the package's MLP: Linear, Dropout, Linear, Dropout, Linear, Dropout, Linear x2
CHECKPOINT_HINT = (f"ImageReward's checkpoint (a directory holding {CHECKPOINT_NAME} and {MED_CONFIG_NAME}, as the hub "
                   f"repository {IMAGEREWARD_MODEL}, or the .pt file with {MED_CONFIG_NAME} beside it)")

# the package's ViT key (after "blip.visual_encoder.") -> transformers' BlipVisionModel key
VISION_RENAMES = (
    (r"cls_token", "embeddings.class_embedding"),
    (r"pos_embed", "embeddings.position_embedding"),
    (r"patch_embed\.proj\.(weight|bias)", r"embeddings.patch_embedding.\1"),
    (r"blocks\.(\d+)\.norm1\.(weight|bias)", r"encoder.layers.\1.layer_norm1.\2"),
    (r"blocks\.(\d+)\.norm2\.(weight|bias)", r"encoder.layers.\1.layer_norm2.\2"),
    (r"blocks\.(\d+)\.attn\.qkv\.(weight|bias)", r"encoder.layers.\1.self_attn.qkv.\2"),
    (r"blocks\.(\d+)\.attn\.proj\.(weight|bias)", r"encoder.layers.\1.self_attn.projection.\2"),
    (r"blocks\.(\d+)\.mlp\.(fc1|fc2)\.(weight|bias)", r"encoder.layers.\1.mlp.\2.\3"),
    (r"norm\.(weight|bias)", r"post_layernorm.\1"),
)
IGNORED_KEYS = re.compile(r"blip\.(vision_proj|text_proj)\.(weight|bias)|.*\.position_ids")


def rename_vision_key(key: str) -> str | None:
    """transformers' name of a key of BLIP's VisionTransformer, or None when it is not one."""
    for pattern, replacement in VISION_RENAMES:
        if re.fullmatch(pattern, key):
            return re.sub(pattern, replacement, key)
    return None


def split_checkpoint(state: dict, source: str) -> tuple[dict, dict, dict]:
    """(vision, text, mlp) state dicts in transformers' / nn.Sequential's names; other keys left out with a warning."""
    vision, text, mlp, unknown = {}, {}, {}, []
    for key, value in state.items():
        if IGNORED_KEYS.fullmatch(key):
            continue
        if key.startswith("blip.visual_encoder."):
            name = rename_vision_key(key[len("blip.visual_encoder."):])
            if name is None:
                unknown.append(key)
            else:
                vision[name] = value
        elif key.startswith("blip.text_encoder."):
            text[key[len("blip.text_encoder."):]] = value  # med.py's BertModel names are BlipTextModel's
        elif key.startswith("mlp.layers."):
            mlp[key[len("mlp.layers."):]] = value  # the package's MLP.layers: an nn.Sequential
        else:
            unknown.append(key)
    if unknown:  # left out, as the package's load_state_dict(strict=False) leaves them, and named
        warnings.warn(f"imagereward reward: model_path={source!r}: {len(unknown)} checkpoint keys are not ImageReward's "
                      f"scoring weights and are left out, as the image-reward package leaves them "
                      f"({', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''})", stacklevel=2)
    for part, keys in (("blip.visual_encoder", vision), ("blip.text_encoder", text), ("mlp.layers", mlp)):
        if not keys:
            raise ValueError(f"imagereward reward: model_path={source!r} has no {part}.* weights; expected "
                             f"{CHECKPOINT_HINT}")
    return vision, text, mlp


def checkpoint_files(source: str, checkpoint_name: str) -> tuple[Path, Path]:
    """(checkpoint, med_config) paths of a local directory / .pt file, or downloaded from a hub id."""
    path = Path(source)
    if path.is_dir():
        files = path / checkpoint_name, path / MED_CONFIG_NAME
    elif path.is_file():
        files = path, path.parent / MED_CONFIG_NAME
    else:
        from huggingface_hub import hf_hub_download

        try:
            files = tuple(Path(hf_hub_download(source, name)) for name in (checkpoint_name, MED_CONFIG_NAME))
        except Exception as error:  # offline, not cached, no such repository or file: huggingface_hub's many errors
            raise OSError(f"{type(error).__name__}: {error}") from error
    for file in files:
        if not file.is_file():
            raise OSError(f"{file} does not exist")
    return files


def vision_config(vision: dict, heads: int | None, source: str):
    """BlipVisionConfig of the checkpoint's ViT: sizes from its shapes, ``heads`` (default width / 64) given."""
    from transformers import BlipVisionConfig

    try:
        width = vision["embeddings.class_embedding"].shape[-1]
        patch = vision["embeddings.patch_embedding.weight"].shape[-1]
        positions = vision["embeddings.position_embedding"].shape[1]
        mlp_width = vision["encoder.layers.0.mlp.fc1.weight"].shape[0]
    except KeyError as error:
        raise ValueError(f"imagereward reward: model_path={source!r} lacks the ViT weight {error} "
                         f"({CHECKPOINT_HINT})") from None
    depth = 1 + max(int(key.split(".")[2]) for key in vision if key.startswith("encoder.layers."))
    grid = math.isqrt(positions - 1)
    if grid * grid != positions - 1:
        raise ValueError(f"imagereward reward: model_path={source!r}: the ViT's {positions - 1} patch positions are "
                         "not a square grid")
    heads = heads if heads is not None else width // 64
    if heads < 1 or width % heads:
        raise ValueError(f"imagereward reward: vision_heads={heads} does not divide the ViT's width {width}; give "
                         "vision_heads (16 for ImageReward's ViT-L)")
    return BlipVisionConfig(hidden_size=width, intermediate_size=mlp_width, num_hidden_layers=depth,
                            num_attention_heads=heads, image_size=grid * patch, patch_size=patch, hidden_act="gelu",
                            layer_norm_eps=VIT_LAYER_NORM_EPS, attention_dropout=0.0)


def text_config(med_config: dict, encoder_width: int, source: str):
    """BlipTextConfig of a BLIP med_config.json (a BertConfig); cross-attention to the ViT's width, as BLIP sets it."""
    from transformers import BlipTextConfig

    if not med_config.get("add_cross_attention", False):
        raise ValueError(f"imagereward reward: the {MED_CONFIG_NAME} of model_path={source!r} has no "
                         "add_cross_attention=true (ImageReward's text encoder cross-attends to the image)")
    if med_config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"imagereward reward: the {MED_CONFIG_NAME} of model_path={source!r} has position_embedding_"
                         f"type={med_config['position_embedding_type']!r}; only 'absolute' is supported")
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "max_position_embeddings", "hidden_act", "layer_norm_eps", "pad_token_id")
    missing = [key for key in keys[:5] if key not in med_config]
    if missing:
        raise ValueError(f"imagereward reward: the {MED_CONFIG_NAME} of model_path={source!r} lacks {missing}")
    given = {key: med_config[key] for key in keys if key in med_config}
    # is_decoder: the layers get their cross-attention (called with is_decoder=False: a bidirectional mask)
    return BlipTextConfig(**given, encoder_hidden_size=encoder_width, is_decoder=True,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                          bos_token_id=None, eos_token_id=None, sep_token_id=None)  # generation's, unused here


def image_reward_mlp(width: int) -> nn.Sequential:
    """The package's MLP, with its module indices (layers.0, .2, .4, .6, .7); dropout is inactive in eval."""
    a, b, c, d, e = MLP_WIDTHS
    return nn.Sequential(nn.Linear(width, a), nn.Dropout(0.2), nn.Linear(a, b), nn.Dropout(0.2), nn.Linear(b, c),
                         nn.Dropout(0.1), nn.Linear(c, d), nn.Linear(d, e))


class ImageRewardModel(nn.Module):
    """BLIP ViT + cross-attending text encoder + MLP; ``forward`` -> the MLP's output [B] (before standardising)."""

    def __init__(self, vision_cfg, text_cfg):
        super().__init__()
        from transformers import BlipTextModel, BlipVisionModel

        vision_cfg._attn_implementation = "eager"
        text_cfg._attn_implementation = "eager"
        self.vision = BlipVisionModel(vision_cfg)
        self.text = BlipTextModel(text_cfg, add_pooling_layer=False)
        self.mlp = image_reward_mlp(text_cfg.hidden_size)

    def forward(self, pixels, input_ids, attention_mask):
        image_embeds = self.vision(pixel_values=pixels).last_hidden_state
        image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
        text = self.text(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image_embeds,
                         encoder_attention_mask=image_atts)
        return self.mlp(text.last_hidden_state[:, 0].float()).squeeze(-1)


def load_model(source: str, checkpoint_name: str, vision_heads: int | None) -> ImageRewardModel:
    files = load_from_source(lambda s: checkpoint_files(s, checkpoint_name), source, "model_path", "imagereward",
                             CHECKPOINT_HINT)
    checkpoint, med_path = files
    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        med_config = json.loads(med_path.read_text())
    except Exception as error:  # not a torch file, not JSON
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ValueError(f"imagereward reward: model_path={source!r}: {checkpoint} / {med_path} could not be read "
                         f"({type(error).__name__}: {first_line})") from error
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"imagereward reward: model_path={source!r}: {checkpoint} is not a state dict")
    vision, text, mlp = split_checkpoint(state, source)
    vision_cfg = vision_config(vision, vision_heads, source)
    model = ImageRewardModel(vision_cfg, text_config(med_config, vision_cfg.hidden_size, source))
    parts = (("blip.visual_encoder", model.vision, vision), ("blip.text_encoder", model.text, text),
             ("mlp.layers", model.mlp, mlp))
    for name, module, weights in parts:
        try:
            module.load_state_dict(weights, strict=True)
        except RuntimeError as error:  # missing / unexpected keys, or shapes that do not fit the configs
            detail = " ".join(str(error).split())
            raise ValueError(f"imagereward reward: model_path={source!r}: the {name} weights do not fit the model "
                             f"built from its shapes and {MED_CONFIG_NAME}: {detail[:600]}") from error
    return model.eval().requires_grad_(False)


def blip_preprocess(images: torch.Tensor, size: int) -> torch.Tensor:
    """The package's transform on tensors: bicubic resize of the short side to ``size`` (long side
    ``int(size * long / short)``, as torchvision's Resize), center crop (torchvision's rounding), CLIP mean/std.

    Antialiased bicubic as PIL's (a = -0.5, support scaled when downsampling), in PIL's two passes; PIL also rounds
    to 8 bits after each pass, which this does not: within about 1 level of 255 per pixel (0.3 on average)."""
    images = images.float()
    h, w = images.shape[-2:]
    if h <= w:
        new_h, new_w = size, int(size * w / h)
    else:
        new_h, new_w = int(size * h / w), size
    # PIL's two passes, horizontal first, each saturating to [0, 1] (8-bit values in PIL): noisy images overshoot
    for size_hw in ((h, new_w), (new_h, new_w)):
        if tuple(images.shape[-2:]) != size_hw:
            images = F.interpolate(images, size=size_hw, mode="bicubic", align_corners=False, antialias=True)
            images = images.clamp(0, 1)
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    return normalise(images[..., top : top + size, left : left + size], IMAGE_MEAN, IMAGE_STD)


class ImageRewardScorer:
    """ImageReward model + tokenizer; ``scores(images, prompts)`` -> (standardised rewards [B], MLP outputs [B])."""

    def __init__(self, model_path=IMAGEREWARD_MODEL, tokenizer_path=TOKENIZER, checkpoint_name=CHECKPOINT_NAME,
                 vision_heads: int | None = None, dtype="float32", device: str | None = None, batch_size: int = 32):
        from transformers import BertTokenizer

        self.dtype = resolve_dtype(dtype, "imagereward")
        if int(batch_size) < 1:
            raise ValueError(f"imagereward reward: batch_size={batch_size!r} must be a positive integer")
        self.batch_size = int(batch_size)
        model = load_model(str(model_path) if model_path else model_path, checkpoint_name, vision_heads)
        model.vision.to(self.dtype)
        model.text.to(self.dtype)  # the MLP stays float32, on the float32 [CLS] feature (as the package's .float())
        self.model = model
        self.size = model.vision.config.image_size
        tokenizer = load_from_source(BertTokenizer.from_pretrained, tokenizer_path, "tokenizer_path", "imagereward",
                                     "a BERT tokenizer (bert-base-uncased)")
        tokenizer.add_special_tokens({"bos_token": "[DEC]"})  # BLIP's init_tokenizer
        tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
        if len(tokenizer) > model.text.config.vocab_size:
            raise ValueError(f"imagereward reward: tokenizer_path={str(tokenizer_path)!r} has {len(tokenizer)} tokens "
                             f"(with [DEC], [ENC]) but the text encoder's vocabulary has "
                             f"{model.text.config.vocab_size}")
        self.tokenizer = tokenizer
        self.follower = DeviceFollower(self.model, device)

    @torch.no_grad()
    def scores(self, images: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"imagereward reward: images must be [B, 3, H, W], got shape {tuple(images.shape)}")
        if len(prompts) != len(images):
            raise ValueError(f"imagereward reward: {len(images)} images but {len(prompts)} prompts")
        with self.follower.lock:
            device = self.follower.place(images)
            out = []
            for i in range(0, len(images), self.batch_size):
                pixels = blip_preprocess(images[i : i + self.batch_size].to(device), self.size).to(self.dtype)
                tokens = self.tokenizer(prompts[i : i + self.batch_size], padding="max_length", truncation=True,
                                        max_length=MAX_LENGTH, return_tensors="pt").to(device)
                out.append(self.model(pixels, tokens.input_ids, tokens.attention_mask).float())
        raw = torch.cat(out)
        return (raw - REWARD_MEAN) / REWARD_STD, raw


@register_reward("imagereward")
def imagereward(model_path: str = IMAGEREWARD_MODEL, tokenizer_path: str = TOKENIZER,
                checkpoint_name: str = CHECKPOINT_NAME, vision_heads: int | None = None, dtype: str = "float32",
                device: str | None = None, batch_size: int = 32):
    """ImageReward score of each (image, prompt) pair; the model loads once, here.

    * ``model_path``: hub id (default THUDM/ImageReward, downloaded by huggingface_hub when online), or a local
      directory holding ``checkpoint_name`` and med_config.json, or the checkpoint file with med_config.json beside it.
    * ``tokenizer_path``: hub id or local directory of a BERT tokenizer (default bert-base-uncased).
    * ``checkpoint_name``: the checkpoint's file name in the directory / hub repository (default ImageReward.pt).
    * ``vision_heads``: attention heads of the ViT (not in the checkpoint; default width / 64, 16 for ViT-L).
    * ``dtype``: the encoders' dtype (float32, bfloat16, float16); the MLP head runs in float32.
    * ``device``: where the model runs (default None: the images' device); ``batch_size``: images per forward.

    ``info["raw"]`` is the MLP's output before standardisation.
    """
    scorer = ImageRewardScorer(model_path, tokenizer_path, checkpoint_name, vision_heads=vision_heads, dtype=dtype,
                               device=device, batch_size=batch_size)

    def fn(images, prompts, metadata):
        rewards, raw = scorer.scores(images, list(prompts))
        return rewards.double().cpu(), {"raw": raw.double().cpu()}

    return fn
