"""The benchmark scripts run end to end as a user runs them (``python bench/NAME.py ...``, in this process through runpy
or in a process of its own: tests/helpers/bench_helpers.py), on the tiny random models: what they print and the files
they write (mechanics only)."""

import json
import re
import statistics
from pathlib import Path

import pytest

from helpers.bench_helpers import refused, run_bench, succeeded


def table_rows(text: str, first: str) -> dict[str, dict[str, str]]:
    """The markdown table of ``text`` whose header starts with ``| first |``: {row label: {column: cell}}."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first} |"))
    head = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(head, cells))
    return rows


def saved_rows(out: Path) -> list[dict]:
    return json.loads((out / "results.json").read_text())["rows"]


def flags(name: str, values: list[str]) -> list[str]:
    return [x for value in values for x in (name, value)]


def test_distillation_study_trains_teachers_then_students_at_equal_evaluations(tiny_model_dir, tmp_path):
    """bench/distillation.py on the tiny model: two teachers (one reward each), then grpo on the summed reward and a
    student distilled from both (and a mixed-mode row) at equal denoiser evaluations; each reward's gain, its share of
    its teacher's and the paired differences, read from the runs' evaluations."""
    sets = ["pretrained.model=" + tiny_model_dir, "prompt_fn=simple_animals", "sample.num_steps=3",
            "sample.batch_size=4", "sample.num_batches_per_epoch=1", "train.batch_size=4", "train.group_size=2",
            "train.pairs_per_forward=12", "eval_num_prompts=2", "eval_num_seeds=1", "final_eval_num_seeds=2"]
    args = ["--out", str(tmp_path), "--seeds", "0,1", "--rewards", "jpeg_compressibility,jpeg_incompressibility",
            "--teacher-queries", "8", "--nfe", "400", "--student", "opd_mixed opd.reward_weight=1",
            *flags("--set", sets)]
    printed = succeeded("distillation", *args).stdout
    students = saved_rows(tmp_path / "students")
    assert sorted({r["preset"] for r in students}) == ["grpo_sum", "opd", "opd_mixed"]
    assert all(len(r["evaluations"]) == 2 for r in students)
    assert (tmp_path / "teachers" / "runs" / "teacher_jpeg_compressibility_seed1000" / "lora").is_dir()
    results = json.loads((tmp_path / "results.json").read_text())
    teacher = results["teachers"]["jpeg_compressibility"]["gain"]
    opd = [r for r in students if r["preset"] == "opd"]
    gains = [r["evaluations"][-1]["info"]["jpeg_compressibility"] - r["evaluations"][0]["info"]["jpeg_compressibility"]
             for r in sorted(opd, key=lambda r: r["seed"])]
    assert results["rows"]["opd"]["jpeg_compressibility"] == pytest.approx(gains)
    # the two rewards are one another's negatives: each row's summed gain is 0 (to rounding), each teacher's share read
    assert all(abs(g) < 1e-9 for g in results["rows"]["grpo_sum"]["summed"])
    assert f"{teacher:+.4f} | 1" in printed
    paired = results["paired"]["opd_mixed"]["jpeg_compressibility"]
    assert paired["seeds"] == [0, 1] and paired["low"] <= paired["mean"] <= paired["high"]
    assert "| opd_mixed - grpo_sum |" in (tmp_path / "results.md").read_text()


def test_compare_algorithms_runs(tiny_model_dir, tmp_path):
    sets = ["pretrained.model=" + tiny_model_dir, "prompt_fn=simple_animals", "reward_fn=jpeg_compressibility",
            "sample.num_steps=3", "sample.batch_size=4", "sample.num_batches_per_epoch=1", "train.batch_size=4",
            "train.group_size=2", "train.pairs_per_forward=12", "eval_num_prompts=2", "eval_num_seeds=1"]
    args = ["--presets", "grpo,remax", "--seeds", "0,1", "--queries", "8", "--threshold", "-100",
            "--out", str(tmp_path)] + flags("--set", sets)
    printed = succeeded("compare_algorithms", *args, process=True).stdout  # the file as a user starts it
    rows = saved_rows(tmp_path)
    assert [(r["preset"], r["seed"]) for r in rows] == [("grpo", 0), ("grpo", 1), ("remax", 0), ("remax", 1)]
    assert f"grpo seed 1: {rows[1]['before']:.4f} -> {rows[1]['after']:.4f} in 8 queries" in printed
    # the run's own evaluation: before the first update (0 queries) and after the last epoch
    assert len(rows) == 4 and all(len(r["evaluations"]) == 2 and r["evaluations"][0]["epoch"] == -1 for r in rows)
    assert all(r["evaluations"][-1]["queries"] == r["queries"] for r in rows)
    assert all(r["before"] == r["evaluations"][0]["reward"] and r["after"] == r["evaluations"][-1]["reward"]
               for r in rows)
    # each evaluation's prompts: the two drawn prompts' means, each over its images, whose mean is the reward's
    assert all(len(e["prompts"]) == 2 and abs(sum(e["prompts"].values()) / 2 - e["reward"]) < 1e-9
               for r in rows for e in r["evaluations"])
    assert [r["queries"] for r in rows] == [8, 8, 6, 6]  # remax: 4 samples + 2 greedy per epoch, 1 epoch
    assert [e["queries"] for e in rows[2]["evaluations"]] == [0, 6]
    assert (tmp_path / "reward_vs_queries.png").exists() and "| grpo |" in (tmp_path / "results.md").read_text()
    table = table_rows((tmp_path / "results.md").read_text(), "variant")
    assert table == table_rows(printed, "variant")
    for preset in ("grpo", "remax"):  # every seed reached -100 at its first evaluation: 0 queries, 0 evaluations
        assert table[preset]["queries to reach -100"] == "0 ± 0 (2/2 seeds)"
        assert table[preset]["evaluations to reach -100"] == "0 ± 0 (2/2 seeds)"
    # denoiser evaluations: 2 epochs' worth of grpo's for 2 epochs (a probe epoch sized the run), read per evaluation
    per_epoch = rows[0]["nfe"]
    assert per_epoch > 0 and all(r["evaluations"][-1]["nfe"] == r["nfe"] for r in rows)
    assert rows[0]["evaluations"][0]["nfe"] == 0 and rows[2]["nfe"] != per_epoch  # remax also samples greedily
    assert f"gain at {min(r['nfe'] for r in rows)} evaluations (read at)" in table["grpo"]  # the fewest any row spent
    budget = ["--presets", "grpo", "--seeds", "0", "--nfe", str(2 * per_epoch), "--out", str(tmp_path / "nfe")]
    succeeded("compare_algorithms", *budget, "--threshold", "-100", *flags("--set", sets))
    (row,) = saved_rows(tmp_path / "nfe")
    assert row["nfe"] == 2 * per_epoch and row["queries"] == 2 * rows[0]["queries"]
    assert not (tmp_path / "nfe" / "runs" / "grpo_seed0_nfe_probe").exists()

    # run again with one more seed: the saved runs are kept as they are, only the new seed trains; a run
    # directory left by an attempt that was cut short (not in results.json) is started afresh, not appended to
    stale = tmp_path / "runs" / "grpo_seed2"
    stale.mkdir(parents=True)
    (stale / "metrics.jsonl").write_text('{"epoch": 0, "reward_queries": 1000, "reward_mean": 0.0}\n')
    printed = succeeded("compare_algorithms", *[x if x != "0,1" else "0,1,2" for x in args], "--versus", "grpo").stdout
    assert f"4 runs already in {tmp_path / 'results.json'}; 2 to go" in printed
    again = saved_rows(tmp_path)
    assert sorted((r["preset"], r["seed"]) for r in again) == [("grpo", 0), ("grpo", 1), ("grpo", 2), ("remax", 0),
                                                               ("remax", 1), ("remax", 2)]
    kept = {(r["preset"], r["seed"]): r for r in again}
    assert kept[("grpo", 2)]["queries"] == 8
    assert all(kept[(r["preset"], r["seed"])] == r for r in rows)  # as saved
    assert table_rows(printed, "variant")["grpo"]["queries to reach -100"] == "0 ± 0 (3/3 seeds)"
    # --versus: each row's difference of the mean gains to grpo's, paired by seed (the same 3 seeds: the per-seed
    # differences' t interval, 2 degrees of freedom, t_0.975 = 4.3027; a normal interval's 1.96 would fail)
    versus = table_rows(printed[printed.rindex("| variant |"):], "variant")["remax"]  # the second table
    gain = {(r["preset"], r["seed"]): r["after"] - r["before"] for r in again}
    differences = [gain[("remax", seed)] - gain[("grpo", seed)] for seed in (0, 1, 2)]
    half = 4.3027 * statistics.stdev(differences) / 3 ** 0.5
    mean = statistics.mean(differences)
    assert versus["seeds"] == "3"
    printed_interval = re.fullmatch(r"(\S+) \((\S+) to (\S+)\)", versus["gain - grpo's (95% interval)"]).groups()
    assert [float(x) for x in printed_interval] == pytest.approx([mean, mean - half, mean + half], abs=5.1e-5)
    # another study (other settings) in the same directory is refused, not mixed in
    assert "use another --out" in refused("compare_algorithms", *[x if x != "8" else "16" for x in args])


def test_variants_are_rows_of_their_own_and_tweedie_values_are_counted(tiny_model_dir, tmp_path):
    """A variant is a row of its own; the study's overrides take former field names (saying so), keys of a *_kwargs
    section and an object field's literal, and refuse an unknown field."""
    prompts = tmp_path / "animals.txt"
    prompts.write_text("cat\ndog\nhorse\n")
    sets = ["pretrained.model=" + tiny_model_dir, "prompt_fn=from_file", f"prompt_fn_kwargs.path={prompts}",
            "reward_fn=jpeg_compressibility", "sample.num_steps=3", "sample.sde_window_size=0", "sample.eta=0.5",
            "compile_denoiser=False", "sample.batch_size=4", "sample.num_batches_per_epoch=1", "train.batch_size=4",
            "train.group_size=2", "train.pairs_per_forward=12", "eval_num_prompts=2", "eval_num_seeds=1"]
    tweedie = "tweedie=group_ppo group_params.value_source=tweedie"  # a recorded study's spelling
    out = tmp_path / "study"
    args = ["--presets", "grpo", "--variant", tweedie, "--seeds", "0", "--queries", "8", "--threshold", "grpo",
            "--out", str(out)] + flags("--set", sets)
    ran = succeeded("compare_algorithms", *args)
    grpo, tweedie_row = saved_rows(out)
    assert (grpo["preset"], tweedie_row["preset"]) == ("grpo", "tweedie")
    # 3 steps, all stochastic: x_1 and x_2 valued, 2 more queries per sample (4 samples an epoch, one epoch)
    assert grpo["queries"] == 8 and tweedie_row["queries"] == 12 and len(tweedie_row["evaluations"]) == 2
    assert grpo["critic_ev"] is None
    text = (out / "results.md").read_text()
    assert f"queries to reach grpo's final {grpo['after']:.4f}" in text and "| tweedie |" in text
    assert text.strip() in ran.stdout  # the table printed is the one written
    assert "critic EV (last 10 epochs)" in text
    assert "tree value EV" not in text and grpo["tree_value_ev"] is None  # no tree: no column
    # the overrides as the runs read them (their config.json)
    config = json.loads((out / "runs" / "grpo_seed0" / "config.json").read_text())
    assert config["sample"]["noise_level"] == 0.5 and config["compile_denoiser"] is False
    assert config["prompt_fn_kwargs"] == {"path": str(prompts)}
    tweedie_config = json.loads((out / "runs" / "tweedie_seed0" / "config.json").read_text())
    assert tweedie_config["group_ppo"]["value_source"] == "tweedie"
    assert "config field group_params.value_source is now group_ppo.value_source" in ran.stderr
    assert "expected 'LABEL=PRESET FIELD=VALUE ...'" in refused("compare_algorithms", "--variant", "x=nope", "--out",
                                                                  str(tmp_path / "other"))
    # one more variant joins the study; a saved label with another definition is refused
    succeeded("compare_algorithms", *args, "--variant", "dpo=dpo")
    more = saved_rows(out)
    assert [r["preset"] for r in more] == ["grpo", "tweedie", "dpo"]
    assert more[:2] == [grpo, tweedie_row]  # the saved runs, not run again
    error = refused("compare_algorithms", *[x if x != tweedie else "tweedie=grpo" for x in args])
    assert "holds 'tweedie' as ['group_ppo', 'group_params.value_source=tweedie']" in error
    # an unknown field stops the study before its run starts
    error = refused("compare_algorithms", *args, "--variant", "typo=grpo sample.etta=0.5")
    assert "sample.etta=0.5: config has no field 'sample.etta'" in error
    assert "config field sample.eta is now sample.noise_level" in error
    assert not (out / "runs" / "typo_seed0").exists()


