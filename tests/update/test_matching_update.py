"""The matching objectives' update (update/matching_update.py) and the old model (update/old_model.py) in the trainer,
on the tiny random SD3 model; the presets on the embedded flow model."""

import pytest
import torch

from config.base import base
from ddpo_group.errors import ConfigError
from ddpo_group.update.old_model import OLD_ADAPTER, old_decay
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_trainer


def matching_overrides(**extra):
    return {**FAMILY_OVERRIDES["sd3"], "sample.deterministic": True, "kl.beta": 0.0, "kl.use_reference_model": False,
            **extra}


def lora_weights(model, adapter):
    return [p.detach().clone() for name, p in model.named_parameters() if f".{adapter}." in name]


def test_old_decay_schedule():
    assert [old_decay(k, 0, 0.001, 0.5) for k in (0, 10, 1000)] == [0.0, 0.01, 0.5]
    assert [old_decay(k, 75, 0.0075, 0.999) for k in (10, 75, 85, 10_000)] == [0.0, 0.0, pytest.approx(0.075), 0.999]


@pytest.mark.parametrize("objective", ["awm", "nft"])
def test_one_epoch_trains_on_final_samples(objective, tiny_sd3_dir, tmp_path):
    trainer = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, objective, **matching_overrides(**{
        "algorithm.objective": objective, "algorithm.old_decay_ramp": 0.25}))
    before = [p.detach().clone() for p in trainer.updater.params]
    model = trainer.accelerator.unwrap_model(trainer.model)
    policy_before = lora_weights(model, "default")
    metrics = trainer.run()
    assert metrics["global_step"] == 2 and torch.isfinite(torch.tensor(metrics["train/policy_loss"]))
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, trainer.updater.params))
    assert metrics["perf/pairs_trained"] == 8 * 4  # every sample at its 4 rollout times (step_fraction 1)
    # denoiser rows (CFG: 2 per sample): 8 samples x 4 steps; each pair's policy forward (and backward), nft's old model
    assert metrics["perf/nfe_sampling"] == 8 * 4 * 2 and metrics["perf/nfe_backward"] == 8 * 4 * 2
    assert metrics["perf/nfe_training"] == 8 * 4 * 2 * (2 if objective == "nft" else 1)
    if objective == "nft":
        # after 2 optimizer steps d = min(2 * 0.25, 0.5) = 0.5: old = 0.5 old_0 + 0.5 theta, old_0 the initial policy
        assert metrics["train/old_decay"] == 0.5
        policy, old = lora_weights(model, "default"), lora_weights(model, OLD_ADAPTER)
        assert len(old) == len(policy) == len(policy_before) > 0
        for o, p0, p1 in zip(old, policy_before, policy):
            assert torch.allclose(o, 0.5 * p0 + 0.5 * p1, atol=1e-7)
        assert metrics["train/old_param_distance"] > 0


def test_sft_trains_on_the_samples_above_the_threshold_only(tiny_sd3_dir, tmp_path):
    """sft: the kept share is the share of rows whose group advantage passes min_advantage (every pair of a row shares
    its advantage); a threshold no sample passes leaves a zero loss and no gradient."""
    trainer = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "sft", **matching_overrides(**{
        "algorithm.objective": "sft", "train.batch_size": 8}))
    batches = []
    original = trainer.updater.train_epoch
    trainer.updater.train_epoch = lambda batch, **kwargs: batches.append(batch) or original(batch, **kwargs)
    metrics = trainer.run()
    above = float((batches[0].advantages[:, 0] > 0).float().mean())
    assert 0 < above < 1 and metrics["train/kept"] == pytest.approx(above)
    assert metrics["train/policy_loss"] > 0
    none = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "none", **matching_overrides(**{
        "algorithm.objective": "sft", "algorithm.objective_kwargs": {"min_advantage": 1e9}}))
    metrics = none.run()
    assert metrics["train/kept"] == 0.0 and metrics["train/policy_loss"] == 0.0 and metrics["train/grad_norm"] == 0.0


