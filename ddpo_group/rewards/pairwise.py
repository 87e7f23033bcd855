"""Groupwise rewards (rewards/base.py's ``is_groupwise``): each image's reward from the images of its prompt group.

``win_rate`` (Pref-GRPO, arXiv:2508.20751): each image's share of wins against the group's other images under a
pairwise judge. For a group of G images, the judge is asked once per pair i < j (image i shown first):

    P(i beats j) = p(i, j),   P(j beats i) = 1 - p(i, j)
    w_i = 1/(G - 1) * sum_{j != i} P(i beats j)                        in [0, 1]; a group of one image: 1/2

With ``both_orders`` the judge is also asked (j, i), and P(i beats j) = (p(i, j) + 1 - p(j, i)) / 2, which cancels a
judge's preference for the first or the second position (twice the requests). Every group's mean win rate is 1/2: the
reward says which images of a group are better, not how good the group is (the evaluation's mean is 1/2 too; its
``reward_info`` entries, e.g. the judge ``reward``'s ``score``, are absolute: the reward declares it as its
``pointwise_score``, which the guard reads where the mean says nothing; a VLM judge has none).

``rank``: the rank of each image's reward within its group, scaled to [0, 1], ties sharing their mean rank:

    r_i = (#{j: s_j < s_i} + #{j != i: s_j = s_i} / 2) / (G - 1)        a group of one image: 1/2

with s the rewards of ``reward_fn`` (``reward_fn_kwargs``: any reward, a combination too). It is the win rate under
the judge ``reward`` at temperature 0 of the same reward, in one reward call per group and no pairs; only the
order of the rewards within the group reaches the advantage, not their spread.

Pairwise judges (``win_rate``'s ``judge``: a name below, or a plugin ``"package.module:factory"`` /
``"/path/file.py:factory"``): a factory ``make(**judge_kwargs)`` returns
``judge(images, prompts, metadata, pairs) -> (p, info)``, ``pairs`` a list of (i, j) rows of the group, ``p`` one
number per pair, P(image i beats image j) in [0, 1], and ``info`` entries of one value per image to log (``pair_means``
averages per-pair values over each image's comparisons).

* ``reward``: from any reward function (``reward_fn``, ``reward_fn_kwargs``), each image scored once:
  P(i beats j) = 1 if s_i > s_j, 1/2 if s_i = s_j, 0 if s_i < s_j; with ``temperature`` T > 0 the Bradley-Terry
  probability sigmoid((s_i - s_j) / T). info: ``score`` (s).
* ``vlm``: a vision-language model behind an OpenAI-compatible endpoint (vLLM, SGLang, a hosted API; through the
  ``openai`` client, rewards/openai_chat.py), shown both images and the prompt in one chat completion per pair:
  ``mode="answer"`` (default, as Pref-GRPO's UnifiedReward-Think judge) reads the last of ``answers`` (default
  "Image 1 is better", "Image 2 is better") in its answer, after any <think>...</think> block: 1 or 0;
  ``mode="prob"`` asks for "1" or "2" and reads the first token's top logprobs: P(1) / (P(1) + P(2)). An answer with
  neither gives 1/2 (a tie), and ``info["parsed"]`` (the share of an image's comparisons that were parsed) shows it.
  Pairs are asked concurrently (``max_workers``), which lets the server batch them.
"""

from __future__ import annotations

import itertools
import re
from concurrent.futures import ThreadPoolExecutor

import torch

from ddpo_group.registry import Registry
from ddpo_group.rewards import check_rewards, make_reward_fn, register_reward
from ddpo_group.rewards.base import GROUPWISE_ATTRIBUTE, POINTWISE_SCORE_ATTRIBUTE

PAIRWISE_JUDGES = Registry("pairwise judge")
register_judge = PAIRWISE_JUDGES.register


def groupwise(fn):
    """Mark ``fn`` a groupwise reward function (called once per prompt group)."""
    setattr(fn, GROUPWISE_ATTRIBUTE, True)
    return fn


def pair_wins(p: torch.Tensor, pairs: list[tuple[int, int]], size: int) -> torch.Tensor:
    """W [size, size]: W[i, j] = the mean over the judge's answers on {i, j} of P(i beats j), from ``p`` [len(pairs)]
    = P(first beats second) of each asked pair; W[i, j] + W[j, i] = 1 for every asked pair."""
    wins = torch.zeros(size, size, dtype=torch.float64)
    asked = torch.zeros(size, size, dtype=torch.float64)
    for (i, j), value in zip(pairs, p.tolist()):
        wins[i, j] += value
        wins[j, i] += 1.0 - value
        asked[i, j] += 1
        asked[j, i] += 1
    return wins / asked.clamp(min=1)


