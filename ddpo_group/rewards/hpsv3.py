"""HPSv3 (Ma et al. 2025): Qwen2-VL-7B-Instruct fine-tuned as a human-preference reward model (MizzenAI/HPSv3).

    (mu_i, sigma_i) = rm_head(h_i),    reward_i = mu_i

where ``h_i`` is the last hidden state (after the final norm) of Qwen2-VL's language model at the ``<|Reward|>``
token of the prompt below, and ``rm_head`` HPSv3's "ranknet" head, run in float32:
Linear(hidden, 1024) -> ReLU -> Dropout(0.05) -> Linear(1024, 16) -> ReLU -> Linear(16, 2). The head predicts a
Gaussian (mu, sigma) of the preference score; the reward is mu, as the package's example selects
(``info["sigma"]`` holds the second output). The score is unbounded, higher is better; per-model means on HPSv3's
own benchmark are of order 0-11 (the paper's leaderboard, e.g. about 10 for FLUX.1-dev).

This reproduces the ``hpsv3`` package's inference (``HPSv3RewardInferencer`` with ``config/HPSv3_7B.yaml``) on
transformers' own Qwen2-VL classes; the package itself pins transformers 4.45.2 and deepspeed, so it is not used:

* Prompt: one user turn of Qwen2-VL's chat template (its default system turn, generation prompt added) holding
  the image, then ``INSTRUCTION.format(text_prompt=prompt) + PROMPT_WITH_REWARD_TOKEN`` (the package's text, kept
  verbatim below). ``<|Reward|>`` is added to the base tokenizer as a special token, as the package does, so it is
  the id after the base vocabulary.
* Image: quantised to 8 bits (a saved PNG), resized with PIL's bicubic filter to the package's
  ``smart_resize(h, w, 28, min_pixels=max_pixels=256*28*28)`` (multiples of 28 with about 200704 pixels: 448 x
  448 for a square, 256 vision tokens), then Qwen2-VL's image processor (PIL backend: rescale, CLIP
  normalisation, 14 px patches).
* Forward: HPSv3's own forward, which embeds the tokens, scatters the vision tower's merged features at the
  ``<|image_pad|>`` tokens and runs the language model with *1-D* positions (0, 1, 2, ... on all three M-RoPE axes,
  not Qwen2-VL's 3-D image positions: the package's forward gives no position ids, and the model was trained so).
  Right padding and a causal mask make the batch's padding change nothing.

Weights: ``checkpoint_path`` is HPSv3's state dict over the whole model (``HPSv3.safetensors`` of the hub
repository MizzenAI/HPSv3, the transformers-4.45 layout of ``Qwen2VLRewardModelBT``), mapped to transformers'
``Qwen2VLModel``: ``visual.*`` stays, ``model.*`` becomes ``language_model.*`` (checkpoints already in the
transformers-5 layout, ``model.visual.*`` / ``model.language_model.*``, load too), ``rm_head.*`` is the head and
``lm_head.weight`` (unused by the reward) is dropped. Every other weight must be there with its shape (a strict
load); the token embedding's rows are the checkpoint's (the package shrank the 152064 rows to the tokenizer's
length plus ``<|Reward|>``). Only the config, tokenizer and image processor come from ``base_model``: the base
model's own weights are never loaded.

Defaults: ``base_model`` Qwen/Qwen2-VL-7B-Instruct and ``checkpoint_path`` MizzenAI/HPSv3 with ``checkpoint_file``
HPSv3.safetensors (hub ids, downloaded into the Hugging Face cache when online); give a local directory and a local
file to run offline. The file holds 8.3 B parameters (16.6 GB in bfloat16); the 7.7 B used here (no lm_head) take
15.5 GB in bfloat16, the default dtype, as the package runs it (the whole model cast, RoPE frequencies included; the
head stays float32). Needs nothing beyond the base install (transformers, accelerate, safetensors): the image
processor's PIL backend and the tokenizer are used without transformers' Qwen2VLProcessor, whose video processor needs
torchvision.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ddpo_group.rewards import register_reward
from ddpo_group.rewards.loading import DeviceFollower, load_from_source, resolve_dtype
from ddpo_group.rewards.preprocess import qwen_vl_smart_resize

HPSV3_BASE = "Qwen/Qwen2-VL-7B-Instruct"
HPSV3_REPO = "MizzenAI/HPSv3"
HPSV3_FILE = "HPSv3.safetensors"
REWARD_TOKEN = "<|Reward|>"
IMAGE_TOKEN = "<|image_pad|>"
IMAGE_FACTOR = 28  # Qwen2-VL: 14 px patches merged 2 x 2
PIXELS = 256 * 28 * 28  # the package's prepare_batch: min_pixels = max_pixels
MAX_RATIO = 200
HEAD_WIDTHS = (1024, 16)  # the "ranknet" head without rm_head_kwargs

# hpsv3/dataset/data_collator_qwen.py, verbatim
INSTRUCTION = """
You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best. 

