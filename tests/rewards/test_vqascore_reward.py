"""VQAScore on tiny random models built and saved locally (nothing downloads).

Qwen2-VL (and Qwen2.5-VL): a two-layer model with a two-block vision tower, the project's locally built Qwen tokenizer
(merges learned on the question, so "Yes" is one token as in Qwen's vocabulary) with Qwen2-VL's own chat template, a
Qwen2VLImageProcessor, and a generation config with Qwen's repetition_penalty 1.05; the "Yes" row of the head is
aimed so that P("Yes") is near 1/2. The references are t2v_metrics' route written out here (qwen_vl_utils' resize with
its sizes by hand, the chat template, the processor, then ``generate(max_new_tokens=1, do_sample=False,
output_scores=True).scores[0]`` and the softmax) and the forward's last logits with the penalty by hand.
LLaVA-OneVision is refused. CLIP-FlanT5: a module with t2v_metrics' CLIPT5ForConditionalGeneration layout saved as its
checkpoints are, the reference its forward written out. Without torchvision (CI) the processors are built, saved and
loaded without their video processors (tests/helpers/processor_without_video.py; the same patch for Qwen2.5-VL here,
undone after).
"""

import importlib.util
import json
import time

import pytest
import torch
from PIL import Image

from ddpo_group.rewards import make_reward_fn
from ddpo_group.rewards.hpsv3 import QWEN2_VL_CHAT_TEMPLATE  # Qwen2-VL-7B-Instruct's
from tests.helpers.processor_without_video import allow_a_processor_without_video

PROMPTS = ["a red cat", "a sign that says hello", "two dogs", "a blue square"]


def tiny_images(count=4, height=48, width=64, seed=0):
    return torch.rand(count, 3, height, width, generator=torch.Generator().manual_seed(seed))


def aim_yes_at_half(model, inputs, yes):
    """Scale the random head by 30 (logits of about 10) and point the "Yes" row along the last hidden state of
    ``inputs``, so that P("Yes") is about 1/2 there and varies with the image and the prompt (a random head gives
    each token about 1 / vocab)."""
    seen = []
    handle = model.lm_head.register_forward_hook(lambda module, args, output: seen.append(args[0][0, -1].clone()))
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
        logits = model(**inputs).logits[0, -1]
        handle.remove()
        hidden = seen[0]
        others = torch.cat([logits[:yes], logits[yes + 1:]]).logsumexp(0)
        model.lm_head.weight[yes] = hidden * (others / hidden.dot(hidden))


def qwen_inputs(processor, prompt="a red cat"):
    image = Image.new("RGB", (56, 56), (120, 30, 200))
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": f'Does this image show "{prompt}"?'}]}]
    text = processor.apply_chat_template(messages, chat_template=QWEN2_VL_CHAT_TEMPLATE, tokenize=False,
                                         add_generation_prompt=True)
    return processor(text=[text], images=[image], return_tensors="pt")


