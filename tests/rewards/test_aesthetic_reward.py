"""The aesthetic reward on a tiny random CLIP built from config and random LAION-layout heads (nothing downloads)."""

import warnings

import pytest
import torch
from transformers import CLIPConfig, CLIPModel, CLIPVisionConfig, CLIPVisionModelWithProjection

from ddpo_group.rewards import make_reward_fn
from ddpo_group.rewards.aesthetic import AestheticMLP, load_head

VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
              patch_size=8, projection_dim=8)


@pytest.fixture(scope="module")
def clip_dirs(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("clip")
    CLIPVisionModelWithProjection(CLIPVisionConfig(**VISION)).save_pretrained(root / "vision")
    text = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64,
                projection_dim=8, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    CLIPModel(CLIPConfig(text_config=text, vision_config=VISION, projection_dim=8)).save_pretrained(root / "full")
    return root


def reference_scores(clip_dir, head, images):
    """CLIP embeds through transformers' own image processor, L2-normalised, then the head."""
    try:
        from transformers import CLIPImageProcessorPil as Processor
    except ImportError:  # older transformers
        from transformers import CLIPImageProcessor as Processor
    processor = Processor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    arrays = [(im * 255).round().byte().permute(1, 2, 0).numpy() for im in images]
    pixels = processor(images=arrays, return_tensors="pt")["pixel_values"]
    clip = CLIPVisionModelWithProjection.from_pretrained(str(clip_dir)).eval()
    with torch.no_grad():
        embeds = clip(pixel_values=pixels).image_embeds
        embeds = embeds / embeds.norm(dim=-1, keepdim=True)
        return head(embeds).squeeze(-1).double()


def images_32():
    torch.manual_seed(1)
    return (torch.rand(3, 3, 32, 32) * 255).round() / 255  # exact 8-bit values, as the processor sees them


@pytest.mark.parametrize("checkpoint", ["vision", "full"])
def test_mlp_head_matches_transformers_preprocessing(clip_dirs, tmp_path, checkpoint):
    torch.manual_seed(2)
    head = AestheticMLP(8).eval()
    torch.save(head.state_dict(), tmp_path / "mlp.pth")
    assert sorted(head.state_dict()) == [f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("bias", "weight")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fn = make_reward_fn("aesthetic", clip_model_path=str(clip_dirs / checkpoint), head_path=str(tmp_path / "mlp.pth"),
                            batch_size=2)
    images = images_32()
    rewards, info = fn(images, ["a"] * 3, [{}] * 3)
    assert rewards.shape == (3,) and rewards.dtype == torch.float64 and info == {}
    torch.testing.assert_close(rewards, reference_scores(clip_dirs / checkpoint, head, images), atol=1e-4, rtol=1e-4)
    assert rewards.std() > 0  # different images, different scores


def test_linear_head_from_safetensors_and_resizing(clip_dirs, tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(3)
    linear = torch.nn.Linear(8, 1)
    save_file(linear.state_dict(), str(tmp_path / "linear.safetensors"))
    fn = make_reward_fn("aesthetic", clip_model_path=str(clip_dirs / "vision"), head_path=str(tmp_path / "linear.safetensors"))
    images = images_32()
    rewards, _ = fn(images, ["a"] * 3, [{}] * 3)
    torch.testing.assert_close(rewards, reference_scores(clip_dirs / "vision", linear, images), atol=1e-4, rtol=1e-4)
    # larger, non-square images are resized and center-cropped to the model's size
    big, _ = fn(torch.rand(2, 3, 48, 64), ["a", "b"], [{}, {}])
    assert big.shape == (2,) and torch.isfinite(big).all()


def test_missing_paths_and_wrong_heads_are_named(clip_dirs, tmp_path):
    with pytest.raises(ValueError, match="reward_fn_kwargs.clip_model_path"):
        make_reward_fn("aesthetic")
    with pytest.raises(FileNotFoundError, match=r"clip_model_path='/no/such/clip'"):
        make_reward_fn("aesthetic", clip_model_path="/no/such/clip", head_path="/no/head.pth")
    with pytest.raises(FileNotFoundError, match=r"head_path='.*missing.pth'"):
        make_reward_fn("aesthetic", clip_model_path=str(clip_dirs / "vision"), head_path=str(tmp_path / "missing.pth"))
    torch.save({"fc.weight": torch.zeros(1, 8)}, tmp_path / "odd.pth")
    with pytest.raises(ValueError, match=r"holds keys \['fc.weight'\]"):
        load_head(tmp_path / "odd.pth")
    torch.save(AestheticMLP(16).state_dict(), tmp_path / "wide.pth")
    with pytest.raises(ValueError, match=r"takes 16-d embeddings but the CLIP .* gives 8-d"):
        make_reward_fn("aesthetic", clip_model_path=str(clip_dirs / "vision"), head_path=str(tmp_path / "wide.pth"))
