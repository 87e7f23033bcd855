import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

import pytest
import torch
from accelerate import Accelerator

from ddpo_group.errors import CheckpointError
from ddpo_group.run.persistence.checkpointing import (
    TrainingState,
    clear_leftovers,
    complete_checkpoints,
    later_checkpoints,
    load_checkpoint,
    resolve_resume_path,
    save_checkpoint,
)
from ddpo_group.run.persistence.manifest import write_manifest
from ddpo_group.run.persistence.state_files import STATE_JSON, STATE_TENSORS, load_pieces, save_pieces


def test_rotation_keeps_newest_complete_and_resume_finds_latest(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    state = TrainingState()
    root = tmp_path / "run" / "checkpoints"
    for epoch in range(4):
        state.epoch, state.global_step = epoch, 10 * epoch
        save_checkpoint(accelerator, root, epoch, keep=2, pieces={"counters": state})
    assert [p.name for p in complete_checkpoints(root)] == ["checkpoint_00002", "checkpoint_00003"]
    assert not list(root.glob(".tmp_*"))

    # a crash mid-save leaves a temporary directory (and possibly an unmarked one): never resumed from
    (root / ".tmp_checkpoint_00004").mkdir()
    (root / "checkpoint_00005").mkdir()
    resumed, skipped = resolve_resume_path(str(tmp_path / "run"))
    assert resumed.name == "checkpoint_00003"
    assert skipped == [f"skipped checkpoint_00005: {root / 'checkpoint_00005'} is incomplete: it has no COMPLETE "
                       "marker (its save did not finish)",
                       f"{root / '.tmp_checkpoint_00004'} is what a save that never finished left (never resumed "
                       "from; the next save removes it)"]
    assert resolve_resume_path(str(root / "checkpoint_00002")) == (root / "checkpoint_00002", skipped[1:])

    with torch.no_grad():
        model.weight.zero_()
    load_checkpoint(accelerator, resumed, {"counters": state})
    assert state.epoch == 3 and state.global_step == 30
    assert model.weight.abs().sum() > 0


def test_resume_from_a_path_without_checkpoints_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_resume_path(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="neither a complete checkpoint nor a run directory"):
        resolve_resume_path(str(tmp_path))


def linear_state(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    state = TrainingState()
    return accelerator, model, state, tmp_path / "run" / "checkpoints"


def half_written_save_state(original):
    """accelerate's save_state that writes the state, then cuts the model file in half and fails (disk full)."""

    def save_state(output_dir, **kwargs):
        original(output_dir, **kwargs)
        model_file = next(Path(output_dir).glob("model*.safetensors"))
        model_file.write_bytes(model_file.read_bytes()[: model_file.stat().st_size // 2])
        raise OSError(28, "No space left on device")

    return save_state


@pytest.mark.parametrize("fault", ["in save_state", "in extra files", "in the rename"])
def test_a_crash_during_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch, fault):
    accelerator, model, state, root = linear_state(tmp_path)
    with torch.no_grad():
        model.weight.fill_(1.0)
    state.epoch, state.global_step = 0, 5
    save_checkpoint(accelerator, root, 0, keep=1, pieces={"counters": state})

    with torch.no_grad():
        model.weight.fill_(2.0)
    state.epoch, state.global_step = 1, 9
    extra = None
    if fault == "in save_state":
        monkeypatch.setattr(accelerator, "save_state", half_written_save_state(accelerator.save_state))
    elif fault == "in extra files":
        def extra(directory):
            (directory / "lora").mkdir()
            raise RuntimeError("export failed")
    else:
        def replace(src, dst):
            raise OSError("rename failed")

        monkeypatch.setattr(os, "replace", replace)
    with pytest.raises((OSError, RuntimeError)):
        save_checkpoint(accelerator, root, 1, keep=1, pieces={"counters": state}, extra=extra)
    monkeypatch.undo()

    # keep=1 did not delete epoch 0: the failed save never completed
    assert [p.name for p in complete_checkpoints(root)] == ["checkpoint_00000"]
    resumed, skipped = resolve_resume_path(str(root.parent))
    assert resumed.name == "checkpoint_00000" and skipped == []
    with torch.no_grad():
        model.weight.zero_()
    load_checkpoint(accelerator, resumed, {"counters": state})
    assert state.epoch == 0 and state.global_step == 5
    assert torch.equal(model.weight, torch.ones(2, 2))

    # the next save clears the leftovers and rotates normally
    state.epoch = 1
    save_checkpoint(accelerator, root, 1, keep=1, pieces={"counters": state})
    assert [p.name for p in complete_checkpoints(root)] == ["checkpoint_00001"]
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_00001"]


def test_resaving_an_epoch_restores_the_old_one_if_interrupted_and_rotation_keeps_the_new_one(tmp_path, monkeypatch):
    accelerator, model, state, root = linear_state(tmp_path)
    for epoch in range(4):
        state.epoch = epoch
        save_checkpoint(accelerator, root, epoch, keep=5, pieces={"counters": state})
    # a resume from epoch 1 saves epoch 2 again while checkpoint_00003 (an abandoned attempt) exists; keep=1
    state.epoch, state.global_step = 2, 77
    save_checkpoint(accelerator, root, 2, keep=1, pieces={"counters": state})
    names = [p.name for p in complete_checkpoints(root)]
    assert names == ["checkpoint_00002", "checkpoint_00003"]  # never the checkpoint just written
    assert later_checkpoints(root / "checkpoint_00002") == [root / "checkpoint_00003"]
    load_checkpoint(accelerator, root / "checkpoint_00002", {"counters": state})
    assert state.global_step == 77

    # a crash between moving the old epoch-2 checkpoint aside and renaming the new one into place
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(Path(dst).name)
        if Path(dst).name == "checkpoint_00002":
            raise OSError("killed")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    state.global_step = 88
    with pytest.raises(OSError):
        save_checkpoint(accelerator, root, 2, keep=5, pieces={"counters": state})
    monkeypatch.undo()
    assert calls == [".replaced_checkpoint_00002", "checkpoint_00002"]
    assert not (root / "checkpoint_00002").exists()  # hidden aside, not lost:
    clear_leftovers(root)
    assert [p.name for p in complete_checkpoints(root)] == ["checkpoint_00002", "checkpoint_00003"]
    load_checkpoint(accelerator, root / "checkpoint_00002", {"counters": state})
    assert state.global_step == 77


def test_a_crash_while_rotating_never_leaves_a_half_deleted_complete_checkpoint(tmp_path, monkeypatch):
    accelerator, model, state, root = linear_state(tmp_path)
    save_checkpoint(accelerator, root, 0, keep=1, pieces={"counters": state})
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if Path(path).name == ".deleting_checkpoint_00000" and Path(path).exists():  # killed after deleting one file
            next(Path(path).glob("model*.safetensors")).unlink()
            raise OSError("killed")
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(OSError):
        save_checkpoint(accelerator, root, 1, keep=1, pieces={"counters": state})
    monkeypatch.undo()
    assert [p.name for p in complete_checkpoints(root)] == ["checkpoint_00001"]
    assert resolve_resume_path(str(root.parent))[0].name == "checkpoint_00001"


# ---------------------------------------------------------------------------------------- no code from data


class RunsCode:
    """A pickle that, once unpickled, creates ``marker`` (any command would run the same way)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def trained_state(tmp_path, epochs: int = 2):
    """A prepared model and optimizer after one step, the run's counters, and checkpoints of ``epochs`` epochs."""
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=0.1))
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    state, root = TrainingState(), tmp_path / "run" / "checkpoints"
    for epoch in range(epochs):
        state.epoch, state.global_step, state.wandb_run_id = epoch, 10 + epoch, "abc"
        save_checkpoint(accelerator, root, epoch, keep=5, pieces={"counters": state})
    return accelerator, model, state, root


def test_the_training_state_is_plain_data_and_loads_back_as_saved(tmp_path):
    class Piece:
        def __init__(self, state):
            self.state = state

        def state_dict(self):
            return self.state

        def load_state_dict(self, state):
            self.state = state

    nested = {"rng": (3, (1, 2, 3), None), "state": {0: {"step": torch.tensor(4.0), "avg": torch.arange(6).view(2, 3)}},
              "groups": [{"betas": (0.9, 0.999), "params": [0, 1]}], "tau": float("nan"), "inf": float("-inf"),
              "stats": {"a cat/dog": [0.5, 1.5]}, "flag": True, "np": np.float64(0.25), "half": torch.ones(2).half()}
    save_pieces(tmp_path, {"piece": Piece(nested)})
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_JSON, STATE_TENSORS]
    def non_json(token):
        raise AssertionError(f"{token} is not JSON")

    json.loads((tmp_path / STATE_JSON).read_text(), parse_constant=non_json)  # strict JSON: no NaN / Infinity token
    loaded = Piece(None)
    load_pieces(tmp_path, {"piece": loaded})
    back = loaded.state
    assert back["rng"] == (3, (1, 2, 3), None) and type(back["rng"][1]) is tuple
    assert list(back["state"]) == [0] and torch.equal(back["state"][0]["avg"], torch.arange(6).view(2, 3))
    assert back["state"][0]["step"].shape == () and float(back["state"][0]["step"]) == 4.0
    assert back["groups"] == [{"betas": (0.9, 0.999), "params": [0, 1]}]
    assert math.isnan(back["tau"]) and back["inf"] == float("-inf") and back["flag"] is True and back["np"] == 0.25
    assert back["stats"] == {"a cat/dog": [0.5, 1.5]} and back["half"].dtype == torch.float16

    with pytest.raises(CheckpointError, match=r"training_state.json holds the pieces \['piece'\]; this run has "
                                              r"\['counters'\]: the checkpoint holds \['piece'\], which this run has "
                                              r"not; this run has \['counters'\], which the checkpoint does not hold"):
        load_pieces(tmp_path, {"counters": TrainingState()})
    with pytest.raises(TypeError, match="the state of piece holds a set at '0/bad'"):
        save_pieces(tmp_path, {"piece": Piece({"bad": {1, 2}})})


