import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "OMP_NUM_THREADS" not in os.environ:  # an explicit count is kept: the suite must pass with 1, 2 and 4 threads
    torch.set_num_threads(min(2, torch.get_num_threads()))

from tiny_pipeline import build_tiny_pipeline, save_tiny_pipeline  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Stable Diffusion checkpoint on disk, loaded through from_pretrained like a real one."""
    return save_tiny_pipeline(tmp_path_factory.mktemp("tiny_sd") / "model")


@pytest.fixture
def tiny_pipe():
    return build_tiny_pipeline()