def build_tiny_qwen(root, family="qwen2_vl"):
    """A tiny random Qwen2-VL (or Qwen2.5-VL) checkpoint saved in ``root`` with its processor and generation config."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor, Qwen2VLProcessor)

    from ddpo_group.models.tiny_random import qwen_vl_tokenizer

    allow_a_processor_without_video()
    tokenizer = qwen_vl_tokenizer('Yes\nDoes this image show "{}"? No system You are a helpful assistant. user')
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    assert len(tokenizer.encode("Yes")) == 1
    image_processor = Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=112 * 112, patch_size=14, merge_size=2,
                                            temporal_patch_size=2)
    if importlib.util.find_spec("torchvision") is not None:
        from transformers import Qwen2VLVideoProcessor

        processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                     video_processor=Qwen2VLVideoProcessor(), chat_template=QWEN2_VL_CHAT_TEMPLATE)
    else:
        processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                                     chat_template=QWEN2_VL_CHAT_TEMPLATE)
    ids = tokenizer.convert_tokens_to_ids
    torch.manual_seed(0)
    text_config = {"hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "num_key_value_heads": 2, "rope_theta": 1000000.0, "vocab_size": len(tokenizer),
                   "rope_scaling": {"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"},
                   "bos_token_id": ids("<|endoftext|>"), "eos_token_id": ids("<|im_end|>")}
    tokens = dict(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                  vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    if family == "qwen2_vl":
        config = Qwen2VLConfig(text_config=text_config, **tokens, vision_config={
            "depth": 2, "embed_dim": 16, "hidden_size": 32, "mlp_ratio": 2, "num_heads": 2, "patch_size": 14,
            "spatial_merge_size": 2, "temporal_patch_size": 2})
        model = Qwen2VLForConditionalGeneration(config).eval()
    else:  # Qwen2.5-VL: window attention in the tower (its last block full), RMSNorm, SwiGLU
        config = Qwen2_5_VLConfig(text_config=text_config, **tokens, vision_config={
            "depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 32,
            "fullatt_block_indexes": [1], "window_size": 56})
        model = Qwen2_5_VLForConditionalGeneration(config).eval()
    aim_yes_at_half(model, qwen_inputs(processor), tokenizer.encode("Yes")[0])
    model.generation_config.repetition_penalty = 1.05  # Qwen2-VL-Instruct's generation_config.json
    model.generation_config.bos_token_id = ids("<|endoftext|>")
    model.generation_config.eos_token_id = [ids("<|im_end|>"), ids("<|endoftext|>")]
    model.generation_config.pad_token_id = ids("<|endoftext|>")
    model.save_pretrained(root)
    processor.save_pretrained(root)
    tokenizer.save_pretrained(root)  # the template with the tokenizer too (the processor without video saves none)
    return root


@pytest.fixture(scope="module")
def tiny_qwen2vl(tmp_path_factory):
    """The directory of a tiny random Qwen2-VL checkpoint with its processor and generation config."""
    return build_tiny_qwen(tmp_path_factory.mktemp("vqascore") / "tiny-qwen2-vl")


def reference(directory, images, prompts, route="generate", penalty=1.05):
    """t2v_metrics' Qwen2VLModel.forward, written out: P("Yes") of each pair (float64). ``route="generate"``: its
    ``generate(...).scores[0]`` (the generation config's repetition penalty applied by transformers);
    ``route="forward"``: the forward's last logits, each prompt token's logit l made l / penalty (l > 0) or
    l * penalty by hand."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    allow_a_processor_without_video()
    processor = AutoProcessor.from_pretrained(directory)
    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    yes = processor.tokenizer.encode("Yes")[0]
    out = []
    arrays = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for array, prompt in zip(arrays, prompts):
        # qwen_vl_utils.fetch_image: 48 x 64 px -> round(48 / 28) * 28 = 56, round(64 / 28) * 28 = 56 (area >= 3136)
        image = Image.fromarray(array).resize((56, 56), Image.BICUBIC)
        messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                                 {"type": "text", "text": f'Does this image show "{prompt}"?'}]}]
        text = processor.apply_chat_template(messages, chat_template=QWEN2_VL_CHAT_TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)
        assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                               "<|vision_start|><|image_pad|><|vision_end|>Does this image show")
        assert text.endswith('"?<|im_end|>\n<|im_start|>assistant\n')
        inputs = processor(text=[text], images=[image], padding=True, return_tensors="pt")
        with torch.no_grad():
            if route == "generate":
                scores = model.generate(**inputs, max_new_tokens=1, do_sample=False, output_scores=True,
                                        return_dict_in_generate=True).scores[0]
            else:
                scores = model(**inputs, logits_to_keep=1).logits[:, -1].float()  # the last position, as generate
                for token in set(inputs["input_ids"][0].tolist()):
                    logit = scores[0, token]
                    scores[0, token] = logit / penalty if logit > 0 else logit * penalty
        out.append(torch.softmax(scores.double(), dim=-1)[0, yes].item())
    return torch.tensor(out, dtype=torch.float64)


