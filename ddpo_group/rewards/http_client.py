"""Client for a reward server you run yourself (``reward_fn = "http"``).

Protocol (one POST per batch of at most ``batch_size`` images)::

    request   {"images": [PNG, ...], "prompts": [str, ...], "metadata": [dict, ...]}
    response  {"rewards": [float, ...], "info": {"key": [float, ...], ...}}      ("info" optional)

encoded as JSON (``Content-Type: application/json``, PNGs base64-encoded) or msgpack
(``application/msgpack``, PNGs as raw bytes; needs ``pip install ddpo_group[msgpack]``).
Images are 8-bit RGB PNGs of the [0, 1] images. A failed request (connection refused, timeout,
HTTP 5xx) is retried ``retries`` times, ``retry_backoff * 2**k`` seconds apart; HTTP 4xx fails at
once. ``ddpo_group.rewards.http_server`` serves any reward function with this protocol.
"""

from __future__ import annotations

import base64
import io
import json
import socket
import time
import urllib.error
import urllib.request

import numpy as np
import torch
from PIL import Image

from ddpo_group.rewards import register_reward

FORMATS = {"json": "application/json", "msgpack": "application/msgpack"}


class RewardServerError(RuntimeError):
    """The reward server could not be reached, timed out, or answered something unusable."""


def require_msgpack():
    try:
        import msgpack
    except ImportError as error:
        raise ImportError(
            "format='msgpack' needs the msgpack package: pip install 'ddpo_group[msgpack]' (or use format='json')"
        ) from error
    return msgpack


# ---------------------------------------------------------------- encoding (shared with the server)
def images_to_png(images: torch.Tensor) -> list[bytes]:
    """Images [B, 3, H, W] in [0, 1] -> 8-bit RGB PNG bytes."""
    arrays = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    out = []
    for array in arrays:
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(array)).save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


def png_to_images(pngs: list[bytes]) -> torch.Tensor:
    """PNG bytes -> images [B, 3, H, W] float in [0, 1]."""
    arrays = [np.asarray(Image.open(io.BytesIO(png)).convert("RGB")) for png in pngs]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255.0


def encode(payload: dict, fmt: str) -> bytes:
    """``payload`` as JSON (bytes values base64-encoded, key "images") or msgpack."""
    if fmt == "msgpack":
        return require_msgpack().packb(payload, use_bin_type=True)
    if "images" in payload:
        payload = {**payload, "images": [base64.b64encode(png).decode("ascii") for png in payload["images"]]}
    return json.dumps(payload).encode("utf-8")


def decode(body: bytes, fmt: str) -> dict:
    """Inverse of :func:`encode`."""
    if fmt == "msgpack":
        payload = require_msgpack().unpackb(body, raw=False)
    else:
        payload = json.loads(body.decode("utf-8"))
        if "images" in payload:
            payload["images"] = [base64.b64decode(image) for image in payload["images"]]
    if not isinstance(payload, dict):
        raise ValueError(f"expected a JSON/msgpack object, got {type(payload).__name__}")
    return payload


def format_of(content_type: str | None) -> str:
    content_type = (content_type or "application/json").split(";")[0].strip().lower()
    for fmt, mime in FORMATS.items():
        if content_type == mime:
            return fmt
    raise ValueError(f"unsupported Content-Type {content_type!r}; expected one of {sorted(FORMATS.values())}")


