"""A minimal OpenAI-compatible endpoint for the judges' tests: POST /v1/chat/completions answered by a function of the
request body, on 127.0.0.1 only, the requests and headers recorded. It answers a bounded number of requests and shuts
itself down after a deadline, whatever the test does."""

from __future__ import annotations

import base64
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch
from PIL import Image

MAX_REQUESTS, DEADLINE_S = 64, 30.0


def serve(server):
    """Serve in a daemon thread; stop after DEADLINE_S at the latest. Returns a stop function."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    timer = threading.Timer(DEADLINE_S, server.shutdown)
    timer.daemon = True
    timer.start()

    def stop():
        timer.cancel()
        server.shutdown()
        server.server_close()

    return stop


def decode_data_url(url: str) -> torch.Tensor:
    assert url.startswith("data:image/png;base64,")
    array = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float() / 255


def completion(content: str, top_logprobs: list[dict] | None = None) -> dict:
    """A chat.completion answer: ``content``, and the first token's ``top_logprobs`` when given."""
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
    if top_logprobs is not None:
        choice["logprobs"] = {"content": [{"token": top_logprobs[0]["token"], "logprob": top_logprobs[0]["logprob"],
                                           "top_logprobs": top_logprobs}]}
    return {"id": "stub", "object": "chat.completion", "choices": [choice]}


class StubOpenAI:
    """/v1/chat/completions answered by ``answer(body) -> completion dict``; other paths get 404, requests past
    MAX_REQUESTS 429."""

    def __init__(self, answer):
        self.requests, self.headers = [], []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if len(stub.requests) >= MAX_REQUESTS or self.path != "/v1/chat/completions":
                    self.send_error(429 if self.path == "/v1/chat/completions" else 404)
                    return
                stub.requests.append(body)
                stub.headers.append({k.lower(): v for k, v in self.headers.items()})  # header names are case-free
                data = json.dumps(answer(body)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_port}/v1"
        self.stop = serve(self.server)
