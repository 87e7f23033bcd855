"""The HTTP reward client against real local servers on 127.0.0.1 (http.server in a thread)."""

import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from ddpo_group.rewards import RewardUnavailable, make_reward_fn
from ddpo_group.rewards.http_client import (
    TOKEN_ENV, RewardServerError, RewardServerUnavailable, images_to_png, png_to_images,
)
from ddpo_group.rewards.http_server import make_server
from ddpo_group.rollout.reward_scorer import RewardScorer
from helpers.tolerances import reordered_sum_atol


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


def attempt_bound(timeout, retries, backoff):
    """The documented bound on a batch's seconds: every attempt waits its timeout, every backoff is slept."""
    return (retries + 1) * timeout + backoff * (2**retries - 1)


SLACK_S = 1.0  # thread start-up, PNG encoding, a loaded machine


class Scripted(BaseHTTPRequestHandler):
    """A server that misbehaves as its ``script`` says: script(attempt, handler) answers the 0-based attempt."""

    script = None
    attempts: list = []

    def do_POST(self):  # noqa: N802
        self.attempts.append(time.perf_counter())
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        try:
            type(self).script(len(self.attempts) - 1, self, body)
        except OSError:  # the client gave up and closed the connection
            pass

    def reply(self, code: int, data: bytes, content_type: str = "application/json"):
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def scripted(script):
    """A handler class (its own attempt list) running ``script(attempt, handler, body)``."""
    return type("Handler", (Scripted,), {"script": staticmethod(script), "attempts": []})


def ok(attempt, handler, body):
    handler.reply(200, json.dumps({"rewards": [7.0] * len(body["images"])}).encode())


def test_a_server_that_is_not_running_is_retried_with_backoff_then_named():
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    fn = make_reward_fn("http", url=url, retries=2, retry_backoff=0.2, timeout=1)
    start = time.perf_counter()
    with pytest.raises(RewardServerUnavailable) as caught:
        fn(torch.rand(1, 3, 4, 4), ["a"], [{}])
    elapsed = time.perf_counter() - start
    assert 0.2 + 0.4 <= elapsed < 0.6 + SLACK_S  # refused at once: the two backoffs, 0.2 then 0.4 s
    message = str(caught.value)
    assert re.fullmatch(
        rf"reward server {url}: 3 attempts failed over (\d+\.\d) s: not reachable \(.*Connection refused\); is it "
        r"running\? start it \(e\.g\. python -m ddpo_group\.rewards\.http_server\) or fix reward_fn_kwargs\.url",
        message,
    ), message
    assert float(re.search(r"over (\S+) s", message).group(1)) >= 0.6  # the seconds it names are the seconds it took
    assert isinstance(caught.value, RewardUnavailable)  # the trainer does not score the images one by one again


def test_a_silent_server_ends_each_attempt_at_the_timeout(serve):
    def silent(attempt, handler, body):
        time.sleep(1.5)
        handler.reply(200, b'{"rewards": [1.0]}')

    handler = scripted(silent)
    served = serve(handler)
    fn = make_reward_fn("http", url=served.url, timeout=0.3, retries=2, retry_backoff=0.05)
    start = time.perf_counter()
    with pytest.raises(RewardServerUnavailable, match=rf"^reward server {served.url}: 3 attempts failed over "
                                                      r"\d+\.\d s: no answer within timeout=0\.3 s; raise "
                                                      r"reward_fn_kwargs\.timeout or check the server$"):
        fn(torch.rand(1, 3, 4, 4), ["a"], [{}])
    elapsed = time.perf_counter() - start
    assert len(handler.attempts) == 3
    assert attempt_bound(0.3, 2, 0.05) <= elapsed < attempt_bound(0.3, 2, 0.05) + SLACK_S  # 1.05 s and not 4.5


