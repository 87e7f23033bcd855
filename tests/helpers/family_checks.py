"""What the model-family tests (tests/models/test_famil*.py) share: a family on its tiny model, the generators, and
the checks several families make alike (the recorded log-probs scored again, the pipeline's own images, the text
encoder left on its device, a full-size shape's parameter counts)."""

from __future__ import annotations

import torch

from ddpo_group.models import load_family
from ddpo_group.sampling.trajectories import SamplingOptions, TransitionScorer, sample_trajectories
from ddpo_group.update.on_policy import ratio_deviation
from helpers.batch_helpers import batch_of
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_config

PROMPTS = ["a red circle", "a cat", "a blue square on green", "x"]


def family_of(name, model_dir, preset="grpo", **overrides):
    """Family ``name`` on ``model_dir`` under the tiny config of ``preset`` (its FAMILY_OVERRIDES, then
    ``overrides``), and that config."""
    config = tiny_config(preset, model_dir, "unused", **{**FAMILY_OVERRIDES[name], **overrides})
    return load_family(model_dir, config=config), config


def bf16_family_of(name, model_dir, **overrides):
    """``family_of`` in bfloat16: the pipeline loaded in it, as a run with mixed_precision="bf16" loads it."""
    config = tiny_config("grpo", model_dir, "unused",
                         **{**FAMILY_OVERRIDES[name], "mixed_precision": "bf16", **overrides})
    return load_family(model_dir, torch_dtype=torch.bfloat16, config=config), config


def assert_the_float32_state_is_the_pipelines(family, sample, want: torch.Tensor):
    """In bfloat16, a family whose pipeline keeps its state in float32 (``latents_dtype``): our sampler (``sample()``,
    its trajectories) gives the pipeline's own output ``want`` bitwise, and the state rounded to the model's dtype
    every step (``latents_dtype`` None) does not. Returns the trajectories."""
    assert family.model.dtype == torch.bfloat16 and family.latents_dtype == torch.float32
    traj = sample()
    assert torch.equal(traj.images, want.float())
    family.latents_dtype = None  # on the instance: the state rounded to bfloat16 every step
    try:
        rounded = sample()
    finally:
        del family.latents_dtype
    assert not torch.equal(rounded.images, traj.images)
    return traj


def generators(n, offset=0):
    return [torch.Generator().manual_seed(offset + i) for i in range(n)]


def assert_rescored(family, config, traj, batch, steps=None, tolerance=None, chunks=(1, 3, 16)):
    """Score the transitions of ``traj`` (its batch record ``batch``) again under the sampling policy
    (TransitionScorer): the recorded log-probs bitwise in the sampling batch (every row at step n, for n below
    ``steps``, all steps by default) and, with a ``tolerance``, the ratio 1 to within it in chunks of ``chunks``
    (sample, step) pairs (every row at every step, row by row). Returns the scorer."""
    scorer = TransitionScorer.from_config(config, family)
    num_rows, num_steps = traj.log_probs.shape
    with torch.no_grad():
        for n in range(num_steps if steps is None else steps):  # the sampling batch: all rows at step n
            same = scorer(family.model, batch, torch.arange(num_rows), torch.full((num_rows,), n))
            assert torch.equal(same.log_prob, traj.log_probs[:, n]), n
        if tolerance is not None:
            rows = torch.arange(num_rows).repeat_interleave(num_steps)
            columns = torch.arange(num_steps).repeat(num_rows)
            for chunk in chunks:  # the training forward's chunks of (sample, step) pairs
                out = torch.cat([scorer(family.model, batch, rows[c], columns[c]).log_prob
                                 for c in torch.split(torch.arange(len(rows)), chunk)])
                assert float(ratio_deviation(out, traj.log_probs[rows, columns]).max()) < tolerance, chunk
    return scorer


def assert_the_recorded_log_probs_come_back(family, config, cond: dict, tolerance: float, negative=None) -> None:
    """Sample 4 rows of ``cond`` for 4 steps (every step stochastic: no log-prob 0) with ``negative`` (the family's
    negative condition by default; given, the batch record holds it per row) and score the recorded transitions
    again (``assert_rescored``): bitwise in the sampling batch, the ratio 1 to within ``tolerance`` in chunks of 1, 3
    and 16 (sample, step) pairs."""
    sample = config.sample
    traj = sample_trajectories(family, family.model, cond,
                               family.negative_condition() if negative is None else negative,
                               SamplingOptions(4, sample.guidance_scale, family.noise_levels(sample)),
                               generator=generators(4))
    assert bool((traj.log_probs != 0).all())
    batch = batch_of(traj, cond) if negative is None else batch_of(traj, cond, negative=negative)
    assert_rescored(family, config, traj, batch, tolerance=tolerance)


def assert_the_pipelines_images(family, cond, negative, kwargs: dict, guidances=(1.0, 4.0)):
    """At each of ``guidances``, the deterministic sampler (noise level 0, 4 steps) from the same generators gives the
    pipeline's own images of PROMPTS bitwise (its call with ``kwargs``). Returns ({guidance: images}, the last
    trajectory)."""
    images = {}
    for guidance in guidances:
        want = family.pipe(prompt=PROMPTS, num_inference_steps=4, guidance_scale=guidance, generator=generators(4),
                           output_type="pt", **kwargs).images
        traj = sample_trajectories(family, family.model, cond, negative,
                                   SamplingOptions(4, guidance, [0.0] * 4, compute_log_prob=False),
                                   generator=generators(4))
        assert torch.equal(traj.images, want), guidance
        images[guidance] = want
    return images, traj


def assert_the_text_encoder_stays_where_it_is(family) -> None:
    """pretrained.text_encoder_device: one text encoder, which stays on the CPU when the transformer is on the meta
    device, and the condition of PROMPTS (every tensor) moves to the transformer's device with its shapes."""
    from ddpo_group.models.trainable import TEXT_ENCODERS

    assert [name for name in family.pipe.components if name.startswith("text_encoder")] == ["text_encoder"]
    assert "text_encoder" in TEXT_ENCODERS
    on_cpu = family.encode(PROMPTS)
    torch.nn.Module.to(family.pipe.transformer, "meta")
    cond = family.encode(PROMPTS)
    assert family.pipe.text_encoder.device.type == "cpu"
    assert {key: (value.device.type, value.shape) for key, value in cond.items()} == {
        key: ("meta", value.shape) for key, value in on_cpu.items()}


def full_size_on_meta(build):
    """The pipeline ``build()`` makes (a full-size shape of models/full_size.py) on the meta device (no memory, no
    weights), and {component: millions of parameters} of its modules."""
    with torch.device("meta"):
        pipe = build()
    return pipe, {name: sum(p.numel() for p in module.parameters()) / 1e6 for name, module in pipe.components.items()
                  if isinstance(module, torch.nn.Module)}
