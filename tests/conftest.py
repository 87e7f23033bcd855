import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "OMP_NUM_THREADS" not in os.environ:  # an explicit count is kept: the suite must pass with 1, 2 and 4 threads
    # the cores shared among pytest-xdist's workers (-n auto: one a core, so one thread each; two threads a worker on
    # two cores made the tiny runs 1.3 to 2.7 times slower while the other worker ran), at most 2
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, min(2, torch.get_num_threads() // workers)))

from ddpo_group.models.tiny_random import TINY_BUILDERS, build_tiny_pipeline, save_pipeline  # noqa: E402
from helpers.processor_without_video import allow_a_processor_without_video  # noqa: E402

allow_a_processor_without_video()  # Qwen-Image-Edit's processor on a machine without torchvision (its docstring)


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """accelerate keeps one state per process: each test builds its own Accelerator, on the device it asks for."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield


@pytest.fixture(autouse=True)
def no_reward_curve_in_this_process(monkeypatch):
    """Runs in the test process leave reward_curve.png undrawn: a draw is 0.38 s, more than half of a matrix run's
    epoch, and no test reads the curve of an in-process run (a plotting error is only printed; a started process's
    run draws it: test_short_run_artifacts_lora_export_and_evaluate reads it, test_plots draws the figure)."""
    from ddpo_group.run.reporting import epoch_logger

    monkeypatch.setattr(epoch_logger, "plot_reward_curve", lambda *args, **kwargs: None)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` need a GPU: skipped (with the reason) on a machine without one. Under pytest-xdist (the
    README's test command, the GPU check's suite) the tests marked ``slow`` go first, in their order: with work stealing
    (``--dist worksteal``) the long ones start early and the quick ones fill the gaps, instead of a long one started
    last ending the run alone."""
    if hasattr(config, "workerinput"):  # an xdist worker: its collection is the order the controller hands out
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


class TinyModelDirs(dict):
    """{family: directory} of the tiny random pipelines of models/tiny_random.py's TINY_BUILDERS, each built and saved
    like a checkpoint the first time a test asks for it (a new family needs no fixture here)."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, name: str) -> str:
        self[name] = save_pipeline(TINY_BUILDERS[name](), self.tmp_path_factory.mktemp(f"tiny_{name}") / "model")
        return self[name]


@pytest.fixture(scope="session")
def family_model_dirs(tmp_path_factory):
    return TinyModelDirs(tmp_path_factory)


@pytest.fixture
def tiny_pipe():
    return build_tiny_pipeline()


@pytest.fixture(scope="session")
def tiny_model_dir(family_model_dirs):
    """A tiny random Stable Diffusion checkpoint on disk, loaded through from_pretrained like a real one."""
    return family_model_dirs["sd"]


@pytest.fixture(scope="session")
def tiny_sd3_dir(family_model_dirs):
    """A tiny random SD3 checkpoint (no T5) on disk."""
    return family_model_dirs["sd3"]


@pytest.fixture(scope="session")
def tiny_flux_dir(family_model_dirs):
    """A tiny random FLUX.1-dev-style checkpoint (guidance embedding) on disk."""
    return family_model_dirs["flux"]


@pytest.fixture(scope="session")
def tiny_sdxl_dir(family_model_dirs):
    """A tiny random Stable Diffusion XL checkpoint (two text encoders, the "text_time" added embedding) on disk."""
    return family_model_dirs["sdxl"]


@pytest.fixture(scope="session")
def tiny_zimage_dir(family_model_dirs):
    """A tiny random Z-Image checkpoint (a Qwen3 text encoder, a locally built tokenizer with its chat template)."""
    return family_model_dirs["zimage"]


@pytest.fixture(scope="session")
def tiny_flux_kontext_dir(family_model_dirs):
    """A tiny random FLUX.1 Kontext checkpoint (the tiny FLUX.1's components) on disk."""
    return family_model_dirs["flux_kontext"]


@pytest.fixture(scope="session")
def tiny_flux2_dir(family_model_dirs):
    """A tiny random FLUX.2 [klein] checkpoint (step-distilled, like klein-4B / 9B) on disk."""
    return family_model_dirs["flux2"]


@pytest.fixture(scope="session")
def tiny_flux2_dev_dir(family_model_dirs):
    """A tiny random FLUX.2 [dev] checkpoint (Mistral3 text encoder, guidance embedding) on disk."""
    return family_model_dirs["flux2_dev"]


@pytest.fixture(scope="session")
def tiny_wan_dir(family_model_dirs):
    """A tiny random Wan2.1 text-to-video checkpoint (UMT5, the released models' UniPC scheduler) on disk."""
    return family_model_dirs["wan"]


@pytest.fixture(scope="session")
def tiny_qwenimage_dir(family_model_dirs):
    """A tiny random Qwen-Image checkpoint (a Qwen2.5-VL text encoder, a locally built Qwen2 tokenizer) on disk."""
    return family_model_dirs["qwenimage"]


@pytest.fixture(scope="session")
def tiny_krea2_dir(family_model_dirs):
    """A tiny random Krea 2 checkpoint (a Qwen3-VL text model, a locally built Qwen tokenizer) on disk."""
    return family_model_dirs["krea2"]


@pytest.fixture(scope="session")
def tiny_qwenimage_edit_plus_dir(family_model_dirs):
    """A tiny random Qwen-Image-Edit-Plus checkpoint (Qwen2.5-VL with its vision tower and its processor) on disk."""
    return family_model_dirs["qwenimage_edit_plus"]


@pytest.fixture(scope="session")
def tiny_qwenimage_edit_dir(family_model_dirs):
    """A tiny random Qwen-Image-Edit checkpoint (one source image; the Plus checkpoint's components) on disk."""
    return family_model_dirs["qwenimage_edit"]