**Visual Quality:**  
Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:
- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

**Text Alignment:**  
Assess how well the image matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.
- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.
- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.
- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.
Textual prompt - {text_prompt}


"""

PROMPT_WITH_REWARD_TOKEN = """
Please provide the overall ratings of this image: <|Reward|>

END
"""

# Qwen2-VL-7B-Instruct's chat template (its tokenizer_config.json / chat_template.json), used when the base
# tokenizer carries none
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)

BASE_WHAT = "Qwen2-VL-7B-Instruct's config, tokenizer and image processor (e.g. Qwen/Qwen2-VL-7B-Instruct)"
CHECKPOINT_WHAT = f"the HPSv3 checkpoint (e.g. {HPSV3_FILE} of the hub repository {HPSV3_REPO})"


def low_precision_vision_rope(rope: nn.Module) -> None:
    """The vision tower's rotary angles and their cos / sin in the model's dtype, as transformers 4.45 (the package's)
    computes them once the model is cast: its table ``outer(arange(n), inv_freq)`` in the dtype of the cast inv_freq
    and ``freqs.cos()`` of it, where transformers 5 computes both in float32 (``Qwen2VLVisionRotaryEmbedding``)."""
    def forward(x, position_ids):
        dtype = rope.inv_freq.dtype
        freqs = position_ids[..., None].to(dtype) * rope.inv_freq.to(x.device)
        cos, sin = (freqs.cos() * rope.attention_scaling).float(), (freqs.sin() * rope.attention_scaling).float()
        return rope.recomposition_frequencies(cos), rope.recomposition_frequencies(sin)

    rope.forward = forward


def reward_head(hidden_size: int, output_dim: int = 2) -> nn.Sequential:
    """HPSv3's ``rm_head`` ("ranknet" without rm_head_kwargs): state dict keys 0.*, 3.*, 5.*."""
    return nn.Sequential(nn.Linear(hidden_size, HEAD_WIDTHS[0]), nn.ReLU(), nn.Dropout(0.05),
                         nn.Linear(HEAD_WIDTHS[0], HEAD_WIDTHS[1]), nn.ReLU(), nn.Linear(HEAD_WIDTHS[1], output_dim))


def split_checkpoint(state_dict: dict) -> tuple[dict, dict, list[str]]:
    """HPSv3's keys -> (``Qwen2VLModel`` state dict, ``rm_head`` state dict, keys that belong to neither).

    transformers 4.45 (HPSv3's ``Qwen2VLForConditionalGeneration`` subclass): ``visual.*``, ``model.*`` (the
    language model), ``lm_head.weight``, ``rm_head.*``; transformers 5: ``model.visual.*``,
    ``model.language_model.*``. ``lm_head.weight`` is dropped.
    """
    if "model" in state_dict and isinstance(state_dict["model"], dict):  # the package unwraps {"model": ...}
        state_dict = state_dict["model"]
    backbone, head, unknown = {}, {}, []
    for key, value in state_dict.items():
        if key.startswith("rm_head."):
            head[key[len("rm_head."):]] = value
        elif key == "lm_head.weight":
            continue
        elif key.startswith(("model.visual.", "model.language_model.")):
            backbone[key[len("model."):]] = value
        elif key.startswith("visual."):
            backbone[key] = value
        elif key.startswith("model."):
            backbone["language_model." + key[len("model."):]] = value
        else:
            unknown.append(key)
    return backbone, head, unknown


def read_state_dict(file: Path) -> dict:
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file), device="cpu")
    return torch.load(str(file), map_location="cpu", weights_only=True)


