"""The batch record is whole where it is made: every field's shape checked when a record is made (the estimator's
outputs too, added through dataclasses.replace), nothing assigned after, the pooled rows' reward info theirs; the
gathered round alike."""

import dataclasses

import pytest
import torch

from ddpo_group.rollout.collector import GatheredRound, pool_rows
from helpers.batch_helpers import rollout_batch

B, T = 4, 3


def record(offset: float = 0.0, **fields):
    latents = torch.arange(B * T * 2, dtype=torch.float32).view(B, T, 2) + offset
    info = {"color": torch.arange(B, dtype=torch.float32) + offset}
    return rollout_batch({"prompt_embeds": torch.zeros(B, 5, 8)}, latents, latents + 1, torch.zeros(B, T),
                         {"timesteps": torch.zeros(B, T)}, reward_info=info, **fields)


def test_an_estimator_field_of_the_wrong_shape_is_refused_where_the_record_is_made():
    batch = record()
    made = dataclasses.replace(batch, advantages=torch.ones(B, T), group_index=torch.arange(B))
    assert made.advantages.shape == (B, T) and batch.advantages is None  # a new record; the first one unchanged
    with pytest.raises(ValueError, match=r"advantages.: \(4, 4\)"):
        dataclasses.replace(batch, advantages=torch.ones(B, T + 1))
    with pytest.raises(ValueError, match=r"group_index.: 3"):
        dataclasses.replace(batch, group_index=torch.arange(B - 1))
    with pytest.raises(ValueError, match=r"tree_nodes.: \(4, 3\)"):
        dataclasses.replace(batch, tree_nodes=torch.zeros(B, T, dtype=torch.long))  # a state per step: T + 1
    with pytest.raises(ValueError, match=r"reward_info\['color'\].: 2"):
        dataclasses.replace(batch, reward_info={"color": torch.zeros(2)})


def test_nothing_is_assigned_into_a_record_after_it_is_made():
    batch = record()
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.advantages = torch.ones(B, T)


def test_pooled_rows_keep_their_own_reward_info_and_row_mask():
    first, second = record(), record(offset=100.0)
    keeps = [torch.tensor([True, False, True, False]), torch.tensor([False, True, True, True])]
    pooled = pool_rows([first, second], keeps, B)
    # the kept rows in round order (first's 0 and 2, second's 1 and 2), no padding needed
    assert pooled.reward_info["color"].tolist() == [0.0, 2.0, 101.0, 102.0]
    assert pooled.latents[:, 0, 0].tolist() == [0.0, 12.0, 106.0, 112.0]
    assert pooled.row_mask.tolist() == [1.0, 1.0, 1.0, 1.0]
    short = pool_rows([first, second], [torch.tensor([True, False, False, False]), torch.zeros(B, dtype=torch.bool)], B)
    assert short.reward_info["color"].tolist() == [0.0, 1.0, 2.0, 3.0]  # one kept row, then dropped ones as padding
    assert short.row_mask.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_a_gathered_round_of_other_lengths_is_refused():
    GatheredRound(rewards=torch.zeros(4), reward_info={"color": torch.zeros(4)}, values=torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"'values': 3"):
        GatheredRound(rewards=torch.zeros(4), reward_info={}, values=torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"'color': 2"):
        GatheredRound(rewards=torch.zeros(4), reward_info={"color": torch.zeros(2)})
