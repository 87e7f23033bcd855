"""Text rendering reward: how well an OCR engine reads the prompt's quoted text in the image (as Flow-GRPO).

    t = norm(target),  r = norm(recognised),  n = len(t)
    d = 0                       if substring_match and t occurs in r   (extra text in the scene is not penalised)
        Levenshtein(r, t)       otherwise
    reward = 1 - min(d, n) / n                                          in [0, 1]

* target: the text between double quotes in the prompt (``a sign that says "OPEN"`` -> ``OPEN``;
  straight or curly quotes; several quoted parts are read in prompt order and joined), or
  ``metadata["text"]`` when the prompt function gives it. A prompt with no (non-blank) quoted text
  and no ``metadata["text"]`` raises a ValueError naming the prompt.
* norm: case folded (``str.casefold``) and every whitespace character removed, so "Open Now" and
  "OPENNOW" match; OCR engines split and space words unreliably, and generated text is judged on
  its letters.
* recognised: the texts of all boxes the engine keeps (its own confidence threshold), joined in
  the engine's reading order; an image with no text reads as "" (reward 0).

Engine: RapidOCR (PP-OCRv4 detection + recognition on onnxruntime, CPU) from the
``rapidocr-onnxruntime`` package, whose ONNX models ship inside the wheel: nothing downloads.
Edit distance: ``rapidfuzz.distance.Levenshtein``. ``pip install "ddpo_group[ocr]"``.
"""

from __future__ import annotations

import re
import threading

import numpy as np
import torch
from PIL import Image

from ddpo_group.rewards import register_reward

QUOTED = re.compile(r'"([^"]*)"|\u201c([^\u201d]*)\u201d')  # "..." or “...”


def normalise(text: str) -> str:
    """Case folded, all whitespace removed."""
    return "".join(text.casefold().split())


def quoted_text(prompt: str) -> str:
    """The prompt's double-quoted parts, in order, joined by spaces; ValueError when there is none."""
    parts = [a or b for a, b in QUOTED.findall(prompt)]
    text = " ".join(part for part in parts if part.strip())
    if not text:
        raise ValueError(
            f"ocr reward: prompt {prompt!r} has no quoted text to read; use text-rendering prompts such as "
            "'a sign that says \"OPEN\"' (prompt_fn=ocr) or give the target as metadata['text']"
        )
    return text


def edit_distance(a: str, b: str) -> int:
    from rapidfuzz.distance import Levenshtein

    return Levenshtein.distance(a, b)


def ocr_score(recognised: str, target: str, substring_match: bool = True) -> float:
    """1 - min(d, n) / n of the module docstring, for one image."""
    t, r = normalise(target), normalise(recognised)
    if not t:
        raise ValueError(f"ocr reward: the target text {target!r} is blank")
    d = 0 if substring_match and t in r else edit_distance(r, t)
    return 1.0 - min(d, len(t)) / len(t)


def target_of(prompt: str, metadata: dict | None) -> str:
    text = (metadata or {}).get("text")
    return text if isinstance(text, str) and text.strip() else quoted_text(prompt)


def make_engine():
    """RapidOCR with its bundled models; an ImportError that says how to install it."""
    try:
        import rapidfuzz  # noqa: F401  (checked here, not at the first reward call)
        from rapidocr_onnxruntime import RapidOCR
    except ImportError as error:
        raise ImportError(f"the ocr reward needs rapidocr-onnxruntime and rapidfuzz: pip install 'ddpo_group[ocr]' "
                          f"({error})") from error
    return RapidOCR()


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    arrays = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(np.ascontiguousarray(a)) for a in arrays]


@register_reward("ocr")
def ocr(substring_match: bool = True, use_cls: bool = True):
    """OCR accuracy of the prompt's quoted text in each image; the engine loads once, here (CPU).

    ``use_cls``: run the engine's 0/180 degree orientation classifier before recognition (its default).
    """
    engine = make_engine()
    lock = threading.Lock()  # one onnxruntime session set shared by the reward threads

    def read(image: Image.Image) -> str:
        with lock:
            result, _ = engine(image, use_cls=use_cls)
        return "".join(text for _, text, _ in result or [])

    def fn(images, prompts, metadata):
        metadata = metadata or [{}] * len(prompts)
        targets = [target_of(p, m) for p, m in zip(prompts, metadata)]  # before OCR: a bad prompt fails fast
        rewards, exact = [], []
        for image, target in zip(to_pil(images), targets):
            recognised = read(image)
            rewards.append(ocr_score(recognised, target, substring_match))
            exact.append(float(normalise(recognised) == normalise(target)))
        return torch.tensor(rewards, dtype=torch.float64), {"exact_match": torch.tensor(exact, dtype=torch.float64)}

    return fn
