"""GenEval (Ghosh et al. 2023) as a ddpo_group reward server: object-focused checks of each image.

GenEval detects objects with Mask2Former (mmdetection) and classifies their colours with CLIP,
then checks the prompt's metadata: every ``include`` clause (class, count, optionally colour and
position relative to an earlier clause) must hold and no ``exclude`` clause may. This server runs
GenEval's own ``evaluation/evaluate_images.py`` from a GenEval checkout (it is a script, not a
package: its functions read module globals, set here as its ``__main__`` sets them) on each image:

    strict   reward = 1 if GenEval judges the image correct else 0            (the GenEval metric)
    partial  reward = 1 - failed clauses / clauses                            (denser, for training)

where failed clauses are the lines of GenEval's ``reason`` (one per failed include or exclude
clause). ``info["correct"]`` is the strict value either way.

Each image's metadata must be GenEval's for its prompt (a line of GenEval's
``prompts/evaluation_metadata.jsonl``: ``tag``, ``include``, optional ``exclude``, ``prompt``); the
prompt function :func:`geneval_prompts` of this module draws those lines::

    --config.prompt_fn=ddpo_group.rewards.servers.geneval:geneval_prompts \\
    --config.prompt_fn_kwargs='{"path": "/geneval/prompts/evaluation_metadata.jsonl"}'

GenEval's stack (mmdet 2.x, mmcv-full, open_clip, clip_benchmark, a CUDA GPU, the Mask2Former
checkpoint from its ``evaluation/download_models.sh``) lives in its own environment; this module
imports it only when the server starts. Run there::

    python -m ddpo_group.rewards.servers.geneval --geneval_dir /path/to/geneval \\
        --detector_dir /path/to/geneval/models --port 8002

and train with ``--config.reward_fn=http --config.reward_fn_kwargs='{"url": "http://HOST:8002"}'``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import torch

from ddpo_group.rewards.http_client import images_to_png

REWARDS = ("strict", "partial")
GENEVAL_DEFAULTS = {  # GenEval's defaults for the options of its evaluate_images.py
    "threshold": 0.3, "counting_threshold": 0.9, "max_objects": 16, "max_overlap": 1.0, "position_threshold": 0.1,
}


def load_geneval(geneval_dir, detector_dir, model_config: str | None = None, options: dict | None = None):
    """GenEval's ``evaluate_images`` module with its models loaded and its globals set (needs its stack)."""
    script = Path(geneval_dir).expanduser() / "evaluation" / "evaluate_images.py"
    if not script.is_file():
        raise FileNotFoundError(f"geneval server: geneval_dir={str(geneval_dir)!r} has no evaluation/evaluate_images.py "
                                "(give the root of a GenEval checkout)")
    spec = importlib.util.spec_from_file_location("geneval_evaluate_images", script)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)  # imports mmdet, open_clip, clip_benchmark: the heavy stack
    except ImportError as error:
        raise ImportError(
            f"geneval server: GenEval's stack is not importable here ({error}); run this server in GenEval's "
            "environment (mmdet 2.x, mmcv-full, open_clip_torch, clip-benchmark; see GenEval's README)"
        ) from error
    options = {key: str(value) for key, value in (options or {}).items()}
    if model_config is None:
        import mmdet

        model_config = os.path.join(os.path.dirname(mmdet.__file__),
                                    "../configs/mask2former/mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco.py")
    module.args = SimpleNamespace(model_config=model_config, model_path=str(detector_dir), options=options)
    module.object_detector, (module.clip_model, module.transform, module.tokenizer), module.classnames = \
        module.load_models(module.args)
    module.THRESHOLD = float(options.get("threshold", GENEVAL_DEFAULTS["threshold"]))
    module.COUNTING_THRESHOLD = float(options.get("counting_threshold", GENEVAL_DEFAULTS["counting_threshold"]))
    module.MAX_OBJECTS = int(options.get("max_objects", GENEVAL_DEFAULTS["max_objects"]))
    module.NMS_THRESHOLD = float(options.get("max_overlap", GENEVAL_DEFAULTS["max_overlap"]))
    module.POSITION_THRESHOLD = float(options.get("position_threshold", GENEVAL_DEFAULTS["position_threshold"]))
    return module


