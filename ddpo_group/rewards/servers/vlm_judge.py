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
The API key, if the endpoint needs one, is read from ``--api_key`` or the OPENAI_API_KEY variable.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from ddpo_group.rewards.http_client import images_to_png

QUESTIONS = {
    "yes_prob": 'Does this image show "{prompt}"? Answer Yes or No.',
    "score": 'How well does this image match the description "{prompt}"? Rate it from 0 to {max_score}, where '
             "{max_score} is a perfect match. Answer with the number only.",
}
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def answer_word(token: str) -> str:
    """A top token as a bare lower-case word: ' Yes.' -> 'yes'."""
    return re.sub(r"[^a-z]", "", token.lower())


def yes_probability(top_logprobs: list[dict]) -> float | None:
    """P(yes) / (P(yes) + P(no)) over the first generated token's top logprobs; None when neither appears."""
    p_yes = sum(math.exp(t["logprob"]) for t in top_logprobs if answer_word(t["token"]) == "yes")
    p_no = sum(math.exp(t["logprob"]) for t in top_logprobs if answer_word(t["token"]) == "no")
    return p_yes / (p_yes + p_no) if p_yes + p_no > 0 else None


def score_of_answer(text: str, max_score: float) -> float | None:
    """The first number in ``text`` / max_score, clipped to [0, 1]; None when there is no number."""
    match = NUMBER.search(text or "")
    return None if match is None else min(max(float(match.group()) / max_score, 0.0), 1.0)


class OpenAIJudge:
    """One chat completion per image against an OpenAI-compatible endpoint; ``judge(png, prompt) -> (reward, parsed)``."""

    def __init__(self, base_url: str, model: str, mode: str = "yes_prob", question: str | None = None,
                 max_score: float = 10.0, api_key: str | None = None, timeout: float = 120.0, max_workers: int = 8,
                 fallback: float = 0.0, top_logprobs: int = 20):
        if mode not in QUESTIONS:
            raise ValueError(f"vlm judge: mode={mode!r} must be one of {sorted(QUESTIONS)}")
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"vlm judge: base_url={base_url!r} must be the endpoint's http(s) address, e.g. http://HOST:8000/v1")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.mode, self.max_score, self.timeout = model, mode, max_score, timeout
        self.question = question or QUESTIONS[mode]
        if "{prompt}" not in self.question:
            raise ValueError(f"vlm judge: the question {self.question!r} must contain {{prompt}}")
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.max_workers, self.fallback, self.top_logprobs = max_workers, fallback, top_logprobs

    def request_body(self, png: bytes, prompt: str) -> dict:
        image_url = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
        text = self.question.format(prompt=prompt, max_score=f"{self.max_score:g}")
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image_url}},
                {"type": "text", "text": text},
            ]}],
            "temperature": 0.0,
        }
        if self.mode == "yes_prob":
            body.update(max_tokens=1, logprobs=True, top_logprobs=self.top_logprobs)
        else:
            body.update(max_tokens=16)
        return body

    def post(self, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            detail = error.read()[:300].decode("utf-8", "replace")
            raise RuntimeError(f"VLM endpoint {self.url} answered HTTP {error.code}: {detail}") from None

    def judge(self, png: bytes, prompt: str) -> tuple[float, bool]:
        choice = self.post(self.request_body(png, prompt))["choices"][0]
        if self.mode == "yes_prob":
            content = (choice.get("logprobs") or {}).get("content") or []
            if not content:
                raise RuntimeError(f"VLM endpoint {self.url} returned no logprobs; mode='yes_prob' needs an endpoint "
                                   "that supports logprobs/top_logprobs (vLLM does), or use mode='score'")
            value = yes_probability(content[0].get("top_logprobs") or [])
        else:
            value = score_of_answer(choice["message"].get("content") or "", self.max_score)
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
    parser.add_argument("--fallback", type=float, default=0.0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args(argv)
    judge = OpenAIJudge(args.base_url, args.model, mode=args.mode, question=args.question, max_score=args.max_score,
                        api_key=args.api_key, timeout=args.timeout, max_workers=args.max_workers, fallback=args.fallback)
    serve(make_vlm_reward(judge), f"VLM judge ({args.model}, {args.mode})", args.host, args.port)


if __name__ == "__main__":
    main()