def test_awm_trains_an_epoch_on_a_ddim_family_and_nft_is_refused(tiny_model_dir, tmp_path):
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "sd", **{
        "algorithm.objective": "awm", "sample.deterministic": True, "kl.beta": 0.0, "kl.use_reference_model": False})
    assert trainer.updater.forward.process == "ddpm"
    before = [p.detach().clone() for p in trainer.updater.params]
    metrics = trainer.run()
    assert torch.isfinite(torch.tensor(metrics["train/policy_loss"])) and metrics["perf/pairs_trained"] == 8 * 4
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, trainer.updater.params))
    with pytest.raises(ConfigError, match="nft.*defined on the \\('flow',\\) forward process.*'ddpm'"):
        tiny_trainer("grpo", tiny_model_dir, tmp_path, "sd_nft", **{
            "algorithm.objective": "nft", "sample.deterministic": True})


def test_config_contradictions_are_named(tiny_sd3_dir, tmp_path):
    with pytest.raises(ConfigError, match="sample.deterministic=True samples without log-probs"):
        tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "pg", **matching_overrides())
    with pytest.raises(ConfigError, match="algorithm.adv_estimator='gae' gives per-step advantages"):
        tiny_trainer("ppo_gae", tiny_sd3_dir, tmp_path, "gae", **matching_overrides(**{"algorithm.objective": "awm"}))
    with pytest.raises(ConfigError, match=r"algorithm.old_decay_max=1.0 must be in \[0, 1\)"):
        tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "max", **matching_overrides(**{
            "algorithm.objective": "nft", "algorithm.old_decay_max": 1}))


@pytest.mark.parametrize("preset", ["awm", "nft", "sft", "dpo", "dgpo"])
def test_preset_trains_an_epoch_on_the_embedded_flow_model(preset, tmp_path):
    from ddpo_group.models import load_pipeline

    try:
        load_pipeline("tiny-shapes-flow", config=base())
    except Exception as error:  # an install without the embedded models
        pytest.skip(f"the embedded tiny-shapes-flow model is not installed ({error})")
    trainer = tiny_trainer(preset, "tiny-shapes-flow", tmp_path, preset, **{
        "prompt_fn": "tiny_shapes_flow_hard", "reward_fn": "shapes_alignment", "sample.num_steps": 4,
        "train.learning_rate": 1.5e-3})
    assert trainer.config.sample.deterministic and trainer.config.algorithm.objective == preset
    before = [p.detach().clone() for p in trainer.updater.params]
    metrics = trainer.run()
    # dpo: 2 groups of 4 give 2 pairs, one train batch (train.batch_size / 2 = 2 pairs)
    assert trainer.family.name == "sd3" and metrics["global_step"] == (1 if preset == "dpo" else 2)
    assert torch.isfinite(torch.tensor(metrics["train/policy_loss"]))
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, trainer.updater.params))


@pytest.mark.parametrize("objective", ["nft", "dgpo"])
def test_resume_is_exact(objective, tiny_sd3_dir, tmp_path):
    """Two epochs in one run equal one epoch, a checkpoint and a resumed second epoch: the policy, nft's old adapter
    and the logged losses (the old model's bookkeeping, the pairs' noise and times survive a resume)."""
    overrides = matching_overrides(**{"algorithm.objective": objective, "algorithm.old_decay_ramp": 0.25,
                                      "save_freq": 1, "num_epochs": 2, "kl.use_reference_model": objective == "dgpo"})
    whole = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "whole", **overrides)
    whole_metrics = whole.run()
    first = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "parts", **{**overrides, "num_epochs": 1})
    first.run()
    resumed = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "parts", **{**overrides, "resume_from": str(first.run_dir)})
    resumed_metrics = resumed.run()
    assert resumed_metrics["epoch"] == 1
    for key in ("train/policy_loss", "reward_mean") + (("train/old_decay",) if objective == "nft" else ()):
        assert resumed_metrics[key] == whole_metrics[key], key
    for adapter in ("default", OLD_ADAPTER) if objective == "nft" else ("default",):
        a = lora_weights(whole.accelerator.unwrap_model(whole.model), adapter)
        b = lora_weights(resumed.accelerator.unwrap_model(resumed.model), adapter)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), adapter