def check_metadata(metadata: dict, prompt: str) -> dict:
    if not isinstance(metadata, dict) or "tag" not in metadata or "include" not in metadata:
        raise ValueError(f"geneval: the metadata of prompt {prompt!r} is {metadata!r}; it must be GenEval's "
                         "(tag, include, optional exclude), e.g. from prompt_fn geneval_prompts")
    return {**metadata, "prompt": metadata.get("prompt", prompt)}


def score_result(result: dict, metadata: dict, reward: str) -> tuple[float, float]:
    """(reward, correct) of one GenEval result (``correct`` and ``reason`` fields)."""
    correct = float(bool(result["correct"]))
    if reward == "strict":
        return correct, correct
    clauses = len(metadata.get("include", [])) + len(metadata.get("exclude", []))
    failed = len([line for line in (result.get("reason") or "").splitlines() if line.strip()])
    return (1.0 - min(failed, clauses) / clauses if clauses else correct), correct


def make_geneval_reward(geneval, reward: str = "strict"):
    """The reward function of the server over a loaded GenEval module (anything with ``evaluate_image(path, metadata)``)."""
    if reward not in REWARDS:
        raise ValueError(f"geneval: reward={reward!r} must be one of {REWARDS}")
    lock = threading.Lock()  # GenEval's module globals (colour classifier cache, detector) are not thread-safe

    def fn(images, prompts, metadata):
        metadata = [check_metadata(m, p) for m, p in zip(metadata, prompts)]
        rewards, correct = [], []
        with tempfile.TemporaryDirectory() as directory, lock:
            for i, (png, meta) in enumerate(zip(images_to_png(images), metadata)):
                path = os.path.join(directory, f"{i:05d}.png")  # GenEval reads images from files
                with open(path, "wb") as file:
                    file.write(png)
                r, c = score_result(geneval.evaluate_image(path, meta), meta, reward)
                rewards.append(r)
                correct.append(c)
        return torch.tensor(rewards, dtype=torch.float64), {"correct": torch.tensor(correct, dtype=torch.float64)}

    return fn


@lru_cache(maxsize=4)
def _metadata_lines(path: str) -> tuple[str, ...]:
    lines = tuple(line for line in Path(path).read_text().splitlines() if line.strip())
    if not lines:
        raise ValueError(f"geneval_prompts: {path!r} holds no metadata line")
    return lines


def geneval_prompts(rng: random.Random | None = None, path: str = ""):
    """Prompt function: a random line of GenEval's evaluation_metadata.jsonl -> (its prompt, its metadata)."""
    if not path or not Path(path).expanduser().is_file():
        raise FileNotFoundError(f"geneval_prompts: path={path!r} must be GenEval's prompts/evaluation_metadata.jsonl")
    metadata = json.loads((rng or random).choice(_metadata_lines(str(Path(path).expanduser().resolve()))))
    return metadata["prompt"], metadata


def main(argv=None):
    from ddpo_group.rewards.http_server import serve

    parser = argparse.ArgumentParser(description="Serve GenEval as a ddpo_group reward server (run in GenEval's env).")
    parser.add_argument("--geneval_dir", required=True, help="root of a GenEval checkout")
    parser.add_argument("--detector_dir", required=True, help="folder of the Mask2Former checkpoint (.pth)")
    parser.add_argument("--model_config", default=None, help="mmdet config (default: mmdet's Mask2Former Swin-S)")
    parser.add_argument("--options", default="{}", help="JSON of GenEval's --options (threshold, clip_model, ...)")
    parser.add_argument("--reward", choices=REWARDS, default="strict")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8002)
    args = parser.parse_args(argv)
    geneval = load_geneval(args.geneval_dir, args.detector_dir, args.model_config, json.loads(args.options))
    serve(make_geneval_reward(geneval, args.reward), f"GenEval ({args.reward})", args.host, args.port)


if __name__ == "__main__":
    sys.exit(main())