def trickle_bytes(handler, data: bytes, every_s: float = 0.1) -> None:
    for byte in data:  # never silent for the 0.5 s timeout
        handler.wfile.write(bytes([byte]))
        handler.wfile.flush()
        time.sleep(every_s)


@pytest.mark.parametrize("part", ["status line", "headers", "body"])
def test_an_answer_trickling_in_ends_at_the_timeout_whatever_part_trickles(serve, part):
    """One byte every 0.1 s, for 20 s, of the status line, of a header, or of the body: each of the 2 attempts ends at
    its 0.5 s timeout (a socket timeout alone bounds each wait for a byte, not the attempt)."""
    def trickle(attempt, handler, body):
        if part == "status line":
            trickle_bytes(handler, b"HTTP/1.1 200 OK" + b" " * 200)
            return
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        if part == "headers":
            handler.flush_headers()
            trickle_bytes(handler, b"X-Slow: " + b"a" * 200)
            return
        handler.send_header("Content-Length", "200")
        handler.end_headers()
        trickle_bytes(handler, b" " * 200)

    handler = scripted(trickle)
    fn = make_reward_fn("http", url=serve(handler).url, timeout=0.5, retries=1, retry_backoff=0.05)
    start = time.perf_counter()
    with pytest.raises(RewardServerUnavailable, match=r"2 attempts failed over 1\.\d s: no answer within timeout=0\.5 s"):
        fn(torch.rand(1, 3, 4, 4), ["a"], [{}])
    assert attempt_bound(0.5, 1, 0.05) <= time.perf_counter() - start < attempt_bound(0.5, 1, 0.05) + SLACK_S
    assert len(handler.attempts) == 2


def test_a_server_dying_mid_request_is_retried(serve):
    def dies_once(attempt, handler, body):
        if attempt == 0:
            handler.close_connection = True  # gone without an answer, as a killed process
            return
        ok(attempt, handler, body)

    handler = scripted(dies_once)
    fn = make_reward_fn("http", url=serve(handler).url, retries=1, retry_backoff=0.01, timeout=2)
    rewards, _ = fn(torch.rand(2, 3, 4, 4), ["a", "b"], [{}, {}])
    assert rewards.tolist() == [7.0, 7.0] and len(handler.attempts) == 2

    def cut_once(attempt, handler, body):
        if attempt == 0:  # killed in the middle of its answer: 20 of the 100 bytes announced
            handler.send_response(200)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", "100")
            handler.end_headers()
            handler.wfile.write(b'{"rewards": [1.0, 2.0')
            handler.close_connection = True
            return
        ok(attempt, handler, body)

    handler = scripted(cut_once)
    fn = make_reward_fn("http", url=serve(handler).url, retries=1, retry_backoff=0.01, timeout=2)
    rewards, _ = fn(torch.rand(2, 3, 4, 4), ["a", "b"], [{}, {}])
    assert rewards.tolist() == [7.0, 7.0] and len(handler.attempts) == 2

    always = scripted(lambda attempt, handler, body: setattr(handler, "close_connection", True))
    served = serve(always)
    fn = make_reward_fn("http", url=served.url, retries=2, retry_backoff=0.01, timeout=2)
    with pytest.raises(RewardServerUnavailable, match=rf"^reward server {served.url}: 3 attempts failed over 0\.\d s: "
                                                      r"the connection failed \(RemoteDisconnected: "):
        fn(torch.rand(1, 3, 4, 4), ["a"], [{}])
    assert len(always.attempts) == 3


def test_http_500_is_retried_with_backoff_then_named(serve):
    handler = scripted(lambda attempt, handler, body: handler.reply(500, b'{"error": "CUDA error: device lost"}'))
    served = serve(handler)
    fn = make_reward_fn("http", url=served.url, retries=3, retry_backoff=0.1, timeout=2)
    start = time.perf_counter()
    with pytest.raises(RewardServerUnavailable, match=rf"^reward server {served.url}: 4 attempts failed over "
                                                      r"\d+\.\d s: HTTP 500 \(Internal Server Error\): "
                                                      r'\{"error": "CUDA error: device lost"\}$'):
        fn(torch.rand(1, 3, 4, 4), ["a"], [{}])
    assert 0.1 + 0.2 + 0.4 <= time.perf_counter() - start < 0.7 + SLACK_S  # the backoff doubles: not 3 x 0.1 s
    assert len(handler.attempts) == 4


