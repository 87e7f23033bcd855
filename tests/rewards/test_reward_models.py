"""PickScore and CLIPScore on a tiny random transformers CLIP built from config (nothing downloads).

The reference path is transformers' own: its CLIPProcessor (PIL) and CLIPModel.forward, whose
normalised image_embeds / text_embeds and logit_scale give the formula by hand.
"""

import math
import warnings

import pytest
import torch
from transformers import CLIPConfig, CLIPModel, CLIPProcessor, CLIPTokenizer

from ddpo_group.models.tokenizer import byte_level_vocab
from ddpo_group.rewards import make_reward_fn
from ddpo_group.rewards.clip_pair import ClipPair
from ddpo_group.rewards.preprocess import resize_shortest_crop

try:
    from transformers import CLIPImageProcessorPil as ImageProcessor
except ImportError:  # transformers 4: the PIL processor is the default one
    from transformers import CLIPImageProcessor as ImageProcessor

VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
              patch_size=8)
TEXT = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=514,
            max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=1)
LOGIT_SCALE = 50.0
PROMPTS = ["a red cat", "a sign", "hello world", "a red cat", "two dogs", "x"]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def processor():
    tokenizer = CLIPTokenizer(vocab=byte_level_vocab(), merges=[], model_max_length=16)
    image_processor = ImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                     image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.25, 0.3])  # not CLIP's: read, not assumed
    return CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def clip_dirs(tmp_path_factory):
    """model/: a CLIPModel only; processor/: its processor only; both/: model and processor together."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("clip_pair")
    model = CLIPModel(CLIPConfig(text_config=TEXT, vision_config=VISION, projection_dim=8))
    with torch.no_grad():
        model.logit_scale.fill_(math.log(LOGIT_SCALE))  # a known temperature: the reward must use the checkpoint's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(root / "model")
        processor().save_pretrained(root / "processor")
        model.save_pretrained(root / "both")
        processor().save_pretrained(root / "both")
        with torch.no_grad():
            model.text_projection.weight.neg_()  # every cosine changes sign: both signs are seen whatever the seed
        model.save_pretrained(root / "negated")
        processor().save_pretrained(root / "negated")
    return root


def images_32(n=6, seed=1):
    torch.manual_seed(seed)
    return (torch.rand(n, 3, 32, 32) * 255).round() / 255  # exact 8-bit values, as the processor sees them


def reference(model_dir, images, prompts):
    """(exp(logit_scale) * cos, cos) through transformers' processor and CLIPModel.forward."""
    arrays = [(im * 255).round().byte().permute(1, 2, 0).numpy() for im in images]
    inputs = processor()(text=prompts, images=arrays, padding=True, return_tensors="pt")
    model = CLIPModel.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        out = model(**inputs)
    cosine = (out.image_embeds * out.text_embeds).sum(-1).double()
    torch.testing.assert_close(out.logits_per_image.diagonal().double(), model.logit_scale.exp().double() * cosine, rtol=1e-5, atol=1e-5)
    return model.logit_scale.exp().double() * cosine, cosine