def test_vqascore_equals_t2v_metrics_route(tiny_qwen2vl):
    fn = make_reward_fn("vqascore", model_path=str(tiny_qwen2vl), dtype="float32")
    images = tiny_images()
    rewards, info = fn(images, PROMPTS, [{} for _ in PROMPTS])
    assert rewards.dtype == torch.float64 and rewards.shape == (4,)
    assert set(info) == {"log_likelihood"}
    torch.testing.assert_close(info["log_likelihood"].exp(), rewards, rtol=1e-6, atol=0)
    # the forward's softmax with the checkpoint's 1.05 penalty by hand
    torch.testing.assert_close(rewards, reference(tiny_qwen2vl, images, PROMPTS, route="forward"), rtol=0, atol=1e-6)
    # t2v_metrics' own route: generate(max_new_tokens=1, do_sample=False, output_scores=True).scores[0]
    torch.testing.assert_close(rewards, reference(tiny_qwen2vl, images, PROMPTS), rtol=0, atol=1e-6)
    # repetition_penalty=1.0: the bare forward's softmax at the last position
    plain = make_reward_fn("vqascore", model_path=str(tiny_qwen2vl), dtype="float32", repetition_penalty=1.0)
    plain_rewards, _ = plain(images, PROMPTS, [{} for _ in PROMPTS])
    torch.testing.assert_close(plain_rewards, reference(tiny_qwen2vl, images, PROMPTS, route="forward", penalty=1.0),
                               rtol=0, atol=1e-6)
    assert not torch.allclose(plain_rewards, rewards, rtol=0, atol=1e-9)  # the penalty changes the softmax


def test_vqascore_qwen2_5_vl(tmp_path, monkeypatch):
    directory = build_tiny_qwen(tmp_path / "tiny-qwen2.5-vl", family="qwen2_5_vl")
    if importlib.util.find_spec("torchvision") is None:  # AutoProcessor picks Qwen2_5_VLProcessor: the same patch
        from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor

        monkeypatch.setattr(Qwen2_5_VLProcessor, "from_pretrained",
                            classmethod(lambda cls, path, *args, **kwargs: Qwen2VLProcessor.from_pretrained(path)))
    assert json.loads((directory / "config.json").read_text())["model_type"] == "qwen2_5_vl"
    fn = make_reward_fn("vqascore", model_path=str(directory), dtype="float32")
    images = tiny_images(count=2)
    rewards, _ = fn(images, PROMPTS[:2], [{}, {}])
    expected = reference(directory, images, PROMPTS[:2], route="forward")
    torch.testing.assert_close(rewards, expected, rtol=0, atol=1e-6)
    assert abs(rewards[0] - rewards[1]) > 1e-6


def test_vqascore_range_and_dependence(tiny_qwen2vl):
    fn = make_reward_fn("vqascore", model_path=str(tiny_qwen2vl), dtype="float32")
    images = tiny_images(count=2, height=56, width=56, seed=1)
    same_prompt = ["a red cat", "a red cat"]
    rewards, _ = fn(images, same_prompt, [{}, {}])
    assert ((rewards >= 0) & (rewards <= 1)).all()
    assert abs(rewards[0] - rewards[1]) > 1e-6  # the image matters
    other, _ = fn(images[:1].repeat(2, 1, 1, 1), ["a red cat", "two dogs on a beach"], [{}, {}])
    assert abs(other[0] - other[1]) > 1e-6  # the prompt matters
    assert abs(other[0] - rewards[0]) < 1e-9  # and the same pair scores the same
    # images of another size are resized as qwen_vl_utils does (and bfloat16 runs)
    big, _ = make_reward_fn("vqascore", model_path=str(tiny_qwen2vl), dtype="bfloat16")(
        tiny_images(count=1, height=100, width=30), ["a red cat"], [{}])
    assert 0 <= big.item() <= 1


def test_vqascore_refusals(tiny_qwen2vl, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model_path='/no/such/dir'"):
        make_reward_fn("vqascore", model_path="/no/such/dir")
    clip_t5 = tmp_path / "a-checkpoint"
    clip_t5.mkdir()
    (clip_t5 / "config.json").write_text(json.dumps({"model_type": "clip_t5",
                                                     "architectures": ["CLIPT5ForConditionalGeneration"]}))
    with pytest.raises(FileNotFoundError, match=r"model_path='.*a-checkpoint' holds no \*.safetensors"):
        make_reward_fn("vqascore", model_path=str(clip_t5))
    with pytest.raises(ValueError, match=r"tokenizer_path='x' is for CLIP-FlanT5 checkpoints"):
        make_reward_fn("vqascore", model_path=str(tiny_qwen2vl), tokenizer_path="x")
    other = tmp_path / "a-clip"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "clip"}))
    with pytest.raises(ValueError, match=r"is a 'clip' model; supported: qwen2_vl, qwen2_5_vl, clip_t5"):
        make_reward_fn("vqascore", model_path=str(other))
    with pytest.raises(ValueError, match=r"question_template='Is it\?'"):
        make_reward_fn("vqascore", model_path=str(tiny_qwen2vl), question_template="Is it?")
    with pytest.raises(ValueError, match=r"question_template='Is \{x\} \{\}\?' must hold one '\{\}' for the prompt and no "
                                         r"other field \(KeyError"):
        make_reward_fn("vqascore", model_path=str(tiny_qwen2vl), question_template="Is {x} {}?")
    with pytest.raises(ValueError, match=r"dtype='float8'"):
        make_reward_fn("vqascore", model_path=str(tiny_qwen2vl), dtype="float8")
    fn = make_reward_fn("vqascore", model_path=str(tiny_qwen2vl), dtype="float32")
    with pytest.raises(ValueError, match=r"2 images but 1 prompts"):
        fn(tiny_images(count=2), ["a cat"], [{}])