def evaluation(queries: int, nfe: int, reward: float) -> dict:
    return {"epoch": -1 if queries == 0 else 0, "queries": queries, "nfe": nfe, "reward": reward, "accuracy": None}


def test_a_saved_study_is_reported_without_training(tmp_path):
    """A results.json holding every run of the command: nothing trains; the table and the figure's curves come from
    the saved rows, by hand. grpo reaches 0.6 at its second evaluation (8 queries, 40 denoiser evaluations); 'tree'
    never does. At 39 evaluations (--at-nfe) grpo is read at its evaluation at 20 (the last within), 'tree' at 39 (a
    level is within itself). The training curves' moving average over 5 epochs: fewer at the start."""
    def row(label, evaluations, rewards, tree_value_ev):
        return {"preset": label, "definition": ["grpo"], "seed": 0, "critic_ev": None, "tree_value_ev": tree_value_ev,
                "before": evaluations[0]["reward"], "after": evaluations[-1]["reward"], "accuracy_before": None,
                "accuracy_after": None, "queries": 8, "nfe": evaluations[-1]["nfe"], "wall_s": 1.0,
                "curve": [[i + 1, reward] for i, reward in enumerate(rewards)], "evaluations": evaluations}

    rows = [row("grpo", [evaluation(0, 0, 0.5), evaluation(4, 20, 0.55), evaluation(8, 40, 0.7)], [1, 3, 5, 7, 9, 11],
                None),
            row("tree", [evaluation(0, 0, 0.5), evaluation(8, 39, 0.45)], [0, 0, 4, 4, 8, 8], 0.25)]
    (tmp_path / "results.json").write_text(json.dumps({"settings": {"queries": 8, "set": []}, "rows": rows}))
    printed = succeeded("compare_algorithms", "--presets", "grpo", "--variant", "tree=grpo", "--seeds", "0",
                        "--queries", "8", "--threshold", "0.6", "--at-nfe", "39", "--out", tmp_path).stdout
    assert f"2 runs already in {tmp_path / 'results.json'}; 0 to go" in printed
    lines = (tmp_path / "results.md").read_text().splitlines()
    assert lines[0].endswith("| gain at 39 evaluations (read at) | tree value EV (all epochs) | wall time (s) |")
    assert "critic EV" not in lines[0]  # no row has a critic
    table = table_rows("\n".join(lines), "variant")
    grpo, tree = table["grpo"], table["tree"]
    assert (grpo["queries to reach 0.6"], grpo["evaluations to reach 0.6"]) == ("8 ± 0 (1/1 seeds)", "40 ± 0 (1/1 seeds)")
    assert tree["queries to reach 0.6"] == tree["evaluations to reach 0.6"] == "never (0/1 seeds)"
    assert grpo["gain at 39 evaluations (read at)"] == "0.05 ± 0 (20 ± 0)"
    assert tree["gain at 39 evaluations (read at)"] == "-0.05 ± 0 (39 ± 0)"
    assert (grpo["gain"], tree["gain"]) == ("0.2 ± 0", "-0.05 ± 0")
    assert (grpo["tree value EV (all epochs)"], tree["tree value EV (all epochs)"]) == ("—", "0.25 ± 0")
    curves = json.loads((tmp_path / "reward_vs_queries.json").read_text())
    assert (tmp_path / "reward_vs_queries.png").exists()
    assert curves["grpo"]["training"] == {"queries": [1, 2, 3, 4, 5, 6],
                                          "reward_moving_average": [1.0, 2.0, 3.0, 4.0, 5.0, 7.0]}
    assert curves["tree"]["training"]["reward_moving_average"] == pytest.approx([0, 0, 4 / 3, 2, 16 / 5, 24 / 5])
    assert curves["grpo"]["evaluation"] == {"queries": [0, 4, 8], "nfe": [0, 20, 40], "reward_mean": [0.5, 0.55, 0.7],
                                            "reward_std": [0.0, 0.0, 0.0]}


