"""Reference model: frozen base (adapters disabled), mixup adapter, full copy; KL 0 at the start, > 0 after updates."""

import dataclasses

import pytest
import torch

from ddpo_group.models.families.sd import StableDiffusionFamily
from ddpo_group.models.trainable import lora_config
from ddpo_group.reference.model import POLICY_ADAPTER, REFERENCE_ADAPTER, ReferenceModel, lora_layers
from ddpo_group.models.tiny_random import build_tiny_pipeline
from helpers.tolerances import EPS32
from helpers.trainer_helpers import tiny_config, tiny_trainer


def lora_unet(rank=4):
    config = tiny_config("ddpo", "unused", "unused")
    config.lora_rank = rank
    unet = build_tiny_pipeline().unet
    unet.requires_grad_(False)
    lora = lora_config(config, StableDiffusionFamily.lora_target_modules)
    unet.add_adapter(lora)
    return unet, lora


def perturb(params, scale=0.1):
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn_like(p))


def unet_out(unet, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, c = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 16, 32, generator=g)
    with torch.no_grad():
        return unet(x, torch.tensor([500, 100]), encoder_hidden_states=c).sample


def lerp_atol(pol, old):
    """lerp_ and alpha * pol + (1 - alpha) * old round differently, each to within 1.5 ulp (<= 1.5 eps |x|) of the
    exact mix: 3 eps times the larger operand bounds their difference (elementwise: no reduction, no thread count)."""
    return 3 * EPS32 * max(float(pol.detach().abs().max()), float(old.detach().abs().max()))


def adapter_weights(unet, name):
    return [w for layer in lora_layers(unet) for w in (layer.lora_A[name].weight, layer.lora_B[name].weight)]


def test_frozen_lora_reference_equals_base_model_output():
    torch.manual_seed(0)
    base = build_tiny_pipeline().unet  # build_tiny_pipeline seeds itself: the same base weights as lora_unet's
    unet, _ = lora_unet()
    base_out = unet_out(base)
    trainable = [p for p in unet.parameters() if p.requires_grad]
    perturb(trainable)  # the policy moved away from the base model
    assert not torch.allclose(unet_out(unet), base_out)
    reference = ReferenceModel(unet, "base")
    with reference.applied(unet) as ref_unet:
        torch.testing.assert_close(unet_out(ref_unet), base_out, rtol=0, atol=0)
    # leaving the context restores the policy: adapters on and trainable
    assert all(p.requires_grad for p in trainable)
    assert not torch.allclose(unet_out(unet), base_out)


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_adapter_reference_mixup(alpha):
    torch.manual_seed(0)
    unet, lora = lora_unet()
    trainable = [p for p in unet.parameters() if p.requires_grad]
    reference = ReferenceModel(unet, "adapter", alpha=alpha, update_freq=1, lora_config=lora)
    # created as a copy of the policy adapter, frozen; the policy adapter stays the active, trainable one
    assert [p for p in unet.parameters() if p.requires_grad] == trainable
    for ref, pol in zip(adapter_weights(unet, REFERENCE_ADAPTER), adapter_weights(unet, POLICY_ADAPTER)):
        assert torch.equal(ref, pol) and not ref.requires_grad
    perturb(trainable)
    old_ref = [w.clone() for w in adapter_weights(unet, REFERENCE_ADAPTER)]
    assert reference.maybe_update(unet, epoch=0) and reference.last_update_epoch == 0
    for ref, pol, old in zip(adapter_weights(unet, REFERENCE_ADAPTER), adapter_weights(unet, POLICY_ADAPTER), old_ref):
        torch.testing.assert_close(ref, alpha * pol + (1 - alpha) * old, rtol=0, atol=lerp_atol(pol, old))
    if alpha == 1.0:
        assert reference.param_distance(unet) == 0.0
        with reference.applied(unet) as ref_unet:
            ref_out = unet_out(ref_unet)
        torch.testing.assert_close(ref_out, unet_out(unet), rtol=0, atol=0)
    else:
        assert reference.param_distance(unet) > 0
    assert [p for p in unet.parameters() if p.requires_grad] == trainable


