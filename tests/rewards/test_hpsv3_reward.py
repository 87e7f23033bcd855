"""HPSv3 on a tiny random Qwen2-VL built here (nothing downloads).

The base "model directory" holds a Qwen2-VL config, a Qwen-style tokenizer built locally (ddpo_group.models.tiny_random,
with Qwen2-VL's chat template and vision tokens) and a Qwen2VLImageProcessor; the checkpoint is a random backbone with
HPSv3's ranknet head saved in HPSv3's layout (transformers 4.45's ``Qwen2VLRewardModelBT``: ``visual.*``,
``model.*``, ``lm_head.weight``, ``rm_head.*``). The reference is computed as the hpsv3 package does: its
prepare_batch (PIL images resized by qwen_vl_utils' rule to 256 * 28 * 28 pixels, transformers' Qwen2VLProcessor on
the chat template), then its forward (token embeddings, vision features scattered at the image tokens, the language
model with no position ids, the head at the ``<|Reward|>`` token). Without torchvision, conftest.py lets the
processor be built without its video processor; everything here runs with the ``[test]`` extra alone.
"""

import hashlib

import pytest
import torch
from torch import nn

from ddpo_group.rewards import make_reward_fn
from ddpo_group.rewards.hpsv3 import INSTRUCTION, PROMPT_WITH_REWARD_TOKEN, QWEN2_VL_CHAT_TEMPLATE, HPSv3Scorer

PIXELS = 256 * 28 * 28
PROMPTS = ["a red cat", "a sign that says hello world on a wooden post", "two dogs"]


def test_prompt_text_is_the_packages():
    """INSTRUCTION + prompt_with_special_token of hpsv3 1.0.0's dataset/data_collator_qwen.py (sha256 of the text)."""
    digest = hashlib.sha256((INSTRUCTION + PROMPT_WITH_REWARD_TOKEN).encode()).hexdigest()
    assert digest == "f6ee57479d4e9eee76b49c00dc962e1e696a5a2b3cc32cebd9b1fa76fe27502c"


def tiny_parts(hidden=32, seed=0):
    """(tokenizer, image processor, config, backbone, head) of a tiny Qwen2-VL reward model."""
    from transformers import Qwen2VLConfig, Qwen2VLImageProcessorPil, Qwen2VLModel

    from ddpo_group.models.tiny_random import qwen_vl_tokenizer

    tokenizer = qwen_vl_tokenizer(INSTRUCTION.replace("{text_prompt}", "") + PROMPT_WITH_REWARD_TOKEN)
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    tokenizer.model_max_length = 32768  # Qwen2-VL's (a prompt is about 800 tokens here)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056)  # Qwen2-VL-7B-Instruct's
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config={"hidden_size": hidden, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "initializer_range": 0.2,
                     "vocab_size": len(tokenizer) + 1,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                         "mrope_section": [2, 3, 3] if hidden == 32 else [4, 4, 4]},
                     "bos_token_id": ids("<|endoftext|>"), "eos_token_id": ids("<|im_end|>"),
                     "pad_token_id": ids("<|endoftext|>")},
        vision_config={"depth": 2, "embed_dim": 16, "hidden_size": hidden, "num_heads": 2, "mlp_ratio": 2,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "initializer_range": 0.2},
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    torch.manual_seed(seed)
    backbone = Qwen2VLModel._from_config(config, attn_implementation="eager").eval()
    head = nn.Sequential(nn.Linear(hidden, 1024), nn.ReLU(), nn.Dropout(0.05), nn.Linear(1024, 16), nn.ReLU(),
                         nn.Linear(16, 2)).eval()
    nn.init.normal_(head[5].weight, std=2.0)  # rewards spread well beyond the tolerances below
    return tokenizer, image_processor, config, backbone, head


