"""The example reward servers (VLM judge, GenEval) through the trainer's HTTP client, against stub backends.

Everything listens on 127.0.0.1 only; the stub OpenAI-compatible endpoint answers a bounded number
of requests and shuts itself down after a deadline, whatever the test does.
"""

import json
import math
import random

import numpy as np
import pytest
import torch
from helpers.openai_stub import StubOpenAI, completion, decode_data_url, serve
from PIL import Image

from ddpo_group.prompts import PromptSampler
from ddpo_group.rewards import make_reward_fn
from ddpo_group.rewards.http_client import RewardServerError
from ddpo_group.rewards.http_server import make_server
from ddpo_group.rewards.servers.geneval import load_geneval, make_geneval_reward, score_result
from ddpo_group.rewards.servers.vlm_judge import OpenAIJudge, make_vlm_reward, score_of_answer, yes_probability


def images_8bit(n, seed=0):
    torch.manual_seed(seed)
    return (torch.rand(n, 3, 16, 16) * 255).round() / 255


def answer_from_prompt(body, with_logprobs):
    """The stub VLM's answer, from the prompt in the question: "cat" prompts are judged a match, "void" prompts get an
    answer the judge cannot parse."""
    text = body["messages"][0]["content"][1]["text"]
    if body.get("logprobs"):
        # "cat" prompts: P(Yes)+P( yes) = 0.5+0.1, P(No) = 0.3 -> 2/3; "void" prompts: no yes/no token
        if "void" in text:
            top = [{"token": "Maybe", "logprob": math.log(0.9)}]
        elif "cat" in text:
            top = [{"token": "Yes", "logprob": math.log(0.5)}, {"token": "No", "logprob": math.log(0.3)},
                   {"token": " yes", "logprob": math.log(0.1)}, {"token": "The", "logprob": math.log(0.05)}]
        else:
            top = [{"token": "No", "logprob": math.log(0.8)}, {"token": "Yes.", "logprob": math.log(0.2)}]
        return completion(top[0]["token"], top if with_logprobs else None)
    return completion("I cannot rate this." if "void" in text else ("Score: 7" if "cat" in text else "3/10"))


@pytest.fixture
def stub_openai():
    stubs = []

    def start(with_logprobs=True):
        stubs.append(StubOpenAI(lambda body: answer_from_prompt(body, with_logprobs)))
        return stubs[-1]

    yield start
    for stub in stubs:
        stub.stop()


@pytest.fixture
def reward_server():
    stops = []

    def start(fn):
        server = make_server(fn, "127.0.0.1", 0)
        stops.append(serve(server))
        return f"http://127.0.0.1:{server.server_port}/score"

    yield start
    for stop in stops:
        stop()


def test_answer_parsing_by_hand():
    top = [{"token": "Yes", "logprob": math.log(0.5)}, {"token": " yes", "logprob": math.log(0.1)},
           {"token": "NO.", "logprob": math.log(0.3)}, {"token": "Yesterday", "logprob": math.log(0.05)}]
    assert yes_probability(top) == pytest.approx(0.6 / 0.9)  # "Yesterday" is not "yes"
    assert yes_probability([{"token": "Maybe", "logprob": 0.0}]) is None
    assert score_of_answer("Score: 7", 10) == pytest.approx(0.7)
    assert score_of_answer("8.5 out of 10", 10) == pytest.approx(0.85)
    assert score_of_answer("12", 10) == 1.0 and score_of_answer("-2", 10) == 0.0  # clipped to [0, 1]
    assert score_of_answer("no idea", 10) is None


@pytest.mark.parametrize("mode", ["yes_prob", "score"])
def test_vlm_judge_through_the_http_client(stub_openai, reward_server, mode):
    stub = stub_openai()
    judge = OpenAIJudge(stub.base_url, "stub-vl-model", mode=mode, api_key="sk-test", max_workers=3, fallback=0.25)
    url = reward_server(make_vlm_reward(judge))
    client = make_reward_fn("http", url=url, batch_size=2, timeout=10, retries=0)
    images = images_8bit(5)
    prompts = ["a cat", "a dog", "a cat", "the void", "a dog"]
    rewards, info = client(images, prompts, [{}] * 5)

    if mode == "yes_prob":
        expected = [0.6 / 0.9, 0.2 / 1.0, 0.6 / 0.9, 0.25, 0.2]
    else:
        expected = [0.7, 0.3, 0.7, 0.25, 0.3]  # "Score: 7", "3/10" -> the first number / 10
    torch.testing.assert_close(rewards, torch.tensor(expected, dtype=torch.float64))
    assert info["parsed"].tolist() == [1.0, 1.0, 1.0, 0.0, 1.0]  # the void answer fell back

    # the contract with the endpoint: one request per image, the image itself as a PNG data URL
    assert len(stub.requests) == 5
    by_prompt = {}
    for body in stub.requests:
        assert body["model"] == "stub-vl-model" and body["temperature"] == 0.0
        image_part, text_part = body["messages"][0]["content"]
        assert image_part["type"] == "image_url" and text_part["type"] == "text"
        by_prompt.setdefault(text_part["text"], []).append(decode_data_url(image_part["image_url"]["url"]))
        if mode == "yes_prob":
            assert body["max_tokens"] == 1 and body["logprobs"] is True and body["top_logprobs"] == 20
    assert set(by_prompt) == {judge.question.format(prompt=p, max_score="10") for p in prompts}
    for prompt, sent in zip(prompts, images):
        question = judge.question.format(prompt=prompt, max_score="10")
        assert any(torch.equal(received, sent) for received in by_prompt[question])  # 8-bit exact round trip
    assert all(h.get("authorization") == "Bearer sk-test" for h in stub.headers)


