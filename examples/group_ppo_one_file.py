"""The main job in one file: GROUP_PPO on the embedded model (``config/base.py:group_ppo``), an epoch read top to
bottom as CleanRL writes one, with the policy update written out flat.

    python examples/group_ppo_one_file.py [--epochs 3] [--set train.learning_rate=1e-3 ...]

What ``Trainer.train_epoch`` (ddpo_group/run/trainer.py) spreads over its modules is here in one loop: the rollouts
and the advantages come from the package (steps 1 and 2), the policy update is written out (step 3: the loop of
update/updater.py and the loss of update/policy_update.py, the vanilla policy loss, no KL term: the preset's), the
components' updates (the critic, GROUP_PPO's threshold) and the evaluation are the package's again (steps 4, 5).
tests/end_to_end/test_one_file.py checks ``policy_update`` against the package's updater: from the same batch and
random state, the same trained weights bitwise. The index convention is sampling/__init__.py's: step n maps x_n to
x_{n+1}; a trajectory's T steps are the token axis of an LLM trainer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config.base import get_config  # noqa: E402
from ddpo_group.algorithms.aggregation import aggregation_weights  # noqa: E402
from ddpo_group.run.trainer import Trainer  # noqa: E402
from ddpo_group.sampling.trajectories import rows_of  # noqa: E402
from ddpo_group.update.updater import random_step_mask  # noqa: E402


def policy_update(trainer: Trainer, batch) -> float:
    """Step 3 of an epoch, flat: ``train.num_inner_epochs`` passes over this process's samples; each train batch's
    (sample, step) pairs run ``pairs_per_forward`` at a time through the denoiser, the clipped surrogate of their
    log-probability ratios weighted by the aggregation weights, one optimizer step per train batch. Returns the mean
    loss of the train batches."""
    config, family, model = trainer.config, trainer.family, trainer.model
    train, sample, device = config.train, config.sample, trainer.accelerator.device
    family.schedule(sample.num_steps, device)  # a DDIM step reads its previous timestep from the schedule
    guidance, noise_level = family.training_guidance(config), family.noise_level(sample)
    pairs_per_forward = trainer.updater.pairs_per_forward_of(batch)  # train.pairs_per_forward ("auto": 32 on the CPU)
    num_samples, num_steps = batch.log_probs.shape
    losses = []
    model.train()
    for _ in range(train.num_inner_epochs):
        order = torch.randperm(num_samples)  # the samples shuffled
        # int(W x step_fraction) of each sample's W trainable steps (the SDE window's), drawn at random (DDPO's)
        step_mask = random_step_mask(num_samples, num_steps, train.step_fraction,
                                     trainable=family.stochastic_steps(sample))
        for start in range(0, num_samples, train.batch_size):  # a train batch: one optimizer step
            rows, loss_sum = order[start : start + train.batch_size], 0.0
            pair_rows, pair_steps = step_mask[rows].nonzero(as_tuple=True)  # its (sample, step) pairs
            weights = aggregation_weights(step_mask[rows], config.algorithm.loss_agg_mode)[pair_rows, pair_steps]
            pair_rows = rows[pair_rows]
            for chunk in torch.split(torch.arange(len(pair_rows)), max(1, pairs_per_forward)):
                r, n, w = pair_rows[chunk].to(device), pair_steps[chunk].to(device), weights[chunk].to(device)
                # 1. l_theta: the recorded step x_n -> x_{n+1} under the policy, the guided denoiser output, then the
                #    DDIM step's Gaussian log-density of x_{n+1} (sampling/ddim.py: its numbered math)
                times = {key: batch.times[key][r, n] for key in family.time_keys}
                latents = batch.latents[r, n]
                output = family.model_output(model, latents, times, rows_of(batch.cond, r),
                                             batch.negative_rows(family, r), guidance)
                log_prob = family.step(output, latents, times, noise_level, next_latents=batch.next_latents[r, n],
                                       reduce=sample.log_prob_reduce, log_prob_dtype=sample.log_prob_dtype).log_prob
                # 2. the ratio to the rollout's l_rollout, PPO's clipped surrogate L = max(-A r, -A clip(r, 1 +- eps))
                ratio = torch.exp((log_prob - batch.log_probs[r, n]).clamp(-20.0, 20.0))
                advantages = batch.advantages[r, n]
                surrogate = torch.maximum(-advantages * ratio,
                                          -advantages * ratio.clamp(1.0 - train.clip_range, 1.0 + train.clip_range))
                # 3. the aggregation: sum w L (w: algorithm.loss_agg_mode's weights of the train batch's pairs)
                loss = (w * surrogate.masked_fill(w == 0, 0.0)).sum()
                loss.backward()  # the chunks' gradients add up to the train batch's
                loss_sum += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(trainer.params, train.max_grad_norm)
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
            losses.append(loss_sum)
    model.eval()
    return sum(losses) / max(len(losses), 1)


def train_epoch(trainer: Trainer, epoch: int) -> dict:
    """One epoch of the main job."""
    if epoch == 0:
        trainer.evaluations.before_training()  # the evaluation before any update
    # 1. sample and score: 32 images (4 prompts x group 8) with their log-probs and rewards, the critic's values
    rounds = trainer.rollouts.collect(epoch, trainer.sampling_model)
    # 2. advantages: GROUP_PPO's (algorithms/group_ppo.py) on the whole round
    estimated = trainer.rollouts.estimate(rounds)
    # 3. the policy update, written out above (not while the critic warms up: critic.warmup_epochs)
    warming_up = not all(component.trains_policy(epoch) for component in trainer.components)
    loss = float("nan") if warming_up else policy_update(trainer, estimated.batch)
    # 4. the components' updates: the critic's regression, GROUP_PPO's threshold controller
    metrics = {"reward_mean": float(estimated.rewards.mean()), "policy_loss": loss}
    for component in trainer.components:
        metrics.update(component.after_update(epoch, estimated, {}))
    # 5. the evaluation when due (fixed prompts and noise, the deterministic sampler)
    metrics.update(trainer.evaluations.after_epoch(epoch))
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--logdir", default="logs")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="config fields, e.g. seed=1")
    args = parser.parse_args()
    config = get_config("group_ppo")
    config.num_epochs, config.logdir, config.wandb.mode = args.epochs, args.logdir, "disabled"
    for item in args.set:
        field, _, value = item.partition("=")
        section, _, name = field.rpartition(".")
        target = config[section] if section else config
        target[name] = type(target[name])(value) if not isinstance(target[name], bool) else value == "True"
    trainer = Trainer(config)
    try:
        for epoch in range(config.num_epochs):
            metrics = train_epoch(trainer, epoch)
            evaluated = f", evaluation {metrics['eval/reward_mean']:.4f}" if "eval/reward_mean" in metrics else ""
            print(f"epoch {epoch}: reward {metrics['reward_mean']:.4f}, loss {metrics['policy_loss']:.3g}{evaluated}")
    finally:
        trainer.rollouts.close()


if __name__ == "__main__":
    main()
