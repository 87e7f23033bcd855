"""Sizes that fit the card: ``train.pairs_per_forward="auto"``, gradient checkpointing when it is needed, chunked VAE
decoding after an out-of-memory error, and the out-of-memory error that names the setting to lower.

``train.pairs_per_forward="auto"`` on the CPU is ``CPU_PAIRS_PER_FORWARD`` (what the embedded model's runs were
tuned with: memory is rarely the limit there). On CUDA it is resolved once, the first time a chunk size is needed,
with that epoch's real batch and the model actually loaded (any family, any loss, the KL's reference forward too):

    0. the first guess, when the memory plan traced this run (update/memory_plan.jsonl: bench/memory_plan.py's rows,
       each a family's step at full size traced with fake tensors, update/memory_trace.py; ``plan_key`` says what
       must match): n from the trace's per_pair and fixed part as in step 4, run once as in step 5; within the
       budget it is the answer (or the larger size its own peak gives, tried once), else steps 1-6 measure (what the
       guess did is printed)
    1. peak(k): CUDA peak memory above the current allocation of one forward + backward of k pairs, exactly as the
       training step runs them (no optimizer step; the gradients are dropped; no collective: under DDP no_sync)
    2. per_pair = peak(2) - peak(1),   fixed = peak(1) - per_pair + Adam's state if not allocated yet (2 x fp32)
    3. budget = HEADROOM x (memory this process may still take: the device's free memory plus what the caching
       allocator holds, at most torch.cuda's per-process fraction of the card) minus what is allocated
    4. n = floor((budget - fixed) / per_pair), at most the pairs of one train batch and MAX_PAIRS
    5. n is tried: an out-of-memory error halves it; a peak(n) + Adam's state above the budget (the two-point
       estimate was low: a compiled forward's first calls, kernel workspaces) measures per_pair again over n pairs,
       (peak(n) - peak(1)) / (n - 1), and fits n again, smaller, until one runs within the budget; every process
       takes the smallest n
    6. if fewer than MIN_PAIRS_WITHOUT_CHECKPOINTING fit, gradient checkpointing is switched on (recompute the
       denoiser's activations in the backward: ~1/3 more compute) and 0-5 run again

The result is printed, logged (``train/pairs_per_forward``) and kept in the checkpoint (TrainingState.sizes), so a
resumed run chunks, and so sums, exactly as the first. A loss without a per-step matrix (gspo, geo_mean)
backpropagates the whole train batch at once: its memory is set by ``train.batch_size``, not by the chunk.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

import torch

from ddpo_group.models.trainable import enable_checkpointing

CPU_PAIRS_PER_FORWARD = 32
HEADROOM = 0.85  # of the measured budget: fragmentation, the optimizer's temporaries, later epochs' caches
MAX_PAIRS = 256  # beyond this the forward is saturated on any card
MIN_PAIRS_WITHOUT_CHECKPOINTING = 4
PLAN_PATH = Path(__file__).with_name("memory_plan.jsonl")  # the traced plan (bench/memory_plan.py --json)

# what to lower when a phase runs out of memory (named in the error)
SETTINGS = {
    "sampling": "sample.batch_size (or set sample.decode_batch_size, sample.text_embedding_cache, "
                "pretrained.text_encoder_device='cpu')",
    "training": "train.pairs_per_forward (or set train.gradient_checkpointing=True; a loss without a per-step "
                "matrix holds a whole train batch: lower train.batch_size)",
    "reward": "the reward model's batch size (reward_fn_kwargs.batch_size)",
}


def plan_key(family, config, updater) -> dict:
    """What a traced row of the memory plan (update/memory_plan.jsonl, bench/memory_plan.py) must share with a run to
    be its first guess: the family, LoRA or full fine-tuning, the trainable parameters (the shape, LoRA's rank and
    targets), the precision, the objective, gradient checkpointing, the training forward's rows (CFG's two), the
    reference's forward, LoRA's dropout, the optimizer's state (8-bit Adam, the EMA) and where the text encoders are.
    (The state's shape, which sets the activations, is compared with the batch's.)"""
    train = config.train
    return {"family": family.name, "mode": "lora" if config.use_lora else "full",
            "trainable": sum(p.numel() for p in updater.params), "mixed_precision": config.mixed_precision,
            "objective": config.algorithm.objective,
            "gradient_checkpointing": bool(family.model.is_gradient_checkpointing),
            "cfg": updater.scorer.guidance_scale != 1.0, "reference_forward": bool(updater.uses_reference),
            "lora_dropout": bool(config.use_lora and config.lora_dropout > 0),
            "use_8bit_adam": bool(train.use_8bit_adam), "ema": bool(train.ema),
            "text_encoder_device": config.pretrained.text_encoder_device or ""}


def traced_plan() -> list[dict]:
    """The memory plan's traced rows that fit an 80 GB card (one JSON object a line; a line that does not read, a
    row without a trace, and a row that fits no such card, whose per pair was not fitted again at a size, are left
    out)."""
    if not PLAN_PATH.exists():
        return []
    rows = []
    for line in PLAN_PATH.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "kinds_1_gib" in row and row["per_pair_gib"] > 0 \
                and "pairs_80GB" in row and row["pairs_80GB"] > 0:
            rows.append(row)
    return rows


def traced_guess(family, config, updater, batch) -> dict | None:
    """The traced row of this run (``plan_key`` and the state's shape equal; the last one written when several are),
    or None."""
    rows = traced_plan()
    if not rows:
        return None
    key = plan_key(family, config, updater)
    state = list(batch.latents.shape[2:])
    matching = [row for row in rows
                if all(row.get(name) == value for name, value in key.items()) and row.get("state") == state]
    return matching[-1] if matching else None


def configured_pairs(value) -> int | None:
    """``train.pairs_per_forward`` as set: None for "auto", else an integer >= 1 (digits from a command line too)."""
    if value == "auto":
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"train.pairs_per_forward={value!r} must be 'auto' or an integer >= 1")
    return value


class DeviceOutOfMemory(RuntimeError):
    """A phase ran out of device memory; the message names the setting to lower."""


@contextmanager
def names_the_setting(phase: str, current: str = ""):
    """Turn torch's out-of-memory error inside ``phase`` into one that says which setting to lower."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        now = f" (now {current})" if current else ""
        first_line = str(error).splitlines()[0] if str(error) else "out of memory"
        raise DeviceOutOfMemory(f"out of device memory while {phase}{now}: lower {SETTINGS[phase]}. "
                                f"torch said: {first_line}") from error


def memory_budget(device: torch.device) -> int:
    """Bytes this process may still allocate on ``device`` (step 3, before the headroom)."""
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    fraction = torch.cuda.get_per_process_memory_fraction(device) if hasattr(
        torch.cuda, "get_per_process_memory_fraction") else 1.0
    reachable = min(free + torch.cuda.memory_reserved(device), int(fraction * total))
    return reachable - torch.cuda.memory_allocated(device)


def most_pairs(train, trainable: torch.Tensor) -> int:
    """The most pairs one forward can take: a train batch's (``train.batch_size`` samples x their trained steps),
    at most MAX_PAIRS."""
    return min(MAX_PAIRS, max(1, int(train.batch_size * int(trainable.sum()) * train.step_fraction)))


def probe_batch(batch, pairs: int, trainable: torch.Tensor) -> tuple[object, torch.Tensor, torch.Tensor]:
    """(batch, rows, step mask) holding ``pairs`` (sample, step) pairs of trainable steps, row after row, from the
    epoch's real batch (a RolloutBatch); advantages are zeros where the batch has none yet (a rollout KL before the
    first update)."""
    num_samples, num_steps = batch.log_probs.shape
    steps = torch.nonzero(trainable.cpu()).flatten()
    rows_needed = min(num_samples, math.ceil(pairs / max(len(steps), 1)))
    mask = torch.zeros(rows_needed, num_steps)
    flat = [(i, int(n)) for i in range(rows_needed) for n in steps][:pairs]
    for i, n in flat:
        mask[i, n] = 1.0
    if batch.advantages is None:
        batch = replace(batch, advantages=torch.zeros_like(batch.log_probs))
    rows = torch.arange(rows_needed, device=batch.log_probs.device)
    return batch, rows, mask


def drop_gradients(params) -> None:
    for param in params:
        param.grad = None


class PairsPerForward:
    """The chunk of (sample, step) pairs per training forward: ``train.pairs_per_forward`` or, for "auto", the size
    resolved once (module docstring); ``sizes`` is the checkpointed record of what was chosen."""

    def __init__(self, config, accelerator, family, sizes: dict, say=print):
        self.config, self.accelerator, self.family = config, accelerator, family
        self.sizes = sizes  # TrainingState.sizes: restored from a checkpoint before the first epoch
        self.say = say
        self.fixed = configured_pairs(config.train.pairs_per_forward)
        self.auto = self.fixed is None
        self.seen_peak = 0  # the epoch's CUDA peak before and during the probe, which resets torch's peak counter

    @property
    def value(self) -> int | None:
        if not self.auto:
            return self.fixed
        if self.accelerator.device.type != "cuda":
            return CPU_PAIRS_PER_FORWARD
        return self.sizes.get("pairs_per_forward")

    def setting(self) -> str:
        """The setting that chooses the size, for the out-of-memory message (update/memory_fit.py's
        ``names_the_setting``)."""
        value = self.value
        return f"train.pairs_per_forward={value if value is not None else 'auto'}{' (auto)' if self.auto else ''}"

    def take_seen_peak(self) -> int:
        """The CUDA peak the probe saw this epoch (0 without a probe): the epoch's peak reading must include it."""
        peak, self.seen_peak = self.seen_peak, 0
        return peak

    def restore(self) -> None:
        """Re-apply what a checkpoint recorded (gradient checkpointing switched on by the probe)."""
        if self.sizes.get("gradient_checkpointing") and not self._checkpointing():
            enable_checkpointing(self.family.model)

    def __call__(self, updater, batch) -> int:
        value = self.value
        if value is None:
            value = self.resolve(updater, batch)
        return value

    def _checkpointing(self) -> bool:
        return bool(self.family.model.is_gradient_checkpointing)

    def resolve(self, updater, batch) -> int:
        """Steps 0-6 of the module docstring; records and prints the result."""
        n, detail = self._fit(updater, batch)
        if n < MIN_PAIRS_WITHOUT_CHECKPOINTING and not self._checkpointing() and \
                self.family.model._supports_gradient_checkpointing:
            enable_checkpointing(self.family.model)
            self.sizes["gradient_checkpointing"] = True
            n, detail = self._fit(updater, batch)
            detail += f", with gradient checkpointing: fewer than {MIN_PAIRS_WITHOUT_CHECKPOINTING} fit without"
        n = int(self.accelerator.gather(torch.tensor([n], device=self.accelerator.device)).min())  # all processes
        self.sizes["pairs_per_forward"] = n
        self.say(f"train.pairs_per_forward=auto: {n} pairs per forward ({detail})")
        return n

    def _fit(self, updater, batch) -> tuple[int, str]:
        device = self.accelerator.device
        trainable = self.family.stochastic_steps(self.config.sample)
        most = most_pairs(self.config.train, trainable)
        state = self._optimizer_state_bytes(updater)
        budget = HEADROOM * memory_budget(device)
        guessed = self._traced_first_guess(updater, batch, trainable, most, state, budget)
        if guessed is not None and guessed[0] is not None:
            return guessed
        first, second = (self.peak(updater, batch, k, trainable) for k in (1, 2))
        per_pair = max(second - first, 1)

        def fits(per: int) -> int:  # step 4, fixed = first - per + state
            return max(1, min(most, int((budget - (first - per) - state) // per)))

        n, refits = fits(per_pair), []
        while True:  # step 5: n strictly decreases until it runs within the budget
            try:
                peak = self.peak(updater, batch, n, trainable)
            except torch.OutOfMemoryError:
                if n == 1:
                    raise
                refits.append(f"{n} ran out of memory")
                n = max(1, n // 2)
                continue
            if n == 1 or peak + state <= budget:
                break
            refits.append(f"{n} peaked at {(peak + state) / 2**30:.2f} GiB")
            per_pair = max((peak - first) // (n - 1), 1)
            n = min(n - 1, fits(per_pair))
        gib = 2**30
        detail = (f"{per_pair / gib:.2f} GiB per pair, {max(first - per_pair + state, 0) / gib:.2f} GiB fixed, "
                  f"{budget / gib:.1f} GiB budget; at most {most}")
        if refits:
            detail += "; " + ", ".join(refits)
        if guessed is not None:
            detail += "; " + guessed[1]
        return n, detail

    def _traced_first_guess(self, updater, batch, trainable, most: int, state: int, budget: float):
        """Step 0: with a traced row of this run in the memory plan (``traced_guess``), its pairs for this card: the
        row's per_pair and its step's fixed part above the weights, F = (gradients + activations + temporaries of the
        one-pair trace) - per_pair, give n = floor((budget - state - F) / per_pair) as step 4 does; n is run once (as
        in step 5). Within ``budget`` (the headroom's share of what may still be allocated) it is kept, or the larger
        size its own peak gives when that runs within it too: (n, detail); over it or out of memory: (None, what
        happened), and steps 1-5 measure. None without a traced row."""
        row = traced_guess(self.family, self.config, updater, batch)
        if row is None:
            return None
        gib = 2**30
        per_pair = max(row["per_pair_gib"] * gib, 2**20)
        kinds = row["kinds_1_gib"]
        fixed = max(0.0, sum(kinds[kind] for kind in ("gradients", "activations", "temporaries")) * gib
                    - per_pair)

        def fits(per: float) -> int:
            return max(1, min(most, int((budget - state - fixed) // per)))

        n = fits(per_pair)
        guess = (f"the traced plan's first guess {n} ({row['per_pair_gib']:.2f} GiB per pair, {fixed / gib:.2f} GiB "
                 f"fixed, {row['shape']} traced)")
        try:
            peak = self.peak(updater, batch, n, trainable)
        except torch.OutOfMemoryError:
            return None, f"{guess} ran out of memory"
        if peak + state > budget:
            return None, f"{guess} peaked at {(peak + state) / gib:.2f} GiB"
        detail = f"{guess}, peaking at {(peak + state) / gib:.2f} GiB of the {budget / gib:.1f} GiB budget"
        larger = fits(max((peak - fixed) / n, 1.0))  # the trace was high: the size this peak gives, tried once
        if larger > n:
            try:
                peak = self.peak(updater, batch, larger, trainable)
            except torch.OutOfMemoryError:
                return n, f"{detail}; {larger} ran out of memory"
            if peak + state <= budget:
                return larger, f"{detail}; {larger} from its peak, peaking at {(peak + state) / gib:.2f} GiB"
            return n, f"{detail}; {larger} peaked at {(peak + state) / gib:.2f} GiB"
        return n, detail

    @staticmethod
    def _optimizer_state_bytes(updater) -> int:
        """AdamW's two fp32 moments, when the optimizer has not allocated them yet (before its first step)."""
        optimizer = updater.optimizer
        if optimizer is None or any(len(s) for s in optimizer.state.values()):
            return 0
        return sum(2 * 4 * p.numel() for p in updater.params)

    def peak(self, updater, batch, pairs: int, trainable) -> int:
        """Peak bytes above the current allocation of one forward + backward of ``pairs`` pairs (step 1)."""
        device = self.accelerator.device
        probe, rows, mask = probe_batch(batch, pairs, trainable)
        drop_gradients(updater.params)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        self.seen_peak = max(self.seen_peak, torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        sync = self.accelerator.no_sync(updater.model) if self.accelerator.num_processes > 1 else nullcontext()
        was_training = updater.model.training
        updater.model.train()  # as the update runs it (the rollout KL may ask first, in eval mode and without grad)
        try:
            with sync, torch.enable_grad():
                updater.accumulate_gradients(probe, rows, mask, pairs_per_forward=pairs)
            torch.cuda.synchronize(device)
            self.seen_peak = max(self.seen_peak, torch.cuda.max_memory_allocated(device))
            return torch.cuda.max_memory_allocated(device) - base
        finally:
            updater.model.train(was_training)
            drop_gradients(updater.params)
            torch.cuda.empty_cache()
