"""The batch record: one process's rollouts of an epoch, B samples of T steps (the index convention of
sampling/__init__.py: step n maps x_n to x_{n+1}).

Made by the collector (rollout/collect.py) from the sampled trajectories and their rewards; the estimator's outputs
are added on each round (rollout/rounds.py: ``advantages``, ``group_index``, the critic's targets) and dynamic
sampling pools the kept rows of several rounds (``row_mask``). The updaters, the critic, the KL term and the logger
read it by attribute. A field the collector must fill has no default, so a record without it fails where it is made;
the optional ones are None when the run does not use them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass
class RolloutBatch:
    # ---- made by the collector
    prompts: list[str]  # [B]
    metadata: list[dict]  # [B] the prompt function's metadata (an editing family's source images, ...)
    cond: dict[str, torch.Tensor]  # the condition, family.cond_keys (prompt_embeds, ...): [B, ...] each
    latents: torch.Tensor  # [B, T, ...] x_n: the state step n starts from
    next_latents: torch.Tensor  # [B, T, ...] x_{n+1}: the state step n reached (next_latents[:, -1]: the final latent)
    log_probs: torch.Tensor  # [B, T] l_n under the rollout policy (0 at deterministic steps)
    steps: dict[str, torch.Tensor]  # the family's per-step tensors, family.step_keys (timesteps, sigmas, ...): [B, T]
    images: torch.Tensor  # [B, 3, H, W] in [0, 1] (a video family's frames: [B, F, 3, H, W])
    rewards: torch.Tensor  # [B] float64, checked
    reward_info: dict[str, torch.Tensor]  # the reward's per-image info entries: [B] each, on the CPU
    # a prompt's own negative condition, family.cond_keys: [B, ...] each; None: every row has the family's one
    # (family.negative_condition())
    negative: dict[str, torch.Tensor] | None = None
    values: torch.Tensor | None = None  # [B, T] the critic's pre-step values V(x_n) (an estimator with a critic)
    pred_x0: torch.Tensor | None = None  # [B, T, ...] x0_hat(x_n) of every step (a critic that reads it)
    step_means: torch.Tensor | None = None  # [B, T, ...] mu_n of the rollout policy (a loss with needs_old_means)
    tweedie_values: torch.Tensor | None = None  # [B, T] float64 the rewards of the one-step predictions (rollout/tweedie.py)
    tree_nodes: torch.Tensor | None = None  # [B, T+1] tree rollouts: per state x_n, the first row sharing it
    # ---- added by the estimator (rollout/rounds.py)
    advantages: torch.Tensor | None = None  # [B, T]
    group_index: torch.Tensor | None = None  # [B] each row's prompt group
    critic_targets: torch.Tensor | None = None  # [B, T] what the critic regresses on (an estimator with a critic)
    critic_mask: torch.Tensor | None = None  # [B, T] 0/1: the steps it regresses on
    # ---- added by dynamic sampling's pooling (rollout/rounds.py)
    row_mask: torch.Tensor | None = None  # [B] 1 for a kept row, 0 for a dropped row that pads the batch (kept first)

    def __post_init__(self):
        size, num_steps = self.log_probs.shape
        shapes = {"prompts": len(self.prompts), "metadata": len(self.metadata), "latents": self.latents.shape[0],
                  "next_latents": self.next_latents.shape[0], "rewards": len(self.rewards),
                  **{f"cond[{key!r}]": len(value) for key, value in self.cond.items()},
                  **{f"steps[{key!r}]": len(value) for key, value in self.steps.items()}}
        wrong = {name: n for name, n in shapes.items() if n != size}
        if wrong or self.latents.shape[1] != num_steps:
            raise ValueError(f"a RolloutBatch of {size} rows x {num_steps} steps (log_probs) has fields of other "
                             f"lengths: {wrong or {'latents steps': self.latents.shape[1]}}")

    def __len__(self) -> int:
        return self.log_probs.shape[0]

    @property
    def num_steps(self) -> int:
        return self.log_probs.shape[1]

    @property
    def timesteps(self) -> torch.Tensor:
        return self.steps["timesteps"]

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

    def take(self, picks: list[tuple["RolloutBatch", int]]) -> "RolloutBatch":
        """A record of the rows ``picks`` (record, row) in order, from records of the same layout as this one;
        reward_info is this one's."""
        out = {}
        for f in fields(self):
            first = getattr(self, f.name)
            if f.name == "reward_info" or first is None:
                out[f.name] = first
            elif isinstance(first, list):
                out[f.name] = [getattr(batch, f.name)[i] for batch, i in picks]
            elif isinstance(first, dict):
                out[f.name] = {key: torch.stack([getattr(batch, f.name)[key][i] for batch, i in picks])
                               for key in first}
            else:
                out[f.name] = torch.stack([getattr(batch, f.name)[i] for batch, i in picks])
        return RolloutBatch(**out)
