"""Trajectories with log-probabilities for any model family, and their recomputation for training.

    x_0 = family.initial_latents(...)                    (the pipeline's own noise draw: same generator, same x_T)
    for n in 0..T-1:
        out     = family.model_output(model, x_n, step_n, cond, negative, guidance)
        x_{n+1} = family.step(out, x_n, step_n, noise_n)   (mean + std z, and log N(x_{n+1}; mean, std^2))
    images = family.decode(x_T)

The random generators are consumed as the family's pipeline consumes them (initial latents, then one noise draw
per stochastic step), so with the same generator and a zero noise level both give the same images. A step whose
noise level is 0 (outside an SDE window, or a greedy sample) is the pipeline's deterministic step and records
log-prob 0: it has none and is never trained.

A tree (``branches`` {n: f}, docs/design TREES.md): the B rows are the leaves of B / L roots, L = prod(f), each
root's leaves consecutive. The loop runs on the tree's nodes: a root's leaves share x_0 and every step before the
first branch (one row: one denoiser forward); at a branch step n each node's model output is computed once and f
children draw their own noise for x_n -> x_{n+1}, each with the generator of its first leaf. Every leaf is then
recorded as a full trajectory (a node's tensors repeated for its leaves), and ``shared_from`` [B, T+1] holds, per
leaf and state x_n (n = 0..T), the first leaf of the leaves that share it (transition n is shared by the leaves that
share x_{n+1}).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm


@dataclass
class Trajectories:
    images: torch.Tensor | None  # [B, 3, H, W] in [0, 1], float32 (a video family's frames: [B, F, 3, H, W])
    latents: torch.Tensor  # [B, T+1, ...]: x_0 (noise) .. x_T (final latent)
    log_probs: torch.Tensor  # [B, T]
    steps: dict = field(default_factory=dict)  # the family's per-step tensors ("timesteps", "sigmas", ...), [B, T]
    values: torch.Tensor | None = None  # [B, T] critic values of the pre-step latents, set by the caller
    means: torch.Tensor | None = None  # [B, T, ...] each step's mean mu_n (float32), when asked for (record_means)
    pred_x0: torch.Tensor | None = None  # [B, S, ...] x0_hat(x_n) of the S steps asked for (record_x0), float32
    shared_from: torch.Tensor | None = None  # [B, T+1] a tree's: the first leaf sharing each leaf's state x_n

    @property
    def timesteps(self) -> torch.Tensor:
        return self.steps["timesteps"]


NEGATIVE_PREFIX = "negative_"  # the batch record's per-sample negative condition: negative_<cond key> (e.g.
# negative_prompt_embeds), present when a prompt of the epoch has its own negative prompt (models/families/base.py)


def negative_record(negative: dict | None) -> dict:
    """The batch record's entries of a per-sample negative condition (B rows; none for None: the run's one row)."""
    return {} if negative is None else {NEGATIVE_PREFIX + key: value for key, value in negative.items()}


def recorded_negative(family, batch: dict, rows) -> dict:
    """The negative condition of some rows of a batch record: the recorded per-sample one when the record has it,
    else the run's one row (``family.negative_condition()``)."""
    if NEGATIVE_PREFIX + family.cond_keys[0] in batch:
        return {key: batch[NEGATIVE_PREFIX + key][rows] for key in family.cond_keys}
    return family.negative_condition()


def with_negative_rows(family, batches: list[dict]) -> list[dict]:
    """Batch records that can be pooled row by row: when one of them holds a per-sample negative condition, the
    others get the run's one-row negative repeated for each of their rows (a dynamic-sampling round whose prompts had
    no negative prompt); unchanged when none holds one."""
    key = NEGATIVE_PREFIX + family.cond_keys[0]
    if all(key in batch for batch in batches) or not any(key in batch for batch in batches):
        return batches
    negative = family.negative_condition()
    out = []
    for batch in batches:
        if key not in batch:
            n = batch["latents"].shape[0]
            batch = {**batch, **negative_record({k: v.expand(n, *v.shape[1:]).clone() for k, v in negative.items()})}
        out.append(batch)
    return out


def rows_of(cond: dict, rows) -> dict:
    """The condition of some rows (``rows``: an index tensor or a slice)."""
    return {key: value[rows] for key, value in cond.items()}


def concatenate_rows(conditions: list[dict], prompts: list[str], device) -> dict:
    """One condition of the rows of ``conditions`` (one per prompt); a clear error when their shapes differ (e.g.
    prompts with and without a source image in one batch)."""
    out = {}
    for key in conditions[0]:
        shapes = {tuple(c[key].shape[1:]) for c in conditions}
        if len(shapes) > 1:
            examples = {tuple(c[key].shape[1:]): p for c, p in zip(conditions, prompts)}
            raise ValueError(f"the condition's {key!r} has different shapes for different prompts, {examples} (a "
                             "prompt and its shape): rows with and without a source image, or source images the "
                             "family encodes at different sizes, cannot share a batch")
        out[key] = torch.cat([c[key] for c in conditions]).to(device)
    return out


