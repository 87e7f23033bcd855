"""The learning-proof script runs end to end (mechanics only, on the tiny random model)."""

import json
import sys

import pytest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def test_compare_algorithms_runs(tiny_model_dir, tmp_path):
    import compare_algorithms

    sets = ["pretrained.model=" + tiny_model_dir, "prompt_fn=simple_animals", "reward_fn=jpeg_compressibility",
            "sample.num_steps=3", "sample.batch_size=4", "sample.num_batches_per_epoch=1", "train.batch_size=4",
            "train.group_size=2", "train.pairs_per_forward=12", "eval_num_prompts=2", "eval_num_seeds=1"]
    args = ["--presets", "grpo,remax", "--seeds", "0,1", "--queries", "8", "--threshold", "-100",
            "--out", str(tmp_path)] + [x for s in sets for x in ("--set", s)]
    rows = compare_algorithms.main(args)
    # the run's own evaluation: before the first update (0 queries) and after the last epoch
    assert len(rows) == 4 and all(len(r["evaluations"]) == 2 and r["evaluations"][0]["epoch"] == -1 for r in rows)
    assert all(r["evaluations"][-1]["queries"] == r["queries"] for r in rows)
    assert all(r["before"] == r["evaluations"][0]["reward"] and r["after"] == r["evaluations"][-1]["reward"]
               for r in rows)
    assert all(compare_algorithms.queries_to_reach(r["evaluations"], -100) == 0 for r in rows)
    evaluations = [{"queries": 0, "reward": 0.5}, {"queries": 8, "reward": 0.7}]
    assert compare_algorithms.queries_to_reach(evaluations, 0.6) == 8
    assert compare_algorithms.queries_to_reach(evaluations[:1], 0.6) is None
    assert [r["queries"] for r in rows] == [8, 8, 6, 6]  # remax: 4 samples + 2 greedy per epoch, 1 epoch
    assert [e["queries"] for e in rows[2]["evaluations"]] == [0, 6]
    assert (tmp_path / "reward_vs_queries.png").exists() and "| grpo |" in (tmp_path / "results.md").read_text()
    assert "(2/2 seeds)" in (tmp_path / "results.md").read_text()  # both seeds reached the threshold
    # denoiser evaluations: 2 epochs' worth of grpo's for 2 epochs (a probe epoch sized the run), read per evaluation
    per_epoch = rows[0]["nfe"]
    assert per_epoch > 0 and all(r["evaluations"][-1]["nfe"] == r["nfe"] for r in rows)
    assert rows[0]["evaluations"][0]["nfe"] == 0 and rows[2]["nfe"] != per_epoch  # remax also samples greedily
    assert compare_algorithms.reward_at_nfe(rows[0]["evaluations"], per_epoch - 1) == (rows[0]["before"], 0)
    assert compare_algorithms.reward_at_nfe(rows[0]["evaluations"], per_epoch) == (rows[0]["after"], per_epoch)
    assert compare_algorithms.queries_to_reach(rows[0]["evaluations"], -100, "nfe") == 0
    budget = ["--presets", "grpo", "--seeds", "0", "--nfe", str(2 * per_epoch), "--out", str(tmp_path / "nfe")]
    (row,) = compare_algorithms.main(budget + args[args.index("--threshold"):args.index("--out")] +
                                     [x for s in sets for x in ("--set", s)])
    assert row["nfe"] == 2 * per_epoch and row["queries"] == 2 * rows[0]["queries"]
    assert not (tmp_path / "nfe" / "runs" / "grpo_seed0_nfe_probe").exists()

    # run again with one more seed: the saved runs are kept as they are, only the new seed trains; a run
    # directory left by an attempt that was cut short (not in results.json) is started afresh, not appended to
    stale = tmp_path / "runs" / "grpo_seed2"
    stale.mkdir(parents=True)
    (stale / "metrics.jsonl").write_text('{"epoch": 0, "reward_queries": 1000, "reward_mean": 0.0}\n')
    again = compare_algorithms.main([x if x != "0,1" else "0,1,2" for x in args])
    assert [(r["preset"], r["seed"]) for r in again] == [("grpo", 0), ("grpo", 1), ("grpo", 2), ("remax", 0),
                                                         ("remax", 1), ("remax", 2)]
    kept = {(r["preset"], r["seed"]): r for r in again}
    assert kept[("grpo", 2)]["queries"] == 8
    assert all(kept[(r["preset"], r["seed"])] == json.loads(json.dumps(r)) for r in rows)  # as saved
    # another study (other settings) in the same directory is refused, not mixed in
    with pytest.raises(SystemExit, match="use another --out"):
        compare_algorithms.main([x if x != "8" else "16" for x in args])


