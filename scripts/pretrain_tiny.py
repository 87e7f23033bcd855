"""Rebuild the embedded "tiny-shapes" model and its alignment classifier from scratch, or the embedded
flow-matching model "tiny-shapes-flow" beside them.

    python scripts/pretrain_tiny.py                 # writes ddpo_group/models/tiny_shapes{,_classifier}/
    python scripts/pretrain_tiny.py --family sd3    # writes ddpo_group/models/tiny_shapes_flow/
    python scripts/pretrain_tiny.py --out /tmp/m --quick   # a fast smoke run (poor quality)

Phases (each seeded; with the default single thread a rebuild gives the same weights):
  1. the shapes classifier (color, shape, background heads) on freshly rendered images;
  2. the VAE (AutoencoderKL, 32x32 images -> 4x8x8 latents): L1 + MSE reconstruction + a small KL;
  3. the text encoder (CLIP) and UNet (cross-attention) together with the epsilon diffusion loss,
     10% caption dropout (so classifier-free guidance works), EMA weights;
  4. measurement: classifier accuracy on fresh images; DDIM 20 steps, eta 1, guidance 5 samples of
     the saved pipeline (loaded back with StableDiffusionPipeline.from_pretrained) scored by the
     classifier on train and held-out combinations; a sample grid.

With ``--family sd3`` (after the phases above, whose classifier and VAE it reuses from ``--out``):
  3. two CLIP text encoders with projection and an SD3Transformer2DModel (MM-DiT) trained together with the
     rectified-flow loss ||v - (noise - x_clean)||^2 at x_s = (1 - s) x_clean + s noise, s drawn logit-normal and shifted
     as the scheduler shifts its sigmas (shift 3); the VAE is the tiny-shapes one with SD3's latent convention
     (latents = (z - shift_factor) * scaling_factor), 10% caption dropout, EMA weights;
  4. measurement as above with the pipeline's Euler sampler at the default 10 steps, guidance 5
     (StableDiffusion3Pipeline.from_pretrained loads the saved model).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import (AutoencoderKL, DDIMScheduler, DDPMScheduler, FlowMatchEulerDiscreteScheduler,
                       SD3Transformer2DModel, StableDiffusion3Pipeline, StableDiffusionPipeline, UNet2DConditionModel)
from tqdm.auto import tqdm
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config.base import base  # noqa: E402
from ddpo_group.models import shapes_data as shapes  # noqa: E402
from ddpo_group.models import (CLASSIFIER_DIR, TINY_SHAPES_DIR, TINY_SHAPES_FLOW_DIR,  # noqa: E402
                               TINY_SHAPES_FLOW_T5_TOKENS, load_pipeline)
from ddpo_group.models.shapes_classifier import ShapesClassifier  # noqa: E402
from ddpo_group.models.tokenizer import build_tokenizer, save_classic_files  # noqa: E402
from ddpo_group.run.reporting.epoch_logger import image_grid  # noqa: E402

MAX_LENGTH = 20
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
    clip_sample=False, set_alpha_to_one=False, steps_offset=1, prediction_type="epsilon",
)
FULL = dict(classifier_steps=800, vae_steps=800, vae_images=20000, unet_steps=1400, flow_steps=1500, eval_images=256,
            batch=64)
QUICK = dict(classifier_steps=20, vae_steps=20, vae_images=256, unet_steps=20, flow_steps=20, eval_images=16, batch=16)
FLOW_SHIFT = 3.0  # SD3's scheduler shift: sampling spends its steps at high noise, and training draws s the same way
FLOW_SAMPLING = dict(num_inference_steps=10, guidance_scale=5.0, max_sequence_length=TINY_SHAPES_FLOW_T5_TOKENS)
DDIM_SAMPLING = dict(num_inference_steps=20, eta=1.0, guidance_scale=5.0)


def vocabulary() -> list[str]:
    return ["a", "an", "on", "background", *shapes.COLOR_NAMES, *shapes.SHAPE_NAMES]


def build_vae() -> AutoencoderKL:
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(32, 64, 64), layers_per_block=1,
        latent_channels=4, norm_num_groups=16, sample_size=shapes.RESOLUTION,
    )


def text_config(vocab_size: int, layers: int) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        max_position_embeddings=MAX_LENGTH, bos_token_id=0, eos_token_id=1, pad_token_id=1, projection_dim=64,
    )


def build_text_encoder(vocab_size: int) -> CLIPTextModel:
    return CLIPTextModel(text_config(vocab_size, layers=2))


def build_unet() -> UNet2DConditionModel:
    return UNet2DConditionModel(
        sample_size=shapes.RESOLUTION // 4, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(48, 96), down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=64, attention_head_dim=8,
        norm_num_groups=16,
    )


def build_clip_with_projection(vocab_size: int) -> CLIPTextModelWithProjection:
    """One of SD3's two CLIP encoders: the penultimate hidden states condition the tokens, the projection the pool."""
    return CLIPTextModelWithProjection(text_config(vocab_size, layers=3))


