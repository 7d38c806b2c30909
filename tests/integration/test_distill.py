"""Distillation on CPU with gloo: a tiny teacher trained once, a smaller student distilled from its checkpoint.

The student's KL to the teacher falls as it trains; 2-rank DDP and FSDP students agree with the independent
reference (which writes the objective out on its own) within acceptance's noise-derived tolerance, and a trainer
whose objective weighs the terms otherwise does not.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tasks.acceptance.suite import CorrectnessPlan, correctness_plan
from tasks.acceptance.workspace import Job, RunOutcome, variant
from tasks.spec import DeploymentSpec, SpecError, parse_spec
from tests.conftest import TINY_SPEC, deep_merge, metrics_by_step, run_lone_process
from training.checkpoint import CheckpointStore
from training.config import CheckpointConfig, DistillConfig, ModelConfig
from training.distill import TeacherError, load_teacher
from training.run_output import RunOutput
from training.storage import StorageConfig
from validation.acceptance import check_correctness

pytestmark = pytest.mark.integration

STEPS, REFERENCE_STEPS = 20, 6
STUDENT = {"n_layers": 1, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 48}


@pytest.fixture(scope="module")
def teacher(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The checkpoint folder of a tiny teacher (2 layers, d_model 32) trained 30 steps by one process."""
    root = tmp_path_factory.mktemp("teacher")
    overrides = {
        "cluster": {"procs_per_node": 1},
        "data": {"dataset_url": tiny_dataset},
        "checkpoint": {"url": str(root / "checkpoints"), "save_every_steps": None},
        "run": {"steps": 30, "output_url": str(root / "output")},
    }
    run_lone_process(parse_spec(deep_merge(TINY_SPEC, overrides), "tiny:teacher"))
    return str(root / "checkpoints")


def _student(
    teacher: str, tiny_dataset: str, root: Path, extra: dict | None = None, distill: dict | None = None
) -> DeploymentSpec:
    overrides = {
        "model": STUDENT,
        "data": {"dataset_url": tiny_dataset},
        "checkpoint": {"url": str(root / "checkpoints")},
        "run": {"output_url": str(root / "output")},
        "distill": {"teacher_url": teacher, "alpha": 0.7, "temperature": 2.0, **(distill or {})},
    }
    return parse_spec(deep_merge(deep_merge(TINY_SPEC, overrides), extra or {}), "tiny:student")


def test_the_spec_reads_the_teachers_architecture_from_its_checkpoint(teacher: str, tiny_dataset: str,
                                                                      tmp_path: Path) -> None:
    spec = _student(teacher, tiny_dataset, tmp_path)
    card = CheckpointStore(CheckpointConfig(url=teacher), StorageConfig()).read_card(30)
    assert card is not None and spec.distill is not None
    assert spec.distill.teacher_model == card.model and spec.distill.teacher_model.n_layers == 2
    assert spec.training_config().distill == spec.distill


def test_a_teacher_checkpoint_of_another_vocabulary_is_refused_when_the_spec_is_read(
    teacher: str, tiny_dataset: str, tmp_path: Path
) -> None:
    with pytest.raises(SpecError) as caught:
        _student(teacher, tiny_dataset, tmp_path, {"model": {"vocab_size": 300}})
    assert [p for p in caught.value.problems if p.startswith("distill.teacher_model.vocab_size=257:")], caught.value


def test_the_payload_refuses_a_teacher_that_is_not_the_stated_one_or_does_not_fit(teacher: str) -> None:
    card = CheckpointStore(CheckpointConfig(url=teacher), StorageConfig()).read_card(30)
    assert card is not None
    student = ModelConfig(**{**TINY_SPEC["model"], **STUDENT})
    stated = DistillConfig(teacher_url=teacher, teacher_model=card.model.model_copy(update={"n_layers": 3}))
    with pytest.raises(TeacherError) as caught:
        load_teacher(stated, student, StorageConfig(), torch.device("cpu"))
    assert caught.value.field == "distill.teacher_model.n_layers" and "has 2" in caught.value.problem
    with pytest.raises(TeacherError) as caught:
        load_teacher(DistillConfig(teacher_url=teacher), student.model_copy(update={"vocab_size": 300}),
                     StorageConfig(), torch.device("cpu"))  # fmt: skip
    assert caught.value.field == "distill.teacher_model.vocab_size" and "model.json" in caught.value.problem
    with pytest.raises(TeacherError) as caught:
        load_teacher(DistillConfig(teacher_url=teacher, teacher_step=7), student, StorageConfig(), torch.device("cpu"))
    assert caught.value.field == "distill.teacher_step" and "committed steps: 30" in caught.value.problem
    loaded = load_teacher(DistillConfig(teacher_url=teacher), student, StorageConfig(), torch.device("cpu"))
    assert loaded.model.cfg.n_layers == 2 and not any(p.requires_grad for p in loaded.model.parameters())