def test_presets_and_published_recipes():
    from config.base import get_config
    from config.recipes import RECIPES
    from ddpo_group.run.config_checks import validate_config

    for name in ("awm", "nft", "sft", "dpo", "dgpo"):
        config = get_config(name)
        validate_config(config)  # the embedded model: no download
        assert (config.algorithm.objective, config.sample.deterministic, config.pretrained.model) == (
            name, True, "tiny-shapes-flow")
    assert (get_config("nft").sample.guidance_scale, get_config("nft").train.cfg) == (1.0, False)  # CFG-free
    nft, awm = get_config("nft_sd35"), get_config("awm_sd35")  # hub models: checked without loading them
    assert {"nft_sd35", "awm_sd35"} <= set(RECIPES)
    assert dict(nft.algorithm.objective_kwargs) == {"beta": 0.1, "adaptive_weight": True}
    assert (nft.algorithm.old_decay_flat_steps, nft.algorithm.old_decay_ramp, nft.algorithm.old_decay_max) == (
        75, 0.0075, 0.999)
    assert (nft.kl.beta, nft.train.group_size, nft.sample.guidance_scale) == (1e-4, 24, 1.0)
    assert dict(awm.algorithm.objective_kwargs) == {"weighting": "ghuber", "ghuber_power": 0.25}
    assert (awm.kl.beta, awm.sample.num_steps, awm.sample.guidance_scale) == (1e-3, 14, 1.0)

    dgpo, dpo = get_config("dgpo_sd35"), get_config("dpo_sd35")
    assert {"dgpo_sd35", "dpo_sd35"} <= set(RECIPES)
    for config, name in ((dgpo, "dgpo"), (dpo, "dpo")):
        assert config.pretrained.model == "stabilityai/stable-diffusion-3.5-medium"
        assert (config.algorithm.objective, config.sample.deterministic) == (name, True)
        assert (config.kl.use_reference_model, config.kl.beta) == (True, 0.0)
        s = config.sample
        assert s.batch_size * s.num_batches_per_epoch % config.train.group_size == 0  # whole groups on one process
        config.pretrained.family = "sd3"  # the family without reading the hub model's model_index.json
        validate_config(config)
    assert dict(dgpo.algorithm.objective_kwargs) == {"beta": 100.0}
    assert (dgpo.train.group_size, dgpo.sample.num_steps, dgpo.sample.eval_num_steps) == (16, 10, 14)
    assert (dgpo.sample.guidance_scale, dgpo.train.cfg, dgpo.algorithm.global_std) == (4.5, True, True)
    assert (dgpo.lora_rank, dgpo.lora_alpha, dgpo.train.learning_rate) == (64, 128, 3e-4)
    assert int(dgpo.sample.num_steps * dgpo.train.step_fraction) == 4  # their 4 training times a sample
    assert (dgpo.train.ema, dgpo.train.ema_decay, dgpo.train.ema_update_interval) == (True, 0.9, 8)
    dgpo.train.cfg = False  # the released script's conditional-only training forward after CFG sampling: refused
    with pytest.raises(ConfigError, match="train.cfg"):
        validate_config(dgpo)
    assert dict(dpo.algorithm.objective_kwargs) == {"beta": 100.0}
    assert (dpo.train.group_size, dpo.sample.num_steps, dpo.sample.guidance_scale, dpo.train.cfg) == (4, 40, 1.0, False)
    assert (dpo.algorithm.objective_times, dpo.algorithm.objective_time_shift) == ("logit_normal", 1.0)
    assert int(dpo.sample.num_steps * dpo.train.step_fraction) == 1  # one drawn time a pair
    assert (dpo.lora_rank, dpo.lora_alpha, dpo.train.learning_rate, dpo.reward_fn) == (32, 64, 1e-5, "pickscore")
    assert (dpo.train.ema_decay, dpo.train.ema_update_interval) == (0.99, 4)


def test_dpo_trains_each_groups_pair_and_equal_rewards_train_nothing(tiny_sd3_dir, tmp_path):
    overrides = matching_overrides(**{"algorithm.objective": "dpo", "kl.use_reference_model": True,
                                      "algorithm.objective_kwargs": {"beta": 100.0}})
    trainer = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "dpo", **overrides)
    before = [p.detach().clone() for p in trainer.updater.params]
    metrics = trainer.run()
    # 8 samples in 2 groups of 4: 2 pairs, each at its 4 times, 2 samples a unit
    assert metrics["train/preference_units"] == 2 and metrics["perf/pairs_trained"] == 2 * 4 * 2
    assert metrics["train/policy_loss"] == pytest.approx(float(torch.log(torch.tensor(2.0))), abs=0.05)
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, trainer.updater.params))
    # a constant reward: no group has a preference, no pair, no change
    plugin = tmp_path / "constant.py"
    plugin.write_text("import torch\n\ndef constant():\n    return lambda images, prompts, metadata: "
                      "(torch.ones(len(prompts)), {})\n")
    flat = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "flat", **{**overrides, "reward_fn": f"{plugin}:constant"})
    before = [p.detach().clone() for p in flat.updater.params]
    metrics = flat.run()
    assert metrics["train/preference_units"] == 0
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, flat.updater.params))
    with pytest.raises(ConfigError, match="kl.use_reference_model=True"):
        tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "noref", **{**overrides, "kl.use_reference_model": False})
    with pytest.raises(ConfigError, match=r"kl.beta=0.1 with algorithm.objective='dpo': the preference objective's "
                                          r"reference is in its loss already and no KL term is added"):
        tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "beta", **{**overrides, "kl.beta": 0.1})