def test_server_errors_are_retried_and_4xx_fails_at_once(serve):
    def flaky(attempt, handler, body):
        if body["prompts"][0] == "bad":
            handler.reply(422, b'{"error": "prompt \'bad\' refused"}')
        elif attempt == 0:
            handler.reply(503, b'{"error": "warming up"}')
        else:
            ok(attempt, handler, body)

    handler = scripted(flaky)
    served = serve(handler)
    fn = make_reward_fn("http", url=served.url, retries=2, retry_backoff=0.01, timeout=2)
    rewards, _ = fn(torch.rand(2, 3, 4, 4), ["a", "b"], [{}, {}])
    assert rewards.tolist() == [7.0, 7.0] and len(handler.attempts) == 2  # one 503, then success
    with pytest.raises(RewardServerError, match=rf"^reward server {served.url}: 1 attempt failed over 0\.\d s: HTTP 422 "
                                                r".*prompt 'bad' refused.* \(not retried: not a transient failure\)$") \
            as caught:
        fn(torch.rand(1, 3, 4, 4), ["bad"], [{}])
    assert len(handler.attempts) == 3 and not isinstance(caught.value, RewardUnavailable)


@pytest.mark.parametrize("answer, message", [
    (b'{"rewards": [1.0, 2.', r"answered a body that is not a JSON/msgpack object \(Content-Type 'application/json'\): "
                             r".*; first bytes: b'\{\"rewards\": \[1\.0, 2\.'"),
    (b"<html>proxy error</html>", r"answered a body that is not a JSON/msgpack object .*<html>proxy error"),
    (b'{"scores": [1.0, 2.0]}', r"answered without 'rewards' \(keys: \['scores'\]\)"),
    (b'{"rewards": [1.0, 2.0, 3.0]}', r"returned \(3,\) rewards for a batch of 2 images"),
    (b'{"rewards": [1.0]}', r"returned \(1,\) rewards for a batch of 2 images"),
    (b'{"rewards": [1.0, NaN]}', r"returned non-finite rewards at indices \[1\]: \[nan\]"),
    (b'{"rewards": [Infinity, 0.5]}', r"returned non-finite rewards at indices \[0\]: \[inf\]"),
    (b'{"rewards": ["good", "bad"]}', r"answered rewards that are not numbers .*good"),
])
def test_answers_that_break_the_protocol_fail_at_once(serve, answer, message):
    handler = scripted(lambda attempt, handler, body: handler.reply(200, answer))
    served = serve(handler)
    fn = make_reward_fn("http", url=served.url, retries=3, retry_backoff=1.0, timeout=2)
    start = time.perf_counter()
    with pytest.raises(RewardServerError, match=rf"^reward server {served.url} {message}") as caught:
        fn(torch.rand(2, 3, 4, 4), ["a", "b"], [{}, {}])
    assert time.perf_counter() - start < 1.0  # a retry would sleep 1 s first
    assert len(handler.attempts) == 1 and not isinstance(caught.value, RewardUnavailable)


def test_a_wrong_count_from_the_bundled_server(serve):
    served = serve(lambda images, prompts, metadata: (torch.ones(len(prompts) + 1), {}))
    fn = make_reward_fn("http", url=served.url, retries=0)
    with pytest.raises(RewardServerError, match=r"returned \(3,\) rewards for a batch of 2 images"):
        fn(torch.rand(2, 3, 4, 4), ["a", "b"], [{}, {}])


