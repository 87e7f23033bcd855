"""The HTTP reward client against real local servers on 127.0.0.1 (http.server in a thread)."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from ddpo_group.rewards import make_reward_fn
from ddpo_group.rewards.http_client import RewardServerError, images_to_png, png_to_images
from ddpo_group.rewards.http_server import make_server
from tolerances import reordered_sum_atol


def mean_reward(images, prompts, metadata):
    """Server-side score: pixel mean + the prompt length / 100, and an info value."""
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.float64)
    return images.mean(dim=(1, 2, 3)).double() + lengths / 100, {"length": lengths, "tag": ["x"] * len(prompts)}


class Served:
    def __init__(self, server):
        self.server = server
        self.thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{server.server_port}/score"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve():
    started = []

    def start(handler_or_fn):
        if isinstance(handler_or_fn, type):
            server = ThreadingHTTPServer(("127.0.0.1", 0), handler_or_fn)
        else:
            server = make_server(handler_or_fn, "127.0.0.1", 0)
        started.append(Served(server))
        return started[-1]

    yield start
    for s in started:
        s.close()


def test_png_round_trip_is_8_bit_exact():
    images = (torch.rand(2, 3, 5, 7) * 255).round() / 255
    torch.testing.assert_close(png_to_images(images_to_png(images)), images)


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_client_batches_and_returns_the_servers_rewards(serve, fmt):
    if fmt == "msgpack":
        pytest.importorskip("msgpack")
    calls = []

    def counting(images, prompts, metadata):
        calls.append((len(prompts), [m.get("i") for m in metadata]))
        return mean_reward(images, prompts, metadata)

    served = serve(counting)
    fn = make_reward_fn("http", url=served.url, batch_size=2, format=fmt, timeout=5)
    images = (torch.rand(5, 3, 8, 8) * 255).round() / 255
    prompts = ["a", "bb", "ccc", "dddd", "eeeee"]
    rewards, info = fn(images, prompts, [{"i": i} for i in range(5)])
    expected, _ = mean_reward(images, prompts, None)
    # float32 means over 3 x 8 x 8 pixels, reduced in batches of 2 on the server and of 5 here: another summation
    # order (float64's default tolerance, about 1.6e-7 here, is under 3 float32 ulps of a mean near 0.5)
    torch.testing.assert_close(rewards, expected, rtol=0, atol=reordered_sum_atol(expected, 3 * 8 * 8))
    assert calls == [(2, [0, 1]), (2, [2, 3]), (1, [4])]  # batches of at most 2, in order, metadata passed
    assert info["length"].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert "tag" not in info  # non-numeric info is dropped


def test_server_down_gives_a_clear_error():
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fn = make_reward_fn("http", url=f"http://127.0.0.1:{port}/score", retries=2, retry_backoff=0.01, timeout=1)
    start = time.perf_counter()
    with pytest.raises(RewardServerError, match=rf"127.0.0.1:{port}/score is not reachable .* after 3 attempts: is it running"):
        fn(torch.rand(1, 3, 4, 4), ["a"], [{}])
    assert time.perf_counter() - start < 5


def test_timeout_is_retried_then_reported(serve):
    attempts = []

    class Slow(BaseHTTPRequestHandler):
        def do_POST(self):
            attempts.append(time.perf_counter())
            self.rfile.read(int(self.headers["Content-Length"]))
            time.sleep(0.6)
            try:
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b'{"rewards": [1.0]}')
            except OSError:
                pass

        def log_message(self, *args):
            pass

    served = serve(Slow)
    fn = make_reward_fn("http", url=served.url, timeout=0.2, retries=1, retry_backoff=0.01)
    with pytest.raises(RewardServerError, match=r"did not answer within timeout=0.2s \(2 attempts\)"):
        fn(torch.rand(1, 3, 4, 4), ["a"], [{}])
    assert len(attempts) == 2


def test_server_errors_are_retried_and_4xx_fails_at_once(serve):
    state = {"n": 0}

    class Flaky(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["n"] += 1
            if body["prompts"][0] == "bad":
                code, payload = 422, {"error": "prompt 'bad' refused"}
            elif state["n"] == 1:
                code, payload = 503, {"error": "warming up"}
            else:
                code, payload = 200, {"rewards": [7.0] * len(body["images"])}
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    served = serve(Flaky)
    fn = make_reward_fn("http", url=served.url, retries=2, retry_backoff=0.01, timeout=2)
    rewards, _ = fn(torch.rand(2, 3, 4, 4), ["a", "b"], [{}, {}])
    assert rewards.tolist() == [7.0, 7.0] and state["n"] == 2  # one 503, then success
    with pytest.raises(RewardServerError, match=r"HTTP 422 .* after 1 attempt\(s\): .*prompt 'bad' refused"):
        fn(torch.rand(1, 3, 4, 4), ["bad"], [{}])
    assert state["n"] == 3


def test_wrong_answers_and_bad_settings(serve):
    served = serve(lambda images, prompts, metadata: (torch.ones(len(prompts) + 1), {}))
    fn = make_reward_fn("http", url=served.url, retries=0)
    with pytest.raises(RewardServerError, match=r"returned \(3,\) rewards for a batch of 2 images"):
        fn(torch.rand(2, 3, 4, 4), ["a", "b"], [{}, {}])

    class Html(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"<html>proxy error</html>")

        def log_message(self, *args):
            pass

    html = make_reward_fn("http", url=serve(Html).url, retries=0)
    with pytest.raises(RewardServerError, match=r"not a JSON/msgpack object .*<html>proxy error"):
        html(torch.rand(1, 3, 4, 4), ["a"], [{}])
    with pytest.raises(ValueError, match=r"url='' must be an http"):
        make_reward_fn("http")
    with pytest.raises(ValueError, match=r"format='xml' must be one of"):
        make_reward_fn("http", url="http://127.0.0.1:1", format="xml")


def test_missing_msgpack_fails_clearly(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_msgpack(name, *args, **kwargs):
        if name == "msgpack":
            raise ImportError("No module named 'msgpack'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_msgpack)
    with pytest.raises(ImportError, match=r"pip install 'ddpo_group\[msgpack\]'"):
        make_reward_fn("http", url="http://127.0.0.1:1", format="msgpack")