def test_dgpo_trains_whole_groups(tiny_sd3_dir, tmp_path):
    trainer = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "dgpo", **matching_overrides(**{
        "algorithm.objective": "dgpo", "kl.use_reference_model": True}))
    before = [p.detach().clone() for p in trainer.updater.params]
    metrics = trainer.run()
    # 2 groups of 4, each at its 4 times: 2 x 4 x 4 (sample, time) pairs; one group per train batch (4 / 4)
    assert metrics["train/preference_units"] == 2 and metrics["perf/pairs_trained"] == 2 * 4 * 4
    assert metrics["global_step"] == 2
    assert metrics["train/policy_loss"] == pytest.approx(float(torch.log(torch.tensor(2.0))), abs=0.05)
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, trainer.updater.params))


def test_the_memory_probe_runs_on_preference_units(tiny_sd3_dir, tmp_path):
    """train.pairs_per_forward="auto" on CUDA probes accumulate_gradients with sample rows (update/memory_fit.py): on
    the preference update they wrap around the epoch's units (here on the CPU, the probe's call alone)."""
    from ddpo_group.update.memory_fit import probe_batch

    trainer = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "probe", **matching_overrides(**{
        "algorithm.objective": "dgpo", "kl.use_reference_model": True}))
    batch = trainer.rollouts.estimate(trainer.rollouts.collect(0)).batch
    assert trainer.updater.epoch_units(batch)[1] == {"preference_units": 2}  # 2 groups of 4 for 6 probed rows
    trainer.rollouts.close()
    probe, rows, mask = probe_batch(batch, 6, trainer.family.stochastic_steps(trainer.config.sample))
    sums = trainer.updater.accumulate_gradients(probe, rows, mask, pairs_per_forward=6)
    assert torch.isfinite(torch.as_tensor(sums["policy_loss"]))


@pytest.mark.parametrize("objective", ["dpo", "dgpo"])
def test_several_processes_need_whole_groups_on_each(objective):
    """A preference objective on several processes: each process's samples must hold whole prompt groups."""
    from config.base import get_config
    from ddpo_group.run.config_checks import validate_config

    config = get_config(objective)
    # 12 samples a process: 24 in all are 3 groups of 8, but a process would hold one and a half
    config.sample.batch_size, config.sample.num_batches_per_epoch, config.train.batch_size = 6, 2, 6
    with pytest.raises(ConfigError, match=rf"algorithm.objective='{objective}' needs whole prompt groups on each of "
                                          r"the 2 processes: train.group_size=8 must divide the samples per process, "
                                          r"sample.batch_size \* sample.num_batches_per_epoch = 6 \* 2 = 12"):
        validate_config(config, num_processes=2)
    config.train.group_size = 4  # 12 = 3 groups of 4 a process
    validate_config(config, num_processes=2)
    config.train.group_size, config.algorithm.objective = 8, "awm"  # a matching objective takes any split
    config.kl.use_reference_model = False
    validate_config(config, num_processes=2)


def test_pad_units():
    from ddpo_group.update.preference_update import pad_units

    units, real = pad_units(torch.tensor([[5, 2], [7, 6]]), 4, 2)
    assert units.tolist() == [[5, 2], [7, 6], [0, 1], [0, 1]] and real.tolist() == [True, True, False, False]
    units, real = pad_units(torch.zeros(0, 0, dtype=torch.long), 2, 3)  # no unit here: group_rows' empty answer
    assert units.tolist() == [[0, 1, 2], [0, 1, 2]] and real.tolist() == [False, False]
    with pytest.raises(ValueError, match="2 units of width 2 cannot be padded to 1 units of width 2"):
        pad_units(torch.tensor([[5, 2], [7, 6]]), 1, 2)