def test_update_frequency():
    unet, lora = lora_unet()
    reference = ReferenceModel(unet, "adapter", alpha=1.0, update_freq=3, lora_config=lora)
    assert [e for e in range(9) if reference.due(e)] == [2, 5, 8]


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_full_fine_tuning_copy_mixup(alpha):
    torch.manual_seed(0)
    unet = build_tiny_pipeline().unet
    reference = ReferenceModel(unet, "copy", alpha=alpha, update_freq=1)
    old = [p.detach().clone() for p in reference.copy.parameters()]
    perturb(list(unet.parameters()), 0.01)
    reference.maybe_update(unet, 0)
    for ref, pol, o in zip(reference.copy.parameters(), unet.parameters(), old):
        torch.testing.assert_close(ref, alpha * pol + (1 - alpha) * o, rtol=0, atol=lerp_atol(pol, o))
    assert not any(p.requires_grad for p in reference.copy.parameters())
    state = reference.state_dict()
    assert "copy" in state and state["last_update_epoch"] == 0


def test_kl_is_zero_at_the_first_step_and_positive_after_updates(tiny_model_dir, tmp_path):
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "kl", **{"sample.num_batches_per_epoch": 1})
    # one train batch = one optimizer step per call of train_epoch
    prompts, metadata, groups = trainer.prompt_sampler.sample_epoch(1, 4)
    batch = trainer.rollouts.sampler.sample(trainer.family.model, prompts, metadata, desc=None)
    batch = dataclasses.replace(batch, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5], device=batch.log_probs.device)
                                [:, None].expand(4, 4).clone())
    first = trainer.updater.train_epoch(batch, show_progress=False)
    assert first["kl"] == 0.0 and first["kl_loss"] == 0.0
    second = trainer.updater.train_epoch(batch, show_progress=False)
    assert second["kl"] > 0 and second["kl_loss"] > 0
    trainer.rollouts.close()


def test_checkpoint_with_a_reference_adapter_loads_as_the_policy_for_evaluation(tiny_model_dir, tmp_path):
    from diffusers import StableDiffusionPipeline

    from config.base import base
    from ddpo_group.offline.comparison import load_finetuned_weights, run_config

    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "evalref", **{
        "kl.reference_update_freq": 1, "export_lora": False, "save_freq": 1})
    trainer.run()
    policy = {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()
              if ".reference." not in k}
    pipe = StableDiffusionPipeline.from_pretrained(tiny_model_dir)
    config = run_config(base(), {"lora_rank": 4})
    load_finetuned_weights(StableDiffusionFamily(pipe, config), tmp_path / "evalref" / "checkpoints" / "checkpoint_00000",
                           config)
    loaded = pipe.unet.state_dict()
    assert set(loaded) == set(policy)
    for key, value in policy.items():
        assert torch.equal(loaded[key], value.cpu()), key


def test_below_start_gates_by_hand():
    """kl.only_below_start: g_p = 1 while the mean of p's last W rewards is below the mean of its first W (W = 2)."""
    from ddpo_group.reference.regularizer import BelowStart

    gate = BelowStart(window=2)
    # round 1: a's first two rewards (start 0.5); b has one reward (no start yet)
    assert gate.weights(["a", "a", "b"], torch.tensor([0.4, 0.6, 0.9])).tolist() == [0.0, 0.0, 0.0]
    # round 2: a's last two 0.45, 0.5 (level 0.475 < 0.5: below); b's start 0.9 -> 0.85, its last the same: not below
    assert gate.weights(["a", "b", "a"], torch.tensor([0.45, 0.8, 0.5])).tolist() == [1.0, 0.0, 1.0]
    assert gate.share == pytest.approx(2 / 3)
    # round 3: a's last two 0.5, 0.55 (0.525 >= 0.5): free again; b's last 0.8, 0.7 (0.75 < 0.85): below
    state = gate.state_dict()
    assert gate.weights(["b", "a"], torch.tensor([0.7, 0.55])).tolist() == [1.0, 0.0]
    # a restored gate continues the same way (exact resume)
    restored = BelowStart(window=2)
    restored.load_state_dict(state)
    assert restored.weights(["b", "a"], torch.tensor([0.7, 0.55])).tolist() == [1.0, 0.0]
    assert restored.state_dict() == gate.state_dict()


def test_only_below_start_needs_the_kl_term_in_the_loss():
    from config.base import get_config
    from ddpo_group.errors import ConfigError
    from ddpo_group.run.config_checks import validate_config

    config = get_config("grpo")
    config.kl.only_below_start = True
    validate_config(config)  # grpo's KL term: beta 0.004 in the loss
    config.kl.beta = 0.0
    with pytest.raises(ConfigError, match=r"kl.only_below_start=True .* kl.beta=0.0"):
        validate_config(config)
    config.kl.beta, config.kl.start_window = 0.004, 0
    with pytest.raises(ConfigError, match=r"kl.start_window=0 must be >= 1"):
        validate_config(config)
