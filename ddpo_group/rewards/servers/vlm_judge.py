"""A VLM judge behind an OpenAI-compatible chat endpoint, served as a ddpo_group reward server.

For each (image, prompt) the judge posts one chat completion to ``{base_url}/chat/completions``
with the image as a PNG data URL and a question about the prompt, then scores the answer:

* ``mode="yes_prob"`` (default): the question asks for Yes or No; one token is generated with
  ``logprobs`` and its ``top_logprobs``:

      P(yes) = sum of exp(logprob) over top tokens reading "yes" (case, spaces and punctuation ignored)
      P(no)  = the same for "no"
      reward = P(yes) / (P(yes) + P(no))                                              in [0, 1]

  (the VQAScore-style probability, renormalised over the two answers). An endpoint that returns no
  logprobs is an error: use ``mode="score"`` there.
* ``mode="score"``: the question asks for a rating from 0 to ``max_score``; the first number in the
  answer, divided by ``max_score`` and clipped to [0, 1], is the reward.

An answer with no number (score) or with neither "yes" nor "no" among the top tokens (yes_prob)
gets ``fallback`` (default 0), and ``info["parsed"]`` is 0 for it, so a judge that drifts shows in the
logs as ``reward_info/parsed``. Requests for a batch run concurrently (``max_workers``), which lets
a vLLM server batch them. Run it beside the endpoint::

    python -m ddpo_group.rewards.servers.vlm_judge --base_url http://127.0.0.1:8000/v1 \\
        --model Qwen/Qwen2.5-VL-7B-Instruct --mode yes_prob --port 8001

and train with ``--config.reward_fn=http --config.reward_fn_kwargs='{"url": "http://127.0.0.1:8001"}'``.
The API key, if the endpoint needs one, is read from ``--api_key`` or the OPENAI_API_KEY variable. The requests go
through the ``openai`` client (``pip install "ddpo_group[judge]"``), which retries a failing endpoint ``--retries``
times (rewards/openai_chat.py).
"""

from __future__ import annotations

import argparse
import re
from concurrent.futures import ThreadPoolExecutor

import torch

from ddpo_group.rewards.http_client import images_to_png
from ddpo_group.rewards.openai_chat import ChatEndpoint, label_probability

QUESTIONS = {
    "yes_prob": 'Does this image show "{prompt}"? Answer Yes or No.',
    "score": 'How well does this image match the description "{prompt}"? Rate it from 0 to {max_score}, where '
             "{max_score} is a perfect match. Answer with the number only.",
}
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def yes_probability(top_logprobs: list[dict]) -> float | None:
    """P(yes) / (P(yes) + P(no)) over the first generated token's top logprobs; None when neither appears."""
    return label_probability(top_logprobs, "yes", "no")


def score_of_answer(text: str, max_score: float) -> float | None:
    """The first number in ``text`` / max_score, clipped to [0, 1]; None when there is no number."""
    match = NUMBER.search(text or "")
    return None if match is None else min(max(float(match.group()) / max_score, 0.0), 1.0)


class OpenAIJudge:
    """One chat completion per image against an OpenAI-compatible endpoint (rewards/openai_chat.py: the ``openai``
    client, its retries and errors); ``judge(png, prompt) -> (reward, parsed)``."""

    def __init__(self, base_url: str, model: str, mode: str = "yes_prob", question: str | None = None,
                 max_score: float = 10.0, api_key: str | None = None, timeout: float = 120.0, max_workers: int = 8,
                 fallback: float = 0.0, top_logprobs: int = 20, retries: int = 2):
        if mode not in QUESTIONS:
            raise ValueError(f"vlm judge: mode={mode!r} must be one of {sorted(QUESTIONS)}")
        self.question = question or QUESTIONS[mode]
        if "{prompt}" not in self.question:
            raise ValueError(f"vlm judge: the question {self.question!r} must contain {{prompt}}")
        self.endpoint = ChatEndpoint(base_url, model, api_key, timeout, retries, who="VLM judge")
        self.mode, self.max_score = mode, max_score
        self.max_workers, self.fallback, self.top_logprobs = max_workers, fallback, top_logprobs

    def judge(self, png: bytes, prompt: str) -> tuple[float, bool]:
        text = self.question.format(prompt=prompt, max_score=f"{self.max_score:g}")
        if self.mode == "yes_prob":
            choice = self.endpoint.ask([png], text, max_tokens=1, top_logprobs=self.top_logprobs)
            value = yes_probability(self.endpoint.first_token_top_logprobs(choice, self.mode))
        else:
            choice = self.endpoint.ask([png], text, max_tokens=16)
            value = score_of_answer(choice.message.content or "", self.max_score)
        return (self.fallback, False) if value is None else (value, True)


def make_vlm_reward(judge: OpenAIJudge):
    """The reward function of the server: the judge on each image, concurrently."""

    def fn(images, prompts, metadata):
        pngs = images_to_png(images)
        with ThreadPoolExecutor(max_workers=max(1, min(judge.max_workers, len(pngs)))) as pool:
            results = list(pool.map(judge.judge, pngs, prompts))
        rewards = torch.tensor([r for r, _ in results], dtype=torch.float64)
        return rewards, {"parsed": torch.tensor([float(p) for _, p in results], dtype=torch.float64)}

    return fn


def main(argv=None):
    from ddpo_group.rewards.http_server import serve

    parser = argparse.ArgumentParser(description="Serve an OpenAI-compatible VLM judge as a ddpo_group reward server.")
    parser.add_argument("--base_url", required=True, help="the endpoint, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", required=True, help="the model name the endpoint serves")
    parser.add_argument("--mode", choices=sorted(QUESTIONS), default="yes_prob")
    parser.add_argument("--question", default=None, help="question template with {prompt} (and {max_score})")
    parser.add_argument("--max_score", type=float, default=10.0)
    parser.add_argument("--api_key", default=None, help="default: the OPENAI_API_KEY variable")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--max_workers", type=int, default=8)
    parser.add_argument("--retries", type=int, default=2, help="the openai client's retries of a failing request")
    parser.add_argument("--fallback", type=float, default=0.0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args(argv)
    judge = OpenAIJudge(args.base_url, args.model, mode=args.mode, question=args.question, max_score=args.max_score,
                        api_key=args.api_key, timeout=args.timeout, max_workers=args.max_workers,
                        fallback=args.fallback, retries=args.retries)
    serve(make_vlm_reward(judge), f"VLM judge ({args.model}, {args.mode})", args.host, args.port)


if __name__ == "__main__":
    main()
