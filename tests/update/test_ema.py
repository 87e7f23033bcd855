"""The EMA of the trainable weights (update/ema.py): Flow-GRPO's formula by hand, the swap in and out, the state
through a real checkpoint, the EMA-weighted LoRA export, and the resume check of train.ema."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from ddpo_group.errors import ConfigError
from ddpo_group.update.ema import EMAWeights, ema_decay


def test_warmed_up_decay_is_flow_grpos():
    assert ema_decay(0, 0.9) == 1 / 10
    assert ema_decay(7, 0.9) == 8 / 17  # the first update with interval 8
    assert ema_decay(79, 0.9) == 80 / 89 < 0.9
    assert ema_decay(80, 0.9) == 0.9  # 81 / 90: the warm-up ends here
    assert ema_decay(10_000, 0.9) == 0.9
    assert ema_decay(3, 0.0) == 0.0  # decay 0: the EMA is the weights at each update


def test_update_formula_by_hand_with_warm_up_and_interval():
    param = torch.nn.Parameter(torch.tensor([0.0, 10.0]))
    ema = EMAWeights([param], decay=0.9, interval=2)
    expected = torch.tensor([0.0, 10.0], dtype=torch.float64)
    for k, value in enumerate([[1.0, 8.0], [2.0, 6.0], [3.0, 4.0], [4.0, 2.0], [5.0, 0.0]], start=1):
        with torch.no_grad():
            param.copy_(torch.tensor(value))  # the weights after optimizer step k
        ema.step()
        if (k + 1) % 2 == 0:  # k = 1, 3, 5: decays 2/11, 4/13, 6/15
            d = min((1 + k) / (10 + k), 0.9)
            expected = expected + (1 - d) * (torch.tensor(value, dtype=torch.float64) - expected)
        assert torch.allclose(ema.shadow[0].double(), expected, atol=1e-6), k
    # by hand: k=1: 0 + 9/11 (1 - 0) = 0.81818; k=3: + 9/13 (3 - 0.81818) = 2.32867; k=5: + 9/15 (5 - 2.32867)
    assert ema.shadow[0][0].item() == pytest.approx(3.931469, abs=1e-5)
    assert (ema.steps, ema.updates, ema.last_decay) == (5, 3, 6 / 15)
    assert ema.metrics()["ema/param_distance"] == pytest.approx(
        float(torch.linalg.vector_norm(param.detach().double() - ema.shadow[0].double())), rel=1e-6)


def test_swapped_in_puts_the_ema_in_and_the_training_weights_back_bitwise():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    ema = EMAWeights(params, decay=0.5, interval=1)
    with torch.no_grad():
        for p in params:
            p.mul_(1.7).add_(0.3)
    ema.step()
    trained = [p.detach().clone() for p in params]
    with ema.swapped_in():
        assert all(torch.equal(p, e) for p, e in zip(params, ema.shadow))
        assert not torch.equal(params[0], trained[0])
    assert all(torch.equal(p, t) for p, t in zip(params, trained))
    with pytest.raises(RuntimeError), ema.swapped_in():
        raise RuntimeError("an evaluation failing inside")
    assert all(torch.equal(p, t) for p, t in zip(params, trained))  # restored on error too


def test_state_dict_round_trip_continues_bitwise_and_rejects_other_shapes():
    torch.manual_seed(1)
    param = torch.nn.Parameter(torch.randn(6))
    ema = EMAWeights([param], decay=0.9, interval=1)
    for _ in range(3):
        with torch.no_grad():
            param.add_(torch.randn(6))
        ema.step()
    state = ema.state_dict()
    other = EMAWeights([param], decay=0.9, interval=1)  # a resumed run: starts from the current weights, then loads
    other.load_state_dict(state)
    assert torch.equal(other.shadow[0], ema.shadow[0]) and other.steps == 3 and other.updates == 3
    with torch.no_grad():
        param.add_(1.0)
    ema.step(), other.step()
    assert torch.equal(other.shadow[0], ema.shadow[0]) and other.last_decay == ema.last_decay == 5 / 14  # k = 4
    with pytest.raises(ConfigError, match="other shapes"):
        EMAWeights([torch.nn.Parameter(torch.zeros(7))]).load_state_dict(state)


def test_ema_state_and_ema_lora_export_round_trip_through_a_checkpoint(tiny_model_dir, tmp_path):
    from helpers.trainer_helpers import tiny_trainer

    options = {"train.ema": True, "train.ema_update_interval": 1, "train.ema_export": True, "save_freq": 1}
    trainer = tiny_trainer("ddpo", tiny_model_dir, tmp_path, **options)
    trainer.run()
    ema = trainer.ema
    assert ema.steps == trainer.state.global_step == 2 and ema.updates == 2
    assert not torch.equal(ema.shadow[0], trainer.params[0].detach())  # the EMA lags the weights

    # the checkpoint's lora/ holds the EMA weights, not the training weights
    checkpoint = tmp_path / "run" / "checkpoints" / "checkpoint_00000"
    exported = load_file(str(checkpoint / "lora" / "pytorch_lora_weights.safetensors"))
    with ema.swapped_in():
        trainer.family.save_lora(trainer.model, tmp_path / "ema_lora")
    trainer.family.save_lora(trainer.model, tmp_path / "training_lora")
    as_ema = load_file(str(tmp_path / "ema_lora" / "pytorch_lora_weights.safetensors"))
    as_training = load_file(str(tmp_path / "training_lora" / "pytorch_lora_weights.safetensors"))
    assert exported.keys() == as_ema.keys()
    assert all(torch.equal(exported[k], as_ema[k]) for k in exported)
    assert any(not torch.equal(exported[k], as_training[k]) for k in exported)
    final = load_file(str(tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors"))  # the run's export too
    assert all(torch.equal(final[k], as_ema[k]) for k in as_ema)

    resumed = tiny_trainer("ddpo", tiny_model_dir, tmp_path, resume_from=str(tmp_path / "run"), **options)
    assert (resumed.ema.steps, resumed.ema.updates, resumed.ema.last_decay) == (2, 2, ema.last_decay)
    assert all(torch.equal(a, b) for a, b in zip(resumed.ema.shadow, ema.shadow))
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(resumed.params, trainer.params))


def test_resuming_with_another_train_ema_is_refused_and_old_checkpoints_count_as_without(tmp_path, tiny_model_dir):
    from helpers.trainer_helpers import tiny_config

    from ddpo_group.run.persistence.resume_check import STATE_FIELDS_FILE, check_resume, write_state_fields

    without = tiny_config("ddpo", tiny_model_dir, tmp_path)
    with_ema = tiny_config("ddpo", tiny_model_dir, tmp_path, **{"train.ema": True})
    write_state_fields(tmp_path, without, 1)
    assert check_resume(tmp_path, without, 1) == []
    with pytest.raises(ConfigError, match="train.ema: checkpoint False, config True"):
        check_resume(tmp_path, with_ema, 1)
    # a checkpoint written before train.ema existed held no EMA
    fields = json.loads((tmp_path / STATE_FIELDS_FILE).read_text())
    del fields["train.ema"]
    (tmp_path / STATE_FIELDS_FILE).write_text(json.dumps(fields))
    assert check_resume(tmp_path, without, 1) == []
    with pytest.raises(ConfigError, match="train.ema: checkpoint False, config True"):
        check_resume(tmp_path, with_ema, 1)