def test_sampling_bench_runs_and_prints_the_ratio(tiny_model_dir, tmp_path):
    printed = succeeded("sampling", "--model", tiny_model_dir, "--prompt-fn", "simple_animals", "--images", "2",
                        "--steps", "2", "--repeats", "1", "--device", "cpu", "--threads", "0", "--json",
                        tmp_path / "sampling.json").stdout
    out = json.loads((tmp_path / "sampling.json").read_text())
    assert out["ratio"] > 0 and out["max_image_diff"] < 1e-4  # the same images as diffusers' pipeline
    assert "ratio ours / diffusers" in printed and "machine:" in printed and f"{out['ratio']:.3f}" in printed


def test_training_bench_runs_and_prints_speedup_and_unet_share(tiny_model_dir, tmp_path):
    printed = succeeded("training", "--model", tiny_model_dir, "--prompt-fn", "simple_animals", "--samples", "4",
                        "--steps", "2", "--batch-size", "2", "--pairs-per-forward", "4", "--repeats", "1", "--device",
                        "cpu", "--threads", "0", "--json", tmp_path / "training.json").stdout
    out = json.loads((tmp_path / "training.json").read_text())
    assert out["pairs"] == 8 and out["speedup"] > 0 and 0 < out["unet_share"] <= 1
    assert "pairs/s" in printed and "speed-up ours / ddpo-pytorch" in printed and "denoiser share" in printed
    assert out["reference"] == "ddpo-pytorch loop" and out["loss_max_abs_diff"] < 1e-6  # the same pairs, one batch
    assert out["grad_max_abs_diff"] < 1e-4 * out["grad_max_abs"]


