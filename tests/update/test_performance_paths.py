"""The performance paths compute what the plain paths compute: policy setup in the mixed-precision dtype
without diffusers' cast warning, gradient checkpointing, the reference skipped at beta = 0, prompts
encoded once, the phase timer's exclusive accounting."""

import logging
import time

import pytest
import torch
from accelerate import Accelerator

from config.base import base
from ddpo_group.algorithms import FixedKLController
from ddpo_group.models.trainable import build_policy
from ddpo_group.reference.regularizer import KLRegularizer
from ddpo_group.rollout.sampler import encode_unique
from ddpo_group.models.families.sd import StableDiffusionFamily, encode_prompts
from ddpo_group.sampling.trajectories import TransitionScorer
from ddpo_group.update.policy_update import PolicyUpdater
from ddpo_group.update.updater import UpdateOptions
from ddpo_group.timing import PhaseTimer
from ddpo_group.models.tiny_random import build_tiny_pipeline
from helpers.batch_helpers import batch_of
from helpers.sd_helpers import sd_trajectories
from helpers.trainer_helpers import tiny_config


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("precision, use_lora", [("bf16", True), ("bf16", False), ("fp16", True)])
def test_policy_loads_in_the_mixed_precision_dtype_without_cast_warning(tiny_model_dir, precision, use_lora):
    config = tiny_config("ddpo", tiny_model_dir, "unused", mixed_precision=precision, use_lora=use_lora)
    handler = _Records()
    logger = logging.getLogger("diffusers")
    logger.addHandler(handler)
    try:
        family, params = build_policy(config, torch.device("cpu"))
    finally:
        logger.removeHandler(handler)
    assert not [m for m in handler.messages if "Casting" in m or "float32" in m], handler.messages
    pipe = family.pipe
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert pipe.vae.dtype == dtype and pipe.text_encoder.dtype == dtype
    assert params and all(p.dtype == torch.float32 for p in params)  # trainable: float32
    frozen = [p for p in pipe.unet.parameters() if not p.requires_grad]
    assert all(p.dtype == dtype for p in frozen) if use_lora else not frozen


def _lora_grads(config, batch, neg, pipe, params):
    updater = PolicyUpdater(UpdateOptions(config, Accelerator(cpu=True), pipe.unet, None, params,
                                          TransitionScorer.from_config(config, StableDiffusionFamily(pipe, config))))
    pipe.unet.train()
    pipe.unet.zero_grad()
    updater.accumulate_gradients(batch, torch.arange(3), torch.ones(3, 3))
    return [p.grad.clone() for p in params]


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model_dir):
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        config = tiny_config("ddpo", tiny_model_dir, "unused", **{"train.gradient_checkpointing": checkpointing,
                                                                   "sample.num_steps": 3, "sample.guidance_scale": 5.0})
        family, params = build_policy(config, torch.device("cpu"))
        pipe = family.pipe
        assert pipe.unet.is_gradient_checkpointing == checkpointing
        with torch.no_grad():  # LoRA B starts at zero: move it so that every LoRA weight gets a gradient
            for p in params:
                p.add_(0.05 * torch.randn_like(p))
        embeds, neg = encode_prompts(pipe, ["a cat", "a dog", "a cow"]), encode_prompts(pipe, [""])
        traj = sd_trajectories(pipe, embeds, neg.expand(3, -1, -1), 3, 5.0, 1.0,
                               generator=torch.Generator().manual_seed(1), decode=False)
        batch = batch_of(traj, {"prompt_embeds": embeds}, advantages=torch.randn(3, 3))
        grads.append(_lora_grads(config, batch, neg, pipe, params))
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(checkpointed, plain, rtol=1e-4, atol=1e-8)
    assert any(g.abs().sum() > 0 for g in grads[0])


class _ForbiddenReference:
    def applied(self, unet):
        raise AssertionError("the reference forward ran with beta = 0")


def test_reference_forward_only_when_beta_positive():
    torch.manual_seed(0)
    pipe = build_tiny_pipeline()
    config = tiny_config("grpo", "unused", "unused", **{"sample.num_steps": 2, "kl.beta": 0.0})
    embeds, neg = encode_prompts(pipe, ["a cat", "a dog"]), encode_prompts(pipe, [""])
    traj = sd_trajectories(pipe, embeds, neg.expand(2, -1, -1), 2, 5.0, 1.0, decode=False,
                           generator=torch.Generator().manual_seed(0))
    batch = batch_of(traj, {"prompt_embeds": embeds}, advantages=torch.ones(2, 2))
    params = list(pipe.unet.parameters())
    kl = KLRegularizer(_ForbiddenReference(), "gaussian", FixedKLController(0.0), in_reward=False)
    updater = PolicyUpdater(UpdateOptions(config, Accelerator(cpu=True), pipe.unet, None, params,
                                          TransitionScorer.from_config(config, StableDiffusionFamily(pipe, config)), kl))
    assert not updater.uses_reference
    metrics = updater.accumulate_gradients(batch, torch.arange(2), torch.ones(2, 2))
    assert "kl" not in metrics and "policy_loss" in metrics
    kl.controller.value = 0.1
    assert updater.uses_reference
    with pytest.raises(AssertionError, match="beta = 0"):
        updater.accumulate_gradients(batch, torch.arange(2), torch.ones(2, 2))


def test_each_distinct_prompt_is_encoded_once():
    pipe = build_tiny_pipeline()
    prompts = ["a cat", "a dog", "a cat", "a cow", "a dog", "a cat"]
    calls = []
    encoder = pipe.text_encoder
    original = encoder.forward

    def counting_forward(ids, *args, **kwargs):
        calls.append(ids.shape[0])
        return original(ids, *args, **kwargs)

    encoder.forward = counting_forward
    embeds = encode_unique(StableDiffusionFamily(pipe, base()), prompts)["prompt_embeds"]
    assert calls == [3]
    encoder.forward = original
    torch.testing.assert_close(embeds, encode_prompts(pipe, prompts), rtol=1e-5, atol=1e-6)


def test_phase_timer_is_exclusive():
    timer = PhaseTimer()
    with timer.phase("training"):
        time.sleep(0.02)
        with timer.phase("reference"):
            time.sleep(0.03)
        time.sleep(0.01)
    totals = timer.snapshot()
    assert 0.025 <= totals["reference"] < 0.2
    assert 0.025 <= totals["training"] < 0.2  # its own 0.03 s, not the reference's
    before = timer.snapshot()
    with timer.phase("logging"):
        pass
    assert set(PhaseTimer.since(before, timer.snapshot())) >= {"logging", "training"}


def test_every_epoch_logs_its_phase_times(tiny_model_dir, tmp_path):
    from ddpo_group.timing import PHASES
    from helpers.trainer_helpers import tiny_trainer

    trainer = tiny_trainer("group_ppo", tiny_model_dir, tmp_path, "phases")
    metrics = trainer.run()
    assert {key for key in metrics if key.startswith("time/")} == {f"time/{phase}" for phase in PHASES} | {"time/epoch"}
    assert metrics["time/sampling"] > 0 and metrics["time/training"] > 0 and metrics["time/critic"] > 0
    # logging and checkpoint are the previous epoch's: none before the first; the phases are exclusive, so together
    # they fit in the epoch's wall time
    assert metrics["time/logging"] == metrics["time/checkpoint"] == 0.0
    assert metrics["time/epoch"] >= sum(metrics[f"time/{phase}"] for phase in PHASES)
    # the run's checkpoint and summary come after the last epoch's metrics: they are on the timer
    assert trainer.timer.snapshot()["checkpoint"] > 0