def build_transformer() -> SD3Transformer2DModel:
    """An MM-DiT over the 4x8x8 latents, one token per latent pixel; text width 128 = the two CLIPs side by side."""
    return SD3Transformer2DModel(
        sample_size=shapes.RESOLUTION // 4, patch_size=1, in_channels=4, out_channels=4, num_layers=4,
        attention_head_dim=16, num_attention_heads=6, joint_attention_dim=128, caption_projection_dim=96,
        pooled_projection_dim=128, pos_embed_max_size=shapes.RESOLUTION // 4,
    )


def warmup_lr(step: int, warmup: int = 100) -> float:
    return min(1.0, (step + 1) / warmup)


def cosine_lr(step: int, total: int, warmup: int = 100) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Blur half the batch and add noise, so the classifier also judges imperfect generated images."""
    blurred = F.avg_pool2d(F.pad(images, (1, 1, 1, 1), mode="replicate"), 3, stride=1)
    pick = (torch.rand(images.shape[0], 1, 1, 1, generator=generator) < 0.5).float()
    images = pick * blurred + (1 - pick) * images
    return (images + 0.04 * torch.randn(images.shape, generator=generator)).clamp(0, 1)


def train_classifier(steps: int, batch: int, seed: int) -> ShapesClassifier:
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = ShapesClassifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    model.train()
    for step in tqdm(range(steps), desc="classifier"):
        for group in optimizer.param_groups:
            group["lr"] = 2e-3 * cosine_lr(step, steps)
        # both splits: the judge must know every combination, the held-out ones included
        data = shapes.make_batch(batch, seed=seed * 1_000_003 + step, held_out=step % 5 == 4)
        logits = model(augment(data.images, generator))
        loss = sum(F.cross_entropy(lg, data.labels[:, k]) for k, lg in enumerate(logits))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model.eval()


@torch.no_grad()
def head_accuracy(classifier: ShapesClassifier, images: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    logits = classifier(images)
    correct = torch.stack([lg.argmax(1) == labels[:, k] for k, lg in enumerate(logits)], dim=1)
    return {
        "color": correct[:, 0].float().mean().item(),
        "shape": correct[:, 1].float().mean().item(),
        "background": correct[:, 2].float().mean().item(),
        "joint": correct.all(1).float().mean().item(),
    }


def train_vae(steps: int, batch: int, seed: int) -> AutoencoderKL:
    torch.manual_seed(seed)
    vae = build_vae()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=1e-3, weight_decay=0.0)
    vae.train()
    for step in tqdm(range(steps), desc="vae"):
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 * cosine_lr(step, steps)
        x = shapes.make_batch(batch, seed=seed * 1_000_003 + step).images * 2 - 1
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample()).sample
        loss = F.l1_loss(recon, x) + F.mse_loss(recon, x) + 1e-6 * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return vae.eval()


@torch.no_grad()
def encode_dataset(vae: AutoencoderKL, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    data = shapes.make_batch(n, seed=seed)
    means, stds = [], []
    for chunk in torch.split(data.images * 2 - 1, 256):
        dist = vae.encode(chunk).latent_dist
        means.append(dist.mean)
        stds.append(dist.std)
    return torch.cat(means), torch.cat(stds), data.captions


def train_diffusion(vae, tokenizer, n_images: int, steps: int, batch: int, seed: int, probe=None, probe_every: int = 0):
    """Text encoder + UNet with the epsilon loss; EMA weights returned.

    The learning rate is constant after warm-up, so a run of N steps equals the first N steps of a
    longer run: ``probe(step, text_encoder, unet)`` (every ``probe_every`` steps, on EMA weights)
    shows how sample quality grows with N, which is how the default N was chosen.
    """
    torch.manual_seed(seed)
    means, stds, captions = encode_dataset(vae, n_images, seed)
    scaling_factor = float(1.0 / means.std())
    vae.register_to_config(scaling_factor=scaling_factor)
    ids = tokenizer(captions, padding="max_length", max_length=MAX_LENGTH, truncation=True, return_tensors="pt").input_ids
    empty = tokenizer([""], padding="max_length", max_length=MAX_LENGTH, return_tensors="pt").input_ids

    text_encoder, unet = build_text_encoder(len(tokenizer)), build_unet()
    params = list(text_encoder.parameters()) + list(unet.parameters())
    ema = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=5e-4, weight_decay=1e-4)
    noise_scheduler = DDPMScheduler(**{k: v for k, v in SCHEDULER_CONFIG.items() if k != "set_alpha_to_one"})
    generator = torch.Generator().manual_seed(seed)
    text_encoder.train()
    unet.train()
    progress = tqdm(range(steps), desc="unet + text encoder")
    for step in progress:
        rows = torch.randint(0, n_images, (batch,), generator=generator)
        latents = (means[rows] + stds[rows] * torch.randn(means[rows].shape, generator=generator)) * scaling_factor
        tokens = ids[rows].clone()
        dropped = torch.rand(batch, generator=generator) < 0.1
        tokens[dropped] = empty
        noise = torch.randn(latents.shape, generator=generator)
        timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (batch,), generator=generator)
        noisy = noise_scheduler.add_noise(latents, noise, timesteps)
        prediction = unet(noisy, timesteps, encoder_hidden_states=text_encoder(tokens)[0]).sample
        loss = F.mse_loss(prediction, noise)
        update(loss, optimizer, params, ema, step, progress)
        if probe is not None and probe_every and (step + 1) % probe_every == 0 and step + 1 < steps:
            probe(step + 1, *with_weights([text_encoder, unet], params, ema))
    return with_weights([text_encoder, unet], params, ema)


def update(loss, optimizer, params: list, ema: list, step: int, progress) -> None:
    """One optimiser step (learning rate 5e-4 after a warm-up, gradient norm clipped to 1), then the EMA weights (decay
    warming up to 0.999)."""
    for group in optimizer.param_groups:
        group["lr"] = 5e-4 * warmup_lr(step)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    decay = min(0.999, (1 + step) / (10 + step))
    with torch.no_grad():
        for e, p in zip(ema, params):
            e.lerp_(p.detach(), 1 - decay)
    if step % 50 == 0:
        progress.set_postfix(loss=f"{loss.item():.4f}")


def with_weights(models: list, params: list, values: list) -> list:
    """Copies of ``models`` (in eval mode) holding ``values`` (the EMA weights) in place of ``params``."""
    index = {id(p): k for k, p in enumerate(params)}
    copies = [copy.deepcopy(m) for m in models]
    with torch.no_grad():
        for model, clone in zip(models, copies):
            for original, cloned in zip(model.parameters(), clone.parameters()):
                cloned.copy_(values[index[id(original)]])
    return [c.eval() for c in copies]


def clip_condition(text_encoders, ids: torch.Tensor, t5_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SD3's condition as ``StableDiffusion3Pipeline.encode_prompt`` builds it without T5 (with gradients):
    tokens = [CLIP-1 penultimate | CLIP-2 penultimate] then ``t5_tokens`` zero rows; pooled = [proj-1 | proj-2]."""
    hidden, pooled = [], []
    for encoder in text_encoders:
        out = encoder(ids, output_hidden_states=True)
        hidden.append(out.hidden_states[-2])
        pooled.append(out.text_embeds)
    tokens = torch.cat(hidden, dim=-1)
    zeros = tokens.new_zeros(tokens.shape[0], t5_tokens, tokens.shape[-1])
    return torch.cat([tokens, zeros], dim=1), torch.cat(pooled, dim=-1)