def hpsv3_layout(backbone, head, lm_head=True):
    """The state dict as HPSv3.safetensors holds it (transformers 4.45 names)."""
    state = {f"visual.{k}": v for k, v in backbone.visual.state_dict().items()}
    state.update({f"model.{k}": v for k, v in backbone.language_model.state_dict().items()})
    if lm_head:
        state["lm_head.weight"] = torch.randn_like(backbone.language_model.embed_tokens.weight)
    state.update({f"rm_head.{k}": v for k, v in head.state_dict().items()})
    return {k: v.contiguous().clone() for k, v in state.items()}


@pytest.fixture(scope="module")
def tiny_hpsv3(tmp_path_factory):
    """(base directory, checkpoint file, tokenizer, image processor, backbone, head)."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("hpsv3")
    tokenizer, image_processor, config, backbone, head = tiny_parts()
    base = root / "base"
    config.text_config.vocab_size = len(tokenizer) + 9  # a padded vocabulary, as Qwen2-VL's 152064 rows
    config.save_pretrained(base)
    tokenizer.save_pretrained(base)
    image_processor.save_pretrained(base)
    save_file(hpsv3_layout(backbone, head), str(root / "HPSv3.safetensors"))
    return base, root / "HPSv3.safetensors", tokenizer, image_processor, backbone, head


def images(h, w, n=3, seed=1):
    torch.manual_seed(seed)
    return (torch.rand(n, 3, h, w) * 255).round() / 255  # exact 8-bit values


def reference(tiny, batch, prompts, hpsv3_positions=True):
    """hpsv3's prepare_batch + Qwen2VLRewardModelBT.forward, on the tiny model: (mu, sigma) float64."""
    import transformers
    from PIL import Image
    from transformers import AutoTokenizer, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    base, _, _, image_processor, backbone, head = tiny
    tokenizer = AutoTokenizer.from_pretrained(base, padding_side="right")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|Reward|>"]})  # hpsv3 train.py
    processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                 video_processor=transformers.Qwen2VLVideoProcessor(),  # None without torchvision
                                 chat_template=QWEN2_VL_CHAT_TEMPLATE)
    pil = []  # qwen_vl_utils' fetch_image: RGB, resized with PIL's bicubic to smart_resize(min = max = 256*28*28)
    for image in batch:
        image = Image.fromarray((image * 255).round().byte().permute(1, 2, 0).numpy()).convert("RGB")
        h_bar, w_bar = smart_resize(image.height, image.width, 28, min_pixels=PIXELS, max_pixels=PIXELS)
        pil.append(image.resize((w_bar, h_bar), Image.BICUBIC))
    messages = [[{"role": "user", "content": [
        {"type": "image", "image": image, "min_pixels": PIXELS, "max_pixels": PIXELS},
        {"type": "text", "text": INSTRUCTION.format(text_prompt=text) + PROMPT_WITH_REWARD_TOKEN}]}]
        for text, image in zip(prompts, pil)]
    inputs = processor(text=processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                       images=pil, padding=True, return_tensors="pt")
    input_ids = inputs["input_ids"]
    with torch.no_grad():
        if hpsv3_positions:  # the package's forward: its own embedding + scatter, the decoder given no position ids
            embeds = backbone.language_model.embed_tokens(input_ids)
            vision = backbone.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
            mask = (input_ids == backbone.config.image_token_id).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(mask, vision.to(embeds.dtype))
            hidden = backbone.language_model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"],
                                             position_ids=None).last_hidden_state
        else:  # transformers' Qwen2-VL forward: 3-D M-RoPE positions of the image tokens
            hidden = backbone(**inputs).last_hidden_state
        logits = head(hidden.float())  # [B, L, 2]
    pooled = logits[input_ids == tokenizer.convert_tokens_to_ids("<|Reward|>")].view(len(prompts), -1)
    return pooled[:, 0].double(), pooled[:, 1].double()


