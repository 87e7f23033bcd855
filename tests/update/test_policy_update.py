"""The chunked (sample, step) training forward gives the same gradient as DDPO's one-timestep-at-a-time loop."""

import pytest
import torch
from accelerate import Accelerator

from config.base import get_config
from ddpo_group.update.policy_update import PolicyUpdater
from ddpo_group.update.updater import UpdateOptions
from ddpo_group.update.updater import random_step_mask
from ddpo_group.models.families.sd import StableDiffusionFamily, encode_prompts
from ddpo_group.sampling.trajectories import TransitionScorer
from ddpo_group.models.tiny_random import build_tiny_pipeline
from helpers.batch_helpers import batch_of
from helpers.sd_helpers import sd_step_output, sd_trajectories
from helpers.tolerances import reordered_sum_atol


def test_random_step_mask_counts():
    mask = random_step_mask(6, 10, 0.3, generator=torch.Generator().manual_seed(0))
    assert mask.shape == (6, 10) and mask.sum(dim=1).tolist() == [3.0] * 6
    assert random_step_mask(2, 10, 1.0).sum().item() == 20
    assert random_step_mask(2, 10, 0.01).sum(dim=1).tolist() == [1.0, 1.0]  # at least one step


@pytest.mark.parametrize("pairs_per_forward, guidance", [(1, 5.0), (5, 5.0), (64, 1.0)])
def test_chunked_gradient_equals_per_timestep_loop(pairs_per_forward, guidance):
    torch.manual_seed(0)
    pipe = build_tiny_pipeline()
    config = get_config("ddpo")
    config.sample.num_steps, config.sample.guidance_scale, config.train.cfg = 4, guidance, guidance > 1
    config.train.pairs_per_forward, config.train.clip_range = pairs_per_forward, 0.2
    prompts = ["a cat", "a dog", "a cow"]
    embeds, neg = encode_prompts(pipe, prompts), encode_prompts(pipe, [""])
    traj = sd_trajectories(pipe, embeds, neg.expand(3, -1, -1), 4, guidance, 1.0, generator=torch.Generator().manual_seed(1))
    batch = batch_of(traj, {"prompt_embeds": embeds},
                     advantages=torch.tensor([[1.0], [-0.5], [2.0]]).expand(3, 4).clone())
    unet = pipe.unet
    with torch.no_grad():  # move the policy away from the sampling policy so that ratios differ from 1
        for p in unet.parameters():
            p.add_(0.01 * torch.randn_like(p))
    step_mask = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float32)
    rows = torch.tensor([2, 0, 1])  # a shuffled train batch
    updater = PolicyUpdater(UpdateOptions(config, Accelerator(cpu=True), unet, None, list(unet.parameters()),
                                          TransitionScorer.from_config(config, StableDiffusionFamily(pipe, config))))
    unet.zero_grad()
    updater.accumulate_gradients(batch, rows, step_mask)
    chunked = [p.grad.clone() for p in unet.parameters()]

    # reference: DDPO's loop, one timestep of the whole batch at a time, step-mean over masked pairs
    unet.zero_grad()
    total = step_mask.sum()
    for n in range(4):
        m = step_mask[:, n]
        if m.sum() == 0:
            continue
        r = rows
        out = sd_step_output(pipe, unet, batch.latents[r, n], batch.next_latents[r, n],
                             batch.timesteps[r, n], embeds[r], neg.expand(3, -1, -1), guidance, 1.0)
        ratio = torch.exp(out.log_prob - batch.log_probs[r, n])
        adv = batch.advantages[r, n]
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        ((loss * m).sum() / total).backward()
    # a weight's gradient sums one product per trained pair, CFG branch and latent position (8 x 8), added in
    # another order by the chunked forward (and by the thread count)
    terms = int(step_mask.sum()) * (2 if guidance > 1 else 1) * 64
    for got, want in zip(chunked, [p.grad for p in unet.parameters()]):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=reordered_sum_atol(want, terms))
    assert any(g.abs().sum() > 0 for g in chunked)


@pytest.mark.parametrize("loss_name, kl_type, gated", [("vanilla", "gaussian", False), ("gspo", "gaussian", False),
                                                        ("geo_mean", "k3", False), ("vanilla", "k1", False),
                                                        ("vanilla", "gaussian", True), ("gspo", "gaussian", True)])
