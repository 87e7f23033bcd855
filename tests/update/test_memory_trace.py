"""update/memory_trace.py: a training step's memory traced with fake tensors is the memory the same step takes with
real ones, byte for byte, and grows with the pairs per forward."""

import pytest
import torch

pytest.importorskip("torch.distributed._tools.mem_tracker")  # torch's memory tracker (torch 2.5 and later)

from config.base import get_config  # noqa: E402
from ddpo_group.models.tiny_random import TINY_BUILDERS  # noqa: E402
from ddpo_group.models.trainable import DTYPES  # noqa: E402
from ddpo_group.update.memory_trace import (GIB, CudaAutocast, fake_mode, fake_module, fake_pipeline,  # noqa: E402
                                            fake_reads, peak_snapshot, trace_step, traced_run, tracked)


def tiny_config(use_lora: bool, checkpointing: bool = False):
    config = get_config("grpo")
    config.train.gradient_checkpointing = checkpointing
    config.pretrained.family = "sd"
    config.use_lora, config.mixed_precision = use_lora, "bf16"
    config.sample.num_steps, config.sample.batch_size, config.sample.num_batches_per_epoch = 2, 2, 2
    config.kl.beta = 0.1  # the reference's forward in the loss (full fine-tuning: a frozen copy on the card)
    return config


def traces(use_lora: bool, fake: bool, checkpointing: bool = False) -> list:
    torch.manual_seed(0)
    config = tiny_config(use_lora, checkpointing)
    if fake:
        mode = fake_mode()
        run = traced_run(config, fake_pipeline(TINY_BUILDERS["sd"], mode, DTYPES["bf16"]), mode)
    else:
        run = traced_run(config, TINY_BUILDERS["sd"]())
    return [trace_step(run, k) for k in (1, 3)]


@pytest.mark.parametrize("use_lora", [True, False], ids=["lora", "full"])
def test_a_fake_trace_takes_the_bytes_of_the_real_step(use_lora):
    """The tiny SD model's step (bf16, KL to the reference in the loss) traced on fake weights and on real ones: the
    same peaks, kind by kind, at 1 and 3 pairs per forward (full fine-tuning's activations within 0.5%); more pairs take more activations; full fine-tuning
    holds float32 gradients and Adam's two moments (and a float32 step count a tensor) of every UNet weight, LoRA only
    of its adapters."""
    fake, real = traces(use_lora, fake=True), traces(use_lora, fake=False)
    for f, r in zip(fake, real):
        assert (f.optimizer_peak, f.trainable) == (r.optimizer_peak, r.trainable)
        assert {k: v for k, v in f.kinds.items() if k != "activations"} == \
            {k: v for k, v in r.kinds.items() if k != "activations"}
        if use_lora:
            assert (f.peak, f.kinds) == (r.peak, r.kinds)
        else:  # full fine-tuning's real step keeps a few kB more (0.5% at most): a kernel's choice on real tensors
            assert 0 <= r.peak - f.peak < 0.005 * r.kinds["activations"], (f.peak, r.peak)
    activations = [t.kinds["activations"] for t in fake]
    assert activations[0] < activations[1], activations
    unet = TINY_BUILDERS["sd"]().unet
    weights = sum(p.numel() for p in unet.parameters())
    first = fake[0]
    assert first.kinds["optimizer state"] == 2 * 4 * first.trainable + 4 * first.tensors
    if use_lora:
        assert first.trainable < weights / 5
    else:
        assert (first.trainable, first.tensors) == (weights, len(list(unet.parameters())))


def test_checkpointing_recomputes_what_the_forward_ran():
    """With gradient checkpointing the backward recomputes each block under the trace's float32 casts as the forward
    ran (torch's checkpoint refuses a recomputation that saves bfloat16 values where the forward saved float32
    ones): the fake trace runs, equals the real one, and keeps fewer activations than the step without it."""
    fake, real = traces(True, fake=True, checkpointing=True), traces(True, fake=False, checkpointing=True)
    for f, r in zip(fake, real):
        assert (f.peak, f.kinds) == (r.peak, r.kinds)
    plain = traces(True, fake=True)
    assert fake[1].kinds["activations"] < plain[1].kinds["activations"], (fake[1].kinds, plain[1].kinds)


