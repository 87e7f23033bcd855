"""On-policy distillation's per-step loss (algorithms/objectives.py's ``opd_kl``) against hand computations, and the
opd section's checks (reference/teachers.py's ``teacher_errors``)."""

import pytest
import torch

from config.base import get_config
from ddpo_group.algorithms import get_objective
from ddpo_group.reference.teachers import teacher_errors, teacher_paths


def test_the_step_kl_is_the_closed_form_of_two_gaussians_of_one_std():
    opd = get_objective("opd")
    student = torch.tensor([[1.0, 2.0, 0.0, -1.0], [0.5, 0.5, 0.5, 0.5]], requires_grad=True)
    teacher = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    std = torch.tensor([2.0, 0.1])
    kl = opd(student, teacher, std)
    # row 0: (1 + 4 + 0 + 1) / 4 / (2 * 4) = 0.1875; row 1: the teacher's own mean, KL 0
    assert kl.tolist() == pytest.approx([0.1875, 0.0])
    assert opd(student, teacher, std, "sum").tolist() == pytest.approx([0.75, 0.0])
    kl.sum().backward()  # d KL / d mu = (mu_s - mu_t) / (D sigma^2): the gradient pulls the student to the teacher
    assert student.grad[0].tolist() == pytest.approx([1 / 16, 2 / 16, 0.0, -1 / 16])
    assert student.grad[1].abs().max() == 0.0


def test_a_deterministic_step_takes_the_unit_variance_surrogate():
    opd = get_objective("opd")
    student, teacher = torch.tensor([[3.0, 1.0]]), torch.zeros(1, 2)
    assert opd(student, teacher, torch.tensor([0.0])).tolist() == pytest.approx([(9 + 1) / 2 / 2])
    assert opd(student, teacher, torch.tensor([1.0])).tolist() == opd(student, teacher, torch.tensor([0.0])).tolist()
    assert get_objective("opd").kind == "distillation" and not get_objective("opd").is_matching


def test_the_opd_section_is_checked_against_the_objective(tmp_path):
    lora = tmp_path / "teacher"
    lora.mkdir()
    (lora / "pytorch_lora_weights.safetensors").write_bytes(b"")
    config = get_config("grpo")
    config.algorithm.objective = "opd"
    assert any("opd.teachers is empty" in e for e in teacher_errors(config))
    config.opd.teachers = {"a": str(lora), "b": str(tmp_path / "nowhere")}
    errors = teacher_errors(config)
    assert len(errors) == 1 and "opd.teachers['b']" in errors[0] and "nowhere" in errors[0]
    config.opd.teachers = {"a": str(tmp_path)}  # a run directory: its lora/ is looked for
    assert any("neither a LoRA directory" in e for e in teacher_errors(config))
    config.opd.teachers = {"a": str(lora)}
    assert teacher_errors(config) == []
    config.opd.beta, config.opd.reward_weight = 0.0, 0.0
    assert any("leave no loss" in e for e in teacher_errors(config))
    config.opd.beta, config.opd.reward_weight, config.algorithm.policy_loss = 1.0, 0.5, "gspo"
    assert any("one loss a trajectory" in e for e in teacher_errors(config))
    config.algorithm.objective, config.algorithm.policy_loss = "policy_gradient", "vanilla"
    assert any("does not distil" in e for e in teacher_errors(config))
    assert teacher_paths(str(lora)) == {"teacher": str(lora)} and teacher_paths("") == {}
