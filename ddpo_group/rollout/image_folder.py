"""Supervised fine-tuning's data: a folder of images with their prompts, made into the batch records that the ``sft``
objective's matching update trains on in the run's first ``sft.epochs`` epochs, before reinforcement learning
(run/trainer.py's ``supervised_epoch``).

The folder, ``sft.data_dir``, laid out as diffusers' text-to-image training scripts and the common LoRA data sets are:

* with ``metadata.jsonl`` (Hugging Face's imagefolder layout): one JSON object per image, its ``file_name`` (relative to
  the folder) and its prompt in ``text`` (or ``prompt``); the row's other keys are its metadata, read as a .jsonl
  prompt file's are (prompts.py): ``negative_prompt``, and ``image``, an editing family's source image(s), relative to
  the folder;
* without it: every image (.png, .jpg, .jpeg, .webp, .bmp) with its prompt in the text file of the same stem beside it
  (``cat.png``, ``cat.txt``).

An epoch's rows: ``sample.batch_size * sample.num_batches_per_epoch`` images a process (a rollout epoch's count), taken
in the order of a permutation of the folder drawn for each pass over it from (``seed``, pass): epoch e holds the
positions [e S, (e + 1) S) of the passes laid end to end (S = that count times the processes), process p its p-th
slice. The rows depend on the epoch alone, so a resumed run reads the rows it would have read.

Each image is resized (the smaller scale that covers the run's size, bilinear) and center-cropped to the run's size, as
diffusers' ``train_text_to_image.py`` does, then encoded as the clean state x_clean whose ``decode`` it is
(``family.clean_latents``: the VAE encoder's mean). The record holds x_clean as every step's state (the matching update
reads the final one), the rollout schedule's times, the prompts' condition and advantage 1 in every row: the ``sft``
objective keeps every row, a row's loss the flow-matching (or DDPM) loss at drawn times.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ddpo_group.errors import ConfigError
from ddpo_group.prompts import checked_metadata, json_lines
from ddpo_group.sampling.batch import RolloutBatch

METADATA_FILE = "metadata.jsonl"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
PROMPT_KEYS = ("text", "prompt")  # imagefolder's caption column, or the prompt files' key


def read_folder(path) -> list[tuple[Path, str, dict]]:
    """(image file, prompt, metadata) of every image of the folder ``path`` (module docstring), checked: a missing or
    unreadable file, a missing or empty prompt, a bad row is refused naming the file and the line."""
    folder = Path(path).expanduser()
    if not str(path) or not folder.is_dir():
        raise ConfigError(f"sft.data_dir={str(path)!r} is not a folder: it must hold the images to fine-tune on, with "
                          f"their prompts ({METADATA_FILE}, or a .txt beside each image)")
    metadata_file = folder / METADATA_FILE
    rows = _metadata_rows(metadata_file) if metadata_file.is_file() else _sidecar_rows(folder)
    for file, _, _ in rows:  # an unreadable image stops the run at start, not at its epoch
        _check_image(file)
    if not rows:
        raise ConfigError(f"sft.data_dir={str(path)!r} holds no image with a prompt (images: {', '.join(IMAGE_SUFFIXES)}"
                          f"; prompts: {METADATA_FILE} or a .txt of the same name)")
    return rows


def _metadata_rows(file: Path) -> list[tuple[Path, str, dict]]:
    rows = []
    for where, row in json_lines(file, "sft.data_dir", ConfigError):
        if not isinstance(row, dict) or not isinstance(row.get("file_name"), str):
            raise ConfigError(f"{where}: a row must be a JSON object with 'file_name' (the image, relative to the "
                              "folder) and 'text' (its prompt)")
        image = (file.parent / row.pop("file_name")).resolve()
        prompt = next((row.pop(key) for key in PROMPT_KEYS if key in row), None)
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(f"{where}: the prompt ('text' or 'prompt') is {prompt!r}; it must be a non-empty string")
        if not image.is_file():
            raise ConfigError(f"{where}: file_name {image.name!r} ({image}) does not exist")
        rows.append((image, prompt.strip(), checked_metadata(row, file.parent, where, ConfigError)))
    return rows


def _sidecar_rows(folder: Path) -> list[tuple[Path, str, dict]]:
    rows = []
    for image in sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
        caption = image.with_suffix(".txt")
        if not caption.is_file():
            raise ConfigError(f"sft.data_dir: {image} has no prompt: write it in {caption.name} beside it, or list "
                              f"every image in {METADATA_FILE}")
        prompt = caption.read_text().strip()
        if not prompt:
            raise ConfigError(f"sft.data_dir: {caption} is empty; it must hold the image's prompt")
        rows.append((image.resolve(), prompt, {}))
    return rows


def _check_image(file: Path) -> None:
    from PIL import Image

    try:
        with Image.open(file) as opened:
            opened.verify()
    except Exception as error:
        raise ConfigError(f"sft.data_dir: {file} is not an image PIL can read ({type(error).__name__}: {error})") \
            from None


def load_image(file: Path, height: int, width: int) -> torch.Tensor:
    """[3, height, width] float32 in [0, 1]: RGB, resized by the smaller scale that covers the size (bilinear), then
    center-cropped."""
    from PIL import Image, ImageOps

    with Image.open(file) as opened:
        image = ImageOps.exif_transpose(opened).convert("RGB")  # a photo's orientation tag applied
    scale = max(height / image.height, width / image.width)
    size = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
    image = image.resize(size, Image.BILINEAR)
    left, top = (size[0] - width) // 2, (size[1] - height) // 2
    image = image.crop((left, top, left + width, top + height))
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()


def epoch_rows(epoch: int, folder_size: int, per_process: int, num_processes: int, process: int,
               seed: int) -> list[int]:
    """The folder indices of one process's rows in ``epoch`` (module docstring)."""
    total = per_process * num_processes
    start = epoch * total + process * per_process
    out, passes = [], {}
    for position in range(start, start + per_process):
        number = position // folder_size
        if number not in passes:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + number)  # the same on every process
            passes[number] = torch.randperm(folder_size, generator=generator).tolist()
        out.append(passes[number][position % folder_size])
    return out


