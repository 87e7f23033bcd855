"""VQAScore (Lin et al. 2024, "Evaluating Text-to-Visual Generation with Image-to-Text Generation"): the probability
that a vision-language model answers "Yes" to a question about the prompt.

    reward_i = P(answer | image_i, question(prompt_i))
             = softmax(penalised logits at the position after the prompt)[first token of answer]   (decoder-only VLMs)

with t2v_metrics' (the authors' package, version 3.0) scoring of each architecture reproduced on transformers:

* Qwen2-VL / Qwen2.5-VL (``t2v_metrics/models/vqascore_models/qwen2vl_model.py``, ``Qwen2VLModel.forward``):
  question ``'Does this image show "{}"?'``, answer ``"Yes"``; one user turn holding the image then the question,
  rendered by the checkpoint's chat template with the generation prompt (Qwen's default system turn, then
  ``<|im_start|>assistant\\n``); the image resized first as ``qwen_vl_utils.fetch_image`` does (each side rounded to a
  multiple of 28 = patch 14 x merge 2, the area kept within [4, 16384] x 28 x 28 pixels, a PIL bicubic resize), then
  the checkpoint's processor. t2v_metrics reads ``generate(max_new_tokens=1, do_sample=False,
  output_scores=True).scores[0]``: the last position's logits (float32) after the greedy logits processors of the
  checkpoint's generation config, i.e. its ``repetition_penalty`` (1.05 for Qwen's instruct models) over the prompt's
  tokens (a logit l of a token in the prompt becomes l / p if l > 0, l * p otherwise), which is applied here too.
* CLIP-FlanT5 (``clip_t5_model.py``, ``CLIPT5Model``; ``zhiqiulin/clip-flant5-xxl``, the paper's default, and
  ``-xl``): t2v_metrics' ``CLIPT5ForConditionalGeneration`` rebuilt from transformers' ``T5ForConditionalGeneration``,
  ``CLIPVisionModel`` and the ``mm_projector`` (``mlp2x_gelu``: Linear, GELU, Linear), its weights read from the
  checkpoint's key layout (T5's keys, ``vision_tower.vision_tower.*``, ``mm_projector.*``; a tower missing there is
  loaded from ``mm_vision_tower``, as t2v_metrics builds it). The reward is

      reward_i = exp( mean_t log P_T5(a_t | a_<t, encoder(question_i with image_i)) ),  a = tokens("Yes") = [Yes, </s>]

  (``CLIPT5Model.forward``: exp(-cross entropy) over the answer's tokens with the tokenizer's ``</s>``; the logits cut
  to ``len(tokenizer)`` = 32100 as its ``resize_token_embeddings`` does). The encoder reads ``"<system> USER: "``,
  the image's 576 projected CLIP ViT-L/14-336 patch features (layer -2, CLS dropped), then ``"\\n" + question +
  " ASSISTANT: "`` (``format_question(..., "t5_chat")``), each text chunk tokenized with its ``</s>``
  (``mm_utils.t5_tokenizer_image_token``); question ``'Does this figure show "{}"? Please answer yes or no.'``; the
  image centred on a square of the CLIP mean colour (``expand2square``), then CLIP's processor (336 px).

The answer's token is ``tokenizer.encode(answer)[0]``, as t2v_metrics takes it. Each image is scored alone (no
padding). Images, float [B, 3, H, W] in [0, 1], become 8-bit RGB (rounded) as the image files t2v_metrics reads.
``info["log_likelihood"]`` holds the log of each reward.

Not built here: t2v_metrics' other models (InstructBLIP, LLaVA-1.5/1.6, InternVL, mPLUG-Owl3, PaliGemma, Molmo,
Gemini / GPT-4o); a LLaVA-OneVision checkpoint is refused by name: t2v_metrics scores it through the ``llava``
package, whose ``process_images`` hands its anyres tiles to the video branch (each tile pooled 2 x 2, in float16),
not transformers' image path. Default model: ``Qwen/Qwen2.5-VL-7B-Instruct`` (t2v_metrics' ``qwen2.5-vl-7b``, the default of its
Qwen2VLModel), in bfloat16 as t2v_metrics loads it. Needs transformers, and torchvision (built for the installed
torch) for transformers 5's Qwen2-VL processor, which holds a video processor (the extra ``vqascore``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ddpo_group.rewards import register_reward
from ddpo_group.rewards.loading import DeviceFollower, load_from_source, looks_local, resolve_dtype
from ddpo_group.rewards.preprocess import qwen_vl_smart_resize

DEFAULT_MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
WHAT = ("a Qwen2-VL / Qwen2.5-VL checkpoint (transformers layout: config, weights, processor) or a CLIP-FlanT5 one "
        "(t2v_metrics' layout)")

QWEN_TYPES = ("qwen2_vl", "qwen2_5_vl")
SUPPORTED = QWEN_TYPES
# t2v_metrics scores LLaVA-OneVision through the llava package's video branch, which this reward does not reproduce
REFUSED = {"llava_onevision": "t2v_metrics scores LLaVA-OneVision through the llava package, whose anyres tiles go "
                              "through its video branch (each tile pooled 2 x 2, in float16), not transformers' image "
                              "path, which this reward would run: use a Qwen2-VL / Qwen2.5-VL or CLIP-FlanT5 checkpoint"}

# t2v_metrics 3.0, models/vqascore_models/qwen2vl_model.py (Qwen2VLModel.forward's defaults)
QWEN_QUESTION = 'Does this image show "{}"?'
ANSWER = "Yes"

# qwen_vl_utils.vision_process (fetch_image's defaults)
QWEN_MIN_PIXELS = 4 * 28 * 28
QWEN_MAX_PIXELS = 16384 * 28 * 28
QWEN_MAX_RATIO = 200


def check_templates(question_template: str, answer_template: str) -> None:
    """A question with one ``{}`` for the prompt (and no other field), a non-empty answer; else a ValueError."""
    try:
        question_template.format("p")
    except (IndexError, KeyError, ValueError) as error:
        raise ValueError(f"vqascore reward: question_template={question_template!r} must hold one '{{}}' for the "
                         f"prompt and no other field ({type(error).__name__}: {error})") from None
    if "{}" not in question_template:
        raise ValueError(f"vqascore reward: question_template={question_template!r} needs a '{{}}' for the prompt")
    if not answer_template:
        raise ValueError(f"vqascore reward: answer_template={answer_template!r} must be a non-empty answer")


def check_inputs(images: torch.Tensor, prompts: list[str]) -> None:
    """Images [B, 3, H, W] and B prompts, or a ValueError saying what came."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"vqascore reward: images must be [B, 3, H, W], got {tuple(images.shape)}")
    if len(prompts) != len(images):
        raise ValueError(f"vqascore reward: {len(images)} images but {len(prompts)} prompts")


