"""A reward plugin for the guard's tests: each image's mean absolute pixel difference from the image at its position
in the first batch the function scored (0 for that batch): an evaluation's held-out reward that rises as the weights
move away from the ones that drew its first images."""

import torch


def make_distance_from_first():
    first = []

    def fn(images, prompts, metadata):
        images = images.detach().float().cpu()
        if not first:
            first.append(images.clone())
        return (images - first[0][: len(images)]).abs().flatten(1).mean(dim=1).double(), {}

    return fn