def flow_sigmas(batch: int, generator: torch.Generator, shift: float = FLOW_SHIFT) -> torch.Tensor:
    """Noise levels s in (0, 1): logit-normal (SD3's training density), then shifted like the scheduler's sigmas,
    s -> shift s / (1 + (shift - 1) s), so training weighs the noise levels the sampler visits."""
    s = torch.sigmoid(torch.randn(batch, generator=generator))
    return shift * s / (1 + (shift - 1) * s)


def train_flow(vae, tokenizer, n_images: int, steps: int, batch: int, seed: int, probe=None, probe_every: int = 0):
    """Two CLIP text encoders + the MM-DiT with the rectified-flow loss; EMA weights returned.

    Sets the VAE's SD3 latent convention from the data: shift_factor = mean, scaling_factor = 1 / std of the latents.
    The learning rate is constant after warm-up (as for the UNet), so probes show quality against the step count.
    """
    torch.manual_seed(seed)
    means, stds, captions = encode_dataset(vae, n_images, seed)
    shift_factor, scaling_factor = float(means.mean()), float(1.0 / means.std())
    vae.register_to_config(shift_factor=shift_factor, scaling_factor=scaling_factor)
    ids = tokenizer(captions, padding="max_length", max_length=MAX_LENGTH, truncation=True, return_tensors="pt").input_ids
    empty = tokenizer([""], padding="max_length", max_length=MAX_LENGTH, return_tensors="pt").input_ids

    text_encoders = [build_clip_with_projection(len(tokenizer)), build_clip_with_projection(len(tokenizer))]
    transformer = build_transformer()
    models = [*text_encoders, transformer]
    params = [p for m in models for p in m.parameters()]
    ema = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=5e-4, weight_decay=1e-4)
    generator = torch.Generator().manual_seed(seed)
    for m in models:
        m.train()
    progress = tqdm(range(steps), desc="transformer + text encoders")
    for step in progress:
        rows = torch.randint(0, n_images, (batch,), generator=generator)
        x_clean = (means[rows] + stds[rows] * torch.randn(means[rows].shape, generator=generator) - shift_factor) * scaling_factor
        tokens = ids[rows].clone()
        tokens[torch.rand(batch, generator=generator) < 0.1] = empty
        noise = torch.randn(x_clean.shape, generator=generator)
        s = flow_sigmas(batch, generator)
        x = (1 - s[:, None, None, None]) * x_clean + s[:, None, None, None] * noise
        embeds, pooled = clip_condition(text_encoders, tokens, TINY_SHAPES_FLOW_T5_TOKENS)
        velocity = transformer(hidden_states=x, encoder_hidden_states=embeds, pooled_projections=pooled,
                               timestep=s * 1000, return_dict=False)[0]
        loss = F.mse_loss(velocity, noise - x_clean)
        update(loss, optimizer, params, ema, step, progress)
        if probe is not None and probe_every and (step + 1) % probe_every == 0 and step + 1 < steps:
            probe(step + 1, *with_weights(models, params, ema))
    return with_weights(models, params, ema)


