"""Base vs fine-tuned evaluation: the same prompts and seeds through both models, every configured reward.

Used by ``scripts/evaluate.py``. Image (prompt i, seed s) of either model starts from the noise
of ``torch.Generator().manual_seed(s)`` and uses the same step noise, so the two images of
a pair differ only by the model. Prompt i takes seeds seed + k M .. seed + k M + M - 1, k the number
of earlier rows with the same prompt (a prompt set smaller than N is cycled), so the n = N x M images
are all distinct and the interval below is not narrowed by copies. Statistics over the n images:

    mean, std (ddof = 1), se = std / sqrt(n), ci95 = mean -+ 1.96 se     (normal approximation)

and the same for the paired difference fine-tuned - base, whose total the verdict reads as a run's summary does
(run/reporting/verdict.py: learned, did_not_learn or fell). A groupwise reward (rewards/base.py's ``is_groupwise``: a win
rate, a rank) scores each prompt's M base and M fine-tuned images as one group, so its rewards compare the two models:
a fine-tuned mean win rate above 1/2 says its images win more often than the base model's.
"""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ddpo_group.run.persistence.checkpointing import ADAPTER_WEIGHT, BEST_RECORD, resolve_resume_path
from ddpo_group.models.lora_export import is_lora_dir
from ddpo_group.prompts import draw_prompts
from ddpo_group.rewards import is_groupwise
from ddpo_group.rewards.combine import make_combined_reward
from ddpo_group.rollout.reward_scorer import RewardScorer
from ddpo_group.run.reporting.audio_files import write_wav
from ddpo_group.run.reporting.verdict import verdict
from ddpo_group.sampling.trajectories import with_audio


def find_run_config(path: str | Path, levels: int = 4) -> tuple[dict | None, Path | None]:
    """The config.json of the run that ``path`` (run, checkpoint or LoRA directory) belongs to, and its run dir."""
    path = Path(path).resolve()
    for candidate in [path, *path.parents][: levels + 1]:
        file = candidate / "config.json"
        if file.is_file():
            try:
                config = json.loads(file.read_text())
            except ValueError:
                continue
            if isinstance(config, dict) and {"pretrained", "sample", "reward_fn"} <= set(config):  # a run's, not a model's
                return config, candidate
    return None, None


def resolve_finetuned(path: str | Path) -> tuple[str, Path]:
    """("lora", dir) for a diffusers LoRA directory (or a checkpoint / run holding one; a run's lora_best/), else
    ("weights", checkpoint, or a run's best/)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"fine-tuned model {str(path)!r} does not exist")
    if is_lora_dir(path):
        return "lora", path
    if is_lora_dir(path / "lora") and not (path / "checkpoints").is_dir():
        return "lora", path / "lora"
    if (path / BEST_RECORD).is_file():  # a run's best/: full fine-tuning's trained weights of its best evaluation
        return "weights", path
    checkpoint, _ = resolve_resume_path(str(path))  # the newest that verifies (run/persistence/checkpointing.py)
    if is_lora_dir(checkpoint / "lora"):
        return "lora", checkpoint / "lora"
    return "weights", checkpoint


def run_config(defaults, saved: dict | None):
    """The config a run trained with: its config.json (``saved``; former field names translated) merged onto
    ``defaults``, config/base.py's ``base()`` (fields a run's file lacks take today's defaults)."""
    from ddpo_group.run.command.renamed_fields import translate_saved

    config = copy.deepcopy(defaults)
    config.update(translate_saved(saved or {}))
    return config


