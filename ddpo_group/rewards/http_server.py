"""Serve a reward function over HTTP with the protocol of :mod:`ddpo_group.rewards.http_client`.

Wrap your own scorer (runs anywhere, e.g. on a GPU box next to a big reward model)::

    from ddpo_group.rewards.http_server import make_server
    make_server(my_reward_fn, host="0.0.0.0", port=8000).serve_forever()

or serve any reward the trainer knows::

    python -m ddpo_group.rewards.http_server --reward_fn aesthetic --kwargs '{"clip_model_path": "...", "head_path": "..."}'

and train with ``--config.reward_fn=http --config.reward_fn_kwargs='{"url": "http://HOST:8000"}'``.

With a shared token (``make_server(..., token=...)``; the command line reads the environment variable
``DDPO_REWARD_TOKEN``, never an argument), a request without ``Authorization: Bearer <token>`` gets HTTP 401;
the trainer sends the token of its own ``DDPO_REWARD_TOKEN``. The token is not printed or logged.
"""

from __future__ import annotations

import argparse
import hmac
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from ddpo_group.rewards.base import is_groupwise
from ddpo_group.rewards.http_client import (
    FORMATS, TOKEN_ENV, decode, encode, format_of, png_to_images, token_from_environment,
)


def make_handler(reward_fn, token: str | None = None):
    """A request handler class answering POSTs with ``reward_fn(images, prompts, metadata)``; with ``token``, only
    those that carry it (``Authorization: Bearer <token>``), the others with HTTP 401."""

    lock = threading.Lock()  # one batch at a time through the model
    expected = f"Bearer {token}".encode() if token else None

    class RewardHandler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            if expected is not None:
                given = (self.headers.get("Authorization") or "").encode()
                if not hmac.compare_digest(given, expected):
                    self.rfile.read(int(self.headers.get("Content-Length", 0)))  # read, so the client gets the answer
                    body = {"error": f"missing or wrong bearer token (the server's {TOKEN_ENV})"}
                    self._answer(401, json.dumps(body).encode(), "json", {"WWW-Authenticate": "Bearer"})
                    return
            try:
                fmt = format_of(self.headers.get("Content-Type"))
                request = decode(self.rfile.read(int(self.headers.get("Content-Length", 0))), fmt)
                images = png_to_images(request["images"])
                prompts = list(request.get("prompts") or [""] * len(images))
                metadata = list(request.get("metadata") or [{} for _ in images])
            except Exception as error:  # a malformed request is the client's fault: 400
                self._answer(400, json.dumps({"error": f"{type(error).__name__}: {error}"}).encode(), "json")
                return
            try:
                with lock:
                    rewards, info = reward_fn(images, prompts, metadata)
                payload = {"rewards": _to_list(rewards), "info": {k: _to_list(v) for k, v in (info or {}).items()}}
                self._answer(200, encode(payload, fmt), fmt)
            except Exception as error:
                self._answer(500, json.dumps({"error": f"{type(error).__name__}: {error}"}).encode(), "json")

        def _answer(self, code: int, body: bytes, fmt: str, headers: dict | None = None):
            self.send_response(code)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", FORMATS[fmt])
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # quiet: the trainer prints its own progress
            pass

    return RewardHandler


def _to_list(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().double().tolist()
    if hasattr(value, "tolist"):
        return value.tolist()
    return list(value)


def make_server(reward_fn, host: str = "127.0.0.1", port: int = 8000, token: str | None = None) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving) for ``reward_fn``; port 0 picks a free port (``server.server_port``).
    With ``token``, requests must carry ``Authorization: Bearer <token>`` (HTTP 401 otherwise). A groupwise reward
    function is refused: the client's batches are not prompt groups (the trainer calls it once per group)."""
    if is_groupwise(reward_fn):
        raise ValueError("a groupwise reward function (groupwise=True) scores a prompt group's images together; the "
                         "HTTP protocol's batches are not groups: give it to the trainer as reward_fn instead")
    return ThreadingHTTPServer((host, port), make_handler(reward_fn, token))


def serve(reward_fn, what: str, host: str, port: int) -> None:
    """Serve ``reward_fn`` until stopped, requiring the token of ``DDPO_REWARD_TOKEN`` when it is set; the line
    printed at the start says what is served, where, and whether a token is required (never which)."""
    token = token_from_environment()
    server = make_server(reward_fn, host, port, token)
    guard = f"requests need the token of ${TOKEN_ENV}" if token else f"no token: set {TOKEN_ENV} to require one"
    print(f"serving {what} on http://{host}:{server.server_port} ({guard})", flush=True)
    server.serve_forever()


def main(argv=None):
    parser = argparse.ArgumentParser(description="Serve a ddpo_group reward function over HTTP.")
    parser.add_argument("--reward_fn", default="jpeg_compressibility", help="name, module:factory, or {name: weight}")
    parser.add_argument("--kwargs", default="{}", help="JSON keyword arguments of the reward factory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    from ddpo_group.rewards import make_reward_fn

    serve(make_reward_fn(args.reward_fn, **json.loads(args.kwargs)), f"reward {args.reward_fn!r}", args.host, args.port)


if __name__ == "__main__":
    main()