def flow_grpo_reference(trained: dict, printed: str) -> None:
    """bench/training.py on a flow-matching family: Flow-GRPO's loop, computing ours' loss and gradient on the same
    pairs."""
    assert trained["reference"] == "Flow-GRPO loop" and trained["speedup"] > 0
    assert "reference loop: Flow-GRPO loop" in printed and "speed-up ours / Flow-GRPO" in printed
    assert trained["loss_max_abs_diff"] < 1e-6 and trained["loss_ours"] != 0
    assert trained["grad_max_abs_diff"] < 1e-4 * trained["grad_max_abs"]


@pytest.mark.parametrize("family", ["sdxl", "flux"])  # sd3: the test below
def test_the_benches_run_a_tiny_family_built_from_config(family, tmp_path):
    succeeded("sampling", "--family", family, "--prompt-fn", "simple_animals", "--images", "2", "--steps", "2",
              "--repeats", "1", "--device", "cpu", "--threads", "0", "--json", tmp_path / "sampling.json")
    out = json.loads((tmp_path / "sampling.json").read_text())
    assert out["ratio"] > 0 and out["max_image_diff"] == 0  # the pipeline's own sampler (DDIM, Euler), bitwise
    assert out["stochastic_steps"] == 2  # ours timed as the trainer samples: every step stochastic, log-probs
    printed = succeeded("training", "--family", family, "--prompt-fn", "simple_animals", "--samples", "4", "--steps",
                        "2", "--batch-size", "2", "--pairs-per-forward", "4", "--repeats", "1", "--device", "cpu",
                        "--threads", "0", "--json", tmp_path / "training.json").stdout
    trained = json.loads((tmp_path / "training.json").read_text())
    assert trained["pairs"] == 8 and f"{family} (" in printed and "pairs/s" in printed
    if family == "sdxl":  # neither reference loop handles SDXL's added conditions
        assert trained["reference"] is None and "speedup" not in trained
    else:
        flow_grpo_reference(trained, printed)