def win_rates(wins: torch.Tensor) -> torch.Tensor:
    """w_i = sum_{j != i} W[i, j] / (G - 1) (module docstring); 1/2 for a group of one."""
    size = wins.shape[0]
    if size == 1:
        return torch.full((1,), 0.5, dtype=torch.float64)
    return (wins.sum(1) - wins.diagonal()) / (size - 1)


def normalized_ranks(scores: torch.Tensor) -> torch.Tensor:
    """r_i = (#{j: s_j < s_i} + #{j != i: s_j = s_i} / 2) / (G - 1) (module docstring); 1/2 for a group of one."""
    s = scores.double()
    if len(s) == 1:
        return torch.full((1,), 0.5, dtype=torch.float64)
    below = (s[None, :] < s[:, None]).sum(1).double()
    ties = (s[None, :] == s[:, None]).sum(1).double() - 1
    return (below + ties / 2) / (len(s) - 1)


def judge_probabilities(p, count: int, judge: str) -> torch.Tensor:
    """A judge's output as float64 [count] in [0, 1]; a clear error otherwise."""
    p = check_rewards(p, count, f"pairwise judge {judge}")
    bad = ((p < 0) | (p > 1)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"pairwise judge {judge!r} returned probabilities outside [0, 1] at pairs {bad}: "
                         f"{p[bad].tolist()}")
    return p


def pair_means(values, pairs: list[tuple[int, int]], size: int) -> torch.Tensor:
    """Per-pair ``values`` [len(pairs)] averaged over each image's comparisons: [size] float64 (0 for an image in no
    pair); a judge's per-image info from its answers."""
    index = torch.tensor([k for pair in pairs for k in pair], dtype=torch.long)
    values = torch.as_tensor(values, dtype=torch.float64).repeat_interleave(2)
    total = torch.zeros(size, dtype=torch.float64).index_add_(0, index, values)
    return total / torch.bincount(index, minlength=size).clamp(min=1)


@register_reward("win_rate")
def win_rate(judge: str = "vlm", judge_kwargs: dict | None = None, both_orders: bool = False):
    """Each image's share of wins against its group's others under a pairwise judge (module docstring; groupwise)."""
    factory = PAIRWISE_JUDGES.resolve(judge)
    kwargs = dict(judge_kwargs.to_dict() if hasattr(judge_kwargs, "to_dict") else judge_kwargs or {})
    try:
        compare = factory(**kwargs)
    except TypeError as error:
        raise TypeError(f"win_rate: judge {judge!r} does not accept judge_kwargs {kwargs}: {error}") from None

    @groupwise
    def fn(images, prompts, metadata):
        size = len(prompts)
        pairs = list(itertools.combinations(range(size), 2))
        if both_orders:
            pairs += [(j, i) for i, j in pairs]
        if not pairs:
            return win_rates(torch.zeros(1, 1, dtype=torch.float64)), {}
        p, info = compare(images, prompts, metadata, pairs)
        p = judge_probabilities(p, len(pairs), judge)
        return win_rates(pair_wins(p, pairs, size)), info

    fn.pointwise_score = getattr(compare, POINTWISE_SCORE_ATTRIBUTE, None)  # the judge's own score, if it has one
    return fn


@register_reward("rank")
def rank(reward_fn="", reward_fn_kwargs: dict | None = None):
    """The rank of each image's ``reward_fn`` reward within its group, in [0, 1] (module docstring; groupwise)."""
    score = _inner_reward("rank", reward_fn, reward_fn_kwargs)

    @groupwise
    def fn(images, prompts, metadata):
        s, info = score(images, prompts, metadata)
        return normalized_ranks(s), info

    fn.pointwise_score = "score"  # the ranked reward's own score (rewards/base.py's pointwise_score)
    return fn


def _inner_reward(who: str, reward_fn, reward_fn_kwargs):
    """``fn(images, prompts, metadata) -> (s [B] float64, {**its info, "score": s})`` of the reward ``reward_fn``."""
    if not reward_fn:
        raise ValueError(f"{who} needs reward_fn, the reward whose scores it compares: a name, a path or "
                         "{name: weight}, e.g. {\"reward_fn\": \"shapes_alignment\"}")
    kwargs = reward_fn_kwargs.to_dict() if hasattr(reward_fn_kwargs, "to_dict") else dict(reward_fn_kwargs or {})
    spec = reward_fn.to_dict() if hasattr(reward_fn, "to_dict") else reward_fn
    inner = make_reward_fn(spec, **kwargs)
    name = str(spec)

    def score(images, prompts, metadata):
        s, info = inner(images, prompts, metadata)
        s = check_rewards(s, len(prompts), name)
        return s, {**(info or {}), "score": s}

    return score


