"""A short training run's local artefacts, its LoRA exports, and scripts/evaluate.py on it."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from config.base import base
from ddpo_group.prompts import draw_prompts
from ddpo_group.offline.comparison import (
    build_report, format_report, prompt_seeds, load_finetuned_weights, resolve_finetuned, run_config, stats,
)
from ddpo_group.models.families.sd import StableDiffusionFamily
from ddpo_group.run.reporting.image_grid import MARGIN, caption_font, line_height
from ddpo_group.run.persistence.manifest import write_manifest
from ddpo_group.run.persistence.metrics_log import read_metrics
from ddpo_group.run.reporting.plots import plot_reward_curve
from ddpo_group.run.reporting.summary import format_summary

ROOT = Path(__file__).resolve().parents[2]


def test_stats_and_report_numbers():
    s = stats(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    std = (5 / 3) ** 0.5  # sample std of 1..4
    assert s["mean"] == 2.5 and s["n"] == 4 and s["std"] == pytest.approx(std)
    assert s["ci95"] == pytest.approx([2.5 - 1.96 * std / 2, 2.5 + 1.96 * std / 2])
    base = {"reward": torch.tensor([1.0, 2.0, 3.0, 5.0], dtype=torch.float64)}
    tuned = {"reward": torch.tensor([2.0, 2.0, 4.0, 8.0], dtype=torch.float64)}
    report = build_report(["p", "q"], [[0, 1], [0, 1]], base, tuned, {})
    entry = report["rewards"]["reward"]
    assert entry["difference"]["mean"] == pytest.approx(1.25)  # paired: (1 + 0 + 1 + 3) / 4
    assert entry["per_prompt"]["p"] == {"base_mean": 1.5, "finetuned_mean": 2.0, "base": [1.0, 2.0], "finetuned": [2.0, 2.0]}
    assert entry["per_prompt"]["q"]["finetuned_mean"] == 6.0
    # the console table says what its numbers are: the difference's 95% interval is 1.25 -+ 1.96 * 1.2583 / 2
    # (std of the differences 1, 0, 1, 3: sqrt(1.5833) = 1.2583), i.e. [0.0169, 2.4831]
    table = format_report({**report, "report_path": "r.json", "grid_path": "g.png"}).splitlines()
    assert "base (mean ± std)" in table[0] and "difference ± SE [95% interval]" in table[0]
    assert table[1].split() == ["reward", "2.7500", "±", "1.7078", "4.0000", "±", "2.8284", "+1.2500", "±", "0.6292",
                                "[+0.0169,", "+2.4831]"]
    assert table[2] == "(n = 4 image pairs: each prompt and seed sampled by both models)"
    # 1.25 is within 2 standard errors (2 x 0.6292) of 0: four pairs show nothing learnt
    assert report["verdict"] == "did_not_learn" and table[3] == f"verdict: {report['why']}"
    same = build_report(["p", "q"], [[0, 1], [0, 1]], base, base, {})
    assert same["verdict"] == "did_not_learn" and "starting weights" in same["why"]


def test_draw_prompts_distinct_then_cycled():
    prompts, metadata = draw_prompts("simple_animals", {}, 5, seed=0)
    assert len(set(prompts)) == 5 and len(metadata) == 5


def test_a_cycled_prompt_takes_the_next_seeds_so_every_image_pair_is_distinct():
    # 4 hard captions drawn for 6 rows: rows 4 and 5 repeat two captions. With the same seeds they would repeat the
    # same images, and n = 12 would narrow the interval as if 12 pairs were independent.
    prompts, _ = draw_prompts("tiny_shapes", {"hard": True}, 6, seed=0)
    assert len(set(prompts)) == 4 and prompts[4:] == prompts[:2]
    seeds = prompt_seeds(prompts, seed=10, m=2)
    assert seeds == [[10, 11]] * 4 + [[12, 13]] * 2
    pairs = [(p, s) for p, row in zip(prompts, seeds) for s in row]
    assert len(set(pairs)) == 12
    assert prompt_seeds(["a", "b", "a", "a"], seed=0, m=1) == [[0], [0], [1], [2]]


def test_reward_curve_and_summary(tmp_path):
    metrics = [{"epoch": e, "reward_mean": r, "reward_std": 0.1, "reward_info/a": r / 2}
               for e, r in enumerate([0.1, 0.5, 0.3])]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in metrics) + "\n")
    assert read_metrics(tmp_path / "metrics.jsonl") == metrics
    path = plot_reward_curve(metrics, tmp_path / "curve.png")
    assert Image.open(path).size == (900, 400)  # FIGSIZE 9 x 4 in at 100 dpi
    text = format_summary(metrics, {"metrics": tmp_path / "metrics.jsonl", "missing": tmp_path / "nope"})
    assert "reward before    0.1000" in text and "reward after     0.3000" in text
    assert "change           +0.2000" in text and "best epoch       1: 0.5000" in text
    assert "  a: 0.0500 -> 0.1500" in text
    assert str(tmp_path / "metrics.jsonl") in text and "nope" not in text
    assert len(text.splitlines()) <= 24  # one screen


def test_the_reward_curve_is_redrawn_every_ten_seconds_and_at_the_end(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from ddpo_group.run.reporting import epoch_logger

    clock, drawn = [0.0], []
    monkeypatch.setattr(epoch_logger.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(epoch_logger, "plot_reward_curve",
                        lambda metrics, path, **kwargs: drawn.append([m["epoch"] for m in metrics]))
    logger = epoch_logger.EpochLogger(SimpleNamespace(is_main_process=True), tmp_path, "disabled", 0, lambda line: None)
    for epoch in range(5):  # an epoch every 3 s: past 10 s at epoch 3 (12 s)
        clock[0] += 3.0
        logger.log(epoch, {"epoch": epoch, "reward_mean": 0.1 * epoch, "reward_std": 0.0, "time/sampling": 1.0,
                           "time/training": 2.0}, batch=None)
    assert drawn == [[0, 1, 2, 3]]
    logger.draw_reward_curve()  # the run's end: the epoch since
    logger.draw_reward_curve()  # nothing new: no draw
    assert drawn == [[0, 1, 2, 3], [0, 1, 2, 3, 4]]


@pytest.mark.slow
def test_short_run_artifacts_lora_export_and_evaluate(tiny_model_dir, tmp_path):
    from test_train_e2e import launch, tiny_args

    log = launch(tiny_args(tiny_model_dir, tmp_path, "run", num_epochs=2, save_freq=1,
                           **{"reward_fn": '{"jpeg_compressibility": 1.0, "jpeg_incompressibility": 0.5}'}))
    run = tmp_path / "run"
    # local artefacts whatever the wandb mode (disabled here)
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["epoch"] for m in metrics] == [0, 1]
    for m in metrics:  # combined reward = jpeg_c + 0.5 * jpeg_i = -kb + 0.5 kb = -0.5 kb
        assert m["reward_mean"] == pytest.approx(0.5 * m["reward_info/jpeg_compressibility"], rel=1e-6)
        assert m["reward_info/jpeg_incompressibility"] == pytest.approx(-m["reward_info/jpeg_compressibility"])
    assert Image.open(run / "reward_curve.png").size == (900, 400)  # plots.FIGSIZE at plots.DPI
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["epoch_00000.png", "epoch_00001.png"]
    summary = (run / "summary.txt").read_text()
    assert "reward before" in summary and "best epoch" in summary and str(run / "lora") in summary
    assert "run summary" in log
    for checkpoint in ("checkpoint_00000", "checkpoint_00001"):
        assert (run / "checkpoints" / checkpoint / "lora" / "pytorch_lora_weights.safetensors").exists()
    assert (run / "lora" / "pytorch_lora_weights.safetensors").exists()

    # round trip: base + load_lora_weights(checkpoint/lora) == the trained UNet of the accelerate checkpoint
    from diffusers import StableDiffusionPipeline

    checkpoint = run / "checkpoints" / "checkpoint_00001"
    assert resolve_finetuned(run) == ("lora", checkpoint / "lora")

    def sample(pipe):
        pipe.set_progress_bar_config(disable=True)
        gens = [torch.Generator().manual_seed(i) for i in range(2)]
        return pipe(["cat", "dog"], num_inference_steps=4, guidance_scale=5.0, eta=1.0, generator=gens,
                    output_type="pt").images

    load = lambda: StableDiffusionPipeline.from_pretrained(tiny_model_dir, safety_checker=None,  # noqa: E731
                                                           requires_safety_checker=False)
    trained = load()
    trained_config = run_config(base(), json.loads((run / "config.json").read_text()))
    load_finetuned_weights(StableDiffusionFamily(trained, trained_config), checkpoint, trained_config)
    exported = load()
    base_images = sample(exported)
    exported.load_lora_weights(str(checkpoint / "lora"))
    trained_images = sample(trained)
    assert (trained_images - base_images).abs().max() > 0  # training moved the model
    torch.testing.assert_close(sample(exported), trained_images, atol=1e-5, rtol=1e-4)

    # evaluate.py on the run: same seeds for both models, report and grid
    out = subprocess.run(
        [sys.executable, "scripts/evaluate.py", "--finetuned", str(run), "--num_prompts", "3", "--num_seeds", "2",
         "--batch_size", "4", "--out", str(tmp_path / "eval")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "evaluate (base, then fine-tuned)" in out.stderr  # tqdm progress bar
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["seeds"] == [[0, 1]] * 3 and len(set(report["prompts"])) == 3
    assert report["loaded"] == f"lora:{checkpoint / 'lora'}"
    assert set(report["rewards"]) == {"reward", "jpeg_compressibility", "jpeg_incompressibility"}
    entry = report["rewards"]["reward"]
    assert entry["base"]["n"] == entry["finetuned"]["n"] == 6
    lo, hi = entry["finetuned"]["ci95"]
    assert lo <= entry["finetuned"]["mean"] <= hi
    assert sorted(entry["per_prompt"]) == sorted(report["prompts"])
    for values in entry["per_prompt"].values():
        assert len(values["base"]) == len(values["finetuned"]) == 2
    # total = 1.0 * jpeg_c + 0.5 * jpeg_i, per image
    c = report["rewards"]["jpeg_compressibility"]["base"]["mean"]
    i = report["rewards"]["jpeg_incompressibility"]["base"]["mean"]
    assert entry["base"]["mean"] == pytest.approx(c + 0.5 * i)
    grid = Image.open(tmp_path / "eval" / "grid.png")
    # 3 prompt rows x (2 base + 2 fine-tuned) columns of 96 px tiles over a caption strip of whole lines: model and
    # seed, reward, and the prompt (one line or more)
    assert grid.width == 4 * 96 and grid.height % 3 == 0
    lines, rest = divmod(grid.height // 3 - 96 - MARGIN, line_height(caption_font()))
    assert rest == 0 and lines >= 3
    assert "reward" in out.stdout and "difference" in out.stdout


@pytest.mark.parametrize("use_lora", [False, True])
def test_checkpoint_without_lora_export_loads_its_weights(tiny_model_dir, tmp_path, use_lora):
    """Full fine-tuning checkpoints (and LoRA ones written without lora/) load from model.safetensors."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from safetensors.torch import save_file

    from ddpo_group.offline.comparison import find_run_config

    load = lambda: StableDiffusionPipeline.from_pretrained(tiny_model_dir, safety_checker=None,  # noqa: E731
                                                           requires_safety_checker=False)
    tuned = load()
    if use_lora:
        tuned.unet.add_adapter(LoraConfig(r=2, lora_alpha=2,
                                          target_modules=list(StableDiffusionFamily.lora_target_modules)))
    with torch.no_grad():
        for name, param in tuned.unet.named_parameters():
            if not use_lora or "lora_" in name:
                param.add_(torch.randn_like(param) * 0.05)
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "checkpoint_00003"
    checkpoint.mkdir(parents=True)
    (checkpoint / "COMPLETE").write_text("epoch 3\n")
    save_file({k: v.contiguous() for k, v in tuned.unet.state_dict().items()}, str(checkpoint / "model.safetensors"))
    (checkpoint / "random_states_0.pkl").write_bytes(b"")  # the process's part a complete checkpoint holds
    write_manifest(checkpoint)  # what every save writes last: the evaluation verifies it
    config = {"pretrained": {"model": tiny_model_dir}, "sample": {}, "reward_fn": "jpeg_compressibility", "lora_rank": 2}
    (run / "config.json").write_text(json.dumps(config))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not a run config"}))

    assert find_run_config(checkpoint) == (config, run.resolve())
    assert find_run_config(tmp_path) == (None, None)
    assert resolve_finetuned(run) == ("weights", checkpoint)
    loaded = load()
    loaded_config = run_config(base(), config)
    load_finetuned_weights(StableDiffusionFamily(loaded, loaded_config), checkpoint, loaded_config)
    x = torch.randn(1, 4, 8, 8)
    text = torch.randn(1, 16, 32)
    with torch.no_grad():
        expected = tuned.unet(x, 10, encoder_hidden_states=text).sample
        torch.testing.assert_close(loaded.unet(x, 10, encoder_hidden_states=text).sample, expected)
        assert (load().unet(x, 10, encoder_hidden_states=text).sample - expected).abs().max() > 1e-4