def test_the_sd3_benches_write_their_figures_and_train_an_sde_window(tmp_path):
    """The tiny SD3 built from config, with a 3-step SDE window of 6 steps, 2 of them trained (timestep fraction 0.7):
    the Flow-GRPO loop trains the window's first 2 steps, ours 2 random ones of the window; both as many pairs, and on
    the same pairs the same loss and gradient; the JSON files hold what was printed. Sampled with a 2-step window of 3
    steps: the pipeline's images bitwise."""
    trained_text = succeeded("training", "--family", "sd3", "--prompt-fn", "simple_animals", "--samples", "4",
                             "--steps", "6", "--sde-window-size", "3", "--step-fraction", "0.7", "--batch-size",
                             "2", "--pairs-per-forward", "auto", "--repeats", "2", "--device", "cpu", "--threads",
                             "0", "--json", tmp_path / "training.json").stdout
    sampled_text = succeeded("sampling", "--family", "sd3", "--prompt-fn", "simple_animals", "--images", "2",
                             "--steps", "3", "--sde-window-size", "2", "--repeats", "1", "--device", "cpu",
                             "--threads", "0", "--json", tmp_path / "sampling.json").stdout
    trained = json.loads((tmp_path / "training.json").read_text())
    sampled = json.loads((tmp_path / "sampling.json").read_text())
    assert (trained["pairs"], trained["round_pairs"], trained["trained_steps"]) == (8, 4, 2)
    assert "4 samples x 2 of 6 steps (3 stochastic) = 8 trained" in trained_text and "sd3 (" in trained_text
    flow_grpo_reference(trained, trained_text)
    assert f"{trained['speedup']:.2f}x" in trained_text  # the JSON holds what was printed
    assert len(trained["times"]["ours"]) == len(trained["times"]["Flow-GRPO loop"]) == 2
    assert sampled["ratio"] > 0 and sampled["stochastic_steps"] == 2 and sampled["max_image_diff"] == 0
    assert "flow_sde at 0.7 on 2 of 3 steps, log-probs recorded" in sampled_text
    assert f"{sampled['ratio']:.3f}" in sampled_text


def test_epoch_bench_runs_and_prints_every_phase(tiny_model_dir, tmp_path):
    sets = ["pretrained.model=" + tiny_model_dir, "prompt_fn=simple_animals", "reward_fn=jpeg_compressibility",
            "sample.num_steps=2", "sample.batch_size=4", "sample.num_batches_per_epoch=1", "train.batch_size=4",
            "train.group_size=2", "log_images_every=1"]
    printed = succeeded("epoch", "--epochs", "1", "--device", "cpu", "--threads", "0", "--json",
                        tmp_path / "epoch.json", *flags("--set", sets)).stdout
    out = json.loads((tmp_path / "epoch.json").read_text())
    for label in ("sampling", "reward", "advantage", "training", "reference/KL", "critic", "logging", "checkpoint"):
        assert f"| {label} |" in printed
    assert out["wall_s"] > 0 and out["phases"]["sampling"] > 0 and out["phases"]["checkpoint"] > 0
    assert out["peak_rss_mib"] > 0 and f"peak RSS {out['peak_rss_mib']:.0f} MiB" in printed


def test_unet_rows_bench_prints_per_row_cost_and_ratio():
    printed = succeeded("unet_rows", "--rows", "1,4", "--repeats", "1", "--device", "cpu", "--threads", "0").stdout
    table = table_rows(printed, "rows per call")
    assert set(table) == {"1", "4"}
    ms = {rows: float(cells["ms per row (median of 1)"]) for rows, cells in table.items()}
    assert all(v > 0 for v in ms.values()) and table["1"]["speed-up over 1 rows"] == "1.00x"
    speedup = float(table["4"]["speed-up over 1 rows"].removesuffix("x"))  # the per-row cost at 1 over that at 4
    assert speedup == pytest.approx(ms["1"] / ms["4"], abs=0.01, rel=0.01)  # printed to 2 decimals each


