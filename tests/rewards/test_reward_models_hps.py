"""HPSv2 on a tiny random open_clip model from a custom model config (nothing downloads).

The checkpoint is saved as HPS checkpoints are ({"state_dict": ...}) and loaded by the reward from
the path; the reference is open_clip's own PIL transform (resize_mode="longest", as HPSv2's
validation transform) and the model's forward, whose normalised features give the cosine by hand.
Needs open_clip (``pip install "ddpo_group[hps]"``); the tests that do not are run without it.
"""

import builtins
import json
import warnings

import pytest
import torch

from ddpo_group.rewards import make_reward_fn


def open_clip_or_skip():
    try:
        import open_clip
    except Exception as error:  # ImportError, or torchvision's RuntimeError when its build does not match torch
        pytest.skip(f"open_clip is not importable here ({type(error).__name__}: {str(error)[:120]})")
    return open_clip


TINY = {
    "embed_dim": 8,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 16, "head_width": 8, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1},
}
PROMPTS = ["a red cat", "a sign", "hello world", "two dogs"]


@pytest.fixture(scope="module")
def tiny_hps(tmp_path_factory):
    """(model name, checkpoint path, model) of a tiny open_clip CLIP registered under a custom config."""
    open_clip = open_clip_or_skip()
    root = tmp_path_factory.mktemp("hps")
    (root / "hps-tiny-test.json").write_text(json.dumps(TINY))
    wide = {**TINY, "embed_dim": 12}
    (root / "hps-tiny-wide-test.json").write_text(json.dumps(wide))
    open_clip.add_model_config(root / "hps-tiny-test.json")
    open_clip.add_model_config(root / "hps-tiny-wide-test.json")
    torch.manual_seed(0)
    model = open_clip.create_model("hps-tiny-test", pretrained=None, output_dict=True).eval()
    torch.save({"state_dict": model.state_dict()}, root / "hps_tiny.pt")
    torch.save(model.state_dict(), root / "bare.pt")
    torch.save({"state_dict": open_clip.create_model("hps-tiny-wide-test").state_dict()}, root / "wide.pt")
    return "hps-tiny-test", root, model


def reference(model, images, prompts):
    """HPSv2's scoring: open_clip's PIL transform, forward, diagonal of image_features @ text_features.T."""
    import open_clip
    from PIL import Image

    transform = open_clip.image_transform(32, is_train=False, resize_mode="longest")
    pixels = torch.stack([transform(Image.fromarray((im * 255).round().byte().permute(1, 2, 0).numpy())) for im in images])
    tokens = open_clip.get_tokenizer("hps-tiny-test")(prompts)
    with torch.no_grad():
        out = model(pixels, tokens)
    return torch.diagonal(out["image_features"] @ out["text_features"].T).double()


def images(h, w, seed=1):
    torch.manual_seed(seed)
    return (torch.rand(4, 3, h, w) * 255).round() / 255  # exact 8-bit values, as the PIL transform sees them


@pytest.mark.parametrize("shape", [(32, 32), (24, 32), (32, 20)])  # square; wide and tall ones padded with black
def test_hpsv2_is_the_cosine_of_the_models_features(tiny_hps, shape):
    name, root, model = tiny_hps
    fn = make_reward_fn("hpsv2", checkpoint_path=str(root / "hps_tiny.pt"), model_name=name, batch_size=3)
    batch = images(*shape)
    rewards, info = fn(batch, PROMPTS, [{}] * 4)
    expected = reference(model, batch, PROMPTS)
    assert rewards.dtype == torch.float64 and rewards.shape == (4,) and info == {}
    torch.testing.assert_close(rewards, expected, atol=1e-5, rtol=1e-5)
    assert rewards.abs().max() <= 1 and rewards.std() > 0
    bare, _ = make_reward_fn("hpsv2", checkpoint_path=str(root / "bare.pt"), model_name=name)(batch, PROMPTS, [{}] * 4)
    torch.testing.assert_close(bare, rewards, atol=1e-6, rtol=1e-6)  # a bare state dict loads the same weights


def test_padding_is_black_before_normalisation(tiny_hps):
    """A 16x32 image scores as the 32x32 image with 8 black rows above and below (HPSv2's ResizeMaxSize)."""
    name, root, _ = tiny_hps
    fn = make_reward_fn("hpsv2", checkpoint_path=str(root / "hps_tiny.pt"), model_name=name)
    strip = images(16, 32)
    padded = torch.zeros(4, 3, 32, 32)
    padded[..., 8:24, :] = strip
    torch.testing.assert_close(fn(strip, PROMPTS, [{}] * 4)[0], fn(padded, PROMPTS, [{}] * 4)[0])
    assert not torch.allclose(fn(strip, PROMPTS, [{}] * 4)[0], fn(images(32, 32), PROMPTS, [{}] * 4)[0])


def test_hpsv2_bfloat16(tiny_hps):
    from ddpo_group.rewards.hpsv2 import HPSv2Scorer

    name, root, _ = tiny_hps
    scorer = HPSv2Scorer(str(root / "hps_tiny.pt"), model_name=name, dtype="bfloat16")
    assert {p.dtype for p in scorer.model.parameters()} == {torch.bfloat16}
    batch = images(32, 32)
    low = scorer.scores(batch, PROMPTS).double()
    full, _ = make_reward_fn("hpsv2", checkpoint_path=str(root / "hps_tiny.pt"), model_name=name)(batch, PROMPTS, [{}] * 4)
    assert not torch.equal(low, full)
    torch.testing.assert_close(low, full, atol=0.02, rtol=0)  # cosines within 0.02 (0.002 seen)


def test_wrong_checkpoint_and_model_name(tiny_hps):
    name, root, _ = tiny_hps
    with pytest.raises(ValueError, match=r"checkpoint_path='.*wide.pt' does not fit open_clip's 'hps-tiny-test'"):
        make_reward_fn("hpsv2", checkpoint_path=str(root / "wide.pt"), model_name=name)
    with pytest.raises(ValueError, match=r"model_name='ViT-Q-99' is not an open_clip model config"):
        make_reward_fn("hpsv2", checkpoint_path=str(root / "hps_tiny.pt"), model_name="ViT-Q-99")


def test_missing_checkpoint_is_named():  # runs without open_clip: the path is checked first
    with pytest.raises(ValueError, match=r"hpsv2 reward needs reward_fn_kwargs.checkpoint_path"):
        make_reward_fn("hpsv2")
    with pytest.raises(FileNotFoundError, match=r"hpsv2 reward: checkpoint_path='/no/such/HPS_v2.1_compressed.pt' "
                                                r"does not exist .*xswu/HPSv2"):
        make_reward_fn("hpsv2", checkpoint_path="/no/such/HPS_v2.1_compressed.pt")


def test_missing_open_clip_says_how_to_install(tmp_path, monkeypatch):
    (tmp_path / "hps.pt").write_bytes(b"")
    real_import = builtins.__import__

    def no_open_clip(name, *args, **kwargs):
        if name == "open_clip":
            raise ImportError("No module named 'open_clip'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_open_clip)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ImportError, match=r"pip install 'ddpo_group\[hps\]'.*No module named 'open_clip'"):
            make_reward_fn("hpsv2", checkpoint_path=str(tmp_path / "hps.pt"))
