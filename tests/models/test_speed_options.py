"""The speed options of config/base.py switch what they say (compile_denoiser, cuda_graphs, attention_backend); bad values
are refused with the allowed ones."""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

from ddpo_group.errors import ConfigError
from ddpo_group.models import speed_options
from ddpo_group.models.speed_options import compile_denoiser, eager, sampling_denoiser, set_attention_backend
from ddpo_group.models.tiny_random import TINY_BUILDERS
from ddpo_group.sampling.trajectories import SamplingOptions, sample_trajectories
from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_trainer


@pytest.fixture
def sdpa_flags():
    """torch's SDPA switches as they were, restored after the test (they are process-wide)."""
    b = torch.backends.cuda
    saved = (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled(), b.math_sdp_enabled())
    yield
    for enable, value in zip((b.enable_flash_sdp, b.enable_mem_efficient_sdp, b.enable_cudnn_sdp, b.enable_math_sdp),
                             saved):
        enable(value)


def flags() -> tuple[bool, bool, bool, bool]:
    b = torch.backends.cuda
    return b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled(), b.math_sdp_enabled()


def compiled(model) -> list[str]:
    """Names of the modules of ``model`` compiled in place (Module.compile), "" for the model itself."""
    return [name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]


def attention_kernel() -> str:
    """The aten kernel a CPU scaled_dot_product_attention call runs under the current switches."""
    q = torch.randn(1, 2, 8, 4)
    with profile() as prof:
        F.scaled_dot_product_attention(q, q, q)
    kernels = [e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")]
    assert len(kernels) == 1, kernels
    return kernels[0]


def test_compile_denoiser_off_full_and_regional():
    unet = TINY_BUILDERS["sd"]().unet
    blocks = [n for n, m in unet.named_modules() if type(m).__name__ == "BasicTransformerBlock"]
    assert blocks
    for value, expected in ((False, []), (True, [""]), ("full", [""]), ("regional", blocks)):
        model = TINY_BUILDERS["sd"]().unet
        compile_denoiser(model, value)
        assert compiled(model) == expected, value
    # SD3's transformer declares no _repeated_blocks in diffusers 0.42.1: its JointTransformerBlocks, from our table
    sd3 = TINY_BUILDERS["sd3"]().transformer
    assert not getattr(sd3, "_repeated_blocks", None)
    compile_denoiser(sd3, "regional")
    joint = [n for n, m in sd3.named_modules() if type(m).__name__ == "JointTransformerBlock"]
    assert joint and compiled(sd3) == joint
    with pytest.raises(ConfigError, match="Linear declares no repeated blocks.*'full'"):
        compile_denoiser(torch.nn.Linear(2, 2), "regional")


def test_eager_runs_the_compiled_modules_plain_inside_and_compiled_after():
    """eager (bench/training.py's reference loop beside a compiled denoiser): inside, no module reaches the compiler;
    after, the compiled call is back and the same output is traced once."""
    traced = []

    def backend(graph, inputs):  # a compiler that counts what reaches it and runs the graph as traced
        traced.append(graph)
        return graph.forward

    class Block(torch.nn.Module):  # defined here: dynamo traces no frame of torch's own modules
        def forward(self, x):
            return x * 2 + 1

    model = torch.nn.Sequential(Block(), torch.nn.Linear(2, 2))
    model[0].compile(backend=backend)
    with eager(model):
        eager_out = model(torch.ones(1, 2))
    assert traced == [] and model[0]._compiled_call_impl is not None  # restored after
    torch.testing.assert_close(model(torch.ones(1, 2)), eager_out)
    assert len(traced) == 1


def test_regional_compilation_raises_the_recompile_limit_per_block_shape():
    """SD-1.5's UNet reached dynamo's limit of 8 (its attention blocks at several widths, with and without gradients):
    the limit becomes 8 per distinct parameter-shape signature of the compiled blocks, and is never lowered."""
    import torch._dynamo.config as dynamo

    unet = TINY_BUILDERS["sd"]().unet
    widths = {m.attn1.to_q.in_features for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock"}
    assert len(widths) >= 2  # the tiny UNet too has its attention blocks at several widths
    with dynamo.patch(recompile_limit=8):  # process-wide: restored after
        compile_denoiser(unet, "regional")
        assert dynamo.recompile_limit == speed_options.RECOMPILES_PER_SHAPE * len(widths)
    with dynamo.patch(recompile_limit=1000):
        compile_denoiser(TINY_BUILDERS["sd"]().unet, "regional")
        assert dynamo.recompile_limit == 1000
    with pytest.raises(ConfigError, match=r"compile_denoiser='partial' must be one of \('auto', False, True, 'full', 'regional'\)"):
        compile_denoiser(unet, "partial")


def test_auto_compiles_the_repeated_blocks_of_a_large_transformer_on_cuda_only(monkeypatch):
    """"auto": regional on CUDA for a transformer of AUTO_MIN_PARAMETERS or more; off on the CPU, below the size and
    for a UNet (measured slower). Module.compile only wraps: no GPU is needed to see what would be compiled."""
    sd3 = TINY_BUILDERS["sd3"]().transformer
    assert sum(p.numel() for p in sd3.parameters()) < speed_options.AUTO_MIN_PARAMETERS  # the tiny model: off
    assert compile_denoiser(sd3, "auto", "cuda") is None and compiled(sd3) == []
    monkeypatch.setattr(speed_options, "AUTO_MIN_PARAMETERS", 1000)
    assert compile_denoiser(sd3, "auto", "cpu") is None and compiled(sd3) == []
    assert compile_denoiser(sd3, "auto", "cuda", sharded=True) is None and compiled(sd3) == []  # FSDP: not measured
    assert compile_denoiser(sd3, "auto", "cuda", deterministic=True) is None and compiled(sd3) == []  # nor this
    unet = TINY_BUILDERS["sd"]().unet
    assert compile_denoiser(unet, "auto", torch.device("cuda")) is None and compiled(unet) == []
    assert compile_denoiser(sd3, "auto", "cuda") == "regional"
    assert compiled(sd3) == [n for n, m in sd3.named_modules() if type(m).__name__ == "JointTransformerBlock"]
    assert compile_denoiser(TINY_BUILDERS["sd"]().unet, "regional", "cuda") == "regional"  # asked for: applied


def test_attention_backend_sets_torchs_switches_and_the_cpu_kernel(sdpa_flags):
    set_attention_backend("math", "cpu")
    assert flags() == (False, False, False, True)
    assert attention_kernel() == "aten::_scaled_dot_product_attention_math"
    set_attention_backend("flash", "cpu")
    assert flags() == (True, False, False, True)  # math: for the calls flash cannot run
    assert attention_kernel() == "aten::_scaled_dot_product_flash_attention_for_cpu"
    set_attention_backend("auto", "cpu")
    assert flags() == (True, True, False, True)  # cuDNN's only when named (its backward failed at FLUX.1 shape)
    set_attention_backend("efficient", "cuda")  # switches only: no GPU needed to set them
    assert flags() == (False, True, False, True)
    with pytest.raises(ConfigError, match="attention_backend='efficient' is a CUDA kernel; on the cpu use 'auto', "
                                          "'flash' or 'math'"):
        set_attention_backend("efficient", "cpu")
    with pytest.raises(ConfigError, match="attention_backend='flash' runs fp16 / bf16 only on CUDA, and "
                                          "mixed_precision='no'"):
        set_attention_backend("flash", "cuda", "no")
    set_attention_backend("flash", "cuda", "bf16")
    assert flags() == (True, False, False, True)
    with pytest.raises(ConfigError, match=r"attention_backend='fast' must be one of \('auto', 'flash', 'cudnn', "
                                          r"'efficient', 'math'\)"):
        set_attention_backend("fast", "cpu")


def test_the_trainer_applies_both_after_the_reference_and_refuses_bad_names(tiny_model_dir, tmp_path, sdpa_flags):
    # LoRA and the KL reference (an adapter on the same denoiser): the blocks are compiled with both adapters in them
    trainer = tiny_trainer("grpo", tiny_model_dir, tmp_path, compile_denoiser="regional", attention_backend="math",
                           **{"kl.beta": 0.01, "kl.use_reference_model": True,
                              "kl.reference_update_freq": 1, "device": "cpu"})
    model = trainer.family.model
    blocks = [n for n, m in model.named_modules() if type(m).__name__ == "BasicTransformerBlock"]
    assert compiled(model) == blocks
    assert {"default", "reference"} <= set(model.peft_config)
    assert flags() == (False, False, False, True)
    default = tiny_trainer("grpo", tiny_model_dir, tmp_path, run_name="default", device="cpu")
    assert compiled(default.family.model) == [] and flags() == (True, True, False, True)
    for field, value, allowed in (("compile_denoiser", "partial", "('auto', False, True, 'full', 'regional')"),
                                  ("attention_backend", "fast", "('auto', 'flash', 'cudnn', 'efficient', 'math')")):
        with pytest.raises(ConfigError) as error:
            tiny_trainer("grpo", tiny_model_dir, tmp_path, run_name=field, **{field: value})
        assert f"{field}={value!r} must be one of {allowed}" in str(error.value)
    with pytest.raises(ConfigError, match="attention_backend='efficient' is a CUDA kernel; on the cpu"):
        tiny_trainer("grpo", tiny_model_dir, tmp_path, run_name="efficient", attention_backend="efficient", device="cpu")


def test_cuda_graphs_sample_through_a_compiled_copy_that_follows_the_policys_weights(tiny_sd3_dir, tmp_path):
    # the trainer's policy: LoRA, a mixup reference adapter on the same denoiser, accelerate's bf16 forward; the copy
    # compiled as on CUDA (mode "reduce-overhead": on the CPU the compiled code without graphs)
    trainer = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, device="cpu", mixed_precision="bf16",
                           **FAMILY_OVERRIDES["sd3"],
                           **{"kl.beta": 0.01, "kl.use_reference_model": True, "kl.reference_update_freq": 1})
    family, model = trainer.family, trainer.family.model
    assert trainer.sampling_model is model  # cuda_graphs=False
    graphs = sampling_denoiser(model, True)
    prepared = graphs.forward._torchdynamo_orig_callable  # the compiled forward: accelerate's, bound to the copy
    assert graphs is not model and prepared.__self__ is graphs and prepared.__func__ is model.forward.__func__
    assert not graphs.training and compiled(model) == []
    assert {id(p) for p in graphs.parameters()} == {id(p) for p in model.parameters()}  # no second copy of weights
    cond, steps = family.encode(["a red circle", "a cat"]), trainer.config.sample.num_steps

    def sample(denoiser):  # as the rollouts sample: under the run's autocast
        with torch.no_grad(), trainer.accelerator.autocast():
            return sample_trajectories(family, denoiser, cond, family.negative_condition(),
                                       SamplingOptions(steps, 4.5, family.noise_levels(trainer.config.sample),
                                                       decode=False),
                                       generator=[torch.Generator().manual_seed(i) for i in range(2)])

    def close(a, b):  # bf16: the compiled kernels round otherwise (0.05 here; the update below moves them 0.5)
        return float((a.log_probs - b.log_probs).abs().max()) <= 5e-2 * float(b.log_probs.abs().max()) and \
            torch.allclose(a.latents, b.latents, atol=0.1)

    before = sample(model)
    assert close(sample(graphs), before)
    with torch.no_grad():  # an optimizer step: the policy's adapters change in place
        for param in trainer.params:
            param.add_(0.3 * torch.randn_like(param))
    after = sample(model)
    assert not close(after, before) and close(sample(graphs), after)
    with trainer.kl.reference.applied(model):  # the reference's adapter switch on the policy leaves the copy alone
        assert model.active_adapters() == ["reference"] and graphs.active_adapters() == ["default"]
    assert model.active_adapters() == ["default"]


def test_cuda_graphs_needs_cuda_and_a_policy_that_samples(tiny_model_dir, tiny_sd3_dir, tmp_path):
    with pytest.raises(ConfigError, match="cuda_graphs=True needs a CUDA device, and this run is on the cpu"):
        tiny_trainer("grpo", tiny_model_dir, tmp_path, run_name="cpu", cuda_graphs=True, device="cpu")
    # DiffusionNFT samples with its old model (an adapter switched on the policy), which the copy would not follow
    with pytest.raises(ConfigError, match="algorithm.objective='nft' samples the rollouts with its old model"):
        tiny_trainer("grpo", tiny_sd3_dir, tmp_path, run_name="nft", cuda_graphs=True, device="cpu",
                     **FAMILY_OVERRIDES["sd3"], **{"algorithm.objective": "nft", "sample.deterministic": True,
                                                    "kl.beta": 0.0, "kl.use_reference_model": False})


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("name", ["sd3", "qwenimage"])  # CFG as one doubled batch; as two forwards (true CFG)
def test_cuda_graphs_on_cuda_sample_as_the_plain_denoiser_and_the_run_trains(name, family_model_dirs, tmp_path):
    from torch._dynamo.utils import counters

    overrides = {**FAMILY_OVERRIDES[name], "device": "cuda", "mixed_precision": "bf16"}
    runs = {}
    for graphs in (False, True):
        counters.clear()
        trainer = tiny_trainer("grpo", family_model_dirs[name], tmp_path, f"graphs_{graphs}", cuda_graphs=graphs,
                               **overrides)
        batch = trainer.rollouts.collect(0, trainer.sampling_model)[0].batch
        # two epochs: the second samples after the first's update, through the same graphs
        metrics = [trainer.train_epoch(epoch) for epoch in range(2)][-1]
        runs[graphs] = (trainer, batch, metrics)
        assert (trainer.sampling_model is trainer.family.model) != graphs
        assert counters["inductor"]["cudagraph_skips"] == 0  # no forward fell back to launching its kernels
    (plain, plain_batch, plain_metrics), (trainer, batch, metrics) = runs[False], runs[True]

    def close(a, b):  # bf16: compiled kernels round otherwise (about 0.05 on the CPU)
        relative = float((a["log_probs"] - b.log_probs).abs().max() / b.log_probs.abs().max())
        return relative <= 5e-2 and torch.allclose(a["next_latents"], b.next_latents, atol=0.1)

    assert close(batch, plain_batch)
    assert metrics["perf/nfe_sampling"] == plain_metrics["perf/nfe_sampling"] > 0  # the copy's forwards are counted
    assert torch.isfinite(torch.tensor(metrics["train/policy_loss"]))
    # the replayed graphs read the weights as they are now: after the run's updates, and after a larger step in place
    prompts = trainer.prompt_sampler.state_dict()  # the same prompts each time; the noise is seeded by the epoch

    def collect(denoiser):
        trainer.prompt_sampler.load_state_dict(prompts)
        return trainer.rollouts.collect(2, denoiser)[0].batch

    eager = collect(trainer.family.model)
    assert close(collect(trainer.sampling_model), eager)
    with torch.no_grad():
        for param in trainer.params:
            param.add_(0.3 * torch.randn_like(param))
    moved = collect(trainer.family.model)
    assert not close(moved, eager) and close(collect(trainer.sampling_model), moved)
    for run, _, _ in runs.values():
        run.rollouts.close()