def load_finetuned_weights(family, checkpoint: Path, config) -> None:
    """Load an accelerate checkpoint's denoiser weights (full, or LoRA without an export) into ``family.model``;
    ``config``: the run's (its LoRA rank and alpha)."""
    from safetensors.torch import load_file

    from ddpo_group.models.trainable import lora_config
    from ddpo_group.reference.model import POLICY_ADAPTER

    files = sorted(checkpoint.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{str(checkpoint)!r} holds neither lora/ nor model.safetensors")
    state = load_file(str(files[0]))
    # the policy is the "default" adapter; others in the same denoiser (the KL reference's, the old model's) are not
    other_adapter = re.compile(rf"\.{ADAPTER_WEIGHT}\w+\.(?!{POLICY_ADAPTER}\.)\w+\.")
    state = {k: v for k, v in state.items() if other_adapter.search(k) is None}
    lora = any(ADAPTER_WEIGHT in key for key in state)
    if lora:
        family.model.add_adapter(lora_config(config, family.lora_target_modules))
    # the checkpoint holds the trained weights (run/persistence/checkpointing.py): the adapter's, or every parameter of a full
    # fine-tuning; the rest stay the pretrained model's
    missing, unknown = family.model.load_state_dict(state, strict=False)
    parameters = dict(family.model.named_parameters(remove_duplicate=False))
    untrained = [k for k in missing if (ADAPTER_WEIGHT in k if lora else k in parameters)]
    if untrained or unknown:
        raise ValueError(f"{files[0]} does not match the model: {len(untrained)} trained weight(s) missing "
                         f"({', '.join(untrained[:3])}), {len(unknown)} unknown ({', '.join(unknown[:3])})")


def prompt_seeds(prompts: list[str], seed: int, m: int) -> list[list[int]]:
    """Each prompt row's M seeds: seed + k m .. seed + k m + m - 1, k = how often the prompt came before (a cycled
    prompt set repeats prompts; the same prompt and seed would repeat the same image)."""
    return [[seed + prompts[:i].count(p) * m + j for j in range(m)] for i, p in enumerate(prompts)]


@torch.no_grad()
def sample_images(pipe, prompts: list[str], seeds: list[list[int]], num_steps: int, guidance_scale: float, batch_size: int,
                  progress: tqdm | None = None, metadata: list[dict] | None = None, row_kwargs=None,
                  guidance_kwargs=None, images_of=None, audio_of=None, audio_out: list | None = None,
                  **pipeline_kwargs) -> torch.Tensor:
    """Images [N * M, 3, H, W] in [0, 1], prompt-major: index i * M + j is prompt i with its seed ``seeds[i][j]``, from
    the pipeline's own ``__call__`` (its standard sampler; ``pipeline_kwargs``: the family's, e.g. DDIM's eta, the
    resolution; ``row_kwargs(metadata of a call's rows)``: the keywords of those rows, ``family.pipeline_row_kwargs``,
    e.g. an editing family's source images; ``guidance_kwargs(guidance_scale)``: the call's keywords of the scale,
    ``family.guidance_kwargs``, else ``guidance_scale``; ``images_of(output)``: the images of a call,
    ``family.pipeline_images``); a video pipeline's frames [N * M, F, 3, H, W]. ``audio_out``: a list that receives
    each call's audio [rows, channels, samples] when the pipeline makes audio (``audio_of(output)``,
    ``family.pipeline_audio``, else ``output.audio``)."""
    guidance = guidance_kwargs(guidance_scale) if guidance_kwargs is not None else {"guidance_scale": guidance_scale}
    metadata = metadata if metadata is not None else [{}] * len(prompts)
    pairs = [(p, s, m) for p, row, m in zip(prompts, seeds, metadata) for s in row]
    out = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        generators = [torch.Generator(device="cpu").manual_seed(s) for _, s, _ in chunk]
        rows = row_kwargs([m for _, _, m in chunk]) if row_kwargs is not None else {}
        result = pipe(  # prompt by keyword: FLUX.2's and Kontext's pipelines take an image first
            prompt=[p for p, _, _ in chunk], num_inference_steps=num_steps, **guidance,
            generator=generators, output_type="pt", **{**pipeline_kwargs, **rows},  # a row's negative prompts win
        )
        if images_of is not None:
            images = images_of(result)
        else:
            images = result.frames if hasattr(result, "frames") else result.images  # video: frames
        out.append(images.float().cpu())
        if audio_of is not None:
            audio = audio_of(result)
        else:
            audio = result.audio if hasattr(result, "audio") else None
        if audio_out is not None and audio is not None:
            audio_out.append(audio.float().cpu())
        if progress is not None:
            progress.update(1)
    return torch.cat(out)


def score(reward_fn, images: torch.Tensor, prompts: list[str], metadata: list[dict],
          groups: list | None = None) -> dict[str, torch.Tensor]:
    """{"reward": sum_k w_k r_k} (a combined reward function) plus each component's reward when there are several;
    ``groups``: each image's group, for a groupwise reward (one call per group)."""
    if groups is not None:
        total, info = RewardScorer(reward_fn, "reward_fn")(images, prompts, metadata, groups)
    else:
        total, info = reward_fn(images, prompts, metadata)
    labels = [label for label, _ in reward_fn.components]
    return {"reward": total, **({label: info[label] for label in labels} if len(labels) > 1 else {})}


def score_both(reward_fn, base_images: torch.Tensor, tuned_images: torch.Tensor, prompts: list[str],
               metadata: list[dict], num_seeds: int, tuned_metadata: list[dict] | None = None) -> tuple[dict, dict]:
    """The scores of the base and the fine-tuned images (rows prompt-major, ``num_seeds`` a prompt); a groupwise
    reward scores each prompt's base and fine-tuned images as one group (module docstring). ``tuned_metadata``: the
    fine-tuned rows' own (their audio), else ``metadata``."""
    tuned_metadata = metadata if tuned_metadata is None else tuned_metadata
    if not is_groupwise(reward_fn):
        return (score(reward_fn, base_images, prompts, metadata),
                score(reward_fn, tuned_images, prompts, tuned_metadata))
    rows = [(model, r) for start in range(0, len(prompts), num_seeds) for model in (0, 1)
            for r in range(start, start + num_seeds)]
    images = torch.stack([(base_images, tuned_images)[model][r] for model, r in rows])
    scored = score(reward_fn, images, [prompts[r] for _, r in rows], [metadata[r] for _, r in rows],
                   groups=[r // num_seeds for _, r in rows])
    return tuple({key: value[[k for k, (model, _) in enumerate(rows) if model == which]]
                  for key, value in scored.items()} for which in (0, 1))


def stats(values: torch.Tensor) -> dict:
    """mean, std (ddof 1), n, the mean's standard error and its normal-approximation 95% interval."""
    values = values.double()
    n = values.numel()
    mean = float(values.mean())
    std = float(values.std(unbiased=True)) if n > 1 else 0.0
    se = std / math.sqrt(n) if n > 1 else float("nan")
    half = 1.96 * se
    return {"mean": mean, "std": std, "n": n, "se": se, "ci95": [mean - half, mean + half]}


def build_report(prompts: list[str], seeds: list[list[int]], base: dict[str, torch.Tensor],
                 tuned: dict[str, torch.Tensor], info: dict) -> dict:
    """The JSON report: per reward, overall statistics of base, fine-tuned and their paired difference, and per prompt."""
    m = len(seeds[0])
    report = {**info, "prompts": prompts, "seeds": seeds, "rewards": {}}
    for name in base:
        b, t = base[name], tuned[name]
        per_prompt = {}
        for i, prompt in enumerate(prompts):
            rows = slice(i * m, (i + 1) * m)
            entry = per_prompt.setdefault(prompt, {"base": [], "finetuned": []})
            entry["base"] += b[rows].tolist()
            entry["finetuned"] += t[rows].tolist()
        report["rewards"][name] = {
            "base": stats(b), "finetuned": stats(t), "difference": stats(t - b), "same_as_base": bool(torch.equal(t, b)),
            "per_prompt": {
                p: {"base_mean": sum(v["base"]) / len(v["base"]), "finetuned_mean": sum(v["finetuned"]) / len(v["finetuned"]),
                    "base": v["base"], "finetuned": v["finetuned"]}
                for p, v in per_prompt.items()
            },
        }
    total = report["rewards"]["reward"]  # the weighted sum (its components follow it)
    report["verdict"], report["why"] = verdict(total["difference"]["mean"], total["difference"]["se"],
                                               total["same_as_base"])
    return report


def comparison_grid(base_images, tuned_images, prompts, seeds, base_rewards, tuned_rewards):
    """One row per prompt: its M base images, then its M fine-tuned images, captioned with model and seed, the
    reward, and the whole prompt."""
    from ddpo_group.run.reporting.image_grid import image_grid

    m = len(seeds[0])
    images, captions = [], []
    for i, prompt in enumerate(prompts):
        for label, imgs, rewards in (("base", base_images, base_rewards), ("tuned", tuned_images, tuned_rewards)):
            for j, seed in enumerate(seeds[i]):
                images.append(imgs[i * m + j])
                captions.append(f"{label}, seed {seed}\nreward {float(rewards[i * m + j]):.3f}\n{prompt}")
    return image_grid(torch.stack(images), captions, columns=2 * m)


@dataclass
class EvaluationRequest:
    """What ``evaluate`` compares and how (scripts/evaluate.py's command line); None: the fine-tuned run's config.json
    value (merged onto config/base.py's ``base()``)."""

    finetuned: str  # a run directory (its newest checkpoint that verifies), a checkpoint or a diffusers LoRA directory
    base_model: str | None = None  # the base model (pretrained.model)
    num_prompts: int = 8  # prompts drawn from the prompt function
    num_seeds: int = 2  # initial noises per prompt (n = prompts x seeds pairs)
    seed: int = 0  # the first seed (prompt_seeds)
    prompt_fn: str | None = None
    prompt_fn_kwargs: dict | None = None
    reward_fn: object = None  # a name, module:factory, or {name: weight}
    reward_fn_kwargs: dict | None = None
    num_steps: int | None = None  # sampling steps (sample.eval_num_steps, or sample.num_steps)
    guidance_scale: float | None = None  # sample.guidance_scale
    noise_level: float | None = None  # DDIM's eta for Stable Diffusion (sample.noise_level)
    batch_size: int = 8  # images per pipeline call
    out_dir: str | None = None  # default: <run dir>/evaluation
    device: str | None = None  # default: the GPU when there is one
    show_progress: bool = True


def evaluate(request: EvaluationRequest, defaults) -> dict:
    """Sample both models on the same prompts x seeds, score them, write report.json and grid.png; return the report.

    Unset fields of ``request`` come from the fine-tuned run's config.json (found above ``request.finetuned``) merged
    onto ``defaults`` (config/base.py's ``base()``): the model and its family, prompts, rewards,
    ``sample.eval_num_steps`` (or ``num_steps``), the guidance, the noise level (DDIM's eta on Stable Diffusion; the
    flow families sample with their pipeline's deterministic Euler sampler), the resolution.
    """
    from ddpo_group.models import load_family

    r, finetuned = request, request.finetuned
    saved, run_dir = find_run_config(finetuned)
    config = run_config(defaults, saved)
    base_model = r.base_model or config.pretrained.model
    prompt_fn = r.prompt_fn or config.prompt_fn
    prompt_fn_kwargs = r.prompt_fn_kwargs if r.prompt_fn_kwargs is not None else config.prompt_fn_kwargs.to_dict()
    reward_fn = r.reward_fn or (config.reward_fn.to_dict() if hasattr(config.reward_fn, "to_dict") else config.reward_fn)
    reward_fn_kwargs = r.reward_fn_kwargs if r.reward_fn_kwargs is not None else config.reward_fn_kwargs.to_dict()
    num_steps = r.num_steps or config.sample.eval_num_steps or config.sample.num_steps
    guidance_scale = r.guidance_scale if r.guidance_scale is not None else config.sample.guidance_scale
    if r.noise_level is not None:
        config.sample.noise_level = r.noise_level
    device = r.device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind, source = resolve_finetuned(finetuned)
    out_dir = Path(r.out_dir) if r.out_dir else (run_dir or Path.cwd()) / "evaluation"
    out_dir.mkdir(parents=True, exist_ok=True)

    num_seeds = r.num_seeds
    prompts, metadata = draw_prompts(prompt_fn, dict(prompt_fn_kwargs), r.num_prompts, r.seed)
    seeds = prompt_seeds(prompts, r.seed, num_seeds)
    combined = make_combined_reward(reward_fn, reward_fn_kwargs)
    family = load_family(base_model, family=config.pretrained.family, config=config)  # the run's negative prompt, frames
    pipe = family.pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    batch_size = min(r.batch_size, family.pipeline_max_batch or r.batch_size)  # e.g. Qwen-Image-Edit-Plus: one a call
    batches = math.ceil(len(prompts) * num_seeds / batch_size)
    settings = dict(num_steps=num_steps, guidance_scale=guidance_scale, batch_size=batch_size,
                    **family.pipeline_kwargs(config.sample, config.pretrained))
    rows = dict(metadata=metadata, row_kwargs=family.pipeline_row_kwargs,  # e.g. an editing family's source images
                guidance_kwargs=family.guidance_kwargs, images_of=family.pipeline_images,
                audio_of=family.pipeline_audio)
    base_audio, tuned_audio = [], []  # a pipeline with audio (LTX-2): its waveforms, rows as the images'
    with tqdm(total=2 * batches, desc="evaluate (base, then fine-tuned)", disable=not r.show_progress) as progress:
        base_images = sample_images(pipe, prompts, seeds, progress=progress, audio_out=base_audio, **rows, **settings)
        if kind == "lora":
            family.load_lora(pipe, source)
        else:
            load_finetuned_weights(family, source, config)
        tuned_images = sample_images(pipe, prompts, seeds, progress=progress, audio_out=tuned_audio, **rows,
                                     **settings)
    metadata_all = [metadata[i] for i in range(len(prompts)) for _ in range(num_seeds)]
    prompts_all = [p for p in prompts for _ in range(num_seeds)]
    tuned_metadata = None
    if base_audio:  # the rewards hear each row's audio; a person too: evaluation/audio/{base,finetuned}_<row>.wav
        rate = family.audio_sample_rate
        base_audio, tuned_audio = torch.cat(base_audio), torch.cat(tuned_audio)
        tuned_metadata = with_audio(metadata_all, tuned_audio, rate)
        metadata_all = with_audio(metadata_all, base_audio, rate)
        for name, waves in (("base", base_audio), ("finetuned", tuned_audio)):
            for i, wave in enumerate(waves):
                write_wav(out_dir / "audio" / f"{name}_{i:03d}.wav", wave, rate)
    base_rewards, tuned_rewards = score_both(combined, base_images, tuned_images, prompts_all, metadata_all, num_seeds,
                                             tuned_metadata)

    info = {"base_model": str(base_model), "family": family.name, "finetuned": str(finetuned), "loaded": f"{kind}:{source}",
            "reward_fn": reward_fn, "prompt_fn": prompt_fn, **settings,
            "interval": "normal approximation: mean -+ 1.96 std / sqrt(n)"}
    report = build_report(prompts, seeds, base_rewards, tuned_rewards, info)
    report["report_path"] = str(out_dir / "report.json")
    report["grid_path"] = str(out_dir / "grid.png")
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    comparison_grid(base_images, tuned_images, prompts, seeds, base_rewards["reward"], tuned_rewards["reward"]).save(
        out_dir / "grid.png"
    )
    return report


def format_report(report: dict) -> str:
    """The console table: base and fine-tuned as mean ± standard deviation over the images, the paired difference as
    its mean ± its standard error and the 95% interval of that mean (normal approximation, 1.96 SE); the verdict."""
    header = ("reward", "base (mean ± std)", "fine-tuned (mean ± std)", "difference ± SE [95% interval]")
    lines = [f"{header[0]:<24}{header[1]:>22}{header[2]:>26}{header[3]:>42}"]
    n = 0
    for name, entry in report["rewards"].items():
        base, tuned, difference = (entry[k] for k in ("base", "finetuned", "difference"))
        low, high = difference["ci95"]
        n = difference["n"]
        cells = [f"{base['mean']:.4f} ± {base['std']:.4f}", f"{tuned['mean']:.4f} ± {tuned['std']:.4f}",
                 f"{difference['mean']:+.4f} ± {difference['se']:.4f} [{low:+.4f}, {high:+.4f}]"]
        lines.append(f"{name:<24}{cells[0]:>22}{cells[1]:>26}{cells[2]:>42}")
    lines.append(f"(n = {n} image pairs: each prompt and seed sampled by both models)")
    lines.append(f"verdict: {report['why']}")
    lines.append(f"report: {report['report_path']}\ngrid:   {report['grid_path']}")
    return "\n".join(lines)
