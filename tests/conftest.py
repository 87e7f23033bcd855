import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "OMP_NUM_THREADS" not in os.environ:  # an explicit count is kept: the suite must pass with 1, 2 and 4 threads
    torch.set_num_threads(min(2, torch.get_num_threads()))

from ddpo_group.models.tiny_random import (  # noqa: E402
    build_tiny_flux_kontext_pipeline, build_tiny_flux_pipeline, build_tiny_pipeline, build_tiny_sd3_pipeline,
    build_tiny_sdxl_pipeline, save_pipeline,
)


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """accelerate keeps one state per process: each test builds its own Accelerator, on the device it asks for."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` need a GPU: skipped (with the reason) on a machine without one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Stable Diffusion checkpoint on disk, loaded through from_pretrained like a real one."""
    return save_pipeline(build_tiny_pipeline(), tmp_path_factory.mktemp("tiny_sd") / "model")


@pytest.fixture
def tiny_pipe():
    return build_tiny_pipeline()


@pytest.fixture(scope="session")
def tiny_sd3_dir(tmp_path_factory):
    """A tiny random SD3 checkpoint (no T5) on disk."""
    return save_pipeline(build_tiny_sd3_pipeline(), tmp_path_factory.mktemp("tiny_sd3") / "model")


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory):
    """A tiny random FLUX.1-dev-style checkpoint (guidance embedding) on disk."""
    return save_pipeline(build_tiny_flux_pipeline(), tmp_path_factory.mktemp("tiny_flux") / "model")


@pytest.fixture(scope="session")
def tiny_sdxl_dir(tmp_path_factory):
    """A tiny random Stable Diffusion XL checkpoint (two text encoders, the "text_time" added embedding) on disk."""
    return save_pipeline(build_tiny_sdxl_pipeline(), tmp_path_factory.mktemp("tiny_sdxl") / "model")


@pytest.fixture(scope="session")
def tiny_zimage_dir(tmp_path_factory):
    """A tiny random Z-Image checkpoint (a Qwen3 text encoder, a locally built tokenizer with its chat template)."""
    from ddpo_group.models.tiny_random import build_tiny_zimage_pipeline

    return save_pipeline(build_tiny_zimage_pipeline(), tmp_path_factory.mktemp("tiny_zimage") / "model")


@pytest.fixture(scope="session")
def tiny_flux_kontext_dir(tmp_path_factory):
    """A tiny random FLUX.1 Kontext checkpoint (the tiny FLUX.1's components) on disk."""
    return save_pipeline(build_tiny_flux_kontext_pipeline(), tmp_path_factory.mktemp("tiny_flux_kontext") / "model")


@pytest.fixture(scope="session")
def tiny_qwenimage_dir(tmp_path_factory):
    """A tiny random Qwen-Image checkpoint (a Qwen2.5-VL text encoder, a locally built Qwen2 tokenizer) on disk."""
    from ddpo_group.models.tiny_random import build_tiny_qwenimage_pipeline

    return save_pipeline(build_tiny_qwenimage_pipeline(), tmp_path_factory.mktemp("tiny_qwenimage") / "model")


@pytest.fixture(scope="session")
def family_model_dirs(tiny_model_dir, tiny_sdxl_dir, tiny_sd3_dir, tiny_flux_dir, tiny_zimage_dir,
                      tiny_flux_kontext_dir, tiny_qwenimage_dir):
    return {"sd": tiny_model_dir, "sdxl": tiny_sdxl_dir, "sd3": tiny_sd3_dir, "flux": tiny_flux_dir,
            "zimage": tiny_zimage_dir, "flux_kontext": tiny_flux_kontext_dir, "qwenimage": tiny_qwenimage_dir}