def test_variants_are_rows_of_their_own_and_tweedie_values_are_counted(tiny_model_dir, tmp_path):
    import compare_algorithms

    sets = ["pretrained.model=" + tiny_model_dir, "prompt_fn=simple_animals", "reward_fn=jpeg_compressibility",
            "sample.num_steps=3", "sample.sde_window_size=0", "sample.batch_size=4", "sample.num_batches_per_epoch=1",
            "train.batch_size=4", "train.group_size=2", "train.pairs_per_forward=12", "eval_num_prompts=2",
            "eval_num_seeds=1"]
    args = ["--presets", "grpo", "--variant", "tweedie=group_ppo group_ppo.value_source=tweedie", "--seeds", "0",
            "--queries", "8", "--threshold", "grpo", "--out", str(tmp_path)] + [x for s in sets for x in ("--set", s)]
    grpo, tweedie = compare_algorithms.main(args)
    assert (grpo["preset"], tweedie["preset"]) == ("grpo", "tweedie")
    # 3 steps, all stochastic: x_1 and x_2 valued, 2 more queries per sample (4 samples an epoch, one epoch)
    assert grpo["queries"] == 8 and tweedie["queries"] == 12 and len(tweedie["evaluations"]) == 2 and (tmp_path / "runs" / "tweedie_seed0").is_dir()
    assert grpo["critic_ev"] is None
    text = (tmp_path / "results.md").read_text()
    assert f"queries to reach grpo's final {grpo['after']:.4f}" in text and "| tweedie |" in text
    assert "critic EV (last 10 epochs)" in text
    assert "tree value EV" not in text and grpo["tree_value_ev"] is None  # no tree: no column
    tree = {**grpo, "preset": "tree", "tree_value_ev": 0.25}  # a row measured on trees (its mean over the epochs)
    lines = compare_algorithms.table([grpo, tree], ["grpo", "tree"], "grpo").splitlines()
    assert lines[0].endswith("| tree value EV (all epochs) | wall time (s) |")
    assert lines[2].startswith("| grpo |") and " — | " in lines[2] and " 0.25 ± 0 | " in lines[3]
    with pytest.raises(SystemExit, match="expected 'LABEL=PRESET FIELD=VALUE ...'"):
        compare_algorithms.main(["--variant", "x=nope", "--out", str(tmp_path / "other")])
    # one more variant joins the study; a saved label with another definition is refused
    more = compare_algorithms.main(args + ["--variant", "dpo=dpo"])
    assert [r["preset"] for r in more] == ["grpo", "tweedie", "dpo"]
    assert more[:2] == json.loads(json.dumps([grpo, tweedie]))  # the saved runs, not run again
    with pytest.raises(SystemExit, match="holds 'tweedie' as \\['group_ppo', 'group_ppo.value_source=tweedie'\\]"):
        compare_algorithms.main([x if x != "tweedie=group_ppo group_ppo.value_source=tweedie" else "tweedie=grpo"
                                 for x in args])


def test_sampling_bench_runs_and_prints_the_ratio(tiny_model_dir, capsys):
    import sampling

    out = sampling.main(["--model", tiny_model_dir, "--prompt-fn", "simple_animals", "--images", "2", "--steps", "2",
                         "--repeats", "1", "--device", "cpu", "--threads", "0"])
    printed = capsys.readouterr().out
    assert out["ratio"] > 0 and out["max_image_diff"] < 1e-4  # the same images as diffusers' pipeline
    assert "ratio ours / diffusers" in printed and "machine:" in printed


