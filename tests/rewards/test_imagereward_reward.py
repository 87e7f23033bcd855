"""ImageReward on a tiny random model built here, in the image-reward package's checkpoint layout (nothing downloads).

The checkpoint holds the package's key names (``blip.visual_encoder.*`` of BLIP's timm-style ViT,
``blip.text_encoder.*`` of its med.py BERT, ``mlp.layers.*``) with a med_config.json beside it, as the hub
repository THUDM/ImageReward does; the reward renames them to transformers' BLIP modules. The reference is
computed by hand from the original keys, following the package's vit.py / med.py / ImageReward.py, so it checks
the renaming as well as the scoring. Only transformers and torch are needed (PIL for the transform check, the
image-reward package itself for the last test: both skip when absent).
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from ddpo_group.rewards import make_reward_fn
from ddpo_group.rewards.imagereward import blip_preprocess

# the image-reward package's constants, written out (ImageReward.py: self.mean, self.std; its _transform's Normalize)
REWARD_MEAN, REWARD_STD = 0.16717362830052426, 1.0333394966054072
IMAGE_MEAN, IMAGE_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "cat", "sign", "hello", "world", "two", "dogs",
         "on", "the", "##s", "blue", "sky"]
VISION = dict(width=32, depth=2, heads=2, patch=8, image=32)
MED = {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
       "hidden_dropout_prob": 0.1, "hidden_size": 24, "initializer_range": 0.02, "intermediate_size": 48,
       "layer_norm_eps": 1e-12, "max_position_embeddings": 40, "model_type": "bert", "num_attention_heads": 2,
       "num_hidden_layers": 2, "pad_token_id": 0, "add_type_embeddings": False, "vocab_size": 24,
       "encoder_width": 768, "add_cross_attention": True}
PROMPTS = ["a red cat", "hello world", "two dogs on the blue sky", "a sign"]


def tiny_checkpoint(seed=0, vision=VISION, med=MED):
    """A random state dict with the package's ImageReward key names and shapes."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2, mean=0.0):
        return mean + scale * torch.randn(*shape, generator=gen)

    d, p, n = vision["width"], vision["patch"], (vision["image"] // vision["patch"]) ** 2
    h, inter, vocab = med["hidden_size"], med["intermediate_size"], med["vocab_size"]
    state = {"blip.visual_encoder.cls_token": rand(1, 1, d), "blip.visual_encoder.pos_embed": rand(1, n + 1, d),
             "blip.visual_encoder.patch_embed.proj.weight": rand(d, 3, p, p, scale=0.05),
             "blip.visual_encoder.patch_embed.proj.bias": rand(d)}
    for i in range(vision["depth"]):
        b = f"blip.visual_encoder.blocks.{i}."
        state.update({b + "norm1.weight": rand(d, mean=1), b + "norm1.bias": rand(d),
                      b + "attn.qkv.weight": rand(3 * d, d), b + "attn.qkv.bias": rand(3 * d),
                      b + "attn.proj.weight": rand(d, d), b + "attn.proj.bias": rand(d),
                      b + "norm2.weight": rand(d, mean=1), b + "norm2.bias": rand(d),
                      b + "mlp.fc1.weight": rand(4 * d, d), b + "mlp.fc1.bias": rand(4 * d),
                      b + "mlp.fc2.weight": rand(d, 4 * d), b + "mlp.fc2.bias": rand(d)})
    state.update({"blip.visual_encoder.norm.weight": rand(d, mean=1), "blip.visual_encoder.norm.bias": rand(d)})
    t = "blip.text_encoder."
    state.update({t + "embeddings.position_ids": torch.arange(med["max_position_embeddings"]).expand((1, -1)),
                  t + "embeddings.word_embeddings.weight": rand(vocab, h, scale=1.0),
                  t + "embeddings.position_embeddings.weight": rand(med["max_position_embeddings"], h),
                  t + "embeddings.LayerNorm.weight": rand(h, mean=1), t + "embeddings.LayerNorm.bias": rand(h)})
    for i in range(med["num_hidden_layers"]):
        b = f"{t}encoder.layer.{i}."
        for part, kv_width in (("attention", h), ("crossattention", d)):
            state.update({f"{b}{part}.self.query.weight": rand(h, h), f"{b}{part}.self.query.bias": rand(h),
                          f"{b}{part}.self.key.weight": rand(h, kv_width), f"{b}{part}.self.key.bias": rand(h),
                          f"{b}{part}.self.value.weight": rand(h, kv_width), f"{b}{part}.self.value.bias": rand(h),
                          f"{b}{part}.output.dense.weight": rand(h, h), f"{b}{part}.output.dense.bias": rand(h),
                          f"{b}{part}.output.LayerNorm.weight": rand(h, mean=1),
                          f"{b}{part}.output.LayerNorm.bias": rand(h)})
        state.update({b + "intermediate.dense.weight": rand(inter, h), b + "intermediate.dense.bias": rand(inter),
                      b + "output.dense.weight": rand(h, inter), b + "output.dense.bias": rand(h),
                      b + "output.LayerNorm.weight": rand(h, mean=1), b + "output.LayerNorm.bias": rand(h)})
    # BLIP_Pretrain's contrastive projections: in the package's checkpoint, unused by its score
    state.update({"blip.vision_proj.weight": rand(8, d), "blip.vision_proj.bias": rand(8),
                  "blip.text_proj.weight": rand(8, h), "blip.text_proj.bias": rand(8)})
    widths = [h, 1024, 128, 64, 16, 1]
    for index, (a, b) in zip((0, 2, 4, 6, 7), zip(widths, widths[1:])):
        state[f"mlp.layers.{index}.weight"] = rand(b, a, scale=1 / math.sqrt(a))
        state[f"mlp.layers.{index}.bias"] = rand(b, scale=0.1)
    return state


def save_model(root, state, med=MED):
    root.mkdir(parents=True, exist_ok=True)
    torch.save(state, root / "ImageReward.pt")
    (root / "med_config.json").write_text(json.dumps(med))
    return root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model directory, tokenizer directory, state dict, tokenizer as BLIP's init_tokenizer makes it)."""
    from transformers import BertTokenizer

    root = tmp_path_factory.mktemp("imagereward")
    state = tiny_checkpoint()
    save_model(root / "model", state)
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(WORDS)})
    tokenizer.save_pretrained(root / "tokenizer")
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return root / "model", root / "tokenizer", state, tokenizer


