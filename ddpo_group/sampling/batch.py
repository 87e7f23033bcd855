"""The batch record: one process's rollouts of an epoch, B samples of T steps (the index convention of
sampling/__init__.py: step n maps x_n to x_{n+1}).

Made by the sampler (rollout/sampler.py) from the sampled trajectories and their rewards; each round's record is made
again with the estimator's outputs (rollout/collector.py: ``advantages``, ``group_index``, the critic's targets,
through ``dataclasses.replace``), and dynamic sampling pools the kept rows of several rounds into a new record
(``take``, with ``row_mask``). Nothing is assigned into a record after it is made: every record passes the same check
of its fields' shapes when it is made. The updaters, the critic, the KL term and the logger read it by attribute. A
field the sampler must fill has no default, so a record without it fails where it is made; the optional ones are None
when the run does not use them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass(frozen=True)
class RolloutBatch:
    # ---- made by the collector
    prompts: list[str]  # [B]
    metadata: list[dict]  # [B] the prompt function's metadata (an editing family's source images, ...)
    cond: dict[str, torch.Tensor]  # the condition, family.cond_keys (prompt_embeds, ...): [B, ...] each
    latents: torch.Tensor  # [B, T, ...] x_n: the state step n starts from
    next_latents: torch.Tensor  # [B, T, ...] x_{n+1}: the state step n reached (next_latents[:, -1]: the final latent)
    log_probs: torch.Tensor  # [B, T] l_n under the rollout policy (0 at deterministic steps)
    # each step's times, family.time_keys (timesteps, sigmas, ...): [B, T]; and the values the guidance carries into
    # each step, family.carried_keys (HunyuanImage 2.1's APG momentum): [B, T, ...]
    times: dict[str, torch.Tensor]
    images: torch.Tensor  # [B, 3, H, W] in [0, 1] (a video family's frames: [B, F, 3, H, W])
    rewards: torch.Tensor  # [B] float64, checked
    reward_info: dict[str, torch.Tensor]  # the reward's per-image info entries: [B, ...] each, on the CPU
    # a prompt's own negative condition, family.cond_keys: [B, ...] each; None: every row has the family's one
    # (family.negative_condition())
    negative: dict[str, torch.Tensor] | None = None
    values: torch.Tensor | None = None  # [B, T] the critic's pre-step values V(x_n) (an estimator with a critic)
    clean_hat: torch.Tensor | None = None  # [B, T, ...] clean_hat(x_n) of every step n (a critic that reads it)
    step_means: torch.Tensor | None = None  # [B, T, ...] mu_n of the rollout policy (a loss with needs_rollout_means)
    tweedie_values: torch.Tensor | None = None  # [B, T] float64 the rewards of the one-step predictions (rollout/tweedie.py)
    tree_nodes: torch.Tensor | None = None  # [B, T+1] tree rollouts: per state x_n, the first row sharing it
    # ---- the estimator's (rollout/collector.py)
    advantages: torch.Tensor | None = None  # [B, T]
    group_index: torch.Tensor | None = None  # [B] each row's prompt group
    kl_weights: torch.Tensor | None = None  # [B] the KL term's weight of each row (kl.only_below_start's gates)
    critic_targets: torch.Tensor | None = None  # [B, T] what the critic regresses on (an estimator with a critic)
    critic_mask: torch.Tensor | None = None  # [B, T] 0/1: the steps it regresses on
    # ---- dynamic sampling's pooling (rollout/collector.py)
    row_mask: torch.Tensor | None = None  # [B] 1 for a kept row, 0 for a dropped row that pads the batch (kept first)

    def __post_init__(self):
        """Every field's leading dimensions: [B] rows, [B, T] per-step (B, T: log_probs'), [B, T+1] per state."""
        size, num_steps = self.log_probs.shape
        per_row = {"prompts": self.prompts, "metadata": self.metadata, "rewards": self.rewards,
                   "group_index": self.group_index, "row_mask": self.row_mask,
                   "kl_weights": self.kl_weights,
                   **{f"cond[{key!r}]": value for key, value in self.cond.items()},
                   **{f"negative[{key!r}]": value for key, value in (self.negative or {}).items()},
                   **{f"reward_info[{key!r}]": value for key, value in self.reward_info.items()}}
        per_step = {"latents": self.latents, "next_latents": self.next_latents, "values": self.values,
                    "clean_hat": self.clean_hat, "step_means": self.step_means, "tweedie_values": self.tweedie_values,
                    "advantages": self.advantages, "critic_targets": self.critic_targets,
                    "critic_mask": self.critic_mask, **{f"times[{key!r}]": value for key, value in self.times.items()}}
        wrong = {name: len(value) for name, value in per_row.items() if value is not None and len(value) != size}
        wrong.update({name: tuple(value.shape[:2]) for name, value in per_step.items()
                      if value is not None and tuple(value.shape[:2]) != (size, num_steps)})
        if self.tree_nodes is not None and tuple(self.tree_nodes.shape) != (size, num_steps + 1):
            wrong["tree_nodes"] = tuple(self.tree_nodes.shape)
        if wrong:
            raise ValueError(f"a RolloutBatch of {size} rows x {num_steps} steps (log_probs) has fields of other "
                             f"lengths: {wrong}")

    def __len__(self) -> int:
        return self.log_probs.shape[0]

    def kl_pair_weights(self, weights, rows: torch.Tensor):
        """The KL term's weights of pairs of ``rows``: their aggregation ``weights`` times each row's gate (kl_weights,
        kl.only_below_start), or ``weights`` themselves without gates."""
        return weights if self.kl_weights is None else weights * self.kl_weights[rows]

    @property
    def num_steps(self) -> int:
        return self.log_probs.shape[1]

    @property
    def timesteps(self) -> torch.Tensor:
        return self.times["timesteps"]

    def negative_rows(self, family, rows) -> dict:
        """The negative condition of some rows: their own when the record has one, else the family's one row."""
        if self.negative is not None:
            return {key: value[rows] for key, value in self.negative.items()}
        return family.negative_condition()

    def with_negative(self, family) -> "RolloutBatch":
        """This record with every row's negative condition (the family's one row repeated when it has none of its own),
        so that it pools row by row with records that have their own."""
        if self.negative is not None:
            return self
        n = len(self)
        one = family.negative_condition()
        return replace(self, negative={key: value.expand(n, *value.shape[1:]).clone() for key, value in one.items()})

    def take(self, picks: list[tuple["RolloutBatch", int]], **given) -> "RolloutBatch":
        """A record of the rows ``picks`` (record, row) in order, from records of the same layout as this one (the
        reward info's entries that all of them hold), with the fields ``given`` (e.g. row_mask)."""
        out = dict(given)
        for f in fields(self):
            first = getattr(self, f.name)
            if f.name in out:
                continue
            if f.name == "reward_info":
                out[f.name] = {key: torch.stack([batch.reward_info[key][i] for batch, i in picks]) for key in first
                               if all(key in batch.reward_info for batch, _ in picks)}
            elif first is None:
                out[f.name] = first
            elif isinstance(first, list):
                out[f.name] = [getattr(batch, f.name)[i] for batch, i in picks]
            elif isinstance(first, dict):
                out[f.name] = {key: torch.stack([getattr(batch, f.name)[key][i] for batch, i in picks])
                               for key in first}
            else:
                out[f.name] = torch.stack([getattr(batch, f.name)[i] for batch, i in picks])
        return RolloutBatch(**out)