def test_loss_by_name_with_kl_term_is_independent_of_chunking(loss_name, kl_type, gated):
    """policy loss + beta * agg(g KL): chunk-wise backward (vanilla) or gathered log-probs (gspo, geo_mean) equal the
    registered loss on the whole batch's [b, T] matrix, whatever pairs_per_forward; ``gated``: the rows' KL weights g
    of kl.only_below_start (1, 0, 1), else g = 1."""
    from ddpo_group.algorithms import FixedKLController, agg_loss, aggregation_weights, get_kl_kind, get_policy_loss
    from ddpo_group.models.trainable import lora_config
    from ddpo_group.reference.model import ReferenceModel
    from ddpo_group.reference.regularizer import KLRegularizer

    torch.manual_seed(0)
    pipe = build_tiny_pipeline()
    config = get_config("grpo")
    config.sample.num_steps, config.train.clip_range, config.kl.beta = 4, 0.2, 0.5
    config.algorithm.policy_loss, config.kl.kind = loss_name, kl_type
    config.algorithm.loss_agg_mode = "traj-mean-step-mean"
    unet = pipe.unet
    unet.requires_grad_(False)
    unet.add_adapter(lora_config(config, StableDiffusionFamily.lora_target_modules))
    params = [p for p in unet.parameters() if p.requires_grad]
    prompts = ["a cat", "a dog", "a cow"]
    embeds, neg = encode_prompts(pipe, prompts), encode_prompts(pipe, [""])
    traj = sd_trajectories(pipe, embeds, neg.expand(3, -1, -1), 4, 5.0, 1.0, generator=torch.Generator().manual_seed(1))
    gates = torch.tensor([1.0, 0.0, 1.0]) if gated else torch.ones(3)
    batch = batch_of(traj, {"prompt_embeds": embeds},
                     advantages=torch.tensor([[1.0], [-0.5], [2.0]]).expand(3, 4).clone(),
                     kl_weights=gates if gated else None)
    with torch.no_grad():  # policy away from the sampling policy and from the reference (base)
        for p in params:
            p.add_(0.05 * torch.randn_like(p))
    step_mask = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float32)
    rows = torch.tensor([2, 0, 1])
    reference = ReferenceModel(unet, "base")
    grads = []
    for pairs in (1, 64):
        config.train.pairs_per_forward = pairs
        kl = KLRegularizer(reference, kl_type, FixedKLController(0.5), in_reward=False)
        updater = PolicyUpdater(UpdateOptions(config, Accelerator(cpu=True), unet, None, params,
                                              TransitionScorer.from_config(config, StableDiffusionFamily(pipe, config)), kl))
        unet.zero_grad()
        metrics = updater.accumulate_gradients(batch, rows, step_mask)
        assert metrics["kl"] != 0  # k1 may be negative on transitions sampled by another policy
        grads.append([p.grad.clone() for p in params])

    # direct: every trained pair in one forward, the registered loss on the [b, T] matrix
    unet.zero_grad()
    r, n = step_mask.nonzero(as_tuple=True)
    args = (batch.latents[rows[r], n], batch.next_latents[rows[r], n], batch.timesteps[rows[r], n],
            embeds[rows[r]], neg.expand(len(r), -1, -1), 5.0, 1.0)
    out = sd_step_output(pipe, unet, *args)
    with torch.no_grad(), reference.applied(unet) as reference_unet:
        reference_out = sd_step_output(pipe, reference_unet, *args)
    kl = get_kl_kind(kl_type)(out, reference_out)
    old = batch.log_probs[rows]
    lp = old.clone().index_put((r, n), out.log_prob)
    kl_mat = torch.zeros(3, 4).index_put((r, n), kl) * gates[rows][:, None]
    spec = get_policy_loss(loss_name)
    aggregation = (aggregation_weights(step_mask, "traj-mean-step-mean"),) if spec.per_step \
        else (step_mask, "traj-mean-step-mean")
    loss, _ = spec(old, lp, batch.advantages[rows], *aggregation, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0)
    (loss + 0.5 * agg_loss(kl_mat, step_mask, "traj-mean-step-mean")).backward()
    direct = [p.grad for p in params]
    terms = int(step_mask.sum()) * 2 * 64  # products per LoRA weight gradient: pairs, CFG branches, latent positions
    for chunked, whole, want in zip(grads[0], grads[1], direct):
        torch.testing.assert_close(chunked, want, rtol=1e-3, atol=reordered_sum_atol(want, terms))
        torch.testing.assert_close(whole, want, rtol=1e-3, atol=reordered_sum_atol(want, terms))
    assert any(g.abs().sum() > 0 for g in direct)


def test_random_step_mask_chooses_only_the_sde_windows_steps():
    from ddpo_group.sampling.window import sde_window_mask

    window = sde_window_mask(10, 2, 4)  # steps 2..5
    gen = torch.Generator().manual_seed(0)
    mask = random_step_mask(200, 10, 0.5, generator=gen, trainable=window)
    assert (mask.sum(1) == 2).all()  # int(4 * 0.5) steps of each trajectory
    assert mask[:, ~window].sum() == 0 and (mask[:, window].sum(0) > 0).all()  # every window step gets chosen
    full = random_step_mask(50, 10, 1.0, generator=gen, trainable=window)
    assert torch.equal(full, window.float().expand(50, -1))
    assert random_step_mask(3, 10, 0.01, generator=gen, trainable=window).sum(1).tolist() == [1.0] * 3
