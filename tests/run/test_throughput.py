"""Throughput in the logs (run/reporting/throughput.py): FLOP counts against hand counts, perf/* of a real epoch from its
logged counts and times, MFU from the once-counted model FLOPs, the console line and the run summary."""

import json

import pytest
import torch

from ddpo_group.run.reporting import throughput
from ddpo_group.run.reporting.epoch_logger import perf_line
from ddpo_group.run.reporting.summary import format_summary
from ddpo_group.run.reporting.throughput import count_flops, measure_model_flops, peak_flops
from helpers.trainer_helpers import tiny_trainer


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_linear_flops_match_the_hand_count():
    """y = x W^T + b, x [batch, in]: forward 2*batch*in*out; backward w.r.t. W and x twice that again."""
    batch, n_in, n_out = 3, 8, 4
    linear, x = torch.nn.Linear(n_in, n_out), torch.randn(batch, n_in, requires_grad=True)
    forward = 2 * batch * n_in * n_out
    assert count_flops(lambda: linear(x)) == forward
    assert count_flops(lambda: linear(x).sum().backward()) == 3 * forward
    # a frozen weight (LoRA's base): only the input's gradient is computed
    linear.weight.requires_grad_(False)
    assert count_flops(lambda: linear(x).sum().backward()) == 2 * forward


def test_attention_flops_on_the_cpu_as_on_cuda():
    """softmax(q k^T / sqrt(d)) v, q k v [b, h, s, d]: two products of 2*b*h*s*s*d FLOPs each; the backward five
    (the scores recomputed, then four gradient products), as torch counts CUDA's fused kernels."""
    b, h, s, d = 2, 4, 16, 8
    q = torch.randn(b, h, s, d, requires_grad=True)
    attention = torch.nn.functional.scaled_dot_product_attention
    forward = 2 * (2 * b * h * s * s * d)
    assert count_flops(lambda: attention(q, q, q)) == forward
    assert count_flops(lambda: attention(q, q, q).sum().backward()) == forward + 5 * forward // 2


def test_peak_table():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16", tf32=False) == 989e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "no", tf32=True) == 494e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "no", tf32=False) == 67e12
    assert peak_flops("NVIDIA H100 PCIe", "fp16", tf32=False) == 756e12
    assert peak_flops("NVIDIA H200", "bf16", tf32=False) == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "bf16", tf32=False) == 312e12
    assert peak_flops("NVIDIA L40S", "bf16", tf32=False) == 362e12
    assert peak_flops("NVIDIA L4", "bf16", tf32=False) == 121e12
    assert peak_flops("NVIDIA GeForce RTX 4090", "bf16", tf32=False) == 165e12
    assert peak_flops("Some Future GPU", "bf16", tf32=False) is None
    assert throughput.device_peak_flops(torch.device("cpu"), "no") == (None, None)


def test_model_flops_count_cfg_rows_and_the_reference_forward(tiny_model_dir, tmp_path):
    """F_image = num_steps * one guided forward (CFG: twice an unguided one); the reference forward adds one
    forward with the training guidance; gradients and random streams are left as they were."""
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path)
    batch = trainer.rollouts.estimate(trainer.rollouts.collect(0)).batch
    model, params, steps = trainer.accelerator.unwrap_model(trainer.model), trainer.params, trainer.config.sample.num_steps
    grads = [torch.full_like(p, 0.5) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    rng = torch.get_rng_state()

    def measure(guidance, reference):
        return measure_model_flops(trainer.scorer, model, batch, params, 0, guidance, steps, reference)

    assert trainer.scorer.guidance_scale == 5.0  # train.cfg: the training forward is guided too
    plain, guided, with_ref = measure(1.0, False), measure(5.0, False), measure(5.0, True)
    assert guided.sample_per_image == 2 * plain.sample_per_image > 0
    forward = guided.sample_per_image // steps  # one guided forward: the reference's
    assert with_ref.train_per_pair == guided.train_per_pair + forward
    # LoRA: activation gradients through the frozen weights (not of the inputs: latents, text), adapters' weight gradients
    assert forward < guided.train_per_pair < 3 * forward
    assert all(p.grad is g for p, g in zip(params, grads)) and torch.equal(torch.get_rng_state(), rng)
    # gradient checkpointing's recomputation is not the model's work: the same count with it on, and it stays on
    model.enable_gradient_checkpointing()
    try:
        assert measure(5.0, False) == guided and model.is_gradient_checkpointing
    finally:
        model.disable_gradient_checkpointing()


def test_an_epoch_logs_its_throughput(tiny_model_dir, tmp_path, capsys):
    """perf/* from the logged counts and times (exactly), memory, no MFU without a known peak (CPU); the console
    line and the summary show them. The denoiser evaluations by hand; the evaluation during training adds none."""
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "perf", num_epochs=2, eval_freq=1)
    trainer.run()
    config = trainer.config
    for record in records(tmp_path / "perf"):
        images = config.sample.batch_size * config.sample.num_batches_per_epoch  # one process, one round
        assert record["perf/images_sampled"] == record["reward_count"] == images
        trained_steps = int(int(trainer.family.stochastic_steps(config.sample).sum()) * config.train.step_fraction)
        assert record["perf/pairs_trained"] == config.train.num_inner_epochs * images * trained_steps
        rows = 2  # CFG: a conditional and an unconditional row per sample, in sampling and (train.cfg) in training
        assert record["perf/nfe_sampling"] == images * config.sample.num_steps * rows
        # every trained pair: the policy's forward, backpropagated, and the reference's (kl.beta > 0, no gradient)
        assert record["perf/nfe_backward"] == record["perf/pairs_trained"] * rows
        assert record["perf/nfe_training"] == 2 * record["perf/nfe_backward"]
        assert record["perf/nfe"] == sum(record[f"perf/nfe_{part}"] for part in ("sampling", "training", "backward"))
        assert record["perf/images_per_s"] == record["perf/images_sampled"] / record["time/sampling"]
        assert record["perf/pairs_per_s"] == record["perf/pairs_trained"] / record["time/training"]
        assert record["perf/rss_gb"] > 0
        if trainer.accelerator.device.type == "cuda":  # the in-process trainer takes accelerate's default device
            assert record["perf/cuda_max_allocated_gb"] > 0
        else:
            assert not [key for key in record if key.startswith(("perf/cuda", "perf/mfu", "perf/tflop"))]
    out = capsys.readouterr().out
    assert "img/s)" in out and "pairs/s)" in out and "GiB RSS" in out
    summary = (tmp_path / "perf" / "summary.txt").read_text()
    assert "img/s sampled" in summary and "pairs/s trained" in summary and "(epoch 1)" in summary
    assert "GiB RSS" in summary