def test_the_students_kl_to_the_teacher_falls_as_it_trains(teacher: str, tiny_dataset: str, tmp_path: Path) -> None:
    # An evaluation after every step: the student's validation loss before distillation did much (step 1).
    spec = _student(teacher, tiny_dataset, tmp_path, {"cluster": {"procs_per_node": 1},
                                                      "run": {"steps": 20, "eval_every_steps": 1}})  # fmt: skip
    result = run_lone_process(spec)
    metrics = metrics_by_step(spec.run.output_url)
    kl = [metrics[s].distill_kl for s in sorted(metrics)]
    assert all(k is not None and k >= 0 for k in kl), kl
    print(f"KL(teacher || student) at T=2: step 1 {kl[0]:.4f}, step 20 {kl[-1]:.4f}")
    assert sum(kl[-3:]) / 3 < 0.7 * kl[0]
    # The recorded loss is the objective: alpha T^2 KL + (1 - alpha) CE, so it exceeds alpha T^2 KL alone.
    assert metrics[1].loss > 0.7 * 4 * kl[0]
    # Validation stays the plain cross-entropy: below an untrained model's ln(vocab), above the objective.
    assert result["final_loss"] < result["val_loss"] < math.log(257)
    # The teacher's validation loss on the same batches, for the student's quality beside it.
    assert result["teacher_val_loss"] is not None and result["teacher_val_loss"] < math.log(257)
    print(f"validation loss: student {result['val_loss']:.4f}, teacher {result['teacher_val_loss']:.4f}")
    # distillation.json: the student beside its teacher, on the same batches, measured in one process.
    output = RunOutput(spec.run.output_url)
    report = output.distillation()
    assert report is not None and report.step == 20
    assert report.student.params == result["n_params"] < report.teacher.params
    assert report.student.val_loss == result["val_loss"] and report.teacher.val_loss == result["teacher_val_loss"]
    for side in (report.student, report.teacher):
        assert math.isfinite(side.val_loss) and side.val_ppl == pytest.approx(math.exp(side.val_loss))
        assert side.tokens_per_cpu_s > 0
    first_eval = output.evals()[0]
    assert first_eval["step"] == 1 and report.student.val_loss < first_eval["val_loss"]
    print(f"{report.summary()}; student val_loss after step 1: {first_eval['val_loss']:.4f}")


@pytest.fixture(scope="module")
def reference(teacher: str, tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> RunOutcome:
    """The independent reference of a 2-rank student, run once."""
    spec = _student(teacher, tiny_dataset, tmp_path_factory.mktemp("student-spec"))
    plan = _plan(spec, tmp_path_factory.mktemp("reference"))
    outcome = Job(plan.reference_cluster, plan.reference, "reference", None, None).wait(300)
    assert outcome.ok, outcome.status.describe()
    return outcome


def _plan(spec: DeploymentSpec, root: Path) -> CorrectnessPlan:
    return correctness_plan(spec.cluster, spec.training_config(), root, STEPS, REFERENCE_STEPS)


def _distributed(spec: DeploymentSpec, root: Path) -> RunOutcome:
    """The distributed side of the pair: the spec's own job (fp32, no dropout), stopped where the reference stops."""
    train = spec.training_config()
    assert _plan(spec, root).distributed is None  # acceptance compares the main run itself
    distributed = variant(
        train, root, "correctness", run={"steps": STEPS, "stop_after_steps": REFERENCE_STEPS},
        checkpoint={"save_every_steps": None, "save_at_end": False},
    )  # fmt: skip
    assert distributed.distill == train.distill
    outcome = Job(spec.cluster, distributed, "correctness", None, None).wait(300)
    assert outcome.ok, outcome.status.describe()
    return outcome


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_a_two_rank_student_agrees_with_the_independent_reference(
    sharding: str, teacher: str, tiny_dataset: str, reference: RunOutcome, tmp_path: Path
) -> None:
    spec = _student(teacher, tiny_dataset, tmp_path / "spec", {"parallel": {"sharding": sharding}})
    outcome = _distributed(spec, tmp_path)
    correctness = check_correctness(outcome.metrics(), reference.metrics())
    print(f"{sharding}: max relative deviation {correctness.measured['max_rel_deviation']:.3g}")
    assert correctness.passed, correctness.measured
    # Each rank records the KL of its half of the global batch; the reference that of the whole batch.
    ranks_kl = (outcome.metrics(0)[1].distill_kl + outcome.metrics(1)[1].distill_kl) / 2
    assert reference.metrics()[1].distill_kl == pytest.approx(ranks_kl, rel=1e-5)
    teacher_val = reference.run.result().teacher_val_loss
    assert teacher_val is not None and outcome.run.result().teacher_val_loss == pytest.approx(teacher_val, rel=1e-6)
    # The student's weights gathered from both ranks' DDP replicas or FSDP shards: the report's student is whole.
    report = outcome.run.distillation()
    assert report is not None and report.student.params == outcome.run.result().n_params < report.teacher.params


def test_a_student_weighing_the_terms_otherwise_fails_against_the_reference(
    teacher: str, tiny_dataset: str, reference: RunOutcome, tmp_path: Path
) -> None:
    spec = _student(teacher, tiny_dataset, tmp_path / "spec", distill={"alpha": 0.6})
    correctness = check_correctness(_distributed(spec, tmp_path).metrics(), reference.metrics())
    assert not correctness.passed
    assert correctness.evidence["first_failing_step"] == 1


@pytest.fixture(scope="module")
def hf_teacher(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer Llama of the byte vocabulary (257) saved by transformers: safetensors and config.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5, initializer_range=0.2,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("hf-teacher")
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def test_a_student_of_a_hugging_face_teacher_agrees_with_the_reference(
    hf_teacher: str, tiny_dataset: str, tmp_path: Path
) -> None:
    spec = _student(hf_teacher, tiny_dataset, tmp_path / "spec", distill={"teacher_kind": "hf"})
    assert spec.distill is not None and spec.distill.teacher_model is not None
    assert spec.distill.teacher_model.rope_theta == 5000.0  # read from config.json
    plan = _plan(spec, tmp_path / "pair")
    reference = Job(plan.reference_cluster, plan.reference, "reference", None, None).wait(300)
    assert reference.ok, reference.status.describe()
    outcome = _distributed(spec, tmp_path)
    correctness = check_correctness(outcome.metrics(), reference.metrics())
    print(f"HF teacher, ddp: max relative deviation {correctness.measured['max_rel_deviation']:.3g}")
    assert correctness.passed, correctness.measured
    assert reference.metrics()[1].distill_kl > 0
