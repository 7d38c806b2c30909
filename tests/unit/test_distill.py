"""Distillation's objective (written out twice: training/distill.py and the independent reference), its spec
section's checks, and a Hugging Face teacher (a tiny Llama saved by transformers) computing transformers' logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tasks.spec import SpecError, parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from training.config import DistillConfig, ModelConfig
from training.distill import TeacherError, distill_loss, load_teacher
from training.failure import classify
from training.reference import _softened_kl
from training.storage import StorageConfig

BASE = deep_merge(
    TINY_SPEC, {"data": {"dataset_url": "/tmp/d"}, "checkpoint": {"url": "/tmp/c"}, "run": {"output_url": "/tmp/o"}}
)
TEACHER = {"n_layers": 3, "d_model": 64, "n_heads": 4, "ffn_hidden": 128, "vocab_size": 257, "seq_len": 32}
STUDENT = ModelConfig(n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=257, seq_len=16)


def _by_definition(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, alpha: float, t: float):
    """alpha T^2 sum_v p_v log(p_v / q_v) + (1 - alpha) (-log q(target)), in float64, position by position."""
    s, te = student.double().reshape(-1, student.size(-1)), teacher.double().reshape(-1, teacher.size(-1))
    p, q = torch.softmax(te / t, -1), torch.softmax(s / t, -1)
    kl = (p * (p.log() - q.log())).sum(-1).mean()
    ce = -torch.log_softmax(s, -1).gather(1, targets.reshape(-1, 1)).mean()
    return alpha * t * t * kl + (1 - alpha) * ce, kl, ce


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_the_objective_is_alpha_t_squared_kl_plus_the_rest_cross_entropy(alpha: float, temperature: float) -> None:
    gen = torch.Generator().manual_seed(3)
    student, teacher = torch.randn(2, 5, 11, generator=gen) * 3, torch.randn(2, 5, 11, generator=gen) * 3
    targets = torch.randint(0, 11, (2, 5), generator=gen)
    got = distill_loss(student, teacher, targets, alpha, temperature)
    total, kl, ce = _by_definition(student, teacher, targets, alpha, temperature)
    assert got.total.item() == pytest.approx(total.item(), rel=1e-5)
    assert got.kl.item() == pytest.approx(kl.item(), rel=1e-5) and got.ce.item() == pytest.approx(ce.item(), rel=1e-5)
    # The reference's own spelling of the KL term agrees.
    assert _softened_kl(teacher, student, temperature).item() == pytest.approx(kl.item(), rel=1e-5)


def test_a_student_that_computes_the_teachers_logits_has_no_kl_and_its_gradient_points_to_the_teacher() -> None:
    gen = torch.Generator().manual_seed(4)
    teacher = torch.randn(3, 7, generator=gen)
    targets = torch.randint(0, 7, (3,), generator=gen)
    assert distill_loss(teacher, teacher, targets, 1.0, 2.0).kl.item() == pytest.approx(0.0, abs=1e-7)
    student = torch.zeros(3, 7, requires_grad=True)
    distill_loss(student, teacher, targets, 1.0, 2.0).total.backward()
    # d/ds of T^2 KL = T (q - p): a descent step moves the student towards the teacher's ranking.
    expected = 2.0 * (torch.softmax(student.detach() / 2, -1) - torch.softmax(teacher / 2, -1)) / 3
    torch.testing.assert_close(student.grad, expected)


def _problems(overrides: dict) -> list[str]:
    with pytest.raises(SpecError) as caught:
        parse_spec(deep_merge(BASE, overrides))
    return caught.value.problems


def test_a_teacher_of_another_vocabulary_is_refused_naming_the_field() -> None:
    distill = {"teacher_url": "/tmp/teacher", "teacher_model": {**TEACHER, "vocab_size": 300}}
    problems = _problems({"distill": distill})
    assert any(p.startswith("distill.teacher_model.vocab_size=300:") and "model.vocab_size=257" in p for p in problems)


def test_a_spec_with_a_stated_teacher_carries_the_section_to_the_payload() -> None:
    spec = parse_spec(deep_merge(BASE, {"distill": {"teacher_url": "/tmp/teacher", "teacher_model": TEACHER}}))
    train = spec.training_config()
    assert train.distill is not None and train.distill.teacher_model == ModelConfig(**TEACHER)
    assert (train.distill.alpha, train.distill.temperature) == (0.5, 2.0)
    assert type(train).model_validate_json(train.model_dump_json()).distill == train.distill


@pytest.mark.parametrize(
    ("parallel", "field"),
    [
        ({"tensor_parallel": 2}, "parallel.tensor_parallel=2"),
        ({"pipeline_parallel": 2}, "parallel.pipeline_parallel=2"),
    ],
)
def test_model_parallel_students_are_refused(parallel: dict, field: str) -> None:
    problems = _problems({"parallel": parallel, "distill": {"teacher_url": "/tmp/teacher", "teacher_model": TEACHER}})
    assert any(p.startswith(field) and "data-parallel layouts only" in p for p in problems), problems


def test_the_runs_own_checkpoint_folder_is_not_a_teacher() -> None:
    problems = _problems({"distill": {"teacher_url": "/tmp/c", "teacher_model": TEACHER}})
    assert any(p.startswith("distill.teacher_url=/tmp/c:") and "own checkpoint.url" in p for p in problems)


def test_a_teacher_step_of_a_hugging_face_folder_is_refused() -> None:
    problems = _problems({"distill": {"teacher_url": "/tmp/t", "teacher_kind": "hf", "teacher_step": 3}})
    assert any(p.startswith("distill.teacher_step=3:") and "teacher_kind=checkpoint" in p for p in problems)


def test_a_missing_teacher_is_refused_when_the_spec_is_read(tmp_path: Path) -> None:
    problems = _problems({"distill": {"teacher_url": str(tmp_path / "nothing")}})
    assert any(p.startswith(f"distill.teacher_url={tmp_path / 'nothing'}:") and "no committed checkpoint" in p
               for p in problems), problems  # fmt: skip


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module]:
    """A 2-layer Llama of vocabulary 257 saved by transformers (safetensors), and the model itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5, initializer_range=0.2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    return str(folder), model


def test_a_hugging_face_teacher_computes_transformers_logits(tiny_llama: tuple[str, torch.nn.Module]) -> None:
    folder, hf = tiny_llama
    distill = DistillConfig(teacher_url=folder, teacher_kind="hf")
    teacher = load_teacher(distill, STUDENT, StorageConfig(), torch.device("cpu"))
    assert not teacher.model.training and not any(p.requires_grad for p in teacher.model.parameters())
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(teacher.logits(ids), expected, rtol=1e-4, atol=1e-4)


def test_a_hugging_face_teacher_of_another_vocabulary_is_refused(tiny_llama: tuple[str, torch.nn.Module]) -> None:
    folder, _ = tiny_llama
    student = STUDENT.model_copy(update={"vocab_size": 300})
    distill = DistillConfig(teacher_url=folder, teacher_kind="hf")
    with pytest.raises(TeacherError) as caught:
        load_teacher(distill, student, StorageConfig(), torch.device("cpu"))
    assert caught.value.field == "distill.teacher_model.vocab_size" and caught.value.value == 257


def test_a_teacher_that_does_not_fit_is_a_workload_failure_with_its_fix() -> None:
    err = TeacherError("distill.teacher_model.vocab_size", 300, "another vocabulary", "use the student's tokenizer")
    failure = classify(err, None, 0)
    assert failure is not None and failure.cause == "bad_model"
    assert failure.fix == "use the student's tokenizer; then run again" and "vocab_size=300" in failure.error