def test_mfu_from_the_model_flops_counted_once(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """With a known peak (here 1 TFLOP/s, on any device) the FLOPs are counted once and MFU is
    pairs * F_pair / (time/training * peak), images * F_image / (time/sampling * peak)."""
    peak = 1e12
    monkeypatch.setattr(throughput, "device_peak_flops", lambda device, precision: (peak, None))
    calls = []
    measure = throughput.measure_model_flops
    monkeypatch.setattr("ddpo_group.run.trainer.measure_model_flops", lambda *a, **k: calls.append(1) or measure(*a, **k))
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, "mfu", num_epochs=2)
    trainer.run()
    assert len(calls) == 1
    first, last = records(tmp_path / "mfu")
    assert first["perf/tflop_per_pair"] == last["perf/tflop_per_pair"] > 0
    for r in (first, last):
        assert r["perf/mfu_training"] == pytest.approx(
            r["perf/pairs_trained"] * r["perf/tflop_per_pair"] * 1e12 / (r["time/training"] * peak), rel=1e-12)
        assert r["perf/mfu_sampling"] == pytest.approx(
            r["perf/images_sampled"] * r["perf/tflop_per_image"] * 1e12 / (r["time/sampling"] * peak), rel=1e-12)
    assert "model FLOPs:" in capsys.readouterr().out
    assert "MFU" in perf_line(last) and "MFU" in (tmp_path / "mfu" / "summary.txt").read_text()


def test_unknown_gpu_is_said_once(monkeypatch):
    class Accelerator:
        device, is_main_process, num_processes = torch.device("cuda"), True, 1

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    said = []
    perf = throughput.Throughput(Accelerator(), "bf16", measure=None, print_fn=said.append)
    assert perf.peak is None and len(said) == 1 and "Some Future GPU" in said[0]


def test_summary_rates_are_ratios_of_sums_after_the_first_epoch():
    def record(epoch, images, seconds, mfu):
        return {"epoch": epoch, "reward_mean": 0.0, "perf/images_sampled": images, "time/sampling": seconds,
                "perf/pairs_trained": 10, "time/training": 1.0, "perf/rss_gb": 1.0 + epoch,
                "perf/mfu_sampling": mfu, "perf/mfu_training": 0.2}

    text = format_summary([record(0, 8, 100.0, 0.01), record(1, 8, 1.0, 0.3), record(2, 8, 3.0, 0.1)], {})
    assert "4 img/s sampled, 10 pairs/s trained  (epochs 1..2)" in text  # 16 images in 4 s; warm-up left out
    assert "3.00 GiB RSS" in text and "15% sampling" in text and "20% training" in text  # (0.3 + 0.3) / 4


def test_denoiser_evaluations_count_rows_by_part_however_the_latents_are_passed():
    """Rows counted into the part named (backward: forwards with gradients while training); positional, keyword or a
    list of per-sample latents; nothing outside a part."""
    from ddpo_group.run.reporting.throughput import DenoiserEvaluations

    module, count = torch.nn.Linear(3, 3), DenoiserEvaluations()
    count.watch(module)
    module(torch.zeros(2, 3))  # outside a part
    with count.counting("sampling"), torch.no_grad():
        module(torch.zeros(4, 3))
        module(input=torch.zeros(5, 3))
    with count.counting("training"):
        module(torch.zeros(3, 3))
        with torch.no_grad():
            module(torch.zeros(6, 3))
    assert count.take() == [9, 9, 3] and count.take() == [0, 0, 0]
    with pytest.raises(ValueError, match="part='evaluation' must be one of"):
        with count.counting("evaluation"):
            pass