def test_speed_options_bench_measures_each_option_beside_the_baseline(tiny_model_dir, tmp_path):
    printed = succeeded("speed_options", "--model", tiny_model_dir, "--prompt-fn", "simple_animals", "--samples", "4",
                        "--steps", "2", "--images", "2", "--batch-size", "2", "--pairs-per-forward", "4", "--repeats",
                        "1", "--device", "cpu", "--options", "fused_qkv,sdpa_math,sdpa_flash,sdpa_efficient,"
                        "channels_last,cuda_graphs,fp32_frozen", "--json", tmp_path / "speed.json").stdout
    out = json.loads((tmp_path / "speed.json").read_text())
    rows = {row["option"]: row for row in out["rows"]}
    for name in ("sdpa_math", "sdpa_flash", "channels_last"):  # both phases, the same log-probs as the baseline
        row = rows[name]
        assert row["train_pairs_per_s"] > 0 and row["train_ratio"] > 0 and row["sample_ratio"] > 0
        assert row["train_logprob_rel_diff"] <= 1e-4 and row["sample_logprob_rel_diff"] <= 1e-4
        assert "train_mfu" not in row  # no MFU on the CPU
        assert re.search(rf"^{name} +{row['train_pairs_per_s']:.2f} ", printed, re.M)  # the JSON holds what was printed
    # the fused projections bypass LoRA on to_q/to_k/to_v: the frozen forward only, against the unfused one
    assert "train_pairs_per_s" not in rows["fused_qkv"] and rows["fused_qkv"]["sample_logprob_rel_diff"] <= 1e-4
    assert rows["sdpa_efficient"]["skipped"].startswith("attention_backend='efficient' is a CUDA kernel")
    assert rows["cuda_graphs"]["skipped"] == "CUDA graphs need CUDA"
    assert rows["fp32_frozen"]["skipped"] == "without mixed precision every weight is float32 already"
    assert "LoRA on to_q/to_k/to_v is bypassed" in printed and "machine:" in printed and "n/a" in printed
    assert "OUTSIDE" not in printed


def test_speed_options_bench_frozen_weights_in_float32_under_bf16(tiny_model_dir, tmp_path):
    # under bf16 the frozen weights are bf16 beside float32 LoRA (build_policy); the float32 copy computes alike
    succeeded("speed_options", "--model", tiny_model_dir, "--prompt-fn", "simple_animals", "--samples", "2", "--steps",
              "2", "--images", "2", "--batch-size", "2", "--pairs-per-forward", "4", "--repeats", "1", "--device", "cpu",
              "--options", "fp32_frozen", "--mixed-precision", "bf16", "--json", tmp_path / "speed.json")
    out = json.loads((tmp_path / "speed.json").read_text())
    row = out["rows"][0]
    assert out["mixed_precision"] == "bf16" and out["tolerance"] == 5e-2  # the bench's bf16 tolerance
    assert row["train_ratio"] > 0 and row["train_logprob_rel_diff"] <= out["tolerance"]


@pytest.mark.slow
def test_speed_options_bench_compiles_the_repeated_blocks_with_the_same_log_probs(tmp_path):
    # the tiny SD3: its JointTransformerBlocks come from the table of blocks diffusers does not declare; a third of the
    # tiny UNet's compilation time
    succeeded("speed_options", "--family", "sd3", "--prompt-fn", "simple_animals", "--samples", "2", "--steps", "2",
              "--images", "2", "--batch-size", "2", "--pairs-per-forward", "4", "--repeats", "1", "--device", "cpu",
              "--options", "compile_regional", "--json", tmp_path / "speed.json", process=True)  # in a process of its
    row = json.loads((tmp_path / "speed.json").read_text())["rows"][0]  # own: inside pytest's, inductor's g++ failed
    assert row["train_logprob_rel_diff"] <= 1e-4 and row["sample_logprob_rel_diff"] <= 1e-4
    assert row["first_call_s"] > 0 and row["train_ratio"] > 0


