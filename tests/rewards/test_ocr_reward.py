"""The OCR reward: its formula on hand cases, and the real bundled RapidOCR model on text rendered with PIL."""

import random
import socket

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from ddpo_group.prompts import PromptSampler, get_prompt_fn
from ddpo_group.rewards import make_reward_fn
from ddpo_group.rewards.ocr import normalise, ocr_score, quoted_text, target_of

pytest.importorskip("rapidfuzz")


@pytest.mark.parametrize(
    "recognised, target, expected",
    [
        ("OPEN", "OPEN", 1.0),
        ("OPFN", "OPEN", 0.75),                 # one substitution in 4 letters
        ("OPN", "OPEN", 0.75),                  # one deletion
        ("kitten", "sitting", 1 - 3 / 7),        # the textbook distance 3
        ("", "OPEN", 0.0),                      # nothing read: d = n
        ("a long unrelated caption", "OPEN", 0.0),  # d > n is clipped to n: never negative
        ("Open", "OPEN", 1.0),                  # case folded
        ("O P E N\n", "OPEN", 1.0),             # whitespace removed
        ("HELLO WORD", "Hello World", 1 - 1 / 10),  # "helloword" vs "helloworld": one insertion in 10
        ("WE ARE OPEN NOW", "OPEN", 1.0),       # the target inside extra text (substring rule)
        ("Straße", "STRASSE", 1.0),             # casefold, not lower: ß -> ss
    ],
)
def test_score_against_hand_cases(recognised, target, expected):
    assert ocr_score(recognised, target) == pytest.approx(expected, abs=1e-12)


def test_without_the_substring_rule_extra_text_costs_its_length():
    # "weareopennow" (12) vs "open" (4): 8 deletions, clipped to 4 -> 0; a one-letter extra costs 1/4
    assert ocr_score("WE ARE OPEN NOW", "OPEN", substring_match=False) == 0.0
    assert ocr_score("OPENS", "OPEN", substring_match=False) == pytest.approx(0.75)
    assert ocr_score("OPENS", "OPEN", substring_match=True) == 1.0


def test_target_text_of_prompts():
    assert quoted_text('a sign that says "OPEN"') == "OPEN"
    assert quoted_text("a mug that says \u201cHi there\u201d") == "Hi there"  # curly quotes
    assert quoted_text('a "RED" door next to a "BLUE" one') == "RED BLUE"  # in order, joined
    assert normalise(quoted_text('a "RED" door next to a "BLUE" one')) == "redblue"
    assert target_of('a sign that says "OPEN"', {"text": "CLOSED"}) == "CLOSED"  # metadata wins
    for prompt in ["a cat on a mat", 'a sign that says ""', 'a sign that says "   "']:
        with pytest.raises(ValueError, match=r"ocr reward: prompt .* has no quoted text to read"):
            quoted_text(prompt)
    with pytest.raises(ValueError, match=r"target text ' ' is blank"):
        ocr_score("x", " ")


def test_ocr_prompt_function_gives_quoted_targets():
    fn = get_prompt_fn("ocr")
    prompts = {fn(rng=random.Random(seed))[0] for seed in range(200)}
    assert len(prompts) > 30  # draws from the whole asset
    prompt, metadata = fn(rng=random.Random(0))
    assert metadata == {"text": quoted_text(prompt)} and '"' in prompt
    sampler = PromptSampler("ocr", seed=3)
    batch, metas = sampler.sample(16)
    assert all(m["text"] in p for p, m in zip(batch, metas))


# ---------------------------------------------------------------- the real OCR engine
FONT = ImageFont.load_default(size=64)  # Pillow's bundled scalable font: no system font needed


def render(text: str, size: int = 256) -> torch.Tensor:
    """Black text on white, [3, size, size] in [0, 1]."""
    image = Image.new("RGB", (size, size), "white")
    if text:
        ImageDraw.Draw(image).text((16, size // 2 - 40), text, fill="black", font=FONT)
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255


def no_network(*args, **kwargs):
    raise AssertionError("the OCR reward tried to open a network connection")


@pytest.fixture(scope="module")
def ocr_fn():
    pytest.importorskip("rapidocr_onnxruntime")
    with pytest.MonkeyPatch.context() as patch:  # the models bundled in the wheel are all it loads
        patch.setattr(socket.socket, "connect", no_network)
        return make_reward_fn("ocr")


def test_right_text_beats_misspelt_wrong_and_blank_images(ocr_fn, monkeypatch):
    monkeypatch.setattr(socket.socket, "connect", no_network)
    images = torch.stack([render("OPEN"), render("OPEM"), render("SHUT"), render("")])
    prompts = ['a shop sign that says "OPEN"'] * 4
    rewards, info = ocr_fn(images, prompts, [{}] * 4)
    assert rewards.dtype == torch.float64 and rewards.shape == (4,)
    right, misspelt, wrong, blank = rewards.tolist()
    assert right == 1.0 and info["exact_match"][0] == 1.0
    assert misspelt == pytest.approx(0.75)  # read as "OPEM": one substitution in 4
    assert wrong == 0.0 and blank == 0.0  # "SHUT": 4 substitutions; nothing read: d = n
    assert info["exact_match"][1:].tolist() == [0.0, 0.0, 0.0]


def test_engine_reads_the_metadata_target_and_rejects_unquoted_prompts(ocr_fn):
    image = render("SHUT").unsqueeze(0)
    rewards, _ = ocr_fn(image, ['a shop sign that says "OPEN"'], [{"text": "shut"}])
    assert rewards.tolist() == [1.0]
    with pytest.raises(ValueError, match=r"prompt 'a shop sign' has no quoted text"):
        ocr_fn(image, ["a shop sign"], [{}])