def test_rows_assigned_by_a_real_mask_keep_their_count_in_the_backward():
    """A guided family's ``out[rows] = guided(x[rows])`` with a real mask over fake rows (HunyuanImage 2.1's rows of
    one guider): the assignment's backward selects the mask's 3 rows of 8, not all 8 (``select_all`` is for fake
    masks only), so the gradient has the shape of the rows it came from."""
    mode = fake_mode()
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    fake_module(model, mode, torch.float32)
    rows = torch.tensor([True, False, True, False, False, True, False, False])
    with fake_reads(mode, select_all=True), CudaAutocast():
        x = model(torch.ones(8, 4))
        out = x.clone()
        out[rows] = 2 * x[rows]
        assert x[rows].shape == (3, 4)
        out.sum().backward()
    assert model.weight.grad.shape == (4, 4)


def test_cuda_autocast_promotes_as_cuda_does():
    """CUDA autocast runs scatter_add in the widest input dtype (CPU autocast refuses the mix) and a softmax in
    float32: so does the trace's."""
    tokens, embeds = torch.zeros(4, 2, dtype=torch.bfloat16), torch.ones(2, 2)
    index = torch.tensor([[0, 0], [3, 3]])
    with torch.autocast("cpu", dtype=torch.bfloat16), CudaAutocast():
        added = tokens.scatter_add(0, index, embeds)
        soft = torch.softmax(tokens, dim=-1)
    assert (added.dtype, soft.dtype) == (torch.float32, torch.float32)
    assert added.sum().item() == 4.0
    with pytest.raises(RuntimeError, match="dtype"):
        tokens.scatter_add(0, index, embeds)


def test_tied_weights_stay_one_tensor_and_count_once():
    """An embedding and its head sharing one weight (a text encoder's tied LM head) become one fake tensor, so the
    weights on the card count it once: 1000 x 512 float32 values, 1.95 MiB, not twice that."""
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(1000, 512), torch.nn.Linear(512, 1000, bias=False)
            self.head.weight = self.embed.weight

    with torch.device("meta"):
        model = Tied()
    fake_module(model, fake_mode(), torch.float32)
    assert model.head.weight is model.embed.weight and model.embed.weight.device.type == "cpu"
    assert sum(p.numel() * p.element_size() for p in model.parameters()) / GIB * 1024 == pytest.approx(1.953125)


class Block(torch.nn.Module):
    """A checkpointed block that takes the stream and a shared embedding (a transformer block and its timestep's)."""

    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x, embedding):
        return torch.utils.checkpoint.checkpoint(self.mlp, x, embedding, use_reentrant=False)

    def mlp(self, x, embedding):
        return x + self.down(torch.nn.functional.gelu(self.up(x + embedding)))


def block_trace(blocks: int) -> dict:
    torch.manual_seed(0)
    embed, stack = torch.nn.Linear(8, 64), torch.nn.ModuleList(Block(64) for _ in range(blocks))
    x, t = torch.randn(256, 64), torch.randn(256, 8)
    tracker = tracked([embed, stack], torch.optim.SGD([*embed.parameters(), *stack.parameters()]), [])
    with tracker:
        embedding = embed(t)
        for block in stack:
            x = block(x, embedding)
        x.square().mean().backward()
    return peak_snapshot(tracker)[1]


def test_a_block_gradient_is_not_held_for_a_shared_input():
    """Full fine-tuning's checkpointed blocks, each taking the trained timestep embedding: the backward holds one
    block's gradients at a time, as autograd does, so its temporaries at the peak are the same for 2 blocks and 8.
    torch's module hierarchy tracker kept each block's input gradient (256 x 64 floats, 64 kB) until the embedding's
    came, at the backward's end: 6 more for 8 blocks than for 2."""
    two, eight = block_trace(2), block_trace(8)
    assert eight["temporaries"] == two["temporaries"], (two, eight)
    assert eight["gradients"] - two["gradients"] == 6 * sum(p.numel() * 4 for p in Block(64).parameters()), (two, eight)
