"""Groupwise rewards: the call per prompt group (RewardScorer, the sampler's pending groups), the win rate and rank by
hand, the pairwise judges (from a reward, and a VLM behind a stub OpenAI-compatible endpoint
through the real openai client), combinations, and the start-up checks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers.openai_stub import StubOpenAI, completion, decode_data_url

from ddpo_group.rewards import RewardUnavailable, is_groupwise, make_reward_fn
from ddpo_group.rewards.base import scores_frames
from ddpo_group.rewards.http_server import make_server
from ddpo_group.rewards.pairwise import chosen_image, normalized_ranks, pair_means, pair_wins, win_rates
from ddpo_group.rollout.reward_scorer import PendingGroups, RewardScorer
from ddpo_group.run.config_checks import validate_config
from ddpo_group.errors import ConfigError


def grey_images(levels) -> torch.Tensor:
    """One flat grey 8x8 image per level in [0, 1] (8-bit exact)."""
    return torch.stack([torch.full((3, 8, 8), round(v * 255) / 255) for v in levels])


def brightness(images, prompts, metadata):
    return images.mean(dim=(1, 2, 3)).double(), {}


def brightness_reward():
    return brightness


BRIGHTNESS = f"{Path(__file__)}:brightness_reward"  # a plugin reward: each image's mean brightness


def test_ranks_and_win_rates_by_hand():
    # scores 3, 1, 3, 2: image 0 is above 1 and 3 and ties 2 -> (2 + 1/2) / 3
    assert normalized_ranks(torch.tensor([3.0, 1.0, 3.0, 2.0])).tolist() == pytest.approx([5 / 6, 0, 5 / 6, 1 / 3])
    assert normalized_ranks(torch.tensor([7.0])).tolist() == [0.5]  # a group of one image
    # 3 images, the judge's P(first beats second) per unordered pair
    pairs, p = [(0, 1), (0, 2), (1, 2)], torch.tensor([0.9, 0.2, 0.6], dtype=torch.float64)
    rates = win_rates(pair_wins(p, pairs, 3))
    assert rates.tolist() == pytest.approx([(0.9 + 0.2) / 2, (0.1 + 0.6) / 2, (0.8 + 0.4) / 2])
    assert float(rates.mean()) == pytest.approx(0.5)  # every group's mean win rate is 1/2
    # both orders: a judge that always prefers the image shown first cancels out to ties
    both = pairs + [(j, i) for i, j in pairs]
    assert win_rates(pair_wins(torch.ones(6, dtype=torch.float64), both, 3)).tolist() == [0.5, 0.5, 0.5]
    assert pair_means([1.0, 0.0, 1.0], pairs, 3).tolist() == [0.5, 1.0, 0.5]  # image 1: pairs (0, 1), (1, 2)


def test_win_rate_under_the_reward_judge_is_the_rank_and_soft_with_a_temperature():
    images = grey_images([0.2, 0.6, 0.4, 0.6, 0.1])  # a tie between images 1 and 3
    prompts, metadata = ["a cat"] * 5, [{}] * 5
    rank = make_reward_fn("rank", reward_fn=BRIGHTNESS)
    hard = make_reward_fn("win_rate", judge="reward",
                          judge_kwargs={"reward_fn": BRIGHTNESS})
    assert is_groupwise(rank) and is_groupwise(hard)
    ranks, info = rank(images, prompts, metadata)
    assert ranks.tolist() == pytest.approx([0.25, 0.875, 0.5, 0.875, 0.0])
    assert torch.equal(hard(images, prompts, metadata)[0], ranks)
    torch.testing.assert_close(info["score"], images.mean(dim=(1, 2, 3)).double())  # the absolute score, logged
    soft = make_reward_fn("win_rate", judge="reward", judge_kwargs={
        "reward_fn": BRIGHTNESS, "temperature": 0.1})
    s = info["score"]
    expected = [sum(1 / (1 + math.exp(-(s[i] - s[j]) / 0.1)) for j in range(5) if j != i) / 4 for i in range(5)]
    assert soft(images, prompts, metadata)[0].tolist() == pytest.approx(expected)
    with pytest.raises(ValueError, match=r"rank needs reward_fn"):
        make_reward_fn("rank")
    with pytest.raises(ValueError, match=r"unknown pairwise judge 'nope'; registered: \['reward', 'vlm'\]"):
        make_reward_fn("win_rate", judge="nope")


def test_the_scorer_calls_a_groupwise_reward_once_per_group_and_names_the_group_it_fails_on():
    calls = []

    def centred(images, prompts, metadata):  # each image's brightness minus its group's mean
        calls.append(list(prompts))
        b = images.mean(dim=(1, 2, 3)).double()
        if "fail" in prompts[0]:
            raise KeyError("no judge for this")
        return b - b.mean(), {"brightness": b, "group_size": len(prompts)}

    centred.groupwise = True
    scorer = RewardScorer(scores_frames(centred, "centred"), "centred")
    images = grey_images([0.2, 0.4, 0.6, 0.8, 1.0])
    rewards, info = scorer(images, ["a", "a", "a", "b", "b"], [{}] * 5, groups=[7, 7, 7, 2, 2])
    assert calls == [["a", "a", "a"], ["b", "b"]]
    expected = torch.tensor([-0.2, 0.0, 0.2, -0.1, 0.1], dtype=torch.float64)  # group means 0.4 and 0.9
    torch.testing.assert_close(rewards, expected, atol=1e-6, rtol=0)
    assert len(info["brightness"]) == 5 and info["group_size"] == 3  # per-image entries concatenated
    with pytest.raises(ValueError, match=r"prompt group 7 is not consecutive"):
        scorer(images, ["a"] * 5, [{}] * 5, groups=[7, 7, 2, 2, 7])
    with pytest.raises(ValueError, match=r"'centred' is groupwise: it needs the prompt group of each of the 5"):
        scorer(images, ["a"] * 5, [{}] * 5)
    with pytest.raises(RuntimeError, match=r"raised KeyError: 'no judge for this' \(groupwise, on the group of 2 "
                                           r"images of prompt 'fail'\)"):
        scorer(images, ["a", "a", "a", "fail", "fail"], [{}] * 5, groups=[0, 0, 0, 1, 1])
    with pytest.raises(RuntimeError, match=r"'centred' is groupwise .* must score whole videos"):
        scorer(torch.rand(2, 3, 3, 4, 4), ["a", "a"], [{}] * 2, groups=[0, 0])
    with pytest.raises(ValueError, match=r"HTTP protocol's batches are not groups"):
        make_server(centred, "127.0.0.1", 0)


def test_pending_groups_hand_over_each_group_once_all_its_samples_are_drawn():
    """Groups of 3 sampled in batches of 2 (a group spans two batches): nothing after the first batch, then the
    groups that each batch completes with their rows' metadata (each sample's audio rides there), the last batch
    everything left."""
    pending = PendingGroups([5, 5, 5, 1, 1, 1, 4, 4, 4])
    images = torch.arange(9.0)
    rows = [{"row": i} for i in range(9)]
    handed = [pending.add(images[i : i + 2], rows[i : i + 2]) for i in (0, 2, 4, 6, 8)]
    assert [None if h is None else (h[0].tolist(), [m["row"] for m in h[1]], (h[2].start, h[2].stop))
            for h in handed] == [None, ([0.0, 1.0, 2.0], [0, 1, 2], (0, 3)), ([3.0, 4.0, 5.0], [3, 4, 5], (3, 6)),
                                 None, ([6.0, 7.0, 8.0], [6, 7, 8], (6, 9))]


def brighter_first(body) -> tuple[bool, str]:
    """Whether the stub VLM finds the first image brighter, and the question it was asked."""
    first, second, question = body["messages"][0]["content"]
    assert first["type"] == second["type"] == "image_url" and question["type"] == "text"
    brighter = float(decode_data_url(first["image_url"]["url"]).mean()) > float(
        decode_data_url(second["image_url"]["url"]).mean())
    return brighter, question["text"]


def answer_by_brightness(body):
    """A stub VLM that prefers the brighter image: as text ("answer") or as the logprobs of "1" and "2" ("prob");
    prompts with "void" get an answer with neither."""
    brighter, text = brighter_first(body)
    if body.get("logprobs"):
        if "void" in text:
            return completion("3", [{"token": "3", "logprob": 0.0}])
        p1 = 0.7 if brighter else 0.2
        return completion("1", [{"token": "1", "logprob": math.log(p1)}, {"token": " 2", "logprob": math.log(0.9 - p1)},
                                {"token": "Both", "logprob": math.log(0.05)}])
    if "void" in text:
        return completion("I cannot tell them apart.")
    return completion(f"<think>Image 1 is better lit? Compare.</think>Image {1 if brighter else 2} is better.")


@pytest.fixture
def stub_vlm():
    stub = StubOpenAI(answer_by_brightness)
    yield stub
    stub.stop()


@pytest.mark.parametrize("mode", ["answer", "prob"])
def test_the_vlm_pairwise_judge_through_the_openai_client(stub_vlm, monkeypatch, mode):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    judge = {"base_url": stub_vlm.base_url, "model": "stub-vl", "mode": mode, "max_workers": 3}
    fn = make_reward_fn("win_rate", judge="vlm", judge_kwargs=judge)
    scorer = RewardScorer(fn, "win_rate")
    images = grey_images([0.2, 0.8, 0.4, 0.6, 0.6])
    prompts = ["a cat"] * 3 + ["the void"] * 2
    rewards, info = scorer(images, prompts, [{}] * 5, groups=[0, 0, 0, 1, 1])
    if mode == "answer":  # hard wins: the ranks of the brightness; the void group's answers are ties
        expected = [0.0, 1.0, 0.5, 0.5, 0.5]
    else:  # P(1) / (P(1) + P(2)) = 7/9 when the first image is brighter, 2/9 when not
        expected = [2 / 9, 7 / 9, (7 / 9 + 2 / 9) / 2, 0.5, 0.5]
    assert rewards.tolist() == pytest.approx(expected)
    assert info["parsed"].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    # one request per pair (3 + 1), both images in the pair's order, the prompt in the question
    assert len(stub_vlm.requests) == 4
    sent = {(round(float(decode_data_url(b["messages"][0]["content"][0]["image_url"]["url"]).mean()), 3),
             round(float(decode_data_url(b["messages"][0]["content"][1]["image_url"]["url"]).mean()), 3))
            for b in stub_vlm.requests}
    assert sent == {(0.2, 0.8), (0.2, 0.4), (0.8, 0.4), (0.6, 0.6)}
    for body in stub_vlm.requests:
        assert body["model"] == "stub-vl" and body["temperature"] == 0.0
        assert ('"a cat"' in body["messages"][0]["content"][2]["text"]) != ('"the void"' in
                                                                            body["messages"][0]["content"][2]["text"])
        assert (body["max_tokens"], body.get("top_logprobs")) == ((1, 20) if mode == "prob" else (512, None))
    assert all(h["authorization"] == "Bearer EMPTY" for h in stub_vlm.headers)  # no key: a local server's


def test_the_vlm_pairwise_judge_in_both_orders_and_its_errors(stub_vlm):
    fn = make_reward_fn("win_rate", judge="vlm", both_orders=True,
                        judge_kwargs={"base_url": stub_vlm.base_url, "model": "m", "api_key": "sk-test"})
    rewards, _ = fn(grey_images([0.2, 0.8, 0.4]), ["a cat"] * 3, [{}] * 3)
    assert rewards.tolist() == [0.0, 1.0, 0.5] and len(stub_vlm.requests) == 6  # each pair in both orders
    assert {h["authorization"] for h in stub_vlm.headers} == {"Bearer sk-test"}
    # the answer after the reasoning counts; a reasoning without a conclusion is no answer
    answers = ("Image 1 is better", "Image 2 is better")
    assert chosen_image("<think>Image 1 is better?</think> image 2 IS BETTER.", answers) == 0.0
    assert chosen_image("<think>Image 1 is better</think>", answers) is None
    assert chosen_image("Image 2 is better than I thought, but Image 1 is better", answers) == 1.0
    wrong_path = make_reward_fn("win_rate", judge="vlm", judge_kwargs={
        "base_url": stub_vlm.base_url.replace("/v1", "/v2"), "model": "m", "retries": 0})
    with pytest.raises(RuntimeError, match=r"endpoint http://127\.0\.0\.1:\d+/v2/chat/completions answered HTTP 404"):
        wrong_path(grey_images([0.1, 0.2]), ["a", "a"], [{}] * 2)
    stub_vlm.stop()  # nobody listens any more: the judge is unavailable, and the scorer does not retry image by image
    scorer = RewardScorer(make_reward_fn("win_rate", judge="vlm", judge_kwargs={
        "base_url": stub_vlm.base_url, "model": "m", "retries": 0, "timeout": 5}), "win_rate")
    with pytest.raises(RuntimeError, match=r"raised JudgeUnavailable: .*not reachable or silent") as raised:
        scorer(grey_images([0.1, 0.2]), ["a", "a"], [{}] * 2, groups=[0, 0])
    assert isinstance(raised.value.__cause__, RewardUnavailable)
    for kwargs, message in [({"model": "m", "mode": "logits"}, r"mode='logits' must be one of \['answer', 'prob'\]"),
                            ({"model": ""}, r"needs judge_kwargs.model"),
                            ({"model": "m", "question": "Which?"}, r"must contain \{prompt\}"),
                            ({"model": "m", "answers": ["A", "A"]}, r"must be two different strings"),
                            ({"model": "m", "base_url": "localhost:8000"}, r"base_url='localhost:8000' must be")]:
        with pytest.raises(ValueError, match=message):
            make_reward_fn("win_rate", judge="vlm", judge_kwargs={"base_url": stub_vlm.base_url, **kwargs})


def test_a_combination_with_a_groupwise_component_is_scored_per_group():
    spec = {"rank": 1.0, "jpeg_compressibility": 0.5}
    fn = make_reward_fn(spec, rank={"reward_fn": BRIGHTNESS})
    assert is_groupwise(fn) and not is_groupwise(make_reward_fn("jpeg_compressibility"))
    images = grey_images([0.2, 0.8, 0.4, 0.6, 0.2, 0.4])
    rewards, info = RewardScorer(fn, str(spec))(images, ["a"] * 6, [{}] * 6, groups=[0, 0, 0, 1, 1, 1])
    ranks = torch.tensor([0.0, 1.0, 0.5, 1.0, 0.0, 0.5], dtype=torch.float64)  # within each group of 3
    torch.testing.assert_close(info["rank"], ranks)
    torch.testing.assert_close(rewards, ranks + 0.5 * info["jpeg_compressibility"])
    assert len(info["rank/score"]) == 6  # the rank's own info: the brightness it ranked


def test_start_up_checks_name_what_cannot_score_whole_groups(tmp_path):
    from config.base import get_config
    from ddpo_group.run.trainer import Trainer

    config = get_config("grpo")
    config.sample.batch_size, config.sample.num_batches_per_epoch, config.train.batch_size = 4, 3, 4
    config.train.group_size = 8  # 24 samples on 2 processes: 3 groups, but 12 on each process
    validate_config(config, num_processes=2)  # a pointwise reward: the copies of a prompt may be on both processes
    with pytest.raises(ConfigError, match=r"the groupwise reward_fn='shapes_alignment' needs whole prompt groups on "
                                          r"each of the 2 processes: train.group_size=8 must divide the samples per "
                                          r"process, .* = 4 \* 3 = 12"):
        validate_config(config, num_processes=2, groupwise_reward=True)
    config.train.group_size = 4
    validate_config(config, num_processes=2, groupwise_reward=True)
    config.algorithm.adv_estimator = "group_ppo"
    config.group_ppo.value_source = "tweedie"
    with pytest.raises(ConfigError, match=r"adv_estimator='group_ppo' with group_ppo.value_source='tweedie' scores "
                                          r"each step's one-step prediction alone"):
        validate_config(config, groupwise_reward=True)
    config = get_config("remax")
    config.logdir, config.reward_fn = str(tmp_path), "rank"
    config.reward_fn_kwargs.reward_fn = "jpeg_compressibility"
    with pytest.raises(ConfigError, match=r"reward_fn='rank' is groupwise .*adv_estimator='remax' scores one greedy "
                                          r"sample per group"):
        Trainer(config)  # the built reward tells: refused before any model loads


def test_the_base_against_fine_tuned_evaluation_scores_a_prompts_images_of_both_models_as_one_group():
    from ddpo_group.rewards.combine import make_combined_reward
    from ddpo_group.offline.comparison import score_both

    rank = make_combined_reward("rank", {"reward_fn": BRIGHTNESS})
    base, tuned = grey_images([0.2, 0.6, 0.4, 0.4]), grey_images([0.8, 0.4, 0.2, 0.6])  # 2 prompts x 2 seeds
    prompts = ["a", "a", "b", "b"]
    base_scores, tuned_scores = score_both(rank, base, tuned, prompts, [{}] * 4, num_seeds=2)
    # prompt a: 0.2, 0.6 (base) and 0.8, 0.4 (tuned) ranked together; prompt b: 0.4, 0.4 and 0.2, 0.6
    assert base_scores["reward"].tolist() == pytest.approx([0.0, 2 / 3, 0.5, 0.5])
    assert tuned_scores["reward"].tolist() == pytest.approx([1.0, 1 / 3, 0.0, 1.0])
    plain = make_combined_reward({"jpeg_compressibility": 1.0})  # a pointwise reward scores each model's images
    base_plain, _ = score_both(plain, base, tuned, prompts, [{}] * 4, num_seeds=2)
    torch.testing.assert_close(base_plain["reward"], plain(base, prompts, [{}] * 4)[0])