@torch.no_grad()
def sample_accuracy(pipe, classifier, n: int, held_out: bool, seed: int) -> tuple[dict, torch.Tensor, list[str]]:
    """Classifier accuracy of the pipeline's samples on a split's prompts: DDIM 20 steps, eta 1, guidance 5 (SD), or
    the Euler sampler at 10 steps, guidance 5 (SD3)."""
    sampling = FLOW_SAMPLING if isinstance(pipe, StableDiffusion3Pipeline) else DDIM_SAMPLING
    combos = shapes.combinations(held_out)
    picks = [combos[i % len(combos)] for i in range(n)]
    prompts = [shapes.caption(*c) for c in picks]
    labels = torch.tensor([shapes.attribute_labels(*c) for c in picks])
    images = []
    for start in range(0, n, 64):
        generator = torch.Generator().manual_seed(seed + start)
        out = pipe(prompts[start : start + 64], generator=generator, output_type="pt", **sampling).images
        images.append(out.float())
    images = torch.cat(images)
    return head_accuracy(classifier, images, labels), images, prompts


def make_pipeline(vae, text_encoder, tokenizer, unet) -> StableDiffusionPipeline:
    return StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
        scheduler=DDIMScheduler(**SCHEDULER_CONFIG), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False,
    )


def make_flow_pipeline(vae, text_encoders, tokenizer, transformer) -> StableDiffusion3Pipeline:
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=FLOW_SHIFT), vae=vae,
        text_encoder=text_encoders[0], tokenizer=tokenizer, text_encoder_2=text_encoders[1], tokenizer_2=tokenizer,
        text_encoder_3=None, tokenizer_3=None,
    )


