"""Chat completions of an OpenAI-compatible endpoint (vLLM, SGLang, a hosted API) through the ``openai`` client: what
the judges that ask a vision-language model about images share (the VLM judge server, servers/vlm_judge.py, and the
pairwise judge ``vlm`` of pairwise.py). ``pip install "ddpo_group[judge]"`` installs the client.

A request is one user message: the images as PNG data URLs, then the question, at temperature 0. The API key is the
``api_key`` given, else the OPENAI_API_KEY variable, else ``EMPTY`` (a local vLLM or SGLang server checks none).

Failures: the client retries a connection error, a timeout, HTTP 408, 409, 429 and 5xx ``retries`` times (the
``openai`` client's backoff); what still fails, and HTTP 401 / 403, raises JudgeUnavailable (a RewardUnavailable: the
trainer does not score the images one by one to find a culprit); any other HTTP error raises RuntimeError naming the
endpoint, the status and the start of the answer.
"""

from __future__ import annotations

import base64
import math
import os
import re

from ddpo_group.rewards.base import RewardUnavailable


class JudgeUnavailable(RewardUnavailable):
    """The endpoint stayed unreachable, silent or failing through the client's retries, or refused the API key."""


def require_openai():
    try:
        import openai
    except ImportError as error:
        raise ImportError("the VLM judges talk to their endpoint through the openai client: "
                          "pip install 'ddpo_group[judge]' (or pip install openai)") from error
    return openai


def png_data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def answer_word(token: str) -> str:
    """A top token as a bare lower-case word or number: ' Yes.' -> 'yes', ' 2' -> '2'."""
    return re.sub(r"[^a-z0-9]", "", token.lower())


def label_probability(top_logprobs: list[dict], first: str, second: str) -> float | None:
    """P(first) / (P(first) + P(second)) over a generated token's top logprobs ({"token", "logprob"} each), a token
    counting for a label when it reads as it (answer_word); None when neither label appears."""
    p_first = sum(math.exp(t["logprob"]) for t in top_logprobs if answer_word(t["token"]) == first)
    p_second = sum(math.exp(t["logprob"]) for t in top_logprobs if answer_word(t["token"]) == second)
    return p_first / (p_first + p_second) if p_first + p_second > 0 else None


class ChatEndpoint:
    """An OpenAI-compatible chat endpoint serving ``model``; ``ask(pngs, text, ...)`` -> the first choice."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = 120.0,
                 retries: int = 2, who: str = "VLM judge"):
        if not str(base_url).startswith(("http://", "https://")):
            raise ValueError(f"{who}: base_url={base_url!r} must be the endpoint's http(s) address, e.g. "
                             "http://HOST:8000/v1")
        self.url = str(base_url).rstrip("/") + "/chat/completions"
        self.model, self.who = model, who
        self.openai = require_openai()
        key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.client = self.openai.OpenAI(base_url=str(base_url), api_key=key, timeout=timeout, max_retries=retries)

    def ask(self, pngs: list[bytes], text: str, max_tokens: int, top_logprobs: int | None = None):
        """One chat completion: the images, then ``text``; with ``top_logprobs``, the generated tokens' top logprobs.
        Returns the first choice (``.message.content``, ``.logprobs``)."""
        content = [{"type": "image_url", "image_url": {"url": png_data_url(png)}} for png in pngs]
        content.append({"type": "text", "text": text})
        params = {"max_tokens": max_tokens}
        if top_logprobs is not None:
            params.update(logprobs=True, top_logprobs=top_logprobs)
        openai = self.openai
        try:
            completion = self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": content}], temperature=0.0, **params)
        except openai.APIStatusError as error:
            detail = str(error.message)[:300]
            if error.status_code in (401, 403, 408, 409, 429) or error.status_code >= 500:  # retried, or the key
                raise JudgeUnavailable(f"{self.who}: endpoint {self.url} answered HTTP {error.status_code}: "
                                       f"{detail}") from None
            raise RuntimeError(f"{self.who}: endpoint {self.url} answered HTTP {error.status_code}: {detail}") from None
        except openai.APIConnectionError as error:
            raise JudgeUnavailable(f"{self.who}: endpoint {self.url} not reachable or silent ({error}); is it "
                                   "running?") from None
        return completion.choices[0]

    def first_token_top_logprobs(self, choice, mode: str) -> list[dict]:
        """The first generated token's top logprobs as {"token", "logprob"} dicts; an error when the endpoint gave
        none (``mode`` names the judge's mode that needs them)."""
        content = getattr(choice.logprobs, "content", None) or []
        if not content:
            raise RuntimeError(f"{self.who}: endpoint {self.url} returned no logprobs; mode={mode!r} needs an endpoint "
                               "that supports logprobs/top_logprobs (vLLM does)")
        return [{"token": t.token, "logprob": t.logprob} for t in (content[0].top_logprobs or [])]