def build(name, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_reward_fn(name, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_pickscore_is_the_scaled_cosine_of_the_models_embeddings(clip_dirs, device):
    fn = build("pickscore", model_path=str(clip_dirs / "model"), processor_path=str(clip_dirs / "processor"),
               batch_size=4)
    images = images_32()
    rewards, info = fn(images.to(device), PROMPTS, [{}] * len(PROMPTS))
    expected, cosine = reference(clip_dirs / "model", images, PROMPTS)
    assert rewards.dtype == torch.float64 and rewards.device.type == "cpu" and rewards.shape == (6,)
    tolerance = 1e-4 if device == "cpu" else 5e-3  # cuDNN convolutions run in TF32 on CUDA (a 10-bit mantissa)
    torch.testing.assert_close(rewards, expected, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(info["cosine"], cosine, atol=tolerance / 10, rtol=tolerance / 10)
    torch.testing.assert_close(rewards / info["cosine"], torch.full((6,), LOGIT_SCALE, dtype=torch.float64), rtol=1e-6, atol=0)
    assert rewards.std() > 0
    # the same image scored against two prompts: the prompt matters (text is not ignored)
    pair, _ = fn(images[:1].expand(2, -1, -1, -1).to(device), ["a red cat", "two dogs"], [{}, {}])
    assert abs(pair[0] - pair[1]) > 1e-4


def test_clipscore_cosine_and_clipped_form(clip_dirs):
    images = images_32(12, seed=3)
    prompts = PROMPTS * 2
    _, cosine = reference(clip_dirs / "both", images, prompts)
    rewards, info = build("clipscore", model_path=str(clip_dirs / "both"))(images, prompts, [{}] * 12)  # processor
    torch.testing.assert_close(rewards, cosine, atol=1e-5, rtol=1e-5)                                 # from the model dir
    torch.testing.assert_close(info["cosine"], cosine, atol=1e-5, rtol=1e-5)
    clipped, _ = build("clipscore", model_path=str(clip_dirs / "both"), form="clipscore")(images, prompts, [{}] * 12)
    flipped, info = build("clipscore", model_path=str(clip_dirs / "negated"), form="clipscore")(images, prompts, [{}] * 12)
    torch.testing.assert_close(info["cosine"], -cosine, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(clipped, 100 * cosine.clamp(min=0), atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(flipped, 100 * (-cosine).clamp(min=0), atol=1e-3, rtol=1e-5)
    # max(c, 0) + max(-c, 0) = |c|, and one of each pair is exactly 0
    torch.testing.assert_close(clipped + flipped, 100 * cosine.abs(), atol=1e-3, rtol=1e-5)
    assert ((clipped == 0) | (flipped == 0)).all() and (clipped >= 0).all() and (flipped >= 0).all()


def test_bfloat16_runs_in_bfloat16_and_stays_close(clip_dirs):
    kwargs = dict(model_path=str(clip_dirs / "model"), processor_path=str(clip_dirs / "processor"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        half = ClipPair(reward="pickscore", dtype="bfloat16", **kwargs)
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    images = images_32()
    full, _ = build("pickscore", **kwargs)(images, PROMPTS, [{}] * 6)
    low, _ = build("pickscore", dtype="bf16", **kwargs)(images, PROMPTS, [{}] * 6)
    assert not torch.equal(low, full)  # it did run in lower precision
    torch.testing.assert_close(low, full, atol=0.02 * LOGIT_SCALE, rtol=0)  # cosines within 0.02 (0.007 seen)
    with pytest.raises(ValueError, match=r"dtype='float8' must be one of"):
        build("pickscore", dtype="float8", **kwargs)


def test_resize_and_crop_follow_the_processor():
    """A smooth 48x64 image: the short side goes to 32, the center is cropped, as CLIPImageProcessor does."""
    y, x = torch.meshgrid(torch.linspace(0, 1, 48), torch.linspace(0, 1, 64), indexing="ij")
    image = torch.stack([x, y, (x + y) / 2]).unsqueeze(0)
    image = (image * 255).round() / 255
    ours = resize_shortest_crop(image, 32, (32, 32), ImageProcessor().image_mean, ImageProcessor().image_std)
    proc = ImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    theirs = proc(images=[(image[0] * 255).round().byte().permute(1, 2, 0).numpy()], return_tensors="pt")["pixel_values"]
    assert ours.shape == theirs.shape == (1, 3, 32, 32)
    assert (ours - theirs).abs().max() < 0.05  # PIL vs torch bicubic, on a gradient: same image up to rounding
    # a left crop instead of the center one is ~0.2 off on average (measured), far above this bound
    assert (ours - theirs).abs().mean() < 0.01


def test_missing_sources_are_named(clip_dirs, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"pickscore reward: model_path='/no/such/pickscore' does not exist"):
        build("pickscore", model_path="/no/such/pickscore", processor_path=str(clip_dirs / "processor"))
    with pytest.raises(OSError, match=r"clipscore reward: model_path='nobody-here/no-clip' is neither an existing local "
                                      r"path nor a hub id"):
        build("clipscore", model_path="nobody-here/no-clip")  # HF_HUB_OFFLINE=1 (conftest): no network either way
    with pytest.raises(OSError, match=r"clipscore reward: processor_path='.*empty' could not be loaded as a CLIP processor"):
        (tmp_path / "empty").mkdir()
        build("clipscore", model_path=str(clip_dirs / "model"), processor_path=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"form='logits' must be one of"):
        build("clipscore", model_path=str(clip_dirs / "both"), form="logits")