@pytest.mark.parametrize("shape", [(512, 512), (200, 360)])  # square (448 x 448) and a wide one scaled up
def test_hpsv3_is_mu_at_the_reward_token(tiny_hpsv3, shape):
    base, checkpoint, *_ = tiny_hpsv3
    fn = make_reward_fn("hpsv3", base_model=str(base), checkpoint_path=str(checkpoint), dtype="float32", batch_size=2,
                        attn_implementation="eager")
    batch = images(*shape)
    rewards, info = fn(batch, PROMPTS, [{}] * 3)
    mu, sigma = reference(tiny_hpsv3, batch, PROMPTS)
    assert rewards.dtype == torch.float64 and rewards.shape == (3,) and set(info) == {"sigma"}
    torch.testing.assert_close(rewards, mu, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(info["sigma"], sigma, atol=1e-5, rtol=1e-5)
    assert rewards.std() > 0
    if shape == (512, 512):  # HPSv3's 1-D positions, not Qwen2-VL's 3-D ones: the reference tells them apart
        mu_3d, _ = reference(tiny_hpsv3, batch, PROMPTS, hpsv3_positions=False)
        assert (mu_3d - mu).abs().max() > 1e-3


def test_fn_contract_and_batching(tiny_hpsv3):
    base, checkpoint, *_ = tiny_hpsv3
    fn = make_reward_fn("hpsv3", base_model=str(base), checkpoint_path=str(checkpoint), dtype="float32")  # sdpa
    batch, prompts = images(64, 48, n=2), PROMPTS[1:]  # prompts of different lengths: the shorter one is padded
    rewards, info = fn(batch, prompts, [{}] * 2)
    assert rewards.dtype == torch.float64 and rewards.shape == (2,) and info["sigma"].shape == (2,)
    one_by_one = torch.cat([fn(batch[i : i + 1], prompts[i : i + 1], [{}])[0] for i in range(2)])
    torch.testing.assert_close(rewards, one_by_one, atol=1e-5, rtol=1e-5)  # right padding changes nothing
    other, _ = fn(images(64, 48, n=2, seed=7), prompts, [{}] * 2)
    assert (other - rewards).abs().min() > 1e-4  # different images, different rewards
    swapped, _ = fn(batch, prompts[::-1], [{}] * 2)
    assert (swapped - rewards).abs().max() > 1e-4  # the prompt is read


def test_checkpoint_in_transformers5_layout_and_in_a_directory(tiny_hpsv3, tmp_path):
    from safetensors.torch import save_file

    base, checkpoint, _, _, backbone, head = tiny_hpsv3
    state = {f"model.{k}": v.contiguous() for k, v in backbone.state_dict().items()}
    state.update({f"rm_head.{k}": v for k, v in head.state_dict().items()})
    save_file(state, str(tmp_path / "ported.safetensors"))
    batch, prompts = images(56, 56, n=1), PROMPTS[:1]
    expected, _ = make_reward_fn("hpsv3", base_model=str(base), checkpoint_path=str(checkpoint),
                                 dtype="float32")(batch, prompts, [{}])
    for kwargs in ({"checkpoint_path": str(tmp_path / "ported.safetensors")},
                   {"checkpoint_path": str(checkpoint.parent)}):  # a directory holding HPSv3.safetensors
        rewards, _ = make_reward_fn("hpsv3", base_model=str(base), dtype="float32", **kwargs)(batch, prompts, [{}])
        torch.testing.assert_close(rewards, expected, atol=1e-6, rtol=1e-6)


def test_bfloat16(tiny_hpsv3):
    base, checkpoint, *_ = tiny_hpsv3
    scorer = HPSv3Scorer(str(base), str(checkpoint), dtype="bfloat16")
    assert {p.dtype for p in scorer.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in scorer.head.parameters()} == {torch.float32}
    batch, prompts = images(56, 56, n=2), PROMPTS[:2]
    low = scorer.scores(batch, prompts)[0].double()
    full, _ = make_reward_fn("hpsv3", base_model=str(base), checkpoint_path=str(checkpoint),
                             dtype="float32")(batch, prompts, [{}] * 2)
    assert low.isfinite().all()
    torch.testing.assert_close(low, full, atol=0.05 * full.abs().max().item() + 1e-3, rtol=0)
    # the vision tower's rotary table as transformers 4.45 computes it once cast (the package's): outer(arange, inv_freq)
    # in bfloat16 and its cos in bfloat16, where transformers 5 computes both in float32
    rope = scorer.model.visual.rotary_pos_emb
    positions = torch.stack(torch.meshgrid(torch.arange(8), torch.arange(8), indexing="ij"), -1).reshape(-1, 2)
    cos, _ = rope(torch.zeros(1), positions)
    table = torch.outer(torch.arange(8, dtype=torch.bfloat16), rope.inv_freq).cos().float()  # 4.45's, per axis
    quarter = table.shape[1]
    torch.testing.assert_close(cos[:, :quarter], table[positions[:, 0]], rtol=0, atol=0)
    torch.testing.assert_close(cos[:, quarter : 2 * quarter], table[positions[:, 1]], rtol=0, atol=0)
    exact = (positions[:, :1].float() * rope.inv_freq.float()).cos()
    assert not torch.equal(cos[:, :quarter], exact)  # float32 angles (transformers 5's own) differ


def test_checkpoint_of_another_shape_is_refused(tiny_hpsv3, tmp_path):
    from safetensors.torch import save_file

    base, checkpoint, tokenizer, _, backbone, head = tiny_hpsv3
    *_, wide_backbone, wide_head = tiny_parts(hidden=48)
    save_file(hpsv3_layout(wide_backbone, wide_head), str(tmp_path / "wide.safetensors"))
    with pytest.raises(ValueError, match=r"checkpoint_path='.*wide.safetensors' .* does not fit base_model='.*base': "
                                         r"its hidden size is 48, the base model's 32"):
        make_reward_fn("hpsv3", base_model=str(base), checkpoint_path=str(tmp_path / "wide.safetensors"))
    short = hpsv3_layout(backbone, head)
    short = {k: v for k, v in short.items() if not k.startswith("model.layers.1.")}  # one decoder layer missing
    save_file(short, str(tmp_path / "short.safetensors"))
    with pytest.raises(ValueError, match=r"short.safetensors.*does not fit the base model's Qwen2-VL: Missing key"):
        make_reward_fn("hpsv3", base_model=str(base), checkpoint_path=str(tmp_path / "short.safetensors"))
    other_head = hpsv3_layout(backbone, nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 2)))
    save_file(other_head, str(tmp_path / "head.safetensors"))
    with pytest.raises(ValueError, match=r"head.safetensors.*its rm_head is not HPSv3's"):
        make_reward_fn("hpsv3", base_model=str(base), checkpoint_path=str(tmp_path / "head.safetensors"))
    save_file({"text_model.weight": torch.zeros(2)}, str(tmp_path / "clip.safetensors"))
    with pytest.raises(ValueError, match=r"clip.safetensors.*is not an HPSv3 state dict.*text_model.weight"):
        make_reward_fn("hpsv3", base_model=str(base), checkpoint_path=str(tmp_path / "clip.safetensors"))