@pytest.mark.parametrize("planted", ["custom_checkpoint_0.pkl", "optimizer.bin", "random_states_0.pkl"])
def test_a_pickle_that_runs_code_is_never_unpickled(tmp_path, planted):
    accelerator, model, state, root = trained_state(tmp_path, epochs=1)
    checkpoint, marker = root / "checkpoint_00000", tmp_path / "pwned"
    torch.save(RunsCode(marker), checkpoint / planted)
    write_manifest(checkpoint)  # whoever planted it can write a matching manifest too

    if planted.startswith("custom_checkpoint"):  # refused by name, before anything loads
        with pytest.raises(CheckpointError) as refused:
            resolve_resume_path(str(checkpoint))
        message = str(refused.value)
        assert f"{checkpoint / planted} is a pickle, and loading a pickle can run any code it holds" in message
        assert f"convert it with: python scripts/convert_checkpoint.py {checkpoint}" in message
        assert "\n" not in message
    else:  # accelerate's own files load as plain data only (weights_only=True)
        assert resolve_resume_path(str(checkpoint)) == (checkpoint, [])
        with pytest.raises(CheckpointError) as refused:
            load_checkpoint(accelerator, checkpoint, {"counters": TrainingState()})
        assert str(refused.value).startswith(f"{checkpoint / planted}")  # accelerate's error does not name it
    assert not marker.exists()


