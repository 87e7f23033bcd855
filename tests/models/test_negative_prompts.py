"""Per-row negative prompts (a .jsonl prompt file's ``negative_prompt``; models/families/base.py's rule) on the embedded
tiny-shapes SD model and tiny SD3: the rollout records each sample's negative condition and the training forward
re-scores it exactly, our sampler equals the pipeline's own ``__call__(negative_prompt=[...])``, a row's negative
prompt changes its own images only, and a grpo epoch on such a file trains."""

import json
from pathlib import Path
from dataclasses import replace

import pytest
import torch

from ddpo_group.rollout.reward_scorer import RewardScorer
from ddpo_group.rollout.sampler import RolloutSampler, greedy_rewards
from ddpo_group.sampling.trajectories import SamplingOptions, TransitionScorer, sample_trajectories
from ddpo_group.update.on_policy import ratio_deviation
from helpers.batch_helpers import rollout_batch
from helpers.tolerances import reordered_sum_atol
from helpers.family_checks import PROMPTS, family_of, generators
from helpers.trainer_helpers import tiny_trainer

# rows 0 and 2 with their own negative prompts (row 2's the empty one: encoded, not the family's default), 1 and 3 none
METADATA = [{"negative_prompt": "blurry, low quality"}, {}, {"negative_prompt": ""}, {"tag": 1}]
NEGATIVES = ["blurry, low quality", "", "", ""]  # what the pipeline gets: the run's default ("") for rows 1 and 3


def model_dir_of(name, family_model_dirs):
    return "tiny-shapes" if name == "sd" else family_model_dirs[name]


def mean_reward(images, prompts, metadata):
    return images.float().flatten(1).mean(1).double(), {}


@pytest.mark.parametrize("name, guidance", [("sd", 5.0), ("sd3", 5.0), ("zimage", 0.5)])
def test_recorded_log_probs_equal_a_rescore_with_per_row_negatives(name, guidance, family_model_dirs):
    """Z-Image guides from guidance 0 up (its no_guidance): at 0.5 the rows' own negatives are in the forward too."""
    family, config = family_of(name, model_dir_of(name, family_model_dirs), **{"sample.num_batches_per_epoch": 2,
                                                                               "sample.guidance_scale": guidance})
    sample = config.sample
    assert sample.guidance_scale > family.no_guidance and config.train.cfg
    prompts, metadata = PROMPTS * 2, METADATA + METADATA[::-1]
    sampler = RolloutSampler(family, SamplingOptions.rollouts(sample, family), RewardScorer(mean_reward, "mean"))
    record = sampler.sample(family.model, prompts, metadata, generators=generators(8), desc=None)
    sampler.close()
    for key in family.cond_keys:
        negative = record.negative[key]
        assert negative.shape[0] == 8
        default = family.negative_condition()[key][0]
        for i, meta in enumerate(metadata):  # rows without one hold the run's negative condition, the others theirs
            text = meta.get("negative_prompt")
            want = default if text is None else family.encode([text])[key][0]
            assert torch.equal(negative[i], want), (key, i)
    assert not torch.equal(record.negative["prompt_embeds"][0], record.negative["prompt_embeds"][1])

    scorer = TransitionScorer.from_config(config, family)
    scorer.prepare(sample.num_steps, family.device)
    steps = sample.num_steps
    with torch.no_grad():
        for start in (0, 4):  # the sampling batches: bitwise
            rows = torch.arange(start, start + 4)
            for n in range(steps):
                out = scorer(family.model, record, rows, torch.full((4,), n))
                assert torch.equal(out.log_prob, record.log_probs[rows, n]), (start, n)
        rows, columns = torch.arange(8).repeat_interleave(steps), torch.arange(steps).repeat(8)
        # the training forward's chunks of (sample, step) pairs: other batch sizes round differently in float32 (a few
        # ulps: up to 4.2e-6 in the ratio measured on the tiny SD UNet at chunk 1), so the ratio is 1 to within 1e-5,
        # a tenth of the default clip range 1e-4
        for chunk in (1, 3, 32):
            out = torch.cat([scorer(family.model, record, rows[c], columns[c]).log_prob
                             for c in torch.split(torch.arange(8 * steps), chunk)])
            assert float(ratio_deviation(out, record.log_probs[rows, columns]).max()) < 1e-5, chunk
        # the one-row negative would score the rows with their own negative prompt differently (the check can fail)
        plain = replace(record, negative=None)
        other = scorer(family.model, plain, torch.arange(4), torch.zeros(4, dtype=torch.long))
        assert not torch.equal(other.log_prob[0], record.log_probs[0, 0])
        assert torch.equal(other.log_prob[1], record.log_probs[1, 0])


def zero_noise(sample):
    sample = sample.copy_and_resolve_references()
    sample.noise_level = 0.0  # DDIM's eta 0 (SD): the deterministic sampler
    return sample