def test_padding_units_take_no_part_in_the_loss_or_the_metrics(tiny_sd3_dir, tmp_path):
    """The units another process's larger count adds here (several processes: ``pad_units``) run after the real ones
    and weigh nothing: an epoch of 2 dpo pairs (one train batch) gives the same first gradient and the same metrics
    padded to 4 units (a second train batch of padding only, which adds no metrics)."""
    from ddpo_group.update.preference_update import pad_units

    trainer = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "pad", **matching_overrides(**{  # bitwise: the CPU's kernels
        "algorithm.objective": "dpo", "kl.use_reference_model": True, "algorithm.objective_kwargs": {"beta": 100.0},
        "device": "cpu", "train.batch_size": 4}))
    updater = trainer.updater
    batch = trainer.rollouts.estimate(trainer.rollouts.collect(0)).batch
    trainer.rollouts.close()
    start = [p.detach().clone() for p in updater.params]
    grads, calls = [], []
    optimizer_step = updater.optimizer_step

    def first_gradient(metrics, *args):  # after each train batch's backward passes, before its optimizer step
        calls.append(metrics)
        if len(calls) == 1:
            grads.append([p.grad.clone() for p in updater.params if p.grad is not None])
        return optimizer_step(metrics, *args)

    updater.optimizer_step = first_gradient
    def padded_to(count):  # this process's units, padded to another process's count
        def epoch_units(b):
            real, info = type(updater).epoch_units(updater, b)
            assert real.tolist() == [True, True] and info == {"preference_units": 2}
            updater.units, real = pad_units(updater.units, count, 2)
            return real, info
        return epoch_units

    outs = []
    for count in (2, 4):
        updater.epoch_units = padded_to(count)
        with torch.no_grad():
            for p, p0 in zip(updater.params, start):
                p.copy_(p0)
        updater.optimizer.state.clear()
        calls.clear()
        torch.manual_seed(3)
        outs.append(updater.train_epoch(batch, show_progress=False))
        assert len(calls) == count // 2  # 2 units a train batch: padding adds a batch of its own
    alone, padded = outs
    assert padded["optimizer_steps"] == 2 and alone["optimizer_steps"] == 1 and padded["pairs"] == alone["pairs"]
    for key in ("accuracy", "implicit_score", "policy_loss"):
        assert padded[key] == alone[key], key
    assert 0.6 < alone["policy_loss"] < 0.8  # about log 2 at the reference
    assert len(grads[0]) == len(grads[1]) > 0 and any(bool(g.abs().max() > 0) for g in grads[0])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("family, times", [("sd3", "logit_normal"), ("sd", "uniform")])
def test_drawn_training_times(family, times, tiny_sd3_dir, tiny_model_dir, tmp_path):
    model = tiny_sd3_dir if family == "sd3" else tiny_model_dir
    overrides = {**(matching_overrides() if family == "sd3" else {"sample.deterministic": True, "kl.beta": 0.0,
                                                                  "kl.use_reference_model": False}),
                 "algorithm.objective": "awm", "algorithm.objective_times": times, "algorithm.objective_time_shift": 3.0}
    trainer = tiny_trainer("grpo", model, tmp_path, family, **overrides)
    batch = trainer.rollouts.estimate(trainer.rollouts.collect(0)).batch
    trainer.rollouts.close()
    r, n = torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2])
    times = trainer.updater.forward.train_times(batch, r, n)
    scheduled = {key: batch.times[key][r, n] for key in trainer.family.time_keys}
    assert not torch.equal(times["timesteps"].cpu(), scheduled["timesteps"].cpu())  # drawn, not the rollout's
    if family == "sd3":
        assert torch.allclose(times["timesteps"], times["sigmas"] * 1000)
    else:
        assert times["timesteps"].dtype == scheduled["timesteps"].dtype and int(times["timesteps"].max()) < 1000
    with pytest.raises(ConfigError, match="algorithm.objective_times='x' must be one of"):
        tiny_trainer("grpo", model, tmp_path, "bad", **{**overrides, "algorithm.objective_times": "x"})