def test_missing_paths_are_named(tiny_hpsv3, tmp_path):
    base, checkpoint, *_ = tiny_hpsv3
    with pytest.raises(FileNotFoundError, match=r"hpsv3 reward: checkpoint_path='/no/such/HPSv3.safetensors' does "
                                                r"not exist .*MizzenAI/HPSv3"):
        make_reward_fn("hpsv3", base_model=str(base), checkpoint_path="/no/such/HPSv3.safetensors")
    with pytest.raises(FileNotFoundError, match=r"hpsv3 reward: base_model='/no/such/Qwen2-VL-7B-Instruct' does not "
                                                r"exist"):
        make_reward_fn("hpsv3", base_model="/no/such/Qwen2-VL-7B-Instruct", checkpoint_path=str(checkpoint))
    with pytest.raises(OSError, match=r"checkpoint_path='.*' could not be loaded .*no 'HPSv3.safetensors' "
                                      r"\(checkpoint_file\)"):
        make_reward_fn("hpsv3", base_model=str(base), checkpoint_path=str(tmp_path))
    with pytest.raises(ValueError, match=r"hpsv3 reward: dtype='float8' must be one of"):
        make_reward_fn("hpsv3", base_model=str(base), checkpoint_path=str(checkpoint), dtype="float8")