@pytest.mark.parametrize("name", ["sd", "sd3"])
def test_noise_level_zero_with_per_row_negatives_reproduces_the_pipelines_own_call(name, family_model_dirs):
    """The pipeline's ``negative_prompt=[...]`` (family.pipeline_row_kwargs: each row's, the run's default for the
    others) encodes the negatives as one batch: our sampler given that batch gives its images bitwise. The rollout's
    ``negative_rows`` encodes each distinct negative prompt alone (batch-independent, for exact resume): equal to the
    batch's encoding to float rounding (bitwise on SD; SD3's CLIP pooled output differs by ulps), so are the images."""
    family, config = family_of(name, model_dir_of(name, family_model_dirs))
    family.pipe.set_progress_bar_config(disable=True)
    guidance = config.sample.guidance_scale
    assert family.pipeline_row_kwargs(METADATA) == {"negative_prompt": NEGATIVES}
    want = family.pipe(prompt=PROMPTS, num_inference_steps=4, guidance_scale=guidance, generator=generators(4),
                       output_type="pt", **family.pipeline_kwargs(zero_noise(config.sample), config.pretrained),
                       **family.pipeline_row_kwargs(METADATA)).images
    cond, batched, rows = family.encode(PROMPTS), family.encode(NEGATIVES), family.negative_rows(METADATA)

    def images(negative):
        return sample_trajectories(family, family.model, cond, negative,
                                   SamplingOptions(4, guidance, [0.0] * 4, compute_log_prob=False),
                                   generator=generators(4)).images

    assert torch.equal(images(batched), want)
    for key in family.cond_keys:
        torch.testing.assert_close(rows[key], batched[key], rtol=0, atol=1e-6)
    torch.testing.assert_close(images(rows), want, rtol=0, atol=1e-5)
    if name == "sd":
        assert torch.equal(images(rows), want)
    plain = family.pipe(prompt=PROMPTS, num_inference_steps=4, guidance_scale=guidance, generator=generators(4),
                        output_type="pt", **family.pipeline_kwargs(zero_noise(config.sample), config.pretrained)).images
    assert float((plain[0] - want[0]).abs().max()) > 1e-3  # row 0's negative prompt matters (the check can fail)


def test_a_rows_negative_prompt_changes_its_own_images_only_with_guidance():
    family, config = family_of("sd", "tiny-shapes")
    cond = family.encode(PROMPTS)
    levels = family.noise_levels(config.sample)

    def images(metadata, guidance):
        return sample_trajectories(family, family.model, cond, family.negative_for(metadata),
                                   SamplingOptions(4, guidance, levels, compute_log_prob=False),
                                   generator=generators(4)).images

    one = [{}, {"negative_prompt": "a green triangle"}, {}, {}]
    plain, negated = images([{}] * 4, 5.0), images(one, 5.0)
    assert float((negated[1] - plain[1]).abs().max()) > 1e-3
    for i in (0, 2, 3):
        assert torch.equal(negated[i], plain[i]), i
    assert torch.equal(images(one, 1.0), images([{}] * 4, 1.0))  # no guidance: the negative is not used


def write_prompt_file(path):
    rows = [{"prompt": "a red circle on a blue background", "negative_prompt": "a square"},
            {"prompt": "a green square on a white background"},
            {"prompt": "a blue triangle on a black background", "negative_prompt": "blurry"},
            {"prompt": "a yellow circle on a red background", "shape": "circle"}]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return str(path)


def test_a_grpo_epoch_on_a_file_with_negative_prompts_trains_and_both_evaluations_use_them(tmp_path):
    """grpo on a .jsonl with and without negative prompts trains; the periodic evaluation samples with the rows'
    negative prompts (its rewards differ from the same file without them); evaluate() passes them to the pipeline."""
    path = write_prompt_file(tmp_path / "prompts.jsonl")
    trainer = tiny_trainer("grpo", "tiny-shapes", tmp_path, "negatives", device="cpu", prompt_fn="from_file",
                           prompt_fn_kwargs={"path": path}, eval_freq=1)
    before = [p.detach().clone() for p in trainer.updater.params]
    metrics = trainer.run()
    assert metrics["global_step"] == 2
    changed = sum(not torch.equal(b, p.detach()) for b, p in zip(before, trainer.updater.params))
    assert changed > len(before) // 2, f"only {changed} of {len(before)} trained tensors changed"
    for key in ("train/policy_loss", "train/grad_norm", "train/ratio_max", "eval/reward_mean"):
        assert torch.isfinite(torch.tensor(metrics[key])), (key, metrics[key])
    assert set(trainer.family._negatives) == {"a square", "blurry"}  # each distinct one encoded once (eval: all rows)

    plain = tmp_path / "plain.jsonl"
    plain.write_text("\n".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "negative_prompt"})
                               for line in Path(path).read_text().splitlines()) + "\n")
    without = tiny_trainer("grpo", "tiny-shapes", tmp_path, "plain", device="cpu", prompt_fn="from_file",
                           prompt_fn_kwargs={"path": str(plain)}, eval_freq=1).run()
    assert without["eval/reward_mean"] != metrics["eval/reward_mean"]

    from config.base import base as base_config
    from ddpo_group.models.families.base import ModelFamily
    from ddpo_group.offline.comparison import EvaluationRequest, evaluate

    calls = []
    original = ModelFamily.pipeline_row_kwargs
    ModelFamily.pipeline_row_kwargs = lambda self, metadata: calls.append(original(self, metadata)) or calls[-1]
    try:
        report = evaluate(EvaluationRequest(str(tmp_path / "negatives" / "lora"), num_prompts=4, num_seeds=1,
                                            batch_size=4, show_progress=False), base_config())
    finally:
        ModelFamily.pipeline_row_kwargs = original
    assert report["loaded"].startswith("lora:")
    negatives = [text for call in calls for text in call.get("negative_prompt", [])]
    assert {"a square", "blurry"} <= set(negatives) and "" in negatives  # the rows' own, the default for the others