CLIP_T5_NAMES = ("clip-flant5", "clip_flant5", "clip-t5", "clip_t5")


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """[B, 3, H, W] floats in [0, 1] -> B 8-bit RGB PIL images (rounded, as an image file holds them)."""
    arrays = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(np.ascontiguousarray(a)) for a in arrays]


def names_clip_t5(model_path) -> bool:
    return any(name in str(model_path).lower() for name in CLIP_T5_NAMES)


def read_model_type(model_path) -> str:
    """The checkpoint's ``model_type`` (a local config.json is read as JSON first, so a custom type such as clip_t5
    is named rather than failing inside transformers)."""
    path = Path(str(model_path)).expanduser()
    config_file = path / "config.json"
    if path.is_dir() and config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except ValueError as error:
            raise ValueError(f"vqascore reward: model_path={str(model_path)!r}: config.json is not JSON ({error})") \
                from error
        model_type = config.get("model_type", "")
        architectures = " ".join(config.get("architectures") or [])
        if model_type in CLIP_T5_NAMES or "CLIPT5" in architectures:
            return "clip_t5"
        return model_type
    from transformers import AutoConfig

    config = load_from_source(AutoConfig.from_pretrained, model_path, "model_path", "vqascore", WHAT)
    return config.model_type


def import_torchvision_hint(error: Exception, model_path) -> Exception:
    if "torchvision" in str(error).lower():
        return ImportError(
            f"vqascore reward: the processor of model_path={str(model_path)!r} needs torchvision (transformers 5's "
            f"Qwen2-VL processor holds a video processor): pip install a torchvision built for "
            f"your torch {torch.__version__} ({type(error).__name__}: {error})")
    return error