def test_awm_with_an_old_model_kl_samples_with_the_policy(tiny_sd3_dir, tmp_path):
    trainer = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "awm_old", **matching_overrides(**{
        "algorithm.objective": "awm", "algorithm.objective_kwargs": {"old_kl_beta": 0.1},
        "algorithm.old_decay_ramp": 0.25}))
    assert trainer.old is not None
    model = trainer.accelerator.unwrap_model(trainer.model)
    with trainer.updater.rollout_policy(trainer.sampling_model):  # no adapter switch: awm's old model only regularises
        assert model.active_adapters() == ["default"]
    policy_before = lora_weights(model, "default")
    metrics = trainer.run()
    # the old model is the policy on the first step and lags it on the second (the epoch's mean: > 0, a square's)
    assert metrics["train/old_decay"] == 0.5 and metrics["train/old_kl"] > 0
    for o, p0, p1 in zip(lora_weights(model, OLD_ADAPTER), policy_before, lora_weights(model, "default")):
        assert torch.allclose(o, 0.5 * p0 + 0.5 * p1, atol=1e-7)


def test_nft_samples_with_the_old_model(tiny_sd3_dir, tmp_path):
    trainer = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "nft_old", **matching_overrides(**{
        "algorithm.objective": "nft"}))
    model = trainer.accelerator.unwrap_model(trainer.model)
    with trainer.updater.rollout_policy(trainer.sampling_model) as sampler:
        assert sampler is model and model.active_adapters() == [OLD_ADAPTER]
    assert model.active_adapters() == ["default"]
    assert any(p.requires_grad for name, p in model.named_parameters() if ".default." in name)
    assert not any(p.requires_grad for name, p in model.named_parameters() if f".{OLD_ADAPTER}." in name)
    trainer.rollouts.close()
    # full fine-tuning: the old model is a copy of the denoiser, and the rollouts sample with that copy
    full = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "nft_full", **matching_overrides(**{
        "algorithm.objective": "nft", "use_lora": False}))
    with torch.no_grad():  # an old model whose velocity is 0: its deterministic steps leave the latents as they are
        for param in full.old.weights.copy.parameters():
            param.zero_()
    with full.updater.rollout_policy(full.sampling_model) as sampler:
        assert sampler is full.old.weights.copy and sampler is not full.family.model
        batch = full.rollouts.collect(0, sampler)[0].batch
    assert torch.equal(batch.next_latents, batch.latents)
    policy_batch = full.rollouts.collect(0)[0].batch  # the policy's (the default) moves them
    assert float((policy_batch.next_latents - policy_batch.latents).abs().max()) > 1e-3
    full.rollouts.close()
    # an objective without an old model samples with the policy's sampling denoiser
    policy = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "grpo", **FAMILY_OVERRIDES["sd3"])
    with policy.updater.rollout_policy(policy.sampling_model) as sampler:
        assert sampler is policy.sampling_model is policy.family.model
    policy.rollouts.close()


def test_the_kl_term_weighs_each_row_by_its_prompts_gate(tiny_sd3_dir, tmp_path):
    """kl.only_below_start on a matching objective: a row of gate 0 adds no KL term, the gates add up (the same
    training times and noise; a learning rate of 1e-12 keeps the weights)."""
    from dataclasses import replace

    trainer = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "gated", **matching_overrides(**{
        "algorithm.objective": "awm", "kl.beta": 0.5, "kl.use_reference_model": True, "kl.only_below_start": True,
        "train.learning_rate": 1e-12}))
    with torch.no_grad():  # the policy away from its reference (the base model)
        for p in trainer.updater.params:
            p.add_(0.05 * torch.randn_like(p))
    batch = trainer.rollouts.estimate(trainer.rollouts.collect(0)).batch
    assert batch.kl_weights is not None and batch.kl_weights.tolist() == [0.0] * len(batch)  # no start known yet
    n = len(batch)
    half = (torch.arange(n) % 2).float()

    def kl_loss(gates):
        torch.manual_seed(0)
        metrics = trainer.updater.train_epoch(replace(batch, kl_weights=gates), show_progress=False)
        return metrics["kl_loss"], metrics["kl"]

    (none, kl0), (every, kl1), (odd, _), (even, _) = map(kl_loss, (torch.zeros(n), torch.ones(n), half, 1 - half))
    assert none == 0 and every > 0 and kl0 == kl1 > 0  # the KL itself is measured on every row
    assert 0 < odd < every and odd + even == pytest.approx(every, rel=1e-5)