class ImageFolderRecords:
    """The batch records of the supervised epochs from ``sft.data_dir`` (module docstring), for ``family`` on this
    process (``process`` of ``num_processes``)."""

    def __init__(self, config, family, num_processes: int = 1, process: int = 0):
        if not family.encodes_images():
            raise ConfigError(
                f"sft.data_dir: the {family.name!r} family does not encode images into its state, so it cannot be "
                "fine-tuned on a folder of images (a video family); fine-tune it on its own best samples instead: "
                "algorithm.objective='sft' (config/recipes.py's sft) without sft.epochs")
        self.rows = read_folder(config.sft.data_dir)
        self.config, self.family = config, family
        self.num_processes, self.process = num_processes, process
        self.per_process = config.sample.batch_size * config.sample.num_batches_per_epoch

    @torch.no_grad()
    def record(self, epoch: int) -> RolloutBatch:
        """This process's record of ``epoch``: its images encoded, their condition, advantage 1 everywhere."""
        config, family = self.config, self.family
        picks = [self.rows[i] for i in epoch_rows(epoch, len(self.rows), self.per_process, self.num_processes,
                                                  self.process, int(config.seed))]
        prompts, metadata = [prompt for _, prompt, _ in picks], [dict(row) for _, _, row in picks]
        height, width = family.height_width
        images = torch.stack([load_image(file, height, width) for file, _, _ in picks])
        size = int(config.sample.batch_size)
        clean = torch.cat([family.clean_latents(images[i : i + size]) for i in range(0, len(images), size)])
        cond = family.condition(prompts, metadata)
        rows, num_steps = len(picks), int(config.sample.num_steps)
        device = next(iter(cond.values())).device
        clean = clean.to(device)
        states = clean.unsqueeze(1).expand(rows, num_steps, *clean.shape[1:])  # x_clean as every step's state
        schedule = family.schedule(num_steps, device)
        times = {key: schedule[key].reshape(1, num_steps).expand(rows, num_steps) for key in family.time_keys}
        return RolloutBatch(
            prompts=prompts, metadata=metadata, cond=cond, latents=states, next_latents=states,
            log_probs=torch.zeros(rows, num_steps, device=device), times=times, images=images,
            rewards=torch.zeros(rows, dtype=torch.float64), reward_info={},
            negative=family.negative_rows(metadata), advantages=torch.ones(rows, num_steps, device=device))