def test_vlm_judge_errors_reach_the_trainer(stub_openai, reward_server):
    stub = stub_openai(with_logprobs=False)
    url = reward_server(make_vlm_reward(OpenAIJudge(stub.base_url, "m", mode="yes_prob")))
    client = make_reward_fn("http", url=url, retries=0, timeout=10)
    with pytest.raises(RewardServerError, match=r"HTTP 500 .*returned no logprobs; mode='yes_prob' needs"):
        client(images_8bit(1), ["a cat"], [{}])
    bad = OpenAIJudge(stub.base_url.replace("/v1", "/v2"), "m", mode="score")  # a wrong path: the endpoint's 404
    with pytest.raises(RuntimeError, match=r"answered HTTP 404"):
        make_vlm_reward(bad)(images_8bit(1), ["a cat"], [{}])
    with pytest.raises(ValueError, match=r"mode='logits' must be one of"):
        OpenAIJudge(stub.base_url, "m", mode="logits")
    with pytest.raises(ValueError, match=r"must contain \{prompt\}"):
        OpenAIJudge(stub.base_url, "m", question="Is it good?")


# ---------------------------------------------------------------- GenEval
TWO_OBJECT = {"tag": "two_object", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}],
              "prompt": "a photo of a cat and a dog"}
COLOR = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}],
         "exclude": [{"class": "car", "count": 2}], "prompt": "a photo of a red car"}


class StubGenEval:
    """Stands for GenEval's evaluate_images module: checks the file it is given, fails clauses by image brightness."""

    def __init__(self):
        self.calls = []

    def evaluate_image(self, filepath, metadata):
        image = np.asarray(Image.open(filepath).convert("RGB"))
        self.calls.append((image, metadata))
        # dark images fail their first include clause, and the exclude clause when there is one
        reason = []
        if image.mean() < 128:
            reason.append(f"expected {metadata['include'][0]['class']}>=1, found 0")
            reason += [f"expected {e['class']}<{e['count']}, found 3" for e in metadata.get("exclude", [])]
        return {"filename": filepath, "tag": metadata["tag"], "prompt": metadata["prompt"], "correct": not reason,
                "reason": "\n".join(reason)}


@pytest.mark.parametrize("reward", ["strict", "partial"])
def test_geneval_server_through_the_http_client(reward_server, reward):
    geneval = StubGenEval()
    client = make_reward_fn("http", url=reward_server(make_geneval_reward(geneval, reward)), batch_size=3, timeout=10,
                            retries=0)
    images = torch.stack([torch.full((3, 8, 8), v) for v in (0.9, 0.1, 0.9, 0.1)])
    images[0, :, 0, 0] = 0.2  # a distinct pixel, to check the file holds the image sent
    prompts = [TWO_OBJECT["prompt"], TWO_OBJECT["prompt"], COLOR["prompt"], COLOR["prompt"]]
    metadata = [TWO_OBJECT, TWO_OBJECT, COLOR, COLOR]
    rewards, info = client(images, prompts, metadata)
    assert info["correct"].tolist() == [1.0, 0.0, 1.0, 0.0]
    if reward == "strict":
        assert rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    else:  # two_object dark: 1 of 2 clauses failed; colors dark: 2 of 2 (include + exclude) failed
        assert rewards.tolist() == [1.0, 0.5, 1.0, 0.0]
    assert [m for _, m in geneval.calls] == metadata  # GenEval's metadata passed through as sent
    first = torch.from_numpy(geneval.calls[0][0].copy()).permute(2, 0, 1).float() / 255
    torch.testing.assert_close(first, (images[0] * 255).round() / 255)


def test_geneval_rejects_prompts_without_its_metadata_and_names_missing_installs(reward_server, tmp_path):
    client = make_reward_fn("http", url=reward_server(make_geneval_reward(StubGenEval())), retries=0, timeout=10)
    with pytest.raises(RewardServerError, match=r"metadata of prompt 'a cat' is \{\}; it must be GenEval's"):
        client(images_8bit(1), ["a cat"], [{}])
    with pytest.raises(FileNotFoundError, match=r"geneval_dir='.*nowhere' has no evaluation/evaluate_images.py"):
        load_geneval(tmp_path / "nowhere", tmp_path)
    (tmp_path / "geneval" / "evaluation").mkdir(parents=True)
    (tmp_path / "geneval" / "evaluation" / "evaluate_images.py").write_text("import mmdet_not_installed_here\n")
    with pytest.raises(ImportError, match=r"GenEval's stack is not importable here .*mmdet_not_installed_here"):
        load_geneval(tmp_path / "geneval", tmp_path)
    assert score_result({"correct": True, "reason": ""}, {"include": []}, "partial") == (1.0, 1.0)


def test_geneval_prompt_function_draws_metadata_lines(tmp_path):
    path = tmp_path / "evaluation_metadata.jsonl"
    path.write_text(json.dumps(TWO_OBJECT) + "\n\n" + json.dumps(COLOR) + "\n")
    sampler = PromptSampler("ddpo_group.rewards.servers.geneval:geneval_prompts", {"path": str(path)}, seed=0)
    prompts, metadata = sampler.sample(20)
    assert {p for p in prompts} == {TWO_OBJECT["prompt"], COLOR["prompt"]}
    assert all(m == (TWO_OBJECT if p == TWO_OBJECT["prompt"] else COLOR) for p, m in zip(prompts, metadata))
    from ddpo_group.rewards.servers.geneval import geneval_prompts

    with pytest.raises(FileNotFoundError, match=r"path='' must be GenEval's"):
        geneval_prompts(random.Random(0))