def test_evaluate_help_gives_every_option_its_meaning_and_default():
    out = subprocess.run([sys.executable, "scripts/evaluate.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    text = " ".join(out.split()).split("options:", 1)[1]  # the option list, after the usage line
    for option, shown in (("--num_prompts", "(default: 8)"), ("--num_seeds", "(default: 2)"),
                          ("--batch_size", "(default: 8)"), ("--seed", "(default: 0)"),
                          ("--reward_fn", "(default: the run's reward_fn)"),
                          ("--num_steps", "(default: the run's sample.eval_num_steps, or sample.num_steps)")):
        block = re.search(re.escape(f"{option} {option.upper()[2:]} ") + r"(.*?)(?= --[a-z_]+ [A-Z_]+ |$)", text)
        assert block and shown in block.group(1), (option, block and block.group(1))
    options = [word for word in out.split() if word.startswith("--") and word.isascii()]
    assert {"--finetuned", "--base_model", "--noise_level", "--guidance_scale", "--out", "--device"} <= set(options)
    assert "(default: None)" not in text


def test_evaluate_names_a_missing_model_in_one_line_and_takes_eta_under_its_new_name(tmp_path):
    missing = tmp_path / "no_run"
    out = subprocess.run([sys.executable, "scripts/evaluate.py", "--finetuned", str(missing), "--eta", "0.5"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "--eta is now --noise_level" in out.stderr
    assert f"[ddpo_group] error: fine-tuned model '{missing}' does not exist" in out.stderr
    assert "Traceback" not in out.stderr
