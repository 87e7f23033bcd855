"""transformers' Qwen2VLProcessor and Qwen3VLProcessor without their video processors, for machines without
torchvision (CI's CPU machine).

The processor holds an image processor, a tokenizer and a video processor; the video processor needs torchvision, and
transformers refuses a processor without one. The Qwen-Image-Edit and Qwen-Image 2.1 pipelines send no video, so on a
machine without torchvision the tests build, save and load the processor from its image processor
(``Qwen2VLImageProcessor``, its PIL backend), its tokenizer and (Qwen3-VL) its chat template alone; everything the
pipelines call runs transformers' own code. With torchvision installed nothing is changed."""

from __future__ import annotations

import importlib.util
import os


def allow_a_processor_without_video() -> bool:
    """Patch transformers so that a Qwen2VLProcessor is built, saved and loaded without a video processor when
    torchvision is missing; True when it patched."""
    if importlib.util.find_spec("torchvision") is not None:
        return False
    import transformers
    from transformers import Qwen2Tokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen3VLProcessor, processing_utils

    check = processing_utils.ProcessorMixin.check_argument_for_proper_class

    def check_but_the_video(self, name, argument):
        return None if name == "video_processor" and argument is None else check(self, name, argument)

    def no_video_processor(*args, **kwargs):
        return None

    def from_pretrained(cls, path, *args, subfolder: str = "", **kwargs):
        directory = os.path.join(path, subfolder) if subfolder else path
        return cls(image_processor=Qwen2VLImageProcessor.from_pretrained(directory),
                   tokenizer=Qwen2Tokenizer.from_pretrained(directory), video_processor=None)

    def save_pretrained(self, directory, **kwargs):
        os.makedirs(directory, exist_ok=True)
        self.image_processor.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)

    def from_pretrained_with_template(cls, path, *args, subfolder: str = "", **kwargs):
        directory = os.path.join(path, subfolder) if subfolder else path
        tokenizer = Qwen2Tokenizer.from_pretrained(directory)
        return cls(image_processor=Qwen2VLImageProcessor.from_pretrained(directory), tokenizer=tokenizer,
                   video_processor=None, chat_template=tokenizer.chat_template)

    processing_utils.ProcessorMixin.check_argument_for_proper_class = check_but_the_video
    transformers.Qwen2VLVideoProcessor = no_video_processor
    transformers.Qwen3VLVideoProcessor = no_video_processor
    Qwen2VLProcessor.from_pretrained = classmethod(from_pretrained)
    Qwen2VLProcessor.save_pretrained = save_pretrained
    Qwen3VLProcessor.from_pretrained = classmethod(from_pretrained_with_template)  # its template kept by the tokenizer
    Qwen3VLProcessor.save_pretrained = save_pretrained
    return True