# ---------------------------------------------------------------- client
class RewardClient:
    """Posts batches to ``url`` and returns (rewards [B] float64, info {key: [B]})."""

    def __init__(self, url: str, batch_size: int = 16, timeout: float = 60.0, retries: int = 3,
                 retry_backoff: float = 0.5, format: str = "json"):
        if not url or not url.startswith(("http://", "https://")):
            raise ValueError(f"http reward: url={url!r} must be an http:// or https:// address of your reward server")
        if format not in FORMATS:
            raise ValueError(f"http reward: format={format!r} must be one of {sorted(FORMATS)}")
        if format == "msgpack":
            require_msgpack()
        if batch_size < 1 or retries < 0 or timeout <= 0:
            raise ValueError(
                f"http reward: batch_size={batch_size} must be >= 1, retries={retries} >= 0, timeout={timeout} > 0"
            )
        self.url, self.batch_size, self.timeout = url, batch_size, timeout
        self.retries, self.retry_backoff, self.format = retries, retry_backoff, format

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        rewards, infos = [], []
        for start in range(0, len(prompts), self.batch_size):
            stop = start + self.batch_size
            r, info = self.post(images[start:stop], prompts[start:stop], metadata[start:stop])
            rewards.append(r)
            infos.append(info)
        info = {}
        for key in infos[0] if infos else []:
            if all(key in i for i in infos):
                info[key] = torch.cat([i[key] for i in infos])
        return torch.cat(rewards) if rewards else torch.zeros(0, dtype=torch.float64), info

    def post(self, images, prompts, metadata):
        """One batch: the server's rewards [b] (float64) and info tensors, after retries."""
        body = encode({"images": images_to_png(images), "prompts": list(prompts), "metadata": list(metadata)}, self.format)
        request = urllib.request.Request(
            self.url, data=body, method="POST",
            headers={"Content-Type": FORMATS[self.format], "Accept": FORMATS[self.format]},
        )
        attempts = self.retries + 1
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    body, content_type = response.read(), response.headers.get("Content-Type")
                try:
                    payload = decode(body, format_of(content_type))
                except ValueError as error:  # includes JSON and msgpack decoding errors
                    raise RewardServerError(
                        f"reward server {self.url} answered a body that is not a JSON/msgpack object "
                        f"(Content-Type {content_type!r}): {error}; first bytes: {body[:100]!r}"
                    ) from None
                return self._parse(payload, len(prompts))
            except urllib.error.HTTPError as error:
                detail = error.read()[:500].decode("utf-8", "replace")
                if error.code < 500 or last:
                    raise RewardServerError(
                        f"reward server {self.url} answered HTTP {error.code} ({error.reason}) after {attempt + 1} "
                        f"attempt(s): {detail}"
                    ) from None
            except (socket.timeout, TimeoutError) as error:
                if last:
                    raise RewardServerError(
                        f"reward server {self.url} did not answer within timeout={self.timeout}s "
                        f"({attempts} attempts); raise reward_fn_kwargs.timeout or check the server"
                    ) from error
            except urllib.error.URLError as error:
                if isinstance(error.reason, (socket.timeout, TimeoutError)):
                    if last:
                        raise RewardServerError(
                            f"reward server {self.url} did not answer within timeout={self.timeout}s "
                            f"({attempts} attempts); raise reward_fn_kwargs.timeout or check the server"
                        ) from error
                elif last:
                    raise RewardServerError(
                        f"reward server {self.url} is not reachable ({error.reason}) after {attempts} attempts: "
                        "is it running? start it (e.g. python -m ddpo_group.rewards.http_server) or fix reward_fn_kwargs.url"
                    ) from error
            except (ConnectionError, OSError) as error:  # reset / refused outside urllib's wrapping
                if last:
                    raise RewardServerError(
                        f"reward server {self.url} is not reachable ({error}) after {attempts} attempts: is it running?"
                    ) from error
            time.sleep(self.retry_backoff * 2**attempt)
        raise AssertionError("unreachable")

    def _parse(self, payload: dict, n: int):
        if "rewards" not in payload:
            raise RewardServerError(f"reward server {self.url} answered without 'rewards' (keys: {sorted(payload)})")
        rewards = torch.as_tensor(np.asarray(payload["rewards"], dtype=np.float64))
        if rewards.shape != (n,):
            raise RewardServerError(
                f"reward server {self.url} returned {tuple(rewards.shape)} rewards for a batch of {n} images"
            )
        info = {}
        for key, values in (payload.get("info") or {}).items():
            try:
                value = torch.as_tensor(np.asarray(values, dtype=np.float64))
            except (TypeError, ValueError):
                continue  # non-numeric info is not logged
            if value.shape == (n,):
                info[key] = value
        return rewards, info


@register_reward("http")
def http_reward(url: str = "", batch_size: int = 16, timeout: float = 60.0, retries: int = 3,
                retry_backoff: float = 0.5, format: str = "json"):
    """Rewards from a user-run server over HTTP (protocol in this module's docstring)."""
    return RewardClient(url, batch_size=batch_size, timeout=timeout, retries=retries,
                        retry_backoff=retry_backoff, format=format)