def test_a_trusted_pickled_checkpoint_converts_with_one_command_and_resumes(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    state = TrainingState()
    state.epoch, state.global_step, state.sizes = 4, 40, {"train.pairs_per_forward": 6}
    accelerator.register_for_checkpointing(state)  # the pickled layout: accelerate's custom_checkpoint_0.pkl
    checkpoint = tmp_path / "run" / "checkpoints" / "checkpoint_00004"
    accelerator.save_state(str(checkpoint))
    (checkpoint / "COMPLETE").write_text("epoch 4\n")
    with pytest.raises(CheckpointError, match="custom_checkpoint_0.pkl is a pickle"):
        resolve_resume_path(str(tmp_path / "run"))

    script = Path(__file__).resolve().parents[2] / "scripts" / "convert_checkpoint.py"
    done = subprocess.run([sys.executable, str(script), str(checkpoint)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"resume with --config.resume_from={checkpoint}" in done.stdout
    assert [p.name for p in checkpoint.glob("*.pkl")] == ["random_states_0.pkl"]  # accelerate's: plain data
    assert resolve_resume_path(str(tmp_path / "run")) == (checkpoint, [])
    resumed = TrainingState()
    load_checkpoint(Accelerator(cpu=True), checkpoint, {"counters": resumed})
    assert resumed.state_dict() == {"epoch": 4, "global_step": 40, "wandb_run_id": "",
                                    "sizes": {"train.pairs_per_forward": 6}, "supervised_steps": 0}


# ---------------------------------------------------------------------------------------- checkpoints that prove themselves


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGES = {  # damage -> (file, what the verification says)
    "truncated weights": ("model.safetensors", truncate, r"model.safetensors has \d+ bytes, MANIFEST.json says \d+"),
    "missing optimizer": ("optimizer.bin", Path.unlink, r"optimizer.bin is missing \(listed in MANIFEST.json\)"),
    "flipped byte": ("training_state.safetensors", flip_a_byte,
                     r"training_state.safetensors does not match its sha256 in MANIFEST.json"),
    "missing manifest": ("MANIFEST.json", Path.unlink, r"MANIFEST.json is missing \(every save writes it last\)"),
    "added file": ("extra.bin", lambda p: p.write_bytes(b"x"), r"extra.bin is not listed in MANIFEST.json"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_checkpoint_is_named_and_the_run_falls_back_to_the_previous_one(tmp_path, damage):
    accelerator, model, state, root = trained_state(tmp_path)
    name, harm, says = DAMAGES[damage]
    newest, previous = root / "checkpoint_00001", root / "checkpoint_00000"
    harm(newest / name)

    with pytest.raises(CheckpointError) as refused:  # that checkpoint, named: refused before anything loads
        resolve_resume_path(str(newest))
    message = str(refused.value)
    assert re.search(says, message) and str(newest / name) in message
    assert message.endswith(f"resume from checkpoint_00000, the newest earlier checkpoint that verifies: "
                            f"--config.resume_from={previous}")

    resumed, skipped = resolve_resume_path(str(root.parent))  # the run: its newest checkpoint that verifies
    assert resumed == previous
    assert len(skipped) == 1 and skipped[0].startswith(f"skipped checkpoint_00001: {newest / name}")
    with torch.no_grad():
        model.weight.zero_()
    load_checkpoint(accelerator, resumed, {"counters": state})
    assert state.epoch == 0 and state.global_step == 10 and model.weight.abs().sum() > 0


def test_an_empty_checkpoint_directory_is_skipped_or_refused_by_name(tmp_path):
    accelerator, model, state, root = trained_state(tmp_path, epochs=1)
    empty = root / "checkpoint_00001"
    empty.mkdir()
    assert resolve_resume_path(str(root.parent)) == (
        root / "checkpoint_00000", [f"skipped checkpoint_00001: {empty} is incomplete: it has no COMPLETE marker "
                                    "(its save did not finish)"])
    with pytest.raises(CheckpointError, match=re.escape(f"{empty} is incomplete")):
        resolve_resume_path(str(empty))
    for checkpoint in (root / "checkpoint_00000", empty):  # nothing verifies: a new run is the next step
        shutil.rmtree(checkpoint)
    empty.mkdir()
    with pytest.raises(CheckpointError, match=r"no checkpoint verifies:\n  - skipped checkpoint_00001: .*\nstart a new "
                                              r"run \(another run_name, no resume_from\)"):
        resolve_resume_path(str(root.parent))
    with pytest.raises(CheckpointError, match="no earlier checkpoint of this run verifies: start a new run"):
        resolve_resume_path(str(empty))


def test_a_lora_checkpoint_holds_the_adapters_only_and_loads_only_into_a_matching_model(tiny_sd3_dir, tmp_path):
    """The frozen base weights and the buffers (SD3's position table) are the pretrained model's: a LoRA run's
    checkpoint holds its adapters' weights alone; a model without them (full fine-tuning) refuses it, naming the
    counts, before anything is loaded."""
    from diffusers import SD3Transformer2DModel
    from safetensors import safe_open
    from helpers.trainer_helpers import FAMILY_OVERRIDES, tiny_trainer

    trainer = tiny_trainer("grpo", tiny_sd3_dir, tmp_path, "lora", **FAMILY_OVERRIDES["sd3"], num_epochs=1,
                           device="cpu")
    trainer.run()
    (checkpoint,) = complete_checkpoints(tmp_path / "lora" / "checkpoints")
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as file:
        saved = set(file.keys())
    model = trainer.model
    adapters = {name for name, _ in model.named_parameters() if "lora_" in name}
    assert saved == adapters and len(saved) < len(model.state_dict()) and "pos_embed.pos_embed" in model.state_dict()

    accelerator = Accelerator(cpu=True)
    full = accelerator.prepare(SD3Transformer2DModel.from_pretrained(tiny_sd3_dir, subfolder="transformer"))
    before = [p.detach().clone() for p in full.parameters()]
    base = len(list(full.parameters()))
    with pytest.raises(CheckpointError, match=rf"model.safetensors does not match the model: {base} weight\(s\) "
                                              rf"\(.*\) missing, {len(adapters)} weight\(s\) \(.*lora_A.*\) unknown"):
        load_checkpoint(accelerator, checkpoint, {})
    assert all(torch.equal(b, p) for b, p in zip(before, full.parameters()))  # nothing loaded

    # the same model whose frozen weights moved (another revision of the pretrained model): refused by its record
    saved_lora = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}
    for p in saved_lora:
        dict(model.named_parameters())[p].data.add_(1.0)  # what a resume must bring back
    frozen = model.transformer_blocks[0].attn.to_q.base_layer.weight
    pretrained = frozen.detach().clone()
    frozen.data[0, 0] += 1e-3
    with pytest.raises(CheckpointError, match=r"frozen_weights.json: the model's frozen weights are not those this "
                                              r"checkpoint was trained on \(1 weight\(s\) \(transformer_blocks.0.attn"
                                              r".to_q.base_layer.weight\) differ\)"):
        load_checkpoint(trainer.accelerator, checkpoint, trainer.session.pieces)
    frozen.data.copy_(pretrained)  # the pretrained weight again: the record matches, the adapters load
    load_checkpoint(trainer.accelerator, checkpoint, trainer.session.pieces)
    assert all(torch.equal(dict(model.named_parameters())[n], v) for n, v in saved_lora.items())


def test_a_weight_under_two_names_is_saved_once_and_loads(tmp_path):
    """safetensors keeps one name of a tied weight: the check counts it as present under either. Integer and complex
    buffers are left out and fingerprinted too."""
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
            self.b.weight = self.a.weight
            self.register_buffer("ids", torch.arange(3))
            self.register_buffer("rotary", torch.tensor([1 + 2j, 3 - 1j]))

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(Tied())
    checkpoint = save_checkpoint(accelerator, tmp_path, 0, keep=1)
    trained = model.a.weight.detach().clone()
    with torch.no_grad():
        model.a.weight.zero_()
    load_checkpoint(accelerator, checkpoint, {})
    assert torch.equal(model.a.weight, trained) and model.b.weight is model.a.weight
    recorded = json.loads((checkpoint / "frozen_weights.json").read_text())
    assert recorded == {"0": {"ids": [[3], 3.0, pytest.approx(5 ** 0.5)], "rotary": [[2], 5.0, pytest.approx(15 ** 0.5)]}}
    model.ids += 1  # another buffer than the one trained with: refused
    with pytest.raises(CheckpointError, match=r"1 weight\(s\) \(ids\) differ"):
        load_checkpoint(accelerator, checkpoint, {})


def test_a_save_stops_when_its_directory_lacks_a_process_part_and_the_manifest_lists_each_part(tmp_path):
    """What processes that write to two directories (each its own run directory, or a disk the other machine cannot
    see) leave: the main process's directory lacks process 1's random states. A one-process save lists its part."""
    from ddpo_group.run.persistence.manifest import MANIFEST
    from ddpo_group.run.persistence.process_parts import absent_parts

    accelerator, _, state, root = linear_state(tmp_path)
    checkpoint = save_checkpoint(accelerator, root, 0, keep=1, pieces={"counters": state})
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    assert (manifest["processes"], manifest["parts"]) == (1, {"0": ["random_states_0.pkl"]})
    size = (checkpoint / "random_states_0.pkl").stat().st_size
    assert absent_parts(checkpoint, [{"random_states_0.pkl": size}]) is None
    assert absent_parts(checkpoint, [{"random_states_0.pkl": size}, {"random_states_1.pkl": size}]) == (
        f"{checkpoint} does not hold every process's part: process 1's random_states_1.pkl (each process writes its "
        "part into the run directory it names: every process must see the same one, on a filesystem every machine "
        "shares)")


def test_a_learning_rate_changed_on_resume_is_applied_and_said(tiny_model_dir, tmp_path, monkeypatch):
    """The optimizer's settings come back from the checkpoint: a resume whose config says another learning rate (the
    critic's too) applies it, with a line naming the field and both values; the same settings say nothing."""
    from ddpo_group.run.session import RunSession
    from helpers.trainer_helpers import tiny_trainer

    first = tiny_trainer("group_ppo", tiny_model_dir, tmp_path, "lr", num_epochs=1, save_freq=1, device="cpu")
    first.run()
    printed = []
    monkeypatch.setattr(RunSession, "print", lambda self, line: printed.append(line))
    same = tiny_trainer("group_ppo", tiny_model_dir, tmp_path, "lr", num_epochs=2, device="cpu",
                        resume_from=str(tmp_path / "lr"))
    assert not any("applied on resume" in line for line in printed)
    same.rollouts.close()
    changed = tiny_trainer("group_ppo", tiny_model_dir, tmp_path, "lr", num_epochs=2, device="cpu",
                           resume_from=str(tmp_path / "lr"), **{"train.learning_rate": 1e-3,
                                                                "critic.learning_rate": 2e-4})
    assert [group["lr"] for group in changed.optimizer.param_groups] == [1e-3]
    assert [group["lr"] for group in changed.critic.optimizer.param_groups] == [2e-4]
    lines = [line for line in printed if "applied on resume" in line]
    assert len(lines) == 2 and lines[0].startswith("train.learning_rate: the checkpoint's optimizer had 0.01")
    assert lines[1].startswith("critic.learning_rate: the checkpoint's optimizer had 0.001")
    changed.rollouts.close()


def test_pieces_load_by_name_and_a_checkpoint_written_before_the_names_still_loads(tmp_path):
    """A checkpoint's pieces are keyed by the trainer's names (saved in any order, loaded by name); one written when
    they were named by their type (TrainingState, EMAWeights, RestorePoint...) loads into the pieces of those names;
    a piece the run does not have is refused by name."""
    from ddpo_group.run.persistence.state_files import write_states

    class Piece:
        def __init__(self, state=None):
            self.state = state

        def state_dict(self):
            return self.state

        def load_state_dict(self, state):
            self.state = state

    save_pieces(tmp_path, {"counters": Piece({"epoch": 3}), "ema": Piece({"steps": 7})})
    ema, counters = Piece(), Piece()
    load_pieces(tmp_path, {"ema": ema, "counters": counters})  # another order
    assert (counters.state, ema.state) == ({"epoch": 3}, {"steps": 7})

    legacy = tmp_path / "legacy"
    legacy.mkdir()
    write_states(legacy, [("TrainingState", {"epoch": 5}), ("EMAWeights", {"steps": 2}), ("RestorePoint", {"e": 1})])
    pieces = {"counters": Piece(), "ema": Piece(), "best_weights": Piece()}
    load_pieces(legacy, pieces)
    assert [p.state for p in pieces.values()] == [{"epoch": 5}, {"steps": 2}, {"e": 1}]

    with pytest.raises(CheckpointError, match=r"the checkpoint holds \['best_weights'\], which this run has not"):
        load_pieces(legacy, {"counters": Piece(), "ema": Piece()})