def test_a_llava_onevision_checkpoint_is_refused_with_the_reason(tmp_path):
    """t2v_metrics scores LLaVA-OneVision through the llava package's video branch (tiles pooled 2 x 2, float16), which
    transformers' image path would not reproduce: refused by name."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava_onevision"}))
    with pytest.raises(ValueError, match=r"is a 'llava_onevision' model: t2v_metrics scores LLaVA-OneVision through "
                                         r"the llava package.*video branch"):
        make_reward_fn("vqascore", model_path=str(tmp_path))


SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
          "detailed, and polite answers to the user's questions.")


def t5_tokenizer():
    """A T5 (Unigram) tokenizer built locally: single characters, a few words of the question, '</s>' appended."""
    from transformers import T5Tokenizer

    words = ["\u2581Yes", "\u2581Does", "\u2581this", "\u2581figure", "\u2581show", "\u2581USER:", "\u2581ASSISTANT:",
             "\u2581Please", "\u2581answer", "\u2581yes", "\u2581or", "\u2581no."]
    characters = sorted(set(SYSTEM + 'Does this figure show "?" Please answer yes or no. abcdefghijklmnopqrstuvwxyz'))
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [(c, -3.0) for c in characters if c != " "] + [(w, -1.0) for w in words]
    return T5Tokenizer(vocab=vocab, extra_ids=3)


def build_clip_t5(root):
    """t2v_metrics' CLIPT5ForConditionalGeneration's module layout (a T5ForConditionalGeneration with ``embed_tokens``
    aliasing its encoder's, ``vision_tower.vision_tower`` a CLIPVisionModel, ``mm_projector`` mlp2x_gelu) at a tiny
    size, saved as its checkpoints are (config of model type clip_t5 with the mm_* keys, pytorch_model.bin), with a
    tiny CLIP tower directory (config, CLIPImageProcessor) as its mm_vision_tower. Returns the module."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, T5Config, T5ForConditionalGeneration

    tokenizer = t5_tokenizer()
    tower = root / "clip-tower"
    vision_config = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     image_size=28, patch_size=14)
    vision_config.save_pretrained(tower)
    CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(tower)
    t5_config = T5Config(vocab_size=len(tokenizer) + 5, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                         feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
                         pad_token_id=0, eos_token_id=1)

    class CLIPT5(T5ForConditionalGeneration):
        def __init__(self, config):
            super().__init__(config)
            self.embed_tokens = self.encoder.embed_tokens
            self.vision_tower = torch.nn.Module()
            self.vision_tower.vision_tower = CLIPVisionModel(vision_config)
            self.mm_projector = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))

    torch.manual_seed(0)
    model = CLIPT5(t5_config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(0.3)  # likelihoods of a few 1 / vocab (the init's logits are large)
    directory = root / "clip-flant5-tiny"
    directory.mkdir()
    config = {**t5_config.to_dict(), "model_type": "clip_t5", "architectures": ["CLIPT5ForConditionalGeneration"],
              "mm_vision_tower": str(tower), "mm_hidden_size": 16, "mm_projector_type": "mlp2x_gelu",
              "mm_vision_select_layer": -2, "mm_vision_select_feature": "patch", "use_mm_proj": True}
    (directory / "config.json").write_text(json.dumps(config))
    torch.save(model.state_dict(), directory / "pytorch_model.bin")
    tokenizer.save_pretrained(directory)
    return directory, model, tokenizer


def clip_t5_reference(model, tokenizer, tower, images, prompts):
    """t2v_metrics' CLIPT5Model.forward written out on the module itself: expand2square on the CLIP mean colour,
    CLIP's processor, layer -2 patch features through mm_projector spliced where '<image>' splits the t5_chat prompt
    (each chunk tokenized with its </s>), resize_token_embeddings(len(tokenizer)), exp(-cross entropy) of "Yes</s>"."""
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor.from_pretrained(tower)
    model.resize_token_embeddings(len(tokenizer))
    out = []
    for image, prompt in zip(images, prompts):
        pil = Image.fromarray((image * 255).round().to(torch.uint8).permute(1, 2, 0).numpy())
        width, height = pil.size
        side = max(width, height)
        square = Image.new("RGB", (side, side), (122, 116, 104))  # int(255 * OpenAI CLIP's mean)
        square.paste(pil, (0, (side - height) // 2) if width > height else ((side - width) // 2, 0))
        pixels = processor.preprocess(square, return_tensors="pt")["pixel_values"]
        question = f'{SYSTEM} USER: <image>\nDoes this figure show "{prompt}"? Please answer yes or no. ASSISTANT: '
        before, after = (tokenizer(chunk).input_ids for chunk in question.split("<image>"))
        with torch.no_grad():
            features = model.vision_tower.vision_tower(pixels, output_hidden_states=True).hidden_states[-2][:, 1:]
            embeds = torch.cat([model.embed_tokens(torch.tensor(before)), model.mm_projector(features)[0],
                                model.embed_tokens(torch.tensor(after))])[None]
            labels = torch.tensor([tokenizer("Yes").input_ids])
            loss = model(inputs_embeds=embeds, attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long),
                         labels=labels).loss
        out.append(torch.exp(-loss.double()).item())
    return torch.tensor(out, dtype=torch.float64)


def test_vqascore_clip_flant5(tmp_path):
    directory, model, tokenizer = build_clip_t5(tmp_path)
    assert tokenizer("Yes").input_ids == [tokenizer.convert_tokens_to_ids("\u2581Yes"), 1]
    fn = make_reward_fn("vqascore", model_path=str(directory), dtype="float32")
    wide, tall = tiny_images(count=2, height=40, width=50), tiny_images(count=1, height=50, width=30)
    rewards = torch.cat([fn(wide, ["a red cat"] * 2, [{}] * 2)[0], fn(tall, ["two dogs"], [{}])[0]])
    expected = torch.cat([clip_t5_reference(model, tokenizer, tmp_path / "clip-tower", wide, ["a red cat"] * 2),
                          clip_t5_reference(model, tokenizer, tmp_path / "clip-tower", tall, ["two dogs"])])
    torch.testing.assert_close(rewards, expected, rtol=0, atol=1e-6)
    assert ((rewards > 0) & (rewards < 1)).all() and abs(rewards[0] - rewards[1]) > 1e-6
    other, info = fn(wide[:1], ["two dogs"], [{}])
    torch.testing.assert_close(info["log_likelihood"].exp(), other, rtol=1e-6, atol=0)
    assert abs(other[0] - rewards[0]) > 1e-6  # the prompt matters
    # a checkpoint whose projector does not fit is refused by name
    state = torch.load(directory / "pytorch_model.bin", weights_only=True)
    state["mm_projector.2.weight"] = torch.zeros(8, 16)
    torch.save(state, directory / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"model_path='.*clip-flant5-tiny': its mm_projector weights do not fit"):
        make_reward_fn("vqascore", model_path=str(directory), dtype="float32")


def test_vqascore_speed_batch_of_8_at_512(tiny_qwen2vl):
    """Times the pipeline (resize, template, processor, tiny model) on a batch of 8 images of 512 px."""
    fn = make_reward_fn("vqascore", model_path=str(tiny_qwen2vl), dtype="float32")
    images = tiny_images(count=8, height=512, width=512)
    fn(images[:1], PROMPTS[:1], [{}])
    start = time.perf_counter()
    rewards, _ = fn(images, PROMPTS * 2, [{}] * 8)
    elapsed = time.perf_counter() - start
    print(f"vqascore tiny Qwen2-VL, 8 x 512 px: {elapsed * 1000:.0f} ms")
    assert rewards.shape == (8,)
