"""Serve a reward function over HTTP with the protocol of :mod:`ddpo_group.rewards.http_client`.

Wrap your own scorer (runs anywhere, e.g. on a GPU box next to a big reward model)::

    from ddpo_group.rewards.http_server import make_server
    make_server(my_reward_fn, host="0.0.0.0", port=8000).serve_forever()

or serve any reward the trainer knows::

    python -m ddpo_group.rewards.http_server --reward_fn aesthetic --kwargs '{"clip_model_path": "...", "head_path": "..."}'

and train with ``--config.reward_fn=http --config.reward_fn_kwargs='{"url": "http://HOST:8000"}'``.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from ddpo_group.rewards.http_client import FORMATS, decode, encode, format_of, png_to_images


def make_handler(reward_fn):
    """A request handler class answering POSTs with ``reward_fn(images, prompts, metadata)``."""

    lock = threading.Lock()  # one batch at a time through the model

    class RewardHandler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
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

        def _answer(self, code: int, body: bytes, fmt: str):
            self.send_response(code)
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


def make_server(reward_fn, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving) for ``reward_fn``; port 0 picks a free port (``server.server_port``)."""
    return ThreadingHTTPServer((host, port), make_handler(reward_fn))


def main(argv=None):
    parser = argparse.ArgumentParser(description="Serve a ddpo_group reward function over HTTP.")
    parser.add_argument("--reward_fn", default="jpeg_compressibility", help="name, module:factory, or {name: weight}")
    parser.add_argument("--kwargs", default="{}", help="JSON keyword arguments of the reward factory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    from ddpo_group.rewards import make_reward_fn

    server = make_server(make_reward_fn(args.reward_fn, **json.loads(args.kwargs)), args.host, args.port)
    print(f"serving reward {args.reward_fn!r} on http://{args.host}:{server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