@pytest.mark.cuda
def test_speed_options_bench_on_cuda_same_log_probs_under_each_kernel(tmp_path):
    # the tiny SD3 (attention heads of 8: the flash and efficient kernels need a multiple of 8; tiny-shapes' are 4)
    succeeded("speed_options", "--family", "sd3", "--prompt-fn", "simple_animals", "--samples", "4", "--steps", "2",
              "--images", "2", "--batch-size", "2", "--pairs-per-forward", "4", "--repeats", "1", "--device", "cuda",
              "--mixed-precision", "bf16", "--options", "fused_qkv,sdpa_flash,sdpa_efficient,sdpa_math,fp32_frozen",
              "--json", tmp_path / "speed.json")
    out = json.loads((tmp_path / "speed.json").read_text())
    rows = {row["option"]: row for row in out["rows"]}
    for name, row in rows.items():
        assert "skipped" not in row and "failed" not in row, row
        assert row["sample_logprob_rel_diff"] <= out["tolerance"], row
        assert name == "fused_qkv" or row["train_logprob_rel_diff"] <= out["tolerance"], row
    if "tflop_per_image" in out:  # a GPU in PEAK_TFLOPS (H100, A100, ...)
        assert all(0 < row["sample_mfu"] < 1 for row in rows.values())


def test_random_model_counts_a_shape_on_the_meta_device(tmp_path):
    """bench/random_model.py --count-only: Z-Image's shapes described without a weight in memory (nothing saved): its
    6.2B transformer reading the 2560-wide hidden states of a 4.0B Qwen3-4B-sized text encoder. The JSON printed is
    the one written."""
    ran = succeeded("random_model", "--shape", "zimage", "--count-only", "--json", tmp_path / "zimage.json")
    shape = json.loads((tmp_path / "zimage.json").read_text())
    assert json.loads(ran.stdout.strip().splitlines()[-1]) == shape
    assert (shape["shape"], shape["blocks"], shape["pipeline"]) == ("zimage", 1.0, "ZImagePipeline")
    billions = {name: round(count / 1e9, 2) for name, count in shape["parameters"].items()}
    assert billions == {"vae": 0.08, "text_encoder": 4.02, "transformer": 6.15}
    assert shape["configs"]["transformer"]["cap_feat_dim"] == shape["configs"]["text_encoder"]["hidden_size"] == 2560
    assert list(tmp_path.iterdir()) == [tmp_path / "zimage.json"]  # nothing saved


@pytest.mark.slow
def test_reward_hacking_study_reports_its_rows_and_keeps_finished_runs(tmp_path):
    """bench/reward_hacking.py on the embedded model, made small (2 epochs of 8 images, evaluated every epoch): a row
    per preset and variant with the measures read back from each run's eval.jsonl and lora_best/best.json, the plot
    and seed 0's grids; a second call runs nothing (the finished runs are kept)."""
    common = ["--out", tmp_path, "--presets", "grpo", "--variants", "plain,pairwise", "--seeds", "0", "--epochs", "2",
              "--eval-freq", "1", "--jobs", "1"] + flags("--set", ["sample.num_batches_per_epoch=1",
                                                                "sample.batch_size=8", "train.batch_size=8",
                                                                "eval_num_prompts=2", "eval_num_seeds=2"])
    succeeded("reward_hacking", *common)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert set(rows) == {"grpo plain", "grpo pairwise"}
    for label, (run,) in rows.items():
        assert run["epochs"] == [-1, 0, 1] and len(run["heldout"]) == len(run["proxy"]) == 3
        # the best chosen on one half of the images (the first of equals), its held-out reward read on the other
        records = [json.loads(line) for line in
                   (tmp_path / "runs" / f"{label.replace(' ', '_')}_seed0" / "eval.jsonl").read_text().splitlines()]
        selected = [r["eval_heldout/select_half/reward_mean"] for r in records]
        best = records[selected.index(max(selected))]
        assert run["best_epoch"] == best["epoch"]
        assert run["best_heldout"] == best["eval_heldout/report_half/reward_mean"]
        assert run["proxy_gain"] == pytest.approx(run["proxy"][-1] - run["proxy"][0])
    assert rows["grpo pairwise"][0]["proxy"][0] == pytest.approx(rows["grpo plain"][0]["proxy"][0])  # same images
    table = table_rows((tmp_path / "results.md").read_text(), "row")
    assert set(table) == {"grpo plain", "grpo pairwise"}
    assert {"hacking.png", "grid_eval_before.png", "grid_eval_epoch_00001.png"} <= {p.name for p in tmp_path.iterdir()}
    log = tmp_path / "runs" / "grpo_plain_seed0.log"
    written = log.stat().st_mtime_ns
    succeeded("reward_hacking", *common)
    assert log.stat().st_mtime_ns == written


