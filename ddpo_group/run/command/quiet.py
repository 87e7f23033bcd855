"""Known-harmless third-party output, silenced by name at the start of a command (scripts/train.py, evaluate.py).

Each entry names the logger and the message it drops, and says why it is harmless; nothing else is filtered.
"""

from __future__ import annotations

import logging

# (logger, the start of the message dropped): why it is harmless
KNOWN_HARMLESS = {
    # without torchvision, transformers maps CLIPImageProcessor / SiglipImageProcessor (imported by diffusers'
    # pipelines, once per process) to their PIL implementations, which the pipelines used before the rename
    ("transformers.utils.import_utils", "requires torchvision (not installed); falling back to"),
    # loading a LoRA exported by this package (evaluate.py): it adapts the UNet only (models/lora_export.py), so the
    # text encoder has no keys, which diffusers reports and calls "safe to ignore"
    ("diffusers.loaders.lora_base", "No LoRA keys associated to CLIPTextModel found"),
}


class _DropMessages(logging.Filter):
    def __init__(self, fragments: list[str]):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


def silence_known_noise() -> None:
    """Install the filters of KNOWN_HARMLESS (idempotent; the loggers need not exist yet: logging creates them)."""
    by_logger: dict[str, list[str]] = {}
    for name, fragment in KNOWN_HARMLESS:
        by_logger.setdefault(name, []).append(fragment)
    for name, fragments in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(fragments))


def one_bar_per_phase() -> None:
    """Loading a pipeline shows diffusers' bar over its components; transformers' bar over one component's weights
    would open inside it (the text encoder), a second bar for the same phase."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