class VQAScorer:
    """A transformers VLM and its processor; ``scores(images, prompts)`` -> (P(answer) [B], log P(answer) [B])."""

    def __init__(self, model_path=DEFAULT_MODEL, dtype="bfloat16", device: str | None = None,
                 question_template: str | None = None, answer_template: str = ANSWER,
                 repetition_penalty: float | None = None, min_pixels: int = QWEN_MIN_PIXELS,
                 max_pixels: int = QWEN_MAX_PIXELS, model_type: str | None = None):
        self.model_type = model_type or read_model_type(model_path)
        if self.model_type in REFUSED:
            raise ValueError(f"vqascore reward: model_path={str(model_path)!r} is a {self.model_type!r} model: "
                             f"{REFUSED[self.model_type]}")
        if self.model_type not in SUPPORTED:
            raise ValueError(f"vqascore reward: model_path={str(model_path)!r} is a {self.model_type!r} model; "
                             f"supported: {', '.join(SUPPORTED)}, clip_t5 (Qwen2-VL, Qwen2.5-VL, CLIP-FlanT5)")
        question_template = QWEN_QUESTION if question_template is None else question_template
        check_templates(question_template, answer_template)
        if not (isinstance(min_pixels, int) and isinstance(max_pixels, int) and 0 < min_pixels <= max_pixels):
            raise ValueError(f"vqascore reward: min_pixels={min_pixels!r}, max_pixels={max_pixels!r} must be "
                             f"integers with 0 < min_pixels <= max_pixels")
        self.question_template = question_template
        self.dtype = resolve_dtype(dtype, "vqascore")
        self.min_pixels, self.max_pixels = min_pixels, max_pixels

        from transformers import AutoModelForImageTextToText, AutoProcessor

        def load_processor(source):
            try:
                return AutoProcessor.from_pretrained(source)
            except ImportError as error:
                hint = import_torchvision_hint(error, model_path)
                if hint is error:
                    raise
                raise hint from error

        self.processor = load_from_source(load_processor, model_path, "model_path", "vqascore", WHAT)
        self.model = load_from_source(lambda source: AutoModelForImageTextToText.from_pretrained(source,
                                                                                                 dtype=self.dtype),
                                      model_path, "model_path", "vqascore", WHAT)
        self.model.eval().requires_grad_(False)
        tokenizer = self.processor.tokenizer
        self.answer_id = tokenizer.encode(answer_template)[0]  # as t2v_metrics: the answer's first token
        if repetition_penalty is None:  # as t2v_metrics' generate() applies the checkpoint's to the prompt's ids
            repetition_penalty = getattr(self.model.generation_config, "repetition_penalty", None) or 1.0
        if not (isinstance(repetition_penalty, (int, float)) and repetition_penalty > 0):
            raise ValueError(f"vqascore reward: repetition_penalty={repetition_penalty!r} must be a number > 0")
        self.repetition_penalty = float(repetition_penalty)
        image_processor = self.processor.image_processor
        self.factor = int(image_processor.patch_size) * int(image_processor.merge_size)
        # the processor's template (chat_template.json), else the tokenizer's (Qwen's tokenizer_config has it too)
        self.chat_template = self.processor.chat_template or getattr(tokenizer, "chat_template", None)
        if not self.chat_template:
            raise ValueError(f"vqascore reward: model_path={str(model_path)!r} has no chat template (neither "
                             f"chat_template.json nor the tokenizer's): t2v_metrics renders Qwen's")
        self.follower = DeviceFollower(self.model, device)

    def inputs(self, image: Image.Image, prompt: str) -> dict:
        """The processor's inputs for one (image, prompt), as t2v_metrics builds them."""
        question = self.question_template.format(prompt)
        height, width = qwen_vl_smart_resize(image.height, image.width, self.factor, self.min_pixels, self.max_pixels,
                                             "vqascore", QWEN_MAX_RATIO)
        image = image.resize((width, height), Image.Resampling.BICUBIC)  # qwen_vl_utils.fetch_image's PIL default
        messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                                 {"type": "text", "text": question}]}]
        text = self.processor.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=True)
        return self.processor(text=[text], images=[image], padding=True, return_tensors="pt")

    def penalise(self, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """transformers' RepetitionPenaltyLogitsProcessor: each token of the prompt once, l/p if l > 0 else l*p."""
        if self.repetition_penalty == 1.0:
            return logits
        ids = input_ids.unique()
        picked = logits[ids]
        return logits.scatter(0, ids, torch.where(picked < 0, picked * self.repetition_penalty,
                                                  picked / self.repetition_penalty))

    @torch.no_grad()
    def scores(self, images: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        check_inputs(images, prompts)
        probabilities, logits_out = [], []
        with self.follower.lock:
            device = self.follower.place(images)
            for image, prompt in zip(to_pil(images), prompts):
                inputs = self.inputs(image, prompt)
                inputs = {key: (value.to(device, self.dtype) if value.is_floating_point() else value.to(device))
                          for key, value in inputs.items()}
                logits = self.model(**inputs, logits_to_keep=1).logits[0, -1].float()
                logits = self.penalise(logits, inputs["input_ids"][0])
                log_probabilities = torch.log_softmax(logits, dim=-1)
                probabilities.append(log_probabilities[self.answer_id].exp())
                logits_out.append(log_probabilities[self.answer_id])
        return torch.stack(probabilities), torch.stack(logits_out)


CLIP_T5_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
                  "detailed, and polite answers to the user's questions.")  # t2v_metrics constants.SYSTEM_MSG
CLIP_T5_QUESTION = 'Does this figure show "{}"? Please answer yes or no.'  # clip_t5_model.py default_question_template
CLIP_T5_TOKENIZER = "google/flan-t5-xxl"  # t2v_metrics' tokenizer of clip-flant5-xxl (every Flan-T5 has its vocabulary)
CLIP_T5_VISION_PREFIX = "vision_tower.vision_tower."  # CLIPVisionTower(.vision_tower = CLIPVisionModel)
CLIP_T5_PROJECTOR_PREFIX = "mm_projector."


def read_checkpoint(directory: Path, model_path) -> dict:
    """Every tensor of a checkpoint directory: *.safetensors, else pytorch_model*.bin (weights only)."""
    files = sorted(directory.glob("*.safetensors"))
    state = {}
    if files:
        from safetensors.torch import load_file

        for file in files:
            state.update(load_file(str(file)))
        return state
    files = sorted(directory.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"vqascore reward: model_path={str(model_path)!r} holds no *.safetensors nor "
                                f"pytorch_model*.bin weights")
    for file in files:
        state.update(torch.load(file, map_location="cpu", weights_only=True))
    return state


class CLIPFlanT5Scorer:
    """t2v_metrics' CLIPT5ForConditionalGeneration rebuilt from transformers' T5ForConditionalGeneration, a
    CLIPVisionModel and the MLP projector; ``scores(images, prompts)`` -> (score [B], mean answer log-likelihood [B])."""

    def __init__(self, model_path, dtype="bfloat16", device: str | None = None, question_template: str | None = None,
                 answer_template: str = ANSWER, tokenizer_path: str | None = None, vision_tower_path: str | None = None):
        from transformers import AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, T5Config, \
            T5ForConditionalGeneration

        self.dtype = resolve_dtype(dtype, "vqascore")
        directory = Path(load_from_source(self.snapshot, model_path, "model_path", "vqascore",
                                          "a CLIP-FlanT5 checkpoint (t2v_metrics' CLIPT5ForConditionalGeneration)"))
        config = json.loads((directory / "config.json").read_text())
        state = read_checkpoint(directory, model_path)
        projector_type = config.get("mm_projector_type", "linear")
        if projector_type not in ("linear", "mlp2x_gelu") or config.get("mm_vision_select_feature", "patch") != "patch":
            raise ValueError(f"vqascore reward: model_path={str(model_path)!r} has mm_projector_type "
                             f"{projector_type!r} / mm_vision_select_feature {config.get('mm_vision_select_feature')!r}"
                             f"; supported: 'linear' or 'mlp2x_gelu' with 'patch' (clip-flant5-xxl / -xl)")
        self.select_layer = int(config.get("mm_vision_select_layer", -2))
        self.question_template = question_template or CLIP_T5_QUESTION
        check_templates(self.question_template, answer_template)
        self.answer_template = answer_template

        if tokenizer_path is None:  # the checkpoint's own tokenizer files, else t2v_metrics' google/flan-t5-xxl
            has_tokenizer = any((directory / name).is_file() for name in ("tokenizer.json", "spiece.model"))
            tokenizer_path = str(directory) if has_tokenizer else CLIP_T5_TOKENIZER
        self.tokenizer = load_from_source(lambda source: AutoTokenizer.from_pretrained(source), tokenizer_path,
                                          "tokenizer_path", "vqascore", "the Flan-T5 tokenizer (google/flan-t5-xxl)")
        vision_tower_path = vision_tower_path or config.get("mm_vision_tower")
        self.image_processor = load_from_source(CLIPImageProcessor.from_pretrained, vision_tower_path,
                                                "vision_tower_path", "vqascore",
                                                "the CLIP vision tower (openai/clip-vit-large-patch14-336)")
        vision_config = load_from_source(CLIPVisionConfig.from_pretrained, vision_tower_path, "vision_tower_path",
                                         "vqascore", "the CLIP vision tower (openai/clip-vit-large-patch14-336)")

        vision_state = {k[len(CLIP_T5_VISION_PREFIX):]: v for k, v in state.items()
                        if k.startswith(CLIP_T5_VISION_PREFIX)}
        projector_state = {k[len(CLIP_T5_PROJECTOR_PREFIX):]: v for k, v in state.items()
                           if k.startswith(CLIP_T5_PROJECTOR_PREFIX)}
        t5_state = {k: v for k, v in state.items() if not k.startswith((CLIP_T5_VISION_PREFIX,
                                                                          CLIP_T5_PROJECTOR_PREFIX))}
        t5_state.pop("embed_tokens.weight", None)  # CLIPT5's alias of encoder.embed_tokens (= shared)
        for key in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            t5_state.setdefault(key, t5_state.get("shared.weight"))
        t5_config = T5Config(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})
        if t5_config.tie_word_embeddings:
            t5_state.setdefault("lm_head.weight", t5_state.get("shared.weight"))
        t5_state = {k: v for k, v in t5_state.items() if v is not None}
        hidden = t5_config.d_model
        if projector_type == "linear":
            projector = torch.nn.Linear(vision_config.hidden_size, hidden)
        else:  # build_vision_projector: Linear, GELU, Linear
            projector = torch.nn.Sequential(torch.nn.Linear(vision_config.hidden_size, hidden), torch.nn.GELU(),
                                            torch.nn.Linear(hidden, hidden))
        t5 = T5ForConditionalGeneration(t5_config)
        vision = CLIPVisionModel(vision_config)
        if not vision_state:  # not in the checkpoint: the tower's own weights, as t2v_metrics loads them first
            vision_state = load_from_source(lambda source: CLIPVisionModel.from_pretrained(source).state_dict(),
                                            vision_tower_path, "vision_tower_path", "vqascore",
                                            "the CLIP vision tower (openai/clip-vit-large-patch14-336)")
        for module, part, name in ((t5, t5_state, "T5"), (vision, vision_state, "CLIP vision tower"),
                                   (projector, projector_state, "mm_projector")):
            try:
                module.load_state_dict(part, strict=True)
            except RuntimeError as error:
                raise ValueError(f"vqascore reward: model_path={str(model_path)!r}: its {name} weights do not fit "
                                 f"CLIP-FlanT5's layout: {str(error).strip().splitlines()[0]} "
                                 f"{str(error).strip().splitlines()[1:2]}") from error
        vocabulary = len(self.tokenizer)
        if vocabulary > t5_config.vocab_size:
            raise ValueError(f"vqascore reward: tokenizer_path={str(tokenizer_path)!r} has {vocabulary} tokens, more "
                             f"than the checkpoint's {t5_config.vocab_size}")
        self.vocabulary = vocabulary  # t2v_metrics: model.resize_token_embeddings(len(tokenizer)) keeps these rows
        self.model = torch.nn.ModuleDict({"t5": t5, "vision": vision, "projector": projector})
        self.model.eval().requires_grad_(False).to(self.dtype)
        self.background = tuple(int(x * 255) for x in self.image_processor.image_mean)
        self.follower = DeviceFollower(self.model, device)

    @staticmethod
    def snapshot(source: str) -> str:
        if Path(source).exists():
            return source
        from huggingface_hub import snapshot_download

        directory = snapshot_download(source, allow_patterns=["*.json", "*.safetensors", "*.model"])
        if not any(Path(directory).glob("*.safetensors")):  # the older checkpoints: pytorch_model-*.bin shards
            directory = snapshot_download(source, allow_patterns=["*.json", "pytorch_model*.bin", "*.model"])
        return directory

    def text_ids(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids  # with its </s>, as t5_tokenizer_image_token tokenizes each chunk

    def expand2square(self, image: Image.Image) -> Image.Image:
        """t2v_metrics mm_utils.expand2square: centred on a square of the processor's mean colour."""
        width, height = image.size
        if width == height:
            return image
        side = max(width, height)
        result = Image.new(image.mode, (side, side), self.background)
        result.paste(image, (0, (side - height) // 2) if width > height else ((side - width) // 2, 0))
        return result

    @torch.no_grad()
    def scores(self, images: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        check_inputs(images, prompts)
        t5, vision, projector = self.model["t5"], self.model["vision"], self.model["projector"]
        out, loglikelihoods = [], []
        with self.follower.lock:
            device = self.follower.place(images)
            for image, prompt in zip(to_pil(images), prompts):
                pixels = self.image_processor.preprocess(self.expand2square(image), return_tensors="pt")
                pixels = pixels["pixel_values"].to(device, self.dtype)
                features = vision(pixels, output_hidden_states=True).hidden_states[self.select_layer][:, 1:]
                features = projector(features)[0]
                # format_question(conversation_style="t5_chat"), split at <image> as t5_tokenizer_image_token does
                question = self.question_template.format(prompt)
                before = self.text_ids(CLIP_T5_SYSTEM + " USER: ")
                after = self.text_ids("\n" + question + " ASSISTANT: ")
                embed = t5.get_input_embeddings()
                embeds = torch.cat([embed(torch.tensor(before, device=device)), features,
                                    embed(torch.tensor(after, device=device))])[None]
                labels = torch.tensor([self.text_ids(self.answer_template)], device=device)
                logits = t5(inputs_embeds=embeds, attention_mask=torch.ones(embeds.shape[:2], device=device,
                                                                            dtype=torch.long),
                            labels=labels).logits[0, :, :self.vocabulary].float()
                mean_loglikelihood = -torch.nn.functional.cross_entropy(logits, labels[0])
                loglikelihoods.append(mean_loglikelihood)
                out.append(mean_loglikelihood.exp())
        return torch.stack(out), torch.stack(loglikelihoods)


def make_scorer(model_path=DEFAULT_MODEL, dtype="bfloat16", device: str | None = None,
                question_template: str | None = None, answer_template: str = ANSWER,
                repetition_penalty: float | None = None, min_pixels: int = QWEN_MIN_PIXELS,
                max_pixels: int = QWEN_MAX_PIXELS, tokenizer_path: str | None = None,
                vision_tower_path: str | None = None):
    """The scorer of ``model_path``'s architecture (CLIP-FlanT5 by name or by its config's model type)."""
    if not model_path:
        raise ValueError(f"vqascore reward needs reward_fn_kwargs.model_path: {WHAT}")
    if not Path(str(model_path)).expanduser().exists() and looks_local(str(model_path)):
        raise FileNotFoundError(f"vqascore reward: model_path={str(model_path)!r} does not exist ({WHAT})")
    model_type = "clip_t5" if names_clip_t5(model_path) and not Path(str(model_path)).expanduser().is_dir() \
        else read_model_type(model_path)
    if model_type == "clip_t5":
        if repetition_penalty not in (None, 1.0):
            raise ValueError(f"vqascore reward: repetition_penalty={repetition_penalty!r} applies to the Qwen models; "
                             f"CLIP-FlanT5 scores the answer's likelihood")
        return CLIPFlanT5Scorer(model_path, dtype=dtype, device=device, question_template=question_template,
                                answer_template=answer_template, tokenizer_path=tokenizer_path,
                                vision_tower_path=vision_tower_path)
    for name, value in (("tokenizer_path", tokenizer_path), ("vision_tower_path", vision_tower_path)):
        if value is not None:
            raise ValueError(f"vqascore reward: {name}={value!r} is for CLIP-FlanT5 checkpoints; "
                             f"model_path={str(model_path)!r} is a {model_type!r} model with its own processor")
    return VQAScorer(model_path, dtype=dtype, device=device, question_template=question_template,
                     answer_template=answer_template, repetition_penalty=repetition_penalty, min_pixels=min_pixels,
                     max_pixels=max_pixels, model_type=model_type)


@register_reward("vqascore")
def vqascore(model_path: str = DEFAULT_MODEL, dtype: str = "bfloat16", device: str | None = None,
             question_template: str | None = None, answer_template: str = ANSWER,
             repetition_penalty: float | None = None, min_pixels: int = QWEN_MIN_PIXELS,
             max_pixels: int = QWEN_MAX_PIXELS, tokenizer_path: str | None = None,
             vision_tower_path: str | None = None):
    """VQAScore of each (image, prompt) pair: P(answer | image, question); the model loads once, here.

    ``model_path``: a hub id or local directory of a Qwen2-VL, Qwen2.5-VL or LLaVA-OneVision checkpoint in the
    transformers layout (default ``Qwen/Qwen2.5-VL-7B-Instruct``), or of CLIP-FlanT5 (``zhiqiulin/clip-flant5-xxl``:
    t2v_metrics' layout, a config of model type ``clip_t5`` and its weights). ``dtype``: float32, bfloat16 (default,
    as t2v_metrics) or float16. ``device``: None follows the images. ``question_template``: with ``{}`` for the
    prompt; None takes t2v_metrics' question of the architecture. ``answer_template``: the answer scored ("Yes").
    ``repetition_penalty`` (Qwen / LLaVA-OneVision): None applies what t2v_metrics' generate does (the checkpoint's
    generation config's for Qwen, none for LLaVA-OneVision); 1.0 gives the plain softmax. ``min_pixels`` /
    ``max_pixels`` (Qwen): qwen_vl_utils' area bounds of its resize (4 and 16384 x 28 x 28).
    ``tokenizer_path`` (CLIP-FlanT5): None takes the checkpoint's tokenizer files, else ``google/flan-t5-xxl``.
    ``vision_tower_path`` (CLIP-FlanT5): the CLIP tower's config and image processor (and its weights when the
    checkpoint has none); None takes the checkpoint's ``mm_vision_tower`` (openai/clip-vit-large-patch14-336).
    ``info["log_likelihood"]``: log of the reward (Qwen / LLaVA: log P(answer token); CLIP-FlanT5: the mean over the
    answer's tokens).
    """
    scorer = make_scorer(model_path, dtype=dtype, device=device, question_template=question_template,
                         answer_template=answer_template, repetition_penalty=repetition_penalty,
                         min_pixels=min_pixels, max_pixels=max_pixels, tokenizer_path=tokenizer_path,
                         vision_tower_path=vision_tower_path)

    def fn(images, prompts, metadata):
        scores, log_likelihood = scorer.scores(images, list(prompts))
        return scores.double().cpu(), {"log_likelihood": log_likelihood.double().cpu()}

    return fn