def test_an_unreachable_server_is_not_asked_again_image_by_image(serve):
    handler = scripted(lambda attempt, handler, body: handler.reply(503, b"overloaded"))
    scorer = RewardScorer(make_reward_fn("http", url=serve(handler).url, retries=1, retry_backoff=0.01, timeout=2), "http")
    with pytest.raises(RuntimeError, match=r"^reward function 'http' raised RewardServerUnavailable: reward server "
                                           r".*: 2 attempts failed over 0\.\d s: HTTP 503 .*overloaded$"):
        scorer(torch.rand(4, 3, 4, 4), ["a", "b", "c", "d"], [{}] * 4)
    assert len(handler.attempts) == 2  # not 2 + 4 x 2: one image at a time would fail alike


def test_bad_settings_name_the_value():
    with pytest.raises(ValueError, match=r"url='' must be an http"):
        make_reward_fn("http")
    with pytest.raises(ValueError, match=r"format='xml' must be one of"):
        make_reward_fn("http", url="http://127.0.0.1:1", format="xml")
    for bad in ({"retries": -1}, {"timeout": 0}, {"retry_backoff": -0.5}, {"batch_size": 0}):
        (key, value), = bad.items()
        with pytest.raises(ValueError, match=rf"{key}={value} "):
            make_reward_fn("http", url="http://127.0.0.1:1", **bad)


# ---------------------------------------------------------------- the shared token
TOKEN = "tok-3f9c2a7e51"


def test_the_bundled_server_refuses_requests_without_its_token(serve, monkeypatch):
    calls = []

    def counting(images, prompts, metadata):
        calls.append(len(prompts))
        return mean_reward(images, prompts, metadata)

    served = Served(make_server(counting, "127.0.0.1", 0, token=TOKEN))
    try:
        monkeypatch.delenv(TOKEN_ENV, raising=False)
        fn = make_reward_fn("http", url=served.url, retries=3, retry_backoff=1.0, timeout=2)
        start = time.perf_counter()
        with pytest.raises(RewardServerUnavailable, match=r": 1 attempt failed over 0\.\d s: HTTP 401 \(Unauthorized\): "
                                                          r".*missing or wrong bearer token.*the server wants the shared "
                                                          r"token: set DDPO_REWARD_TOKEN in the trainer's environment"):
            fn(torch.rand(1, 3, 4, 4), ["a"], [{}])
        assert time.perf_counter() - start < 1.0  # not retried

        monkeypatch.setenv(TOKEN_ENV, "tok-wrong")
        with pytest.raises(RewardServerUnavailable, match=r"HTTP 401 .*the token in DDPO_REWARD_TOKEN is not the server's") \
                as caught:
            make_reward_fn("http", url=served.url, retries=0)(torch.rand(1, 3, 4, 4), ["a"], [{}])
        assert "tok-wrong" not in str(caught.value)
        assert calls == []  # the reward never ran for a refused request

        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        rewards, info = make_reward_fn("http", url=served.url, retries=0)(torch.rand(2, 3, 4, 4), ["a", "bb"], [{}, {}])
        assert calls == [2] and info["length"].tolist() == [1.0, 2.0]

        monkeypatch.delenv(TOKEN_ENV)
        monkeypatch.setenv("MY_JUDGE_TOKEN", TOKEN)  # another variable, for a second server
        make_reward_fn("http", url=served.url, retries=0, token_env="MY_JUDGE_TOKEN")(torch.rand(1, 3, 4, 4), ["a"], [{}])
        assert calls == [2, 1]
    finally:
        served.close()


def test_a_token_in_reward_fn_kwargs_is_refused_without_being_shown():
    with pytest.raises(ValueError, match=r"reward_fn_kwargs\.token is not accepted .*config\.json.*set the environment "
                                         r"variable DDPO_REWARD_TOKEN") as caught:
        make_reward_fn("http", url="http://127.0.0.1:1", token=TOKEN)
    assert TOKEN not in str(caught.value)


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
