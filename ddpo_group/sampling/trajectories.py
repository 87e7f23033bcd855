"""Trajectories with log-probabilities for any model family, and their recomputation for training.

    x_0 = family.initial_latents(...)                    (the pipeline's own noise draw: same generator, same x_0)
    for n in 0..T-1:
        out     = family.model_output(model, x_n, step_n, cond, negative, guidance)  (with the values its guidance
                                                                                      carries from step to step)
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

import weakref
from dataclasses import dataclass, field

import torch

from ddpo_group.sampling.batch import RolloutBatch
from ddpo_group.sampling.family import Family


@dataclass(frozen=True)
class Trajectories:
    """B sampled trajectories, made whole where they are made and checked there (each field's leading dimensions);
    a caller that adds to them (the critic's values) makes a new record (``dataclasses.replace``)."""

    images: torch.Tensor | None  # [B, 3, H, W] in [0, 1], float32 (a video family's frames: [B, F, 3, H, W])
    latents: torch.Tensor  # [B, T+1, ...]: x_0 (noise) .. x_T (final latent)
    log_probs: torch.Tensor  # [B, T]
    # each step's times, family.time_keys ("timesteps", "sigmas", ...), [B, T], and the values its guidance carries
    # into the step, family.carried_keys (APG's momentum: [B, T, ...])
    times: dict = field(default_factory=dict)
    values: torch.Tensor | None = None  # [B, T] critic values of the pre-step latents (rollout/sampler.py's)
    means: torch.Tensor | None = None  # [B, T, ...] each step's mean mu_n (float32), when asked for (record_means)
    # [B, S, ...] float32, clean_hat(x_n) at the S steps SamplingOptions.clean_hat_steps asks for: column k is step
    # clean_hat_steps[k] (every step's, column n step n, when it asks for all of them)
    clean_hat: torch.Tensor | None = None
    shared_from: torch.Tensor | None = None  # [B, T+1] a tree's: the first leaf sharing each leaf's state x_n
    audio: torch.Tensor | None = None  # [B, channels, samples] float32: a family with audio's (``decode_audio``)
    audio_sample_rate: int = 0  # the audio's samples per second

    def __post_init__(self):
        size, num_steps = self.log_probs.shape
        leading = {"latents": (size, num_steps + 1), "values": (size, num_steps), "means": (size, num_steps),
                   "shared_from": (size, num_steps + 1), "images": (size,), "audio": (size,),
                   "clean_hat": (size,), **{f"times[{key!r}]": (size, num_steps) for key in self.times}}
        tensors = {**vars(self), **{f"times[{key!r}]": value for key, value in self.times.items()}}
        wrong = {name: tuple(tensors[name].shape) for name, dims in leading.items()
                 if tensors[name] is not None and tuple(tensors[name].shape[:len(dims)]) != dims}
        if wrong:
            raise ValueError(f"trajectories of {size} rows and {num_steps} steps (log_probs) have fields of other "
                             f"shapes: {wrong}")

    def reward_metadata(self, metadata: list[dict]) -> list[dict]:
        """The rows' metadata as the rewards receive it: with each sample's audio (``metadata[i]["audio"]``, on the CPU,
        and ``"audio_sample_rate"``) when the family makes audio; the rows themselves otherwise."""
        return with_audio(metadata, self.audio, self.audio_sample_rate)

    @property
    def timesteps(self) -> torch.Tensor:
        return self.times["timesteps"]

    @staticmethod
    def concatenate(parts: list["Trajectories"]) -> "Trajectories":
        """The rows of ``parts`` in order (a tree's ``shared_from`` rows offset by the rows before each part)."""
        def cat(name):
            values = [getattr(part, name) for part in parts]
            return None if values[0] is None else torch.cat(values)

        offsets = torch.tensor([0] + [len(part.latents) for part in parts[:-1]]).cumsum(0).tolist()
        shared = None
        if parts[0].shared_from is not None:
            shared = torch.cat([part.shared_from + offset for part, offset in zip(parts, offsets)])
        return Trajectories(images=cat("images"), latents=cat("latents"), log_probs=cat("log_probs"),
                            times={key: torch.cat([part.times[key] for part in parts]) for key in parts[0].times},
                            values=cat("values"), means=cat("means"), clean_hat=cat("clean_hat"), shared_from=shared,
                            audio=cat("audio"), audio_sample_rate=parts[0].audio_sample_rate)


def condition_dtype(cond: dict, family: Family) -> torch.dtype:
    """The dtype the sampler's model read the condition in: its first floating tensor's, or for a condition of token
    ids alone (Cosmos 3's) the denoiser's."""
    return next((value.dtype for value in cond.values() if value.is_floating_point()), family.model.dtype)


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


@dataclass(frozen=True)
class SamplingOptions:
    """How ``sample_trajectories`` samples and what it records besides the latents and log-probs."""

    num_steps: int  # T
    guidance_scale: float  # of the family's guidance (CFG, or its guidance embedding)
    noise_levels: tuple  # [T] each step's noise level (family.noise_levels: the SDE window); 0: the deterministic step
    compute_log_prob: bool = True  # False: log_probs are zeros (nothing trains on them)
    log_prob_reduce: str = "mean"  # sample.log_prob_reduce
    log_prob_dtype: str = "float32"  # sample.log_prob_dtype
    batch_size: int = 1  # samples per denoiser batch of the callers that split their prompts (sample.batch_size)
    decode: bool = True  # False: no images (Trajectories.images None)
    decode_batch_size: int = 0  # final latents decoded that many at a time (0: all at once): the VAE's peak memory
    record_means: bool = False  # keep each step's mean mu_n (a loss with needs_rollout_means: one latent a step)
    # the steps n whose clean_hat(x_n) is kept, ascending (GROUP_PPO's Tweedie values; every step for a critic that
    # reads it): Trajectories.clean_hat's columns
    clean_hat_steps: tuple = ()
    branches: dict | None = None  # {step: children}: sample trees (sample_trees); None: independent trajectories

    def __post_init__(self):
        object.__setattr__(self, "noise_levels", tuple(float(level) for level in self.noise_levels))
        object.__setattr__(self, "clean_hat_steps", tuple(self.clean_hat_steps))
        if len(self.noise_levels) != self.num_steps:
            raise ValueError(f"noise_levels has {len(self.noise_levels)} values for {self.num_steps} steps")
        if self.compute_log_prob and not any(level > 0 for level in self.noise_levels):
            raise ValueError(f"noise levels {list(self.noise_levels)}: every step is deterministic, so no step has a "
                             "log-probability")

    @classmethod
    def rollouts(cls, sample, family, **recorded) -> "SamplingOptions":
        """The training sampler of ``sample`` (config.sample): its noise levels (every step deterministic and no
        log-probs with ``sample.deterministic``: the matching objectives need the final samples only)."""
        deterministic = bool(sample.deterministic)
        levels = [0.0] * sample.num_steps if deterministic else family.noise_levels(sample)
        return cls(sample.num_steps, sample.guidance_scale, levels, compute_log_prob=not deterministic,
                   log_prob_reduce=sample.log_prob_reduce, log_prob_dtype=sample.log_prob_dtype,
                   batch_size=int(sample.batch_size),
                   decode_batch_size=int(sample.decode_batch_size), **recorded)

    @classmethod
    def deterministic(cls, sample, num_steps: int | None = None) -> "SamplingOptions":
        """The deterministic sampler (noise level 0 on every step, no log-probs) of ``sample`` with ``num_steps``
        steps (default: sample.num_steps): the evaluation's and ReMax's greedy samples."""
        num_steps = int(num_steps or sample.num_steps)
        return cls(num_steps, sample.guidance_scale, (0.0,) * num_steps, compute_log_prob=False,
                   batch_size=int(sample.batch_size), decode_batch_size=int(sample.decode_batch_size))


@torch.no_grad()
def sample_trajectories(family: Family, model, cond: dict, negative: dict | None, options: SamplingOptions,
                        generator=None, initial_noise: torch.Tensor | None = None) -> Trajectories:
    """Sample B images and record their trajectories (module docstring); trees when ``options.branches``.

    ``cond`` holds B rows (``family.encode``), ``negative`` one row (``family.negative_condition``) or B
    (``family.negative_rows``: rows with their own negative prompts). ``generator``: one, or one per sample (each
    sample's noise independent of the batch layout); ``initial_noise`` [B, ...] (standard normal) replaces the x_0
    drawn from ``generator``, which then draws the step noise only.
    """
    if options.branches:
        return sample_trees(family, model, cond, negative, options, generator, initial_noise)
    first = next(iter(cond.values()))
    batch, device, dtype = first.shape[0], first.device, family.state_dtype(condition_dtype(cond, family))
    schedule = family.schedule(options.num_steps, device)
    record = _Record(batch, options, schedule, device)
    latents = family.initial_latents(batch, generator, device, dtype, initial_noise)
    record.start(latents)
    carried = family.initial_carried(latents)
    for n in range(options.num_steps):
        times = {**{key: values[n] for key, values in schedule.items()}, **carried}
        record.carry(carried)
        output, carried = family.model_output_carrying(model, latents, times, cond, negative, options.guidance_scale)
        out, latents = stochastic_step(family, output, latents, times, options, n, generator, dtype)
        record.step(n, out)
    return record.trajectories(family, latents)


@torch.no_grad()
def sample_trees(family: Family, model, cond: dict, negative: dict | None, options: SamplingOptions,
                 generator: list | None = None, initial_noise: torch.Tensor | None = None) -> Trajectories:
    """``sample_trajectories`` on trees (``options.branches`` {step: children}; module docstring): the B rows are
    the leaves of B / L roots, L = prod(children), each root's leaves consecutive, ``generator`` one per leaf."""
    branches = options.branches
    first = next(iter(cond.values()))
    batch, device, dtype = first.shape[0], first.device, family.state_dtype(condition_dtype(cond, family))
    schedule = family.schedule(options.num_steps, device)
    size = tree_leaves(branches, batch, options.noise_levels, generator)  # leaves below each node row
    nodes = torch.arange(0, batch, size, device=device)  # each node row's first leaf
    node_cond, node_negative, node_generator = _node_rows(nodes, size, cond, negative, generator)
    latents = family.initial_latents(len(nodes), node_generator, device, dtype,
                                     initial_noise[nodes.cpu()] if initial_noise is not None else None)
    record = _Record(batch, options, schedule, device)
    record.start(latents, size)
    carried = family.initial_carried(latents)
    shared = [nodes.repeat_interleave(size)]
    for n in range(options.num_steps):
        times = {**{key: values[n] for key, values in schedule.items()}, **carried}
        record.carry(carried, size)
        output, carried = family.model_output_carrying(model, latents, times, node_cond, node_negative,
                                                       options.guidance_scale)
        if n in branches:  # each node's children: its output and state repeated, their own noise from here on
            factor = branches[n]
            size //= factor
            nodes = (nodes[:, None] + size * torch.arange(factor, device=device)).flatten()
            output, latents = output.repeat_interleave(factor, 0), latents.repeat_interleave(factor, 0)
            carried = {key: value.repeat_interleave(factor, 0) for key, value in carried.items()}
            node_cond, node_negative, node_generator = _node_rows(nodes, size, cond, negative, generator)
        out, latents = stochastic_step(family, output, latents, times, options, n, node_generator, dtype)
        record.step(n, out, size)
        shared.append(nodes.repeat_interleave(size))
    return record.trajectories(family, latents, shared_from=torch.stack(shared, dim=1))


def stochastic_step(family: Family, output, latents, times: dict, options: SamplingOptions, n: int, generator, dtype):
    """Step n of a sampling loop: (its output, x_{n+1} in the state's dtype ``dtype``, the next step's input).

    The step's math runs in float32 and draws x_{n+1}; the loop goes on from it in ``dtype`` (``family.state_dtype``:
    the model's, or the float32 a pipeline keeps its state in), as the family's pipeline does. Below float32 (mixed precision) the rounded x_{n+1} is the sample: its log-probability and the recorded
    latent are the rounded one's, which the training forward scores again (the unrounded one would give every step of
    a bf16 run a ratio off 1 by the rounding, 1e-2 to 7e-2 on the embedded models)."""
    level, log_prob = options.noise_levels[n], options.compute_log_prob and options.noise_levels[n] > 0
    rounded = dtype != torch.float32
    out = family.step(output, latents, times, level, generator=generator, compute_log_prob=log_prob and not rounded,
                      reduce=options.log_prob_reduce, log_prob_dtype=options.log_prob_dtype)
    next_latents = out.next_latents.to(dtype)
    if rounded and log_prob:  # the step again at the rounded sample (no noise drawn)
        out = family.step(output, latents, times, level, next_latents=next_latents, reduce=options.log_prob_reduce,
                          log_prob_dtype=options.log_prob_dtype)
    elif rounded:
        out.next_latents = next_latents.float()
    return out, next_latents


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



class _Record:
    """What a sampling loop records, per leaf row: the latents, each step's log-prob, and the means and one-step
    predictions the options ask for (a tree's node tensors repeated for the ``size`` leaves below each node)."""

    def __init__(self, batch: int, options: SamplingOptions, schedule: dict, device):
        self.batch, self.options, self.schedule, self.device = batch, options, schedule, device
        self.latents, self.log_probs, self.means, self.clean_hat = [], [], [], []
        self.carried: dict[str, list] = {}  # each step's carried-in values (family.carried_keys), per leaf row

    def log_prob_at(self, n: int) -> bool:
        return self.options.compute_log_prob and self.options.noise_levels[n] > 0

    def start(self, latents: torch.Tensor, size: int = 1) -> None:
        self.latents.append(_leaves(latents.float(), size))

    def carry(self, carried: dict, size: int = 1) -> None:
        """The values a family's guidance carries into this step (recorded with its times: the training forward reads
        them as the sampler had them)."""
        for key, value in carried.items():
            self.carried.setdefault(key, []).append(_leaves(value, size))

    def step(self, n: int, out, size: int = 1) -> None:
        options = self.options
        self.latents.append(_leaves(out.next_latents, size))
        if options.record_means:
            self.means.append(_leaves(out.mean, size))
        if n in options.clean_hat_steps:
            self.clean_hat.append(_leaves(out.clean_hat.float(), size))
        if options.compute_log_prob:
            self.log_probs.append(_leaves(out.log_prob, size) if self.log_prob_at(n)
                                  else torch.zeros(self.batch, device=self.device))

    def trajectories(self, family: Family, final: torch.Tensor, shared_from: torch.Tensor | None = None) -> Trajectories:
        """The record, with the images of the ``final`` latents when the options decode (``shared_from``: a tree's)."""
        batch, device, options = self.batch, self.device, self.options
        makes_audio = options.decode and family.capabilities.audio
        return Trajectories(
            images=decode_latents(family, final, options.decode_batch_size) if options.decode else None,
            audio=decode_audio_latents(family, final, options.decode_batch_size) if makes_audio else None,
            audio_sample_rate=family.audio_sample_rate if makes_audio else 0,
            latents=torch.stack(self.latents, dim=1),
            log_probs=torch.stack(self.log_probs, dim=1) if self.options.compute_log_prob
            else torch.zeros(batch, self.options.num_steps, device=device),
            times={**{key: values.to(device).unsqueeze(0).expand(batch, -1).clone()
                      for key, values in self.schedule.items()},
                   **{key: torch.stack(values, dim=1) for key, values in self.carried.items()}},
            means=torch.stack(self.means, dim=1) if self.options.record_means else None,
            clean_hat=torch.stack(self.clean_hat, dim=1) if self.clean_hat else None,
            shared_from=shared_from,
        )


def decode_audio_latents(family: Family, latents: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """Final latents -> their audio [B, channels, samples] float32 (a family with ``capabilities.audio``), ``chunk`` at a
    time."""
    return torch.cat([family.decode_audio(part) for part in latents.split(chunk or len(latents))])


def with_audio(metadata: list[dict], audio: torch.Tensor | None, rate: int) -> list[dict]:
    """The rows' metadata as the rewards receive it: each row with its sample's audio (``"audio"`` [channels,
    samples] on the CPU, ``"audio_sample_rate"``) when there is audio; the rows themselves otherwise."""
    if audio is None:
        return metadata
    audio = audio.cpu()
    return [{**(row or {}), "audio": audio[i], "audio_sample_rate": rate} for i, row in enumerate(metadata)]


# the decode chunk that fit each family's VAE after an out-of-memory error, for the rest of the process
DECODE_CHUNKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decode_latents(family: Family, latents: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """Final latents -> images, ``chunk`` latents at a time (0: all at once). An out-of-memory error (the VAE's
    activations are the sampling phase's peak at high resolution) halves the chunk, for this call and every later
    one of the family (``DECODE_CHUNKS``)."""
    chunk = min(chunk or len(latents), DECODE_CHUNKS.get(family, 0) or len(latents))
    while True:
        try:
            return torch.cat([family.decode(part) for part in latents.split(chunk)])
        except torch.OutOfMemoryError:
            if chunk == 1:
                raise
            chunk = max(1, chunk // 2)
            DECODE_CHUNKS[family] = chunk
            torch.cuda.empty_cache()


@dataclass
class TransitionScorer:
    """The step output (log-prob, mean, std) of a batch record's recorded transitions x_n -> x_{n+1} under a model,
    for flattened (sample, step) pairs, with the guidance, noise level and log-prob reduction of the rollout:

        scorer(model, batch, rows, n) = family.step(family.model_output(model, x_n, times_n, cond, ...), x_n,
                                                        step_n, noise, next_latents=x_{n+1})

    The policy update, the KL to the reference and the KL in the reward all score transitions through it.
    """

    family: Family
    guidance_scale: float  # of the training forward (1: none)
    noise_level: float
    reduce: str = "mean"
    log_prob_dtype: str = "float32"

    @classmethod
    def from_config(cls, config, family) -> "TransitionScorer":
        return cls(family, family.training_guidance(config), family.noise_level(config.sample),
                   config.sample.log_prob_reduce, config.sample.log_prob_dtype)

    def prepare(self, num_steps: int, device) -> None:
        """Set the schedule of ``num_steps`` steps (a DDIM step reads its previous timestep from it)."""
        self.family.schedule(num_steps, device)

    def __call__(self, model, batch: RolloutBatch, rows: torch.Tensor, n: torch.Tensor):
        family = self.family
        times = {key: batch.times[key][rows, n] for key in family.time_keys + family.carried_keys}
        latents = batch.latents[rows, n]
        # the rows' own negative conditions whatever the scale: a family may guide with another scale (LTX-2's audio)
        negative = batch.negative_rows(family, rows)
        output = family.model_output(model, latents, times, rows_of(batch.cond, rows), negative, self.guidance_scale)
        return family.step(output, latents, times, self.noise_level, next_latents=batch.next_latents[rows, n],
                           reduce=self.reduce, log_prob_dtype=self.log_prob_dtype)