@register_judge("reward")
def reward_judge(reward_fn="", reward_fn_kwargs: dict | None = None, temperature: float = 0.0):
    """P(i beats j) from the rewards of ``reward_fn``: a hard comparison, or sigmoid((s_i - s_j) / temperature)."""
    if not temperature >= 0:
        raise ValueError(f"pairwise judge 'reward': temperature={temperature!r} must be >= 0 (0: a hard comparison)")
    score = _inner_reward("pairwise judge 'reward'", reward_fn, reward_fn_kwargs)

    def judge(images, prompts, metadata, pairs):
        s, info = score(images, prompts, metadata)
        first, second = (torch.tensor(side) for side in zip(*pairs))
        difference = s[first] - s[second]
        if temperature > 0:
            p = torch.sigmoid(difference / temperature)
        else:
            p = (torch.sign(difference) + 1) / 2
        return p, info

    judge.pointwise_score = "score"  # each image's reward: the win rate's pointwise score (rewards/base.py)
    return judge


PAIR_QUESTIONS = {
    "answer": 'Both images were generated for the description "{prompt}". Which image matches the description '
              'better and looks better? End your answer with "{first}" or "{second}".',
    "prob": 'Both images were generated for the description "{prompt}". Which image matches the description better '
            "and looks better, the first (1) or the second (2)? Answer 1 or 2.",
}
THINKING = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)


def chosen_image(text: str, answers: tuple[str, str]) -> float | None:
    """1.0 when the last of the two ``answers`` in ``text`` (after any <think>...</think> block, case ignored) is the
    first, 0.0 when it is the second; None when neither occurs."""
    text = THINKING.sub("", text or "").lower()
    positions = [text.rfind(answer.lower()) for answer in answers]
    if max(positions) < 0:
        return None
    return 1.0 if positions[0] > positions[1] else 0.0


@register_judge("vlm")
def vlm_judge(base_url: str = "", model: str = "", mode: str = "answer", question: str | None = None,
              answers: tuple = ("Image 1 is better", "Image 2 is better"), api_key: str | None = None,
              timeout: float = 120.0, retries: int = 2, max_workers: int = 8, max_tokens: int = 512,
              top_logprobs: int = 20):
    """A VLM behind an OpenAI-compatible endpoint, asked about each pair in one chat completion (module docstring)."""
    from ddpo_group.rewards.http_client import images_to_png
    from ddpo_group.rewards.openai_chat import ChatEndpoint, label_probability

    who = "pairwise judge 'vlm'"
    if mode not in PAIR_QUESTIONS:
        raise ValueError(f"{who}: mode={mode!r} must be one of {sorted(PAIR_QUESTIONS)}")
    if not model:
        raise ValueError(f"{who} needs judge_kwargs.model, the model name the endpoint serves")
    answers = tuple(answers)
    if len(answers) != 2 or not all(isinstance(a, str) and a for a in answers) or answers[0] == answers[1]:
        raise ValueError(f"{who}: answers={answers!r} must be two different strings (the first image's, the second's)")
    question = question or PAIR_QUESTIONS[mode]
    if "{prompt}" not in question:
        raise ValueError(f"{who}: the question {question!r} must contain {{prompt}}")
    endpoint = ChatEndpoint(base_url, model, api_key, timeout, retries, who=who)

    def ask(first: bytes, second: bytes, prompt: str) -> float | None:
        text = question.format(prompt=prompt, first=answers[0], second=answers[1])
        if mode == "prob":
            choice = endpoint.ask([first, second], text, max_tokens=1, top_logprobs=top_logprobs)
            return label_probability(endpoint.first_token_top_logprobs(choice, mode), "1", "2")
        return chosen_image(endpoint.ask([first, second], text, max_tokens=max_tokens).message.content, answers)

    def judge(images, prompts, metadata, pairs):
        pngs = images_to_png(images)
        with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(pairs)))) as pool:
            values = list(pool.map(lambda pair: ask(pngs[pair[0]], pngs[pair[1]], prompts[pair[0]]), pairs))
        p = torch.tensor([0.5 if v is None else v for v in values], dtype=torch.float64)
        return p, {"parsed": pair_means([float(v is not None) for v in values], pairs, len(prompts))}

    return judge