def test_training_bench_runs_and_prints_speedup_and_unet_share(tiny_model_dir, capsys):
    import training

    out = training.main(["--model", tiny_model_dir, "--prompt-fn", "simple_animals", "--samples", "4", "--steps", "2",
                         "--batch-size", "2", "--pairs-per-forward", "4", "--repeats", "1", "--device", "cpu", "--threads", "0"])
    printed = capsys.readouterr().out
    assert out["pairs"] == 8 and out["speedup"] > 0 and 0 < out["unet_share"] <= 1
    assert "pairs/s" in printed and "speed-up ours / ddpo-pytorch" in printed and "denoiser share" in printed
    assert out["reference"] == "ddpo-pytorch loop" and out["loss_max_abs_diff"] < 1e-6  # the same pairs, one batch
    assert out["grad_max_abs_diff"] < 1e-4 * out["grad_max_abs"]


@pytest.mark.parametrize("family", ["sdxl", "sd3", "flux"])
def test_the_benches_run_a_tiny_family_built_from_config(family, capsys):
    import sampling
    import training

    out = sampling.main(["--family", family, "--prompt-fn", "simple_animals", "--images", "2", "--steps", "2",
                         "--repeats", "1", "--device", "cpu", "--threads", "0"])
    assert out["ratio"] > 0 and out["max_image_diff"] == 0  # the pipeline's own sampler (DDIM, Euler), bitwise
    assert out["stochastic_steps"] == 2  # ours timed as the trainer samples: every step stochastic, log-probs
    trained = training.main(["--family", family, "--prompt-fn", "simple_animals", "--samples", "4", "--steps", "2",
                             "--batch-size", "2", "--pairs-per-forward", "4", "--repeats", "1", "--device", "cpu",
                             "--threads", "0"])
    printed = capsys.readouterr().out
    assert trained["pairs"] == 8 and f"{family} (" in printed and "pairs/s" in printed
    if family == "sdxl":  # neither reference loop handles SDXL's added conditions
        assert trained["reference"] is None and "speedup" not in trained
    else:  # the flow-matching families: Flow-GRPO's loop, computing ours' loss and gradient on the same pairs
        assert trained["reference"] == "Flow-GRPO loop" and trained["speedup"] > 0
        assert "reference loop: Flow-GRPO loop" in printed and "speed-up ours / Flow-GRPO" in printed
        assert trained["loss_max_abs_diff"] < 1e-6 and trained["loss_ours"] != 0
        assert trained["grad_max_abs_diff"] < 1e-4 * trained["grad_max_abs"]


def test_the_sd3_benches_write_their_figures_and_train_an_sde_window(tmp_path, capsys):
    """sd3 with a 3-step SDE window of 6 steps, 2 of them trained (timestep fraction 0.7): the Flow-GRPO loop trains
    the window's first 2 steps, ours 2 random ones of the window; both as many pairs, and on the same pairs the same
    loss and gradient; the JSON files hold what was printed."""
    import sampling
    import training

    trained = training.main(["--family", "sd3", "--prompt-fn", "simple_animals", "--samples", "4", "--steps", "6",
                             "--sde-window-size", "3", "--timestep-fraction", "0.7", "--batch-size", "2",
                             "--pairs-per-forward", "auto", "--repeats", "2", "--device", "cpu", "--threads", "0",
                             "--json", str(tmp_path / "training.json")])
    sampled = sampling.main(["--family", "sd3", "--prompt-fn", "simple_animals", "--images", "2", "--steps", "3",
                             "--sde-window-size", "2", "--repeats", "1", "--device", "cpu", "--threads", "0",
                             "--json", str(tmp_path / "sampling.json")])
    printed = capsys.readouterr().out
    assert (trained["pairs"], trained["round_pairs"], trained["trained_steps"]) == (8, 4, 2)
    assert "4 samples x 2 of 6 steps (3 stochastic) = 8 trained" in printed
    assert trained["grad_max_abs_diff"] < 1e-4 * trained["grad_max_abs"] and trained["loss_max_abs_diff"] < 1e-6
    assert json.loads((tmp_path / "training.json").read_text())["speedup"] == trained["speedup"]
    assert len(trained["times"]["ours"]) == len(trained["times"]["Flow-GRPO loop"]) == 2
    assert sampled["stochastic_steps"] == 2 and sampled["max_image_diff"] == 0
    assert "flow_sde at 0.7 on 2 of 3 steps, log-probs recorded" in printed
    assert json.loads((tmp_path / "sampling.json").read_text())["ratio"] == sampled["ratio"]