def test_remaxs_greedy_baseline_uses_the_rows_negative_prompts():
    family, config = family_of("sd", "tiny-shapes")
    score = RewardScorer(mean_reward, "mean")
    keys = [0, 1, 2, 3]
    options = SamplingOptions.deterministic(config.sample)
    plain = greedy_rewards(family, family.model, PROMPTS, [{}] * 4, keys, score, options, seed=7)
    negated = greedy_rewards(family, family.model, PROMPTS, METADATA, keys, score, options, seed=7)
    assert negated[0] != plain[0]
    # row 2's explicit "" is SD's default negative prompt (the empty one, encoded): the same baseline
    assert negated[1] == plain[1] and negated[2] == plain[2] and negated[3] == plain[3]


def test_rounds_with_and_without_negative_prompts_pool_row_by_row():
    """Dynamic sampling pools the rows of several rounds: a round whose prompts had no negative prompt gets the run's
    one-row negative for each of its rows; rounds that all lack one are left as they are."""
    from ddpo_group.rollout.collector import pool_rows

    family, _ = family_of("sd", "tiny-shapes")
    own = family.negative_rows(METADATA)
    cond = family.encode(PROMPTS)
    rounds = [rollout_batch(cond, torch.zeros(4, 1, 2), torch.zeros(4, 1, 2), torch.zeros(4, 1), {}),
              rollout_batch(cond, torch.ones(4, 1, 2), torch.ones(4, 1, 2), torch.ones(4, 1), {}, negative=own)]
    assert rounds[0].with_negative(family).negative["prompt_embeds"].shape[0] == 4
    assert rounds[1].with_negative(family) is rounds[1]
    pooled = pool_rows([r.with_negative(family) for r in rounds], [torch.tensor([True, False] * 2)] * 2, 4)
    default, negative = family.negative_condition()["prompt_embeds"][0], pooled.negative["prompt_embeds"]
    assert torch.equal(negative[0], default) and torch.equal(negative[1], default)
    assert torch.equal(negative[2], own["prompt_embeds"][0]) and torch.equal(negative[3], own["prompt_embeds"][2])
    assert pooled.row_mask.tolist() == [1.0, 1.0, 1.0, 1.0] and torch.equal(pooled.latents[2], torch.ones(1, 2))


# the widest sum of the tiny Qwen-Image transformer (models/tiny_random.py): its feed-forward's 4 x 48 inputs
QWEN_TERMS = 192


@pytest.mark.parametrize("name", ["sdxl", "zimage", "wan", "qwenimage"])
def test_every_guided_family_takes_a_negative_row_per_sample(name, family_model_dirs):
    """Each family's model_output takes B negative rows as it takes one: the one-row negative repeated B times gives
    the same outputs, and a row's own negative prompt changes that row's output only (with guidance): bitwise, but
    on Qwen-Image, whose rows' text is cut to the longest row's token count (the pipeline's batching too), and whose
    matmuls add in another order for another batch layout: a longer negative prompt, or the one row repeated, moves the
    rows' outputs by float rounding (1.2e-6 measured on one CPU, below 1e-6 on another: reordered_sum_atol's bound,
    tests/helpers/tolerances.py, holds on both)."""
    family, config = family_of(name, family_model_dirs[name], sde_window_size=0)
    guidance = config.sample.guidance_scale
    assert guidance > 1
    cond = family.encode(PROMPTS)
    latents = family.initial_latents(4, generators(4), family.device, next(iter(cond.values())).dtype)
    schedule = family.schedule(4, family.device)
    times = {key: values[1] for key, values in schedule.items()}
    one = family.negative_condition()
    with torch.no_grad():
        base = family.model_output(family.model, latents, times, cond, one, guidance)
        repeated = family.model_output(family.model, latents, times, cond,
                                       {k: v.expand(4, *v.shape[1:]).clone() for k, v in one.items()}, guidance)
        own = family.model_output(family.model, latents, times, cond,
                                  family.negative_rows([{}, {"negative_prompt": "a green triangle"}, {}, {}]), guidance)
    rounding = reordered_sum_atol(base, QWEN_TERMS) if name == "qwenimage" else 0.0
    torch.testing.assert_close(repeated, base, rtol=0, atol=rounding)
    assert float((own[1] - base[1]).abs().max()) > 1e-4
    for i in (0, 2, 3):
        if name == "qwenimage":
            torch.testing.assert_close(own[i], base[i], rtol=0, atol=rounding)
        else:
            assert torch.equal(own[i], base[i]), i