@torch.no_grad()
def sample_trajectories(
    family,
    model,
    cond: dict,
    negative: dict | None,
    num_steps: int,
    guidance_scale: float,
    noise_levels: list[float],
    generator: torch.Generator | list[torch.Generator] | None = None,
    decode: bool = True,
    progress: bool = False,
    compute_log_prob: bool = True,
    initial_noise: torch.Tensor | None = None,
    log_prob_reduce: str = "mean",
    decode_batch_size: int = 0,
    record_means: bool = False,
    record_x0: list[int] | None = None,
    branches: dict[int, int] | None = None,
) -> Trajectories:
    """Sample B images and record the trajectory: latents [B, T+1, ...], log_probs [B, T], the per-step tensors.

    ``cond`` holds B rows (``family.encode``), ``negative`` one row (``family.negative_condition``) or B
    (``family.negative_rows``: rows with their own negative prompts).
    ``noise_levels`` has one value per step (``family.noise_levels``: an SDE window). ``initial_noise`` [B, ...]
    (standard normal) replaces the x_T drawn from ``generator``, which then draws the step noise only.
    ``decode_batch_size`` > 0 decodes the final latents that many at a time (the VAE's activations at high
    resolution are the sampling phase's peak memory). ``record_means`` keeps each step's mean [B, T, ...] (one more
    latent-sized tensor per step: only a policy loss that needs the rollout policy's means asks for it, ratio_norm).
    ``record_x0`` (step indices) keeps those steps' one-step predictions x0_hat(x_n) [B, S, ...] (GROUP_PPO's Tweedie
    values; every step for a critic that reads x0_hat), only those: one latent-sized tensor per listed step.
    ``branches`` {step: children}: the B rows are a tree's leaves (module docstring), ``generator`` one per leaf.
    """
    first = next(iter(cond.values()))
    batch, device, dtype = first.shape[0], first.device, first.dtype
    schedule = family.schedule(num_steps, device)
    if len(noise_levels) != num_steps:
        raise ValueError(f"noise_levels has {len(noise_levels)} values for {num_steps} steps")
    if compute_log_prob and not any(level > 0 for level in noise_levels):
        raise ValueError(f"noise levels {noise_levels}: every step is deterministic, so no step has a log-probability")
    branches = branches or {}
    size = tree_leaves(branches, batch, noise_levels, generator)  # leaves below each node row
    nodes = torch.arange(0, batch, size, device=device)  # each node row's first leaf
    node_cond, node_negative, node_generator = _node_rows(nodes, size, cond, negative, generator)
    latents = family.initial_latents(len(nodes), node_generator, device, dtype,
                                     initial_noise[nodes.cpu()] if initial_noise is not None else None)
    all_latents, log_probs, means, pred_x0 = [_leaves(latents.float(), size)], [], [], []
    shared = [nodes.repeat_interleave(size)]
    for n in tqdm(range(num_steps), desc="denoising", leave=False, disable=not progress):
        step = {key: values[n] for key, values in schedule.items()}
        output = family.model_output(model, latents, step, node_cond, node_negative, guidance_scale)
        if n in branches:  # each node's children: its output and state repeated, their own noise from here on
            factor = branches[n]
            size //= factor
            nodes = (nodes[:, None] + size * torch.arange(factor, device=device)).flatten()
            output, latents = output.repeat_interleave(factor, 0), latents.repeat_interleave(factor, 0)
            node_cond, node_negative, node_generator = _node_rows(nodes, size, cond, negative, generator)
        stochastic = noise_levels[n] > 0
        out = family.step(output, latents, step, noise_levels[n], generator=node_generator,
                          compute_log_prob=compute_log_prob and stochastic, reduce=log_prob_reduce)
        latents = out.next_latents.to(dtype)
        all_latents.append(_leaves(out.next_latents, size))
        if branches:
            shared.append(nodes.repeat_interleave(size))
        if record_means:
            means.append(_leaves(out.mean, size))
        if record_x0 and n in record_x0:
            pred_x0.append(_leaves(out.pred_x0.float(), size))
        if compute_log_prob:
            log_probs.append(_leaves(out.log_prob, size) if stochastic else torch.zeros(batch, device=device))
    images = None
    if decode:
        images = decode_latents(family, latents, decode_batch_size)
    return Trajectories(
        images=images,
        latents=torch.stack(all_latents, dim=1),
        log_probs=torch.stack(log_probs, dim=1) if compute_log_prob else torch.zeros(batch, num_steps, device=device),
        steps={key: values.to(device).unsqueeze(0).expand(batch, -1).clone() for key, values in schedule.items()},
        means=torch.stack(means, dim=1) if record_means else None,
        pred_x0=torch.stack(pred_x0, dim=1) if pred_x0 else None,
        shared_from=torch.stack(shared, dim=1) if branches else None,
    )