def test_epoch_bench_runs_and_prints_every_phase(tiny_model_dir, capsys):
    import epoch

    sets = ["pretrained.model=" + tiny_model_dir, "prompt_fn=simple_animals", "reward_fn=jpeg_compressibility",
            "sample.num_steps=2", "sample.batch_size=4", "sample.num_batches_per_epoch=1", "train.batch_size=4",
            "train.group_size=2", "log_images_every=1"]
    out = epoch.main(["--epochs", "1", "--device", "cpu", "--threads", "0"] + [x for s in sets for x in ("--set", s)])
    printed = capsys.readouterr().out
    for label in ("sampling", "reward", "advantage", "training", "reference/KL", "critic", "logging", "checkpoint"):
        assert f"| {label} |" in printed
    assert out["wall_s"] > 0 and out["phases"]["sampling"] > 0 and out["phases"]["checkpoint"] > 0
    assert out["peak_rss_mib"] > 0 and "peak RSS" in printed


def test_unet_rows_bench_prints_per_row_cost_and_ratio(capsys):
    import unet_rows

    per_row = unet_rows.main(["--rows", "1,4", "--repeats", "1", "--device", "cpu", "--threads", "0"])
    printed = capsys.readouterr().out
    assert set(per_row) == {1, 4} and all(v > 0 for v in per_row.values())
    assert "| 4 |" in printed and f"{per_row[1] / per_row[4]:.2f}x" in printed


def test_moving_average_of_the_plotted_curves():
    import torch
    from compare_algorithms import moving_average

    values = torch.tensor([[1.0, 3.0, 5.0, 7.0], [0.0, 0.0, 4.0, 4.0]], dtype=torch.float64)
    want = torch.tensor([[1.0, 2.0, 3.0, 5.0], [0.0, 0.0, 4 / 3, 8 / 3]], dtype=torch.float64)
    torch.testing.assert_close(moving_average(values, 3), want)
    torch.testing.assert_close(moving_average(values, 1), values)


def test_a_study_override_takes_former_names_and_refuses_unknown_fields(capsys):
    import compare_algorithms
    from config.base import get_config

    config = get_config("group_ppo")
    compare_algorithms.set_field(config, "group_params.value_source", "tweedie")  # a recorded study's spelling
    compare_algorithms.set_field(config, "sample.eta", "0.5")
    assert (config.group_ppo.value_source, config.sample.noise_level) == ("tweedie", 0.5)
    assert "sample.eta is now sample.noise_level" in capsys.readouterr().err
    compare_algorithms.set_field(config, "prompt_fn_kwargs.split", "train")  # a *_kwargs section takes new keys
    assert config.prompt_fn_kwargs.split == "train"
    for raw, value in (("False", False), ("regional", "regional"), ("True", True)):  # an object field, as on the CLI
        compare_algorithms.set_field(config, "compile_denoiser", raw)
        assert config.compile_denoiser is value or config.compile_denoiser == value, raw
    with pytest.raises(SystemExit, match=r"sample.etta=0.5: config has no field 'sample.etta'"):
        compare_algorithms.set_field(config, "sample.etta", "0.5")


def test_speed_options_bench_measures_each_option_beside_the_baseline(tiny_model_dir, tmp_path, capsys):
    import speed_options

    common = ["--model", tiny_model_dir, "--prompt-fn", "simple_animals", "--samples", "4", "--steps", "2",
              "--images", "2", "--batch-size", "2", "--pairs-per-forward", "4", "--repeats", "1", "--device", "cpu"]
    out = speed_options.main(common + ["--options", "fused_qkv,sdpa_math,sdpa_flash,sdpa_efficient,channels_last,"
                                       "cuda_graphs,fp32_frozen", "--json", str(tmp_path / "speed.json")])
    printed = capsys.readouterr().out
    rows = {row["option"]: row for row in out["rows"]}
    assert json.loads((tmp_path / "speed.json").read_text())["rows"] == json.loads(json.dumps(out["rows"]))
    for name in ("sdpa_math", "sdpa_flash", "channels_last"):  # both phases, the same log-probs as the baseline
        row = rows[name]
        assert row["train_pairs_per_s"] > 0 and row["train_ratio"] > 0 and row["sample_ratio"] > 0
        assert row["train_logprob_rel_diff"] <= 1e-4 and row["sample_logprob_rel_diff"] <= 1e-4
        assert "train_mfu" not in row  # no MFU on the CPU
    # the fused projections bypass LoRA on to_q/to_k/to_v: the frozen forward only, against the unfused one
    assert "train_pairs_per_s" not in rows["fused_qkv"] and rows["fused_qkv"]["sample_logprob_rel_diff"] <= 1e-4
    assert rows["sdpa_efficient"]["skipped"].startswith("attention_backend='efficient' is a CUDA kernel")
    assert rows["cuda_graphs"]["skipped"] == "CUDA graphs need CUDA"
    assert rows["fp32_frozen"]["skipped"] == "without mixed precision every weight is float32 already"
    assert "LoRA on to_q/to_k/to_v is bypassed" in printed and "machine:" in printed and "n/a" in printed
    assert "OUTSIDE" not in printed