def test_tree_credit_compares_both_estimators_on_the_same_trees(tmp_path):
    """bench/tree_credit.py on the embedded flow model's group_ppo on trees, one epoch: on the same trees tree_grpo
    gives every row of a shared transition one advantage (none opposed), GROUP_PPO's lambda = 1 gives each row its own
    return, whose mean over the rows of a transition is tree_grpo's credit (the tree values are the leaves' means);
    after the last branch (step 1) both are R - V(x_1)."""
    succeeded("tree_credit", "--seeds", "0", "--queries", "32", "--eval-freq", "0", "--out", tmp_path)
    (seed,) = json.loads((tmp_path / "credit.json").read_text())["seeds"]
    (epoch,) = seed["epochs"]
    step0, step1 = epoch["credit"]["0"], epoch["credit"]["1"]
    assert step0["own"]["net"] == pytest.approx(step0["other"]["net"], rel=1e-9)
    assert step0["other"]["opposed"] == 0 and step0["own"]["opposed"] > 0
    assert step0["own"]["rms"] > step0["other"]["rms"] and step0["own"]["transitions"] == 2 * 4  # 2 a prompt group
    assert step1["own"] == pytest.approx(step1["other"], rel=1e-9) and step1["own"]["transitions"] == 32
    assert epoch["segment/num_endpoints"] == 2 and epoch["train/clipfrac"] is not None
    assert "| first half |" in (tmp_path / "credit.md").read_text()


def test_fingerprint_finds_a_run_bitwise_equal_and_names_what_differs(tmp_path):
    """bench/fingerprint.py: a run written then checked is bitwise equal; a fingerprint whose trained weights or one
    metric of an epoch differ fails the check (exit 1) naming both places."""
    path = tmp_path / "fingerprint.json"
    succeeded("fingerprint", "--write", path, "--only", "grpo")
    out = succeeded("fingerprint", "--check", path, "--only", "grpo")
    assert "grpo: " in out.stdout and out.stdout.rstrip().endswith("bitwise equal")
    saved = json.loads(path.read_text())
    epochs, policy = saved["grpo"]["epochs"], saved["grpo"]["weights"]["policy"]
    assert len(epochs) == 2 and epochs[1]["batch"]["advantages"].startswith("torch.float")
    policy[0] = policy[0][:-1] + ("0" if policy[0][-1] != "0" else "1")
    epochs[1]["metrics"]["reward_mean"] = 123.0
    path.write_text(json.dumps(saved))
    out = run_bench("fingerprint", "--check", path, "--only", "grpo")
    assert out.returncode == 1
    assert "grpo.weights.policy[0]:" in out.stdout and "grpo.epochs[1].metrics.reward_mean: 123.0" in out.stdout


def test_solver_gap_samples_the_adapters_with_the_multistep_solvers(tiny_sd3_dir, tmp_path):
    """bench/solver_gap.py on two tiny grpo runs of a flow model: each run's base model and its adapter sample the
    same fresh prompts with the Euler scheduler they trained with and with DPM-Solver++ and UniPC; each row's gain is
    its adapter's reward less its base's, the multistep solvers' images differ from Euler's."""
    from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_trainer

    runs = []
    for seed in (0, 1):
        trainer = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, f"run{seed}", seed=seed, save_freq=1,
                               **FAMILY_OVERRIDES["sd3"])
        trainer.run()
        runs.append(str(tmp_path / f"run{seed}"))
    out = tmp_path / "gap"
    printed = succeeded("solver_gap", "--runs", *runs, "--num-prompts", "2", "--num-seeds", "1", "--out",
                        str(out)).stdout
    rows = saved_rows(out)
    assert [r["run"] for r in rows] == ["run0", "run1"] and all(r["n"] == 2 and r["kind"] == "lora" for r in rows)
    for row in rows:
        for name in ("euler", "dpmsolver++", "unipc"):
            assert row[name]["gain"] == pytest.approx(row[name]["adapter"] - row[name]["base"])
        assert row["dpmsolver++"]["pixels_base"] > 0 and row["unipc"]["pixels_adapter"] > 0
    table = table_rows(printed, "sampler")
    assert set(table) == {"euler (trained)", "dpmsolver++", "unipc"} and " to " in table["unipc"][
        "gain - Euler's gain (95% interval, paired by run)"]


def test_memory_plan_traces_a_tiny_family_and_tables_its_rows(tmp_path):
    """bench/memory_plan.py --tiny on SD's tiny pipeline with LoRA: one row, the pairs that fit an 80 GB card and a
    24 GiB cap (here a train batch's, the most a forward takes: the tiny model fits anything), each size traced and
    within its card; the table made again from the rows written."""
    rows = tmp_path / "rows.jsonl"
    ran = succeeded("memory_plan", "--tiny", "--family", "sd", "--mode", "lora", "--json", rows)
    row = json.loads(rows.read_text())
    assert json.loads(ran.stdout.splitlines()[0]) == row and "error" not in row, row
    assert row["per_pair_gib"] > 0 and row["held_gib"] > 0 and row["pairs_80GB"] == row["pairs_24GiB"] > 2, row
    for card, size in (("80GB", 79.1), ("24GiB", 24.0)):
        assert row[f"traced_{card}"][0] == row[f"pairs_{card}"] and row[f"traced_{card}"][1] < 0.85 * size
    assert "| sd (tiny sd, group_ppo; the H100 run of docs/performance.md: every step trained) |" in succeeded(
        "memory_plan", "--table", rows).stdout