def tree_leaves(branches: dict[int, int], batch: int, noise_levels: list[float], generator) -> int:
    """The leaves below a root, L = prod(children); ValueError when the B rows are not whole roots, a branch is at a
    deterministic step (its children would be equal) or the generators are not one per leaf."""
    leaves = 1
    for n, factor in sorted(branches.items()):
        if not 0 <= n < len(noise_levels) or noise_levels[n] <= 0:
            raise ValueError(f"branch step {n}: a tree branches at a stochastic step, one of "
                             f"{[k for k, level in enumerate(noise_levels) if level > 0]}")
        if factor < 2:
            raise ValueError(f"branch step {n} has {factor} children: a branch has at least 2")
        leaves *= factor
    if batch % leaves:
        raise ValueError(f"{batch} rows are not whole trees of {leaves} leaves (branches {branches})")
    if branches and not isinstance(generator, list | None):
        raise ValueError("a tree draws each leaf's noise from its own generator: pass one generator per row")
    return leaves


def _node_rows(nodes: torch.Tensor, size: int, cond: dict, negative: dict | None, generator):
    """The condition, negative condition and generators of the node rows (``nodes``: each one's first leaf); the
    leaves' own when every node is a leaf."""
    if size == 1:
        return cond, negative, generator
    rows = nodes.cpu()
    one_negative = negative is None or next(iter(negative.values())).shape[0] == 1
    return (rows_of(cond, nodes), negative if one_negative else rows_of(negative, nodes),
            [generator[int(k)] for k in rows] if isinstance(generator, list) else generator)


def _leaves(values: torch.Tensor, size: int) -> torch.Tensor:
    """Per-node ``values`` repeated for the ``size`` leaves below each node."""
    return values if size == 1 else values.repeat_interleave(size, 0)


def decode_latents(family, latents: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """Final latents -> images, ``chunk`` latents at a time (0: all at once). An out-of-memory error (the VAE's
    activations are the sampling phase's peak at high resolution) halves the chunk, for this call and every later
    one (kept on the family as ``decode_chunk``)."""
    chunk = min(chunk or len(latents), getattr(family, "decode_chunk", 0) or len(latents))
    while True:
        try:
            return torch.cat([family.decode(part) for part in latents.split(chunk)])
        except torch.OutOfMemoryError:
            if chunk == 1:
                raise
            chunk = max(1, chunk // 2)
            family.decode_chunk = chunk
            torch.cuda.empty_cache()


@dataclass
class TransitionScorer:
    """The step output (log-prob, mean, std) of a batch record's recorded transitions x_n -> x_{n+1} under a model,
    for flattened (sample, step) pairs, with the guidance, noise level and log-prob reduction of the rollout:

        scorer(model, batch, rows, steps) = family.step(family.model_output(model, x_n, step_n, cond, ...), x_n,
                                                        step_n, noise, next_latents=x_{n+1})

    The policy update, the KL to the reference and the KL in the reward all score transitions through it.
    """

    family: object
    guidance_scale: float  # of the training forward (1: none)
    noise_level: float
    reduce: str = "mean"

    @classmethod
    def from_config(cls, config, family) -> "TransitionScorer":
        return cls(family, family.training_guidance(config), family.noise_level(config.sample),
                   config.sample.log_prob_reduce)

    def prepare(self, num_steps: int, device) -> None:
        """Set the schedule of ``num_steps`` steps (a DDIM step reads its previous timestep from it)."""
        self.family.schedule(num_steps, device)

    def __call__(self, model, batch: dict, rows: torch.Tensor, steps: torch.Tensor):
        family = self.family
        step = {key: batch[key][rows, steps] for key in family.step_keys}
        cond = {key: batch[key][rows] for key in family.cond_keys}
        latents = batch["latents"][rows, steps]
        guided = self.guidance_scale > family.no_guidance
        negative = recorded_negative(family, batch, rows) if guided else family.negative_condition()
        output = family.model_output(model, latents, step, cond, negative, self.guidance_scale)
        return family.step(output, latents, step, self.noise_level, next_latents=batch["next_latents"][rows, steps],
                           reduce=self.reduce)