def test_speed_options_bench_frozen_weights_in_float32_under_bf16(tiny_model_dir):
    import speed_options

    # under bf16 the frozen weights are bf16 beside float32 LoRA (build_policy); the float32 copy computes alike
    out = speed_options.main(["--model", tiny_model_dir, "--prompt-fn", "simple_animals", "--samples", "2", "--steps",
                              "2", "--images", "2", "--batch-size", "2", "--pairs-per-forward", "4", "--repeats", "1",
                              "--device", "cpu", "--options", "fp32_frozen", "--mixed-precision", "bf16"])
    row = out["rows"][0]
    assert row["train_ratio"] > 0 and row["train_logprob_rel_diff"] <= speed_options.TOLERANCE["bf16"]


@pytest.mark.slow
def test_speed_options_bench_compiles_the_repeated_blocks_with_the_same_log_probs(capsys):
    import speed_options

    # the tiny SD3: its JointTransformerBlocks come from the table of blocks diffusers does not declare; a third of the
    # tiny UNet's compilation time
    out = speed_options.main(["--family", "sd3", "--prompt-fn", "simple_animals", "--samples", "2", "--steps",
                              "2", "--images", "2", "--batch-size", "2", "--pairs-per-forward", "4", "--repeats", "1",
                              "--device", "cpu", "--options", "compile_regional"])
    row = out["rows"][0]
    assert row["train_logprob_rel_diff"] <= 1e-4 and row["sample_logprob_rel_diff"] <= 1e-4
    assert row["first_call_s"] > 0 and row["train_ratio"] > 0


@pytest.mark.cuda
def test_speed_options_bench_on_cuda_same_log_probs_under_each_kernel():
    import speed_options

    # the tiny SD3 (attention heads of 8: the flash and efficient kernels need a multiple of 8; tiny-shapes' are 4)
    out = speed_options.main(["--family", "sd3", "--prompt-fn", "simple_animals", "--samples", "4", "--steps", "2",
                              "--images", "2", "--batch-size", "2", "--pairs-per-forward", "4", "--repeats", "1",
                              "--device", "cuda", "--mixed-precision", "bf16", "--options",
                              "fused_qkv,sdpa_flash,sdpa_efficient,sdpa_math,fp32_frozen"])
    rows = {row["option"]: row for row in out["rows"]}
    for name, row in rows.items():
        assert "skipped" not in row and "failed" not in row, row
        assert row["sample_logprob_rel_diff"] <= speed_options.TOLERANCE["bf16"], row
        assert name == "fused_qkv" or row["train_logprob_rel_diff"] <= speed_options.TOLERANCE["bf16"], row
    if "tflop_per_image" in out:  # a GPU in PEAK_TFLOPS (H100, A100, ...)
        assert all(0 < row["sample_mfu"] < 1 for row in rows.values())


def test_the_reference_loop_runs_a_compiled_denoiser_eager():
    """bench/training.py --compile-denoiser: ours compiled, the reference loop through the same modules uncompiled."""
    import torch
    import training

    traced = []

    def backend(graph, inputs):  # a compiler that counts what reaches it and runs the graph as traced
        traced.append(graph)
        return graph.forward

    class Block(torch.nn.Module):  # defined here: dynamo traces no frame of torch's own modules
        def forward(self, x):
            return x * 2 + 1

    model = torch.nn.Sequential(Block(), torch.nn.Linear(2, 2))
    model[0].compile(backend=backend)
    with training.eager(model):
        eager_out = model(torch.ones(1, 2))
    assert traced == [] and model[0]._compiled_call_impl is not None  # restored after
    torch.testing.assert_close(model(torch.ones(1, 2)), eager_out)
    assert len(traced) == 1