def layer_norm(x, state, key, eps):
    return F.layer_norm(x, x.shape[-1:], state[key + ".weight"], state[key + ".bias"], eps)


def linear(x, state, key):
    return F.linear(x, state[key + ".weight"], state[key + ".bias"])


def reference_raw(state, pixels, input_ids, attention_mask, heads=VISION["heads"], med=MED):
    """The package's forward written out on its own key names: vit.py, then med.py's BertModel in mode
    'multimodal' (self-attention, cross-attention to every image token, feed-forward), [CLS], then the MLP."""
    v = {k[len("blip.visual_encoder."):]: t for k, t in state.items() if k.startswith("blip.visual_encoder.")}
    patch = v["patch_embed.proj.weight"].shape[-1]
    x = F.conv2d(pixels, v["patch_embed.proj.weight"], v["patch_embed.proj.bias"], stride=patch)
    x = x.flatten(2).transpose(1, 2)
    x = torch.cat([v["cls_token"].expand(len(x), -1, -1), x], dim=1) + v["pos_embed"]
    b, n, d = x.shape
    depth = 1 + max(int(k.split(".")[1]) for k in v if k.startswith("blocks."))
    for i in range(depth):
        y = layer_norm(x, v, f"blocks.{i}.norm1", 1e-6)
        q, k, val = linear(y, v, f"blocks.{i}.attn.qkv").reshape(b, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        attn = ((q @ k.transpose(-2, -1)) * (d // heads) ** -0.5).softmax(dim=-1)
        x = x + linear((attn @ val).transpose(1, 2).reshape(b, n, d), v, f"blocks.{i}.attn.proj")
        y = layer_norm(x, v, f"blocks.{i}.norm2", 1e-6)
        x = x + linear(F.gelu(linear(y, v, f"blocks.{i}.mlp.fc1")), v, f"blocks.{i}.mlp.fc2")
    image_embeds = layer_norm(x, v, "norm", 1e-6)

    t = {k[len("blip.text_encoder."):]: s for k, s in state.items() if k.startswith("blip.text_encoder.")}
    eps, text_heads = med["layer_norm_eps"], med["num_attention_heads"]
    seq = input_ids.shape[1]
    h = t["embeddings.word_embeddings.weight"][input_ids] + t["embeddings.position_embeddings.weight"][:seq]
    h = layer_norm(h, t, "embeddings.LayerNorm", eps)
    self_mask = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0  # med.py's extended mask

    def attention(hidden, context, prefix, mask):
        def heads_of(z):
            return z.view(z.shape[0], z.shape[1], text_heads, -1).permute(0, 2, 1, 3)

        q, k, val = (heads_of(linear(src, t, f"{prefix}.self.{name}"))
                     for name, src in (("query", hidden), ("key", context), ("value", context)))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        probs = (scores if mask is None else scores + mask).softmax(dim=-1)
        out = (probs @ val).permute(0, 2, 1, 3).reshape(hidden.shape)
        return layer_norm(linear(out, t, f"{prefix}.output.dense") + hidden, t, f"{prefix}.output.LayerNorm", eps)

    for i in range(med["num_hidden_layers"]):
        prefix = f"encoder.layer.{i}"
        h = attention(h, h, f"{prefix}.attention", self_mask)
        h = attention(h, image_embeds, f"{prefix}.crossattention", None)  # image_atts: all ones
        y = F.gelu(linear(h, t, f"{prefix}.intermediate.dense"))
        h = layer_norm(linear(y, t, f"{prefix}.output.dense") + h, t, f"{prefix}.output.LayerNorm", eps)
    z = h[:, 0]
    for index in (0, 2, 4, 6, 7):  # Linear layers without activations (dropout is off in eval)
        z = linear(z, state, f"mlp.layers.{index}")
    return z.squeeze(-1)


def tokens(tokenizer, prompts):
    out = tokenizer(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    return out.input_ids, out.attention_mask


def images(h, w, n=4, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 3, h, w, generator=gen) * 255).round() / 255  # exact 8-bit values, as PIL holds them


def reward(tiny, **kwargs):
    model, tokenizer, _, _ = tiny
    return make_reward_fn("imagereward", **{"model_path": str(model), "tokenizer_path": str(tokenizer),
                                            "vision_heads": VISION["heads"], **kwargs})


def test_imagereward_matches_the_packages_computation(tiny):
    _, _, state, tokenizer = tiny
    fn = reward(tiny, batch_size=3)  # two batches
    batch = images(32, 32)  # the model's size: the transform only normalises
    rewards, info = fn(batch, PROMPTS, [{}] * 4)
    mean = torch.tensor(IMAGE_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGE_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        raw = reference_raw(state, (batch - mean) / std, *tokens(tokenizer, PROMPTS)).double()
    assert rewards.dtype == torch.float64 and rewards.shape == (4,) and set(info) == {"raw"}
    torch.testing.assert_close(info["raw"], raw, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rewards, (raw - REWARD_MEAN) / REWARD_STD, atol=1e-5, rtol=1e-5)
    assert rewards.std() > 0.05  # the prompts and images tell apart
    same_prompt, _ = fn(batch, PROMPTS[:1] * 4, [{}] * 4)  # the prompt matters, not only the image
    assert (same_prompt[1:] - rewards[1:]).abs().min() > 1e-4 and torch.allclose(same_prompt[0], rewards[0])


def pil_transform(image: torch.Tensor, size: int) -> torch.Tensor:
    """The package's torchvision transform on a PIL image, written with PIL: Resize(size, BICUBIC) of the short
    side (long side int(size * long / short)), CenterCrop (torchvision's rounding), ToTensor, Normalize."""
    import numpy as np
    from PIL import Image

    pil = Image.fromarray((image * 255).round().byte().permute(1, 2, 0).numpy())
    w, h = pil.size
    new_w, new_h = (size, int(size * h / w)) if w <= h else (int(size * w / h), size)
    pil = pil.resize((new_w, new_h), Image.BICUBIC)
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    pil = pil.crop((left, top, left + size, top + size))
    x = torch.from_numpy(np.asarray(pil).copy()).permute(2, 0, 1).float() / 255
    return (x - torch.tensor(IMAGE_MEAN).view(3, 1, 1)) / torch.tensor(IMAGE_STD).view(3, 1, 1)


def smooth_images(h, w, n=4, seed=5):
    """8-bit images without pixel noise (photographs' statistics more than uniform noise's)."""
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.rand(n, 3, 6, 6, generator=gen)
    return (F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False) * 255).round() / 255


@pytest.mark.parametrize("shape", [(64, 64), (48, 72), (81, 40), (24, 24)])  # down; wide, tall (odd crop margin); up
def test_imagereward_transform_follows_the_packages_pil_transform(tiny, shape):
    pytest.importorskip("PIL")
    _, _, state, tokenizer = tiny
    std = torch.tensor(IMAGE_STD).view(1, 3, 1, 1)
    for batch, worst in ((smooth_images(*shape), 1.5), (images(*shape), None)):
        ours = blip_preprocess(batch, 32)
        theirs = torch.stack([pil_transform(im, 32) for im in batch])
        assert ours.shape == theirs.shape == (4, 3, 32, 32)
        levels = ((ours - theirs) * std * 255).abs()  # in 8-bit levels: PIL rounds to 8 bits after each pass
        assert levels.mean() < 0.4, levels.mean()
        assert worst is None or levels.max() < worst, levels.max()  # uniform noise overshoots more (up to ~12)
    rewards, _ = reward(tiny)(batch, PROMPTS, [{}] * 4)
    with torch.no_grad():
        expected = (reference_raw(state, theirs, *tokens(tokenizer, PROMPTS)).double() - REWARD_MEAN) / REWARD_STD
    torch.testing.assert_close(rewards, expected, atol=2e-2, rtol=0)


def test_imagereward_renames_every_key_and_refuses_other_checkpoints(tiny, tmp_path):
    from ddpo_group.rewards.imagereward import load_model, split_checkpoint

    model_dir, tokenizer_dir, state, _ = tiny
    vision, text, mlp = split_checkpoint(state, "tiny")
    model = load_model(str(model_dir), "ImageReward.pt", VISION["heads"])  # strict: nothing missing, nothing unused
    used = {**{f"vision.{k}": v for k, v in vision.items()}, **{f"text.{k}": v for k, v in text.items()},
            **{f"mlp.{k}": v for k, v in mlp.items()}}
    assert set(used) == set(model.state_dict())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in used.items())
    ignored = {k for k in state if k.startswith(("blip.vision_proj", "blip.text_proj")) or k.endswith("position_ids")}
    assert len(used) == len(state) - len(ignored) and len(ignored) == 5

    extra = save_model(tmp_path / "extra", {**state, "blip.itm_head.weight": torch.zeros(2, 24)})
    with pytest.warns(UserWarning, match=r"model_path=.*extra.*1 checkpoint keys are not ImageReward's scoring "
                                         r"weights and are left out.*blip\.itm_head\.weight"):
        left_out = reward(tiny, model_path=str(extra))
    torch.testing.assert_close(left_out(images(32, 32), PROMPTS, [{}] * 4)[0],
                               reward(tiny)(images(32, 32), PROMPTS, [{}] * 4)[0])
    missing = save_model(tmp_path / "missing", {k: v for k, v in state.items() if "blocks.1.attn.proj.bias" not in k})
    with pytest.raises(ValueError, match=r"model_path=.*blip\.visual_encoder.*Missing.*layers\.1\.self_attn\.projection"):
        reward(tiny, model_path=str(missing))
    wide = save_model(tmp_path / "wide", tiny_checkpoint(med={**MED, "hidden_size": 32}))  # another text encoder size
    with pytest.raises(ValueError, match=r"model_path=.*wide.*blip\.text_encoder weights do not fit.*size mismatch"):
        reward(tiny, model_path=str(wide))
    with pytest.raises(ValueError, match=r"vision_heads=5 does not divide the ViT's width 32"):
        reward(tiny, vision_heads=5)
    no_cross = save_model(tmp_path / "no_cross", state, med={**MED, "add_cross_attention": False})
    with pytest.raises(ValueError, match="add_cross_attention"):
        reward(tiny, model_path=str(no_cross))
    small_vocab = save_model(tmp_path / "small_vocab", tiny_checkpoint(med={**MED, "vocab_size": 12}),
                             med={**MED, "vocab_size": 12})
    with pytest.raises(ValueError, match=r"tokenizer_path=.*20 tokens.*vocabulary has 12"):
        reward(tiny, model_path=str(small_vocab))


def test_imagereward_refuses_missing_paths_naming_the_argument(tiny, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"imagereward reward: model_path='/no/such/ir' does not exist"):
        reward(tiny, model_path="/no/such/ir")
    with pytest.raises(FileNotFoundError, match=r"tokenizer_path='\./no_such_tokenizer/x' does not exist"):
        reward(tiny, tokenizer_path="./no_such_tokenizer/x")
    with pytest.raises(OSError, match=r"model_path='nobody-here/no-imagereward' is neither an existing local path nor "
                                      r"a hub id"):
        reward(tiny, model_path="nobody-here/no-imagereward")  # HF_HUB_OFFLINE=1 (conftest): no network either way
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError, match=r"model_path=.*empty.*could not be loaded.*ImageReward\.pt does not exist"):
        reward(tiny, model_path=str(tmp_path / "empty"))
    with pytest.raises(OSError, match=r"model_path=.*other\.pt"):
        reward(tiny, checkpoint_name="other.pt")
    with pytest.raises(ValueError, match=r"dtype='int8'"):
        reward(tiny, dtype="int8")


def test_imagereward_in_a_training_shaped_call(tiny):
    model_dir, _, _, _ = tiny
    fn = reward(tiny, model_path=str(model_dir / "ImageReward.pt"), batch_size=2)  # the .pt file, med_config beside it
    batch = images(40, 56, n=5, seed=3)
    prompts = ["a red cat", "a sign", "hello world", "two dogs", "a red cat " * 30]  # the last one is truncated at 35
    metadata = [{"index": i} for i in range(5)]
    rewards, info = fn(batch, prompts, metadata)
    assert isinstance(info, dict) and rewards.dtype == torch.float64 and rewards.shape == (5,)
    assert torch.isfinite(rewards).all() and info["raw"].shape == (5,)
    half, _ = reward(tiny, dtype="bfloat16")(batch, prompts, metadata)
    torch.testing.assert_close(half, rewards, atol=0.1 * rewards.abs().max().item() + 0.05, rtol=0)
    combined = make_reward_fn({"imagereward": 0.5}, imagereward={"model_path": str(model_dir),
                                                                 "tokenizer_path": str(tiny[1]), "vision_heads": 2})
    scaled, _ = combined(batch, prompts, metadata)
    torch.testing.assert_close(torch.as_tensor(scaled, dtype=torch.float64), 0.5 * rewards, atol=1e-6, rtol=1e-6)


def test_imagereward_matches_the_image_reward_package(tiny):
    """The package's own BLIP modules and PIL transform (skipped where image-reward cannot be imported)."""
    try:
        from ImageReward.ImageReward import MLP, _transform
        from ImageReward.models.BLIP.med import BertConfig, BertModel
        from ImageReward.models.BLIP.vit import VisionTransformer
    except Exception as error:  # not installed; or its timm / fairscale / torchvision do not import here
        pytest.skip(f"the image-reward package is not importable here ({type(error).__name__}: {str(error)[:120]})")
    from PIL import Image

    _, _, state, tokenizer = tiny
    vit = VisionTransformer(img_size=VISION["image"], patch_size=VISION["patch"], embed_dim=VISION["width"],
                            depth=VISION["depth"], num_heads=VISION["heads"])
    config = BertConfig(**{k: v for k, v in MED.items() if k not in ("architectures", "model_type")})
    config.encoder_width = VISION["width"]
    try:
        text = BertModel(config=config, add_pooling_layer=False)
    except AttributeError as error:  # its med.py (written for transformers 4) with the transformers installed here
        pytest.skip(f"the image-reward package's BertModel does not build here ({error})")
    mlp = MLP(MED["hidden_size"])
    for module, prefix in ((vit, "blip.visual_encoder."), (text, "blip.text_encoder."), (mlp, "mlp.")):
        module.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, strict=False)
        module.eval()
    batch = smooth_images(48, 72)
    transform = _transform(VISION["image"])
    pixels = torch.stack([transform(Image.fromarray((im * 255).round().byte().permute(1, 2, 0).numpy()))
                          for im in batch])
    ids, mask = tokens(tokenizer, PROMPTS)
    with torch.no_grad():
        image_embeds = vit(pixels)
        try:
            out = text(ids, attention_mask=mask, encoder_hidden_states=image_embeds,
                       encoder_attention_mask=torch.ones(image_embeds.shape[:-1], dtype=torch.long), return_dict=True)
        except AttributeError as error:  # transformers 4 helpers its med.py calls (invert_attention_mask, ...)
            pytest.skip(f"the image-reward package's BertModel does not run here ({error})")
        expected = ((mlp(out.last_hidden_state[:, 0, :].float()).squeeze(-1) - REWARD_MEAN) / REWARD_STD).double()
        exact = (reference_raw(state, pixels, ids, mask).double() - REWARD_MEAN) / REWARD_STD
    torch.testing.assert_close(exact, expected, atol=1e-5, rtol=1e-5)  # the hand reference is the package's forward
    rewards, _ = reward(tiny)(batch, PROMPTS, [{}] * 4)
    torch.testing.assert_close(rewards, expected, atol=2e-2, rtol=0)  # PIL's 8-bit resampling (a tiny random model)