def resolve_checkpoint(checkpoint_path, checkpoint_file: str) -> Path:
    """The local checkpoint file: ``checkpoint_path`` itself (a file), ``checkpoint_file`` inside it (a
    directory), or ``checkpoint_file`` of the hub repository ``checkpoint_path``."""

    def locate(source: str) -> Path:
        path = Path(source)
        if path.is_file():
            return path
        if path.is_dir():
            if not (path / checkpoint_file).is_file():
                raise FileNotFoundError(f"the directory has no {checkpoint_file!r} (checkpoint_file)")
            return path / checkpoint_file
        from huggingface_hub import hf_hub_download

        try:
            return Path(hf_hub_download(source, checkpoint_file))
        except Exception as error:  # offline, not cached, no such repository or file: errors of several classes
            raise OSError(f"{type(error).__name__}: {error}") from error

    return load_from_source(locate, checkpoint_path, "checkpoint_path", "hpsv3", CHECKPOINT_WHAT)


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class HPSv3Scorer:
    """Qwen2-VL backbone + HPSv3 head; ``scores(images, prompts)`` -> (mu, sigma) float32 [B] each (on the model's
    device; sigma is None for a head with one output)."""

    def __init__(self, base_model: str = HPSV3_BASE, checkpoint_path: str = HPSV3_REPO,
                 checkpoint_file: str = HPSV3_FILE, dtype="bfloat16", device: str | None = None, batch_size: int = 4,
                 attn_implementation: str = "sdpa"):
        from transformers import AutoConfig, AutoTokenizer, Qwen2VLImageProcessorPil

        if int(batch_size) < 1:
            raise ValueError(f"hpsv3 reward: batch_size={batch_size!r} must be a positive integer")
        if attn_implementation not in ("sdpa", "eager", "flash_attention_2"):
            raise ValueError(f"hpsv3 reward: attn_implementation={attn_implementation!r} must be one of sdpa, eager, "
                             "flash_attention_2")
        self.dtype = resolve_dtype(dtype, "hpsv3")
        self.batch_size = int(batch_size)
        config = load_from_source(AutoConfig.from_pretrained, base_model, "base_model", "hpsv3", BASE_WHAT)
        model_type = getattr(config, "model_type", None)
        if model_type != "qwen2_vl":
            raise ValueError(f"hpsv3 reward: base_model={str(base_model)!r} is a {model_type!r} model; HPSv3 is built "
                             "on Qwen2-VL (model_type 'qwen2_vl', e.g. Qwen/Qwen2-VL-7B-Instruct)")
        tokenizer = load_from_source(lambda s: AutoTokenizer.from_pretrained(s, padding_side="right"), base_model,
                                     "base_model", "hpsv3", BASE_WHAT)
        self.image_processor = load_from_source(Qwen2VLImageProcessorPil.from_pretrained, base_model, "base_model",
                                                "hpsv3", BASE_WHAT)
        tokenizer.padding_side = "right"  # the package's processor pads on the right
        tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})  # as hpsv3's train.py does
        self.tokenizer = tokenizer
        self.reward_id = tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        self.image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        if self.image_id != config.image_token_id:
            raise ValueError(f"hpsv3 reward: base_model={str(base_model)!r}: the tokenizer's {IMAGE_TOKEN} is id "
                             f"{self.image_id}, the config's image_token_id {config.image_token_id}")
        self.chat_template = tokenizer.chat_template or QWEN2_VL_CHAT_TEMPLATE

        file = resolve_checkpoint(checkpoint_path, checkpoint_file)
        where = f"hpsv3 reward: checkpoint_path={str(checkpoint_path)!r} ({file})"
        try:
            state_dict = read_state_dict(file)
        except Exception as error:
            raise ValueError(f"{where} could not be read as a state dict: {first_line(error)}") from error
        backbone_state, head_state, unknown = split_checkpoint(state_dict)
        del state_dict
        if unknown or not head_state or "language_model.embed_tokens.weight" not in backbone_state:
            raise ValueError(f"{where} is not an HPSv3 state dict (visual.*, model.*, rm_head.*): "
                             f"{'keys ' + ', '.join(unknown[:5]) if unknown else 'no rm_head.* / model.embed_tokens'}")
        text_config = config.text_config
        rows, width = backbone_state["language_model.embed_tokens.weight"].shape
        if width != text_config.hidden_size:
            raise ValueError(f"{where} does not fit base_model={str(base_model)!r}: its hidden size is {width}, the "
                             f"base model's {text_config.hidden_size}")
        if rows < len(tokenizer):
            raise ValueError(f"{where} does not fit base_model={str(base_model)!r}: its token embedding has {rows} "
                             f"rows, fewer than the tokenizer with {REWARD_TOKEN} ({len(tokenizer)} tokens)")
        text_config.vocab_size = rows  # the package resized the embedding to len(tokenizer)
        config.vocab_size = rows
        self.head = self.load_head(head_state, text_config.hidden_size, where)
        self.model = self.load_backbone(config, backbone_state, attn_implementation, where)
        self.merge = self.image_processor.merge_size
        self.follower = DeviceFollower(nn.ModuleDict({"model": self.model, "head": self.head}), device)

    def load_head(self, head_state: dict, hidden_size: int, where: str) -> nn.Sequential:
        out = head_state.get("5.weight")
        head = reward_head(hidden_size, out.shape[0] if out is not None and out.ndim == 2 else 2)
        try:
            head.load_state_dict(head_state, strict=True)
        except RuntimeError as error:
            details = "; ".join(line.strip() for line in str(error).strip().splitlines()[1:] if line.strip())
            raise ValueError(f"{where}: its rm_head is not HPSv3's Linear({hidden_size}, 1024) -> ReLU -> Dropout -> "
                             f"Linear(1024, 16) -> ReLU -> Linear(16, 2): {details[:600]}") from error
        return head.float().eval().requires_grad_(False)

    def load_backbone(self, config, backbone_state: dict, attn_implementation: str, where: str):
        from accelerate import init_empty_weights
        from transformers import Qwen2VLModel

        with init_empty_weights(include_buffers=False):  # parameters on "meta", filled below; buffers (RoPE) real
            model = Qwen2VLModel._from_config(config, attn_implementation=attn_implementation)
        try:
            model.load_state_dict(backbone_state, strict=True, assign=True)
        except RuntimeError as error:
            lines = [line.strip() for line in str(error).strip().splitlines()[1:] if line.strip()]
            raise ValueError(f"{where} does not fit the base model's Qwen2-VL: {'; '.join(lines)[:600]}") from error
        # the whole module in one dtype, buffers included, as the package's model.to(torch.bfloat16)
        model = model.to(self.dtype).eval().requires_grad_(False)
        if self.dtype != torch.float32:
            low_precision_vision_rope(model.visual.rotary_pos_emb)
        return model

    def pil_images(self, images: torch.Tensor) -> list:
        """8-bit PIL images resized (bicubic) to the package's 256 * 28 * 28 pixels."""
        from PIL import Image

        pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        out = []
        for array in pixels:
            height, width = array.shape[:2]
            h_bar, w_bar = qwen_vl_smart_resize(height, width, IMAGE_FACTOR, PIXELS, PIXELS, "hpsv3", MAX_RATIO)
            out.append(Image.fromarray(array).resize((w_bar, h_bar), Image.BICUBIC))
        return out

    def inputs(self, images: torch.Tensor, prompts: list[str]) -> dict:
        """input_ids, attention_mask, pixel_values, image_grid_thw as Qwen2VLProcessor makes them for the package's
        messages (the chat template rendered, then each image's pad token repeated once per merged patch)."""
        vision = self.image_processor(images=self.pil_images(images), return_tensors="pt")
        texts = []
        for prompt, grid in zip(prompts, vision["image_grid_thw"]):
            messages = [{"role": "user", "content": [
                {"type": "image", "min_pixels": PIXELS, "max_pixels": PIXELS},
                {"type": "text", "text": INSTRUCTION.format(text_prompt=prompt) + PROMPT_WITH_REWARD_TOKEN}]}]
            text = self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                      add_generation_prompt=True)
            if text.count(IMAGE_TOKEN) != 1:
                raise ValueError(f"hpsv3 reward: the prompt {prompt!r} renders {text.count(IMAGE_TOKEN)} "
                                 f"{IMAGE_TOKEN} tokens (one image a prompt)")
            texts.append(text.replace(IMAGE_TOKEN, IMAGE_TOKEN * int(grid.prod() // self.merge ** 2)))
        tokens = self.tokenizer(texts, padding=True, return_tensors="pt")
        counts = (tokens["input_ids"] == self.reward_id).sum(dim=1)
        if not torch.all(counts == 1):
            bad = int((counts != 1).nonzero()[0, 0])
            raise ValueError(f"hpsv3 reward: the prompt {prompts[bad]!r} gives {int(counts[bad])} {REWARD_TOKEN} "
                             "tokens; the reward is read at exactly one")
        return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"],
                "pixel_values": vision["pixel_values"], "image_grid_thw": vision["image_grid_thw"]}

    @torch.no_grad()
    def scores(self, images: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"hpsv3 reward: images must be [B, 3, H, W] in [0, 1], got shape {tuple(images.shape)}")
        if len(prompts) != len(images):
            raise ValueError(f"hpsv3 reward: {len(images)} images but {len(prompts)} prompts")
        mus, sigmas = [], []
        with self.follower.lock:
            device = self.follower.place(images)
            for start in range(0, len(images), self.batch_size):
                batch = self.inputs(images[start : start + self.batch_size], prompts[start : start + self.batch_size])
                input_ids = batch["input_ids"].to(device)
                length = input_ids.shape[1]
                # HPSv3's forward: 1-D positions on the three M-RoPE axes (its language model got no position_ids)
                positions = torch.arange(length, device=device).view(1, 1, -1).expand(3, input_ids.shape[0], -1)
                hidden = self.model(input_ids=input_ids, attention_mask=batch["attention_mask"].to(device),
                                    position_ids=positions, pixel_values=batch["pixel_values"].to(device, self.dtype),
                                    image_grid_thw=batch["image_grid_thw"].to(device)).last_hidden_state
                logits = self.head(hidden[input_ids == self.reward_id].float())  # [B, output_dim], one token a row
                mus.append(logits[:, 0])
                if logits.shape[1] > 1:
                    sigmas.append(logits[:, 1])
        return torch.cat(mus), (torch.cat(sigmas) if sigmas else None)


@register_reward("hpsv3")
def hpsv3(base_model: str = HPSV3_BASE, checkpoint_path: str = HPSV3_REPO, checkpoint_file: str = HPSV3_FILE,
          dtype: str = "bfloat16", device: str | None = None, batch_size: int = 4, attn_implementation: str = "sdpa"):
    """HPSv3's mu for each (image, prompt) pair; the model loads once, here.

    base_model: hub id or local directory of Qwen2-VL-7B-Instruct (config, tokenizer, image processor only).
    checkpoint_path: a local checkpoint file, a local directory holding ``checkpoint_file``, or the hub repository
        of ``checkpoint_file`` (default MizzenAI/HPSv3).
    checkpoint_file: the file name inside a directory / hub repository (default HPSv3.safetensors).
    dtype: float32, bfloat16 (default, as the package runs) or float16 for the backbone; the head runs in float32.
    device: where the model runs; None follows the images' device.
    batch_size: images a forward pass (each about 700 tokens).
    attn_implementation: transformers' attention for the backbone: sdpa (default), eager or flash_attention_2.

    ``info["sigma"]``: the head's second output (the predicted spread of the score).
    """
    scorer = HPSv3Scorer(base_model, checkpoint_path, checkpoint_file, dtype=dtype, device=device,
                         batch_size=batch_size, attn_implementation=attn_implementation)

    def fn(images, prompts, metadata):
        mu, sigma = scorer.scores(images, list(prompts))
        return mu.double().cpu(), ({"sigma": sigma.double().cpu()} if sigma is not None else {})

    return fn
