"""Client for a reward server you run yourself (``reward_fn = "http"``).

Protocol (one POST per batch of at most ``batch_size`` images)::

    request   {"images": [PNG, ...], "prompts": [str, ...], "metadata": [dict, ...]}
    response  {"rewards": [float, ...], "info": {"key": [float, ...], ...}}      ("info" optional)

encoded as JSON (``Content-Type: application/json``, PNGs base64-encoded) or msgpack
(``application/msgpack``, PNGs as raw bytes; needs ``pip install ddpo_group[msgpack]``).
Images are 8-bit RGB PNGs of the [0, 1] images. ``ddpo_group.rewards.http_server`` serves any reward
function with this protocol.

Failures:

* transient (connection refused or reset, no complete answer within ``timeout`` seconds, HTTP 5xx): retried
  ``retries`` times, ``retry_backoff * 2**k`` seconds after the k-th failed attempt (k = 0, 1, ...); then
  RewardServerUnavailable names the URL, the attempts, the seconds they took and the last failure. A batch
  takes at most ``(retries + 1) * timeout + retry_backoff * (2**retries - 1)`` seconds.
* HTTP 4xx, and answers that break the protocol (not JSON / msgpack, no "rewards", a wrong number of them, NaN or
  inf): RewardServerError at once. The server answered, and would answer the same batch the same way; a
  non-finite reward fails the run as it does from any reward function (rewards/base.py: check_rewards).
* HTTP 401 / 403: the token (below) is missing or wrong; RewardServerUnavailable at once.

Shared token: when the environment variable ``token_env`` (default ``DDPO_REWARD_TOKEN``) is set, every request
carries ``Authorization: Bearer <token>``; a server started with the same variable refuses requests without it
(HTTP 401). The token is read from the environment, never from ``reward_fn_kwargs`` (the run saves those in its
config.json), and no message names it. ``https://`` URLs work as they are (TLS in front of the server: docs/rewards.md).
"""

from __future__ import annotations

import base64
import functools
import http.client
import io
import json
import os
import time
import urllib.error
import urllib.request

import numpy as np
import torch
from PIL import Image

from ddpo_group.rewards import RewardUnavailable, register_reward

FORMATS = {"json": "application/json", "msgpack": "application/msgpack"}
TOKEN_ENV = "DDPO_REWARD_TOKEN"  # the environment variable of the shared token, on the server and the trainer


class RewardServerError(RuntimeError):
    """The reward server refused the request or answered something unusable (not retried)."""


class RewardServerUnavailable(RewardServerError, RewardUnavailable):
    """The reward server stayed unreachable, silent or failing (HTTP 5xx) through the retries, or refused the token."""


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
def token_from_environment(name: str = TOKEN_ENV) -> str | None:
    """The shared token in the environment variable ``name`` (None when unset or empty)."""
    return os.environ.get(name) or None