def measure(model_dir: Path, classifier: ShapesClassifier, eval_images: int, n_fresh: int, grid: str, seed: int) -> dict:
    """The quality numbers of a saved model: judge accuracy, VAE reconstructions, base-model samples."""
    report = {}
    fresh = shapes.make_batch(n_fresh, seed=10_000 + seed)
    held = shapes.make_batch(n_fresh // 2, seed=20_000 + seed, held_out=True)
    report["classifier_accuracy_fresh"] = head_accuracy(classifier, fresh.images, fresh.labels)
    report["classifier_accuracy_fresh_held_out"] = head_accuracy(classifier, held.images, held.labels)
    print("classifier accuracy on fresh images:", json.dumps(report["classifier_accuracy_fresh"]))

    # the project's loader: the family from model_index.json, T5 left absent (the family built with the defaults)
    pipe = load_pipeline(str(model_dir), config=base())
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        recon = pipe.vae.decode(pipe.vae.encode(fresh.images * 2 - 1).latent_dist.mean).sample
    recon = ((recon + 1) / 2).clamp(0, 1)
    report["vae_mse"] = F.mse_loss(recon, fresh.images).item()
    report["classifier_accuracy_vae_reconstructions"] = head_accuracy(classifier, recon, fresh.labels)
    for split, held_out in (("train", False), ("held_out", True)):
        accuracy, images, prompts = sample_accuracy(pipe, classifier, eval_images, held_out, seed=1234)
        report[f"base_model_sample_accuracy_{split}"] = accuracy
        print(f"base model samples ({split} combinations):", json.dumps(accuracy))
        if split == "train" and grid:
            Path(grid).parent.mkdir(parents=True, exist_ok=True)
            image_grid(images[:32], prompts[:32]).save(grid)
    return report


def train_sd_model(args, sizes, out: Path, report: dict, timings: dict) -> ShapesClassifier:
    """Phases 1-3 for the SD-format model: the judge, the VAE, the text encoder + UNet, saved in ``out``."""
    start = time.perf_counter()
    if args.reuse:
        classifier = ShapesClassifier.from_pretrained(Path(args.reuse) / CLASSIFIER_DIR.name)
    else:
        classifier = train_classifier(sizes["classifier_steps"], 128 if not args.quick else 16, args.seed)
    classifier.save_pretrained(out / CLASSIFIER_DIR.name)
    timings["classifier"] = time.perf_counter() - start

    start = time.perf_counter()
    if args.reuse:
        vae = AutoencoderKL.from_pretrained(str(Path(args.reuse) / TINY_SHAPES_DIR.name / "vae")).eval()
    else:
        vae = train_vae(sizes["vae_steps"], sizes["batch"], args.seed + 1)
    timings["vae"] = time.perf_counter() - start

    start = time.perf_counter()
    tokenizer = build_tokenizer(vocabulary(), MAX_LENGTH)
    probe = make_probe(lambda te, unet: make_pipeline(vae, te, tokenizer, unet), classifier, tokenizer, out, args, report)
    text_encoder, unet = train_diffusion(vae, tokenizer, sizes["vae_images"], sizes["unet_steps"], sizes["batch"] * 2,
                                         args.seed + 2, probe=probe, probe_every=args.probe_every)
    timings["unet_text_encoder"] = time.perf_counter() - start
    save_model(make_pipeline(vae, text_encoder, tokenizer, unet), tokenizer, out / TINY_SHAPES_DIR.name)
    return classifier


def train_flow_model(args, sizes, out: Path, report: dict, timings: dict) -> ShapesClassifier:
    """Phase 3 for the SD3-format model, with the judge and the VAE of the SD-format model already in ``out``."""
    classifier = ShapesClassifier.from_pretrained(out / CLASSIFIER_DIR.name)
    vae = AutoencoderKL.from_pretrained(str(out / TINY_SHAPES_DIR.name / "vae")).eval()
    start = time.perf_counter()
    tokenizer = build_tokenizer(vocabulary(), MAX_LENGTH)
    probe = make_probe(lambda te1, te2, transformer: make_flow_pipeline(vae, [te1, te2], tokenizer, transformer),
                       classifier, tokenizer, out, args, report)
    te1, te2, transformer = train_flow(vae, tokenizer, sizes["vae_images"], sizes["flow_steps"], sizes["batch"] * 2,
                                       args.seed + 3, probe=probe, probe_every=args.probe_every)
    timings["transformer_text_encoders"] = time.perf_counter() - start
    save_model(make_flow_pipeline(vae, [te1, te2], tokenizer, transformer), tokenizer, out / TINY_SHAPES_FLOW_DIR.name)
    return classifier


def make_probe(build, classifier, tokenizer, out: Path, args, report: dict):
    """``probe(step, *models)``: sample accuracy of the pipeline ``build(*models)`` (recorded in the report)."""
    def probe(step, *models):
        pipe = build(*models)
        pipe.set_progress_bar_config(disable=True)
        accuracy = sample_accuracy(pipe, classifier, 128, held_out=False, seed=99)[0]
        if args.probe_save:
            save_model(pipe, tokenizer, out / f"probe_{step:05d}")
        report.setdefault("probes", {})[step] = accuracy
        tqdm.write(f"probe at step {step}: {json.dumps(accuracy)}")
    return probe


def save_model(pipe, tokenizer, directory: Path) -> None:
    pipe.save_pretrained(str(directory))
    save_classic_files(tokenizer, directory / "tokenizer")
    if (directory / "tokenizer_2").is_dir():  # SD3's second CLIP shares the first one's tokenizer
        save_classic_files(tokenizer, directory / "tokenizer_2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(TINY_SHAPES_DIR.parent),
                        help="directory receiving tiny_shapes/ and tiny_shapes_classifier/ (and tiny_shapes_flow/)")
    parser.add_argument("--family", choices=("sd", "sd3"), default="sd",
                        help="sd: the judge, the VAE and the SD-format model; sd3: the flow model (reuses the first two)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a few steps of each phase (smoke test, poor quality)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default); the weights depend on it")
    parser.add_argument("--evaluate-only", action="store_true", help="only measure the model already in --out")
    parser.add_argument("--reuse", default="", help="development: load the classifier and VAE from an earlier --out "
                        "instead of training them (a full rebuild trains them identically: each phase has its own seed)")
    parser.add_argument("--probe-every", type=int, default=0, help="development: sample accuracy every N diffusion steps")
    parser.add_argument("--probe-save", action="store_true", help="development: save the pipeline at every probe")
    parser.add_argument("--grid", default=None, help="where to save a sample grid ('' for none; default "
                        "docs/figures/tiny_shapes_samples.png or docs/figures/tiny_shapes_flow_samples.png)")
    for key, value in FULL.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"default {value}")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = dict(QUICK if args.quick else FULL)
    sizes.update({k: getattr(args, k) for k in FULL if getattr(args, k) is not None})
    out = Path(args.out)
    flow = args.family == "sd3"
    model_dir = out / (TINY_SHAPES_FLOW_DIR if flow else TINY_SHAPES_DIR).name
    grid = args.grid if args.grid is not None else f"docs/figures/{model_dir.name}_samples.png"
    report_path = model_dir / "pretrain_report.json"

    if args.evaluate_only:
        report = json.loads(report_path.read_text()) if report_path.is_file() else {}
        classifier = ShapesClassifier.from_pretrained(out / CLASSIFIER_DIR.name)
    else:
        report, timings = {"sizes": sizes, "seed": args.seed, "threads": torch.get_num_threads()}, {}
        classifier = (train_flow_model if flow else train_sd_model)(args, sizes, out, report, timings)
        report["seconds"] = timings

    start = time.perf_counter()
    report.update(measure(model_dir, classifier, sizes["eval_images"], 64 if args.quick else 2048, grid, args.seed))
    report.setdefault("seconds", {})["evaluation"] = time.perf_counter() - start
    shipped = [out / d.name for d in (TINY_SHAPES_DIR, CLASSIFIER_DIR, TINY_SHAPES_FLOW_DIR)]
    report["size_mb_this_model"] = sum(f.stat().st_size for f in model_dir.rglob("*") if f.is_file()) / 1e6
    report["size_mb"] = sum(f.stat().st_size for d in shipped if d.is_dir() for f in d.rglob("*") if f.is_file()) / 1e6
    report_path.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