class RewardClient:
    """Posts batches to ``url`` and returns (rewards [B] float64, info {key: [B]})."""

    def __init__(self, url: str, batch_size: int = 16, timeout: float = 60.0, retries: int = 3,
                 retry_backoff: float = 0.5, format: str = "json", token_env: str = TOKEN_ENV):
        if not url or not url.startswith(("http://", "https://")):
            raise ValueError(f"http reward: url={url!r} must be an http:// or https:// address of your reward server")
        if format not in FORMATS:
            raise ValueError(f"http reward: format={format!r} must be one of {sorted(FORMATS)}")
        if format == "msgpack":
            require_msgpack()
        if batch_size < 1 or retries < 0 or not timeout > 0 or not retry_backoff >= 0:
            raise ValueError(
                f"http reward: batch_size={batch_size} must be >= 1, retries={retries} >= 0, timeout={timeout} > 0, "
                f"retry_backoff={retry_backoff} >= 0"
            )
        self.url, self.batch_size, self.timeout = url, batch_size, float(timeout)
        self.retries, self.retry_backoff, self.format = retries, float(retry_backoff), format
        self.token_env = token_env
        self.token = token_from_environment(token_env)  # never in a message, a repr or the run's config

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
        """One batch: the server's rewards [b] (float64) and info tensors, after retries of transient failures."""
        body = encode({"images": images_to_png(images), "prompts": list(prompts), "metadata": list(metadata)}, self.format)
        headers = {"Content-Type": FORMATS[self.format], "Accept": FORMATS[self.format]}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.url, data=body, method="POST", headers=headers)
        attempts = self.retries + 1
        started = time.monotonic()
        for attempt in range(1, attempts + 1):
            refused = False
            try:
                answer, content_type = self.exchange(request)
            except urllib.error.HTTPError as error:
                try:
                    detail = error.read()[:500].decode("utf-8", "replace")
                except (OSError, http.client.HTTPException) as unread:  # the error's body cut short or late
                    detail = f"(its body unread: {type(unread).__name__})"
                failure, transient = f"HTTP {error.code} ({error.reason}): {detail}", error.code >= 500
                refused = error.code in (401, 403)
                if refused:
                    failure += (f"; the server wants the shared token: set {self.token_env} in the trainer's "
                                "environment to the server's" if not self.token else
                                f"; the token in {self.token_env} is not the server's")
            except TimeoutError:  # socket.timeout, or the body still incomplete at the deadline
                failure, transient = self.silent(), True
            except urllib.error.URLError as error:
                if isinstance(error.reason, TimeoutError):
                    failure = self.silent()
                else:
                    failure = (f"not reachable ({error.reason}); is it running? start it (e.g. python -m "
                               "ddpo_group.rewards.http_server) or fix reward_fn_kwargs.url")
                transient = True
            except (OSError, http.client.HTTPException) as error:  # reset, or closed in the middle of its answer
                failure, transient = f"the connection failed ({type(error).__name__}: {error})", True
            else:
                return self.parse(answer, content_type, len(prompts))
            if not transient or attempt == attempts:
                kind = RewardServerUnavailable if transient or refused else RewardServerError
                raise kind(
                    f"reward server {self.url}: {attempt} attempt{'s' if attempt > 1 else ''} failed over "
                    f"{time.monotonic() - started:.1f} s: {failure}"
                    + ("" if transient or attempt == attempts else " (not retried: not a transient failure)")
                ) from None
            time.sleep(self.retry_backoff * 2 ** (attempt - 1))
        raise AssertionError("unreachable")

    def exchange(self, request) -> tuple[bytes, str | None]:
        """One attempt: the answer's body and Content-Type, within ``timeout`` seconds from its start (TimeoutError
        past it), however slowly the server connects, reads the request or sends its status, headers and body."""
        opener = urllib.request.build_opener(*deadline_handlers(time.monotonic() + self.timeout))
        with opener.open(request, timeout=self.timeout) as response:
            chunks = []
            while chunk := response.read1(1 << 16):
                chunks.append(chunk)
            if response.length:  # the connection closed before the Content-Length bytes came
                raise http.client.IncompleteRead(b"".join(chunks), response.length)
            return b"".join(chunks), response.headers.get("Content-Type")

    def silent(self) -> str:
        return f"no answer within timeout={self.timeout:g} s; raise reward_fn_kwargs.timeout or check the server"

    def parse(self, body: bytes, content_type: str | None, n: int):
        """The rewards [n] and info tensors of an answer; RewardServerError for one that breaks the protocol."""
        try:
            payload = decode(body, format_of(content_type))
        except ValueError as error:  # includes JSON and msgpack decoding errors
            raise RewardServerError(
                f"reward server {self.url} answered a body that is not a JSON/msgpack object "
                f"(Content-Type {content_type!r}): {error}; first bytes: {body[:100]!r}"
            ) from None
        if "rewards" not in payload:
            raise RewardServerError(f"reward server {self.url} answered without 'rewards' (keys: {sorted(payload)})")
        try:
            rewards = torch.as_tensor(np.asarray(payload["rewards"], dtype=np.float64))
        except (TypeError, ValueError) as error:
            raise RewardServerError(
                f"reward server {self.url} answered rewards that are not numbers ({error}): {str(payload['rewards'])[:200]}"
            ) from None
        if rewards.shape != (n,):
            raise RewardServerError(
                f"reward server {self.url} returned {tuple(rewards.shape)} rewards for a batch of {n} images"
            )
        bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
        if bad:
            raise RewardServerError(
                f"reward server {self.url} returned non-finite rewards at indices {bad}: {rewards[bad].tolist()}"
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


# ---------------------------------------------------------------- one attempt's deadline
# A socket timeout bounds each wait for the server, not the attempt: a server that sends a byte of its status line,
# headers or body every few seconds would hold an attempt for ever. Every read of an attempt's connection waits at most
# until the attempt's deadline instead, and connecting and sending the request share the same bound.
class _ReadsBefore(io.RawIOBase):
    """The raw reader of a response (the socket's own, ``raw``) whose every read ends by ``deadline``."""

    def __init__(self, raw, sock, deadline: float):
        super().__init__()
        self.raw, self.sock, self.deadline = raw, sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int | None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the answer was still incomplete at the timeout")
        self.sock.settimeout(left)
        return self.raw.readinto(buffer)

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        if not self.closed:
            self.raw.close()  # the socket's reference: urllib closes the connection once the response is closed
        super().close()


class _ResponseBefore(http.client.HTTPResponse):
    """http.client's response, its status line, headers and body read through ``_ReadsBefore``."""

    def __init__(self, sock, *args, deadline: float, **kwargs):
        super().__init__(sock, *args, **kwargs)
        self.fp = io.BufferedReader(_ReadsBefore(self.fp.detach(), sock, deadline))


@functools.cache
def _connection_before(connection_class):
    """``connection_class`` (http.client's HTTP or HTTPS connection) whose connect, request and response end by the
    ``deadline`` its constructor takes."""

    class ConnectionBefore(connection_class):
        def __init__(self, *args, deadline: float, **kwargs):
            super().__init__(*args, **kwargs)
            self.deadline = deadline
            self.response_class = functools.partial(_ResponseBefore, deadline=deadline)

        def connect(self):
            # the socket's timeout: connecting (and TLS's handshake), then sendall's total for the request
            self.timeout = max(self.deadline - time.monotonic(), 1e-3)
            super().connect()

    return ConnectionBefore


class _DeadlineHandler:
    """urllib's HTTP(S) handler opening connections that end by ``deadline`` (time.monotonic())."""

    def __init__(self, deadline: float, **kwargs):
        super().__init__(**kwargs)
        self.deadline = deadline

    def do_open(self, http_class, req, **kwargs):
        return super().do_open(functools.partial(_connection_before(http_class), deadline=self.deadline), req,
                               **kwargs)


class _HTTPBefore(_DeadlineHandler, urllib.request.HTTPHandler):
    pass


class _HTTPSBefore(_DeadlineHandler, urllib.request.HTTPSHandler):
    pass


def deadline_handlers(deadline: float) -> list:
    """The handlers of an opener (``urllib.request.build_opener``) whose requests end by ``deadline``."""
    return [_HTTPBefore(deadline), _HTTPSBefore(deadline)]


@register_reward("http")
def http_reward(url: str = "", batch_size: int = 16, timeout: float = 60.0, retries: int = 3,
                retry_backoff: float = 0.5, format: str = "json", token_env: str = TOKEN_ENV, token=None):
    """Rewards from a user-run server over HTTP (protocol in this module's docstring)."""
    if token is not None:  # reward_fn_kwargs are saved with the run (config.json): no secret there
        raise ValueError(
            f"http reward: reward_fn_kwargs.token is not accepted (the run saves its reward_fn_kwargs in config.json); "
            f"set the environment variable {token_env} of the trainer instead"
        )
    return RewardClient(url, batch_size=batch_size, timeout=timeout, retries=retries, retry_backoff=retry_backoff,
                        format=format, token_env=token_env)
