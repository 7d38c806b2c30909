"""The distillation teacher in the capacity plan: its fp32 weights and one micro-batch of its logits on every rank,
its forward in the step time, and a teacher too large for the device refused like a too-large model."""

from __future__ import annotations

from tasks.capacity.plan import CapacityError, CapacityPlan, plan_capacity
from tasks.capacity.report import markdown_report
from tasks.spec import parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from training.config import ModelConfig
from training.model import Transformer

BASE = deep_merge(
    TINY_SPEC, {"data": {"dataset_url": "/tmp/d"}, "checkpoint": {"url": "/tmp/c"}, "run": {"output_url": "/tmp/o"}}
)
TEACHER = {"n_layers": 3, "d_model": 64, "n_heads": 4, "ffn_hidden": 128, "vocab_size": 257, "seq_len": 32}
# Two ranks of 2 GiB: the tiny student fits with room to spare.
SMALL_DEVICES = {
    "cluster": {"accelerator": "small-gpu"},
    "capacity": {
        "enforce": False,
        "accelerators": {
            "small-gpu": {
                "kind": "gpu", "memory_gib": 2, "peak_tflops_bf16": 100, "peak_tflops_fp16": 100,
                "peak_tflops_fp32": 10, "hbm_tb_s": 1, "intra_node_gb_s": 100, "inter_node_gb_s": 10,
            }
        },
    },
}  # fmt: skip
# About 0.8 billion parameters: 3 GiB of fp32 weights, more than a 2 GiB device holds.
LARGE_TEACHER = {"n_layers": 16, "d_model": 2048, "n_heads": 16, "ffn_hidden": 5632, "vocab_size": 257, "seq_len": 32}


def _plan(overrides: dict) -> CapacityPlan:
    s = parse_spec(deep_merge(BASE, overrides))
    return plan_capacity(s.name, s.capacity, s.cluster, s.model, s.parallel, s.precision, s.run, distill=s.distill)


def _distill(teacher: dict) -> dict:
    return {"distill": {"teacher_url": "/tmp/teacher", "teacher_model": teacher}}


def test_a_distill_plan_carries_the_teachers_weights_logits_and_forward_flops() -> None:
    plan = _plan(_distill(TEACHER))
    # The definitions: the payload's own teacher (load_teacher builds a Transformer and keeps its dtype), one
    # micro-batch of fp32 logits, 2 FLOPs per parameter per token of the step.
    teacher = Transformer(ModelConfig(**TEACHER))
    params = teacher.num_params()
    bytes_per_param = next(teacher.parameters()).element_size()
    spec = parse_spec(deep_merge(BASE, _distill(TEACHER)))
    tokens_per_micro_batch = spec.parallel.micro_batch * spec.model.seq_len
    step_tokens = plan.requested.layout.global_batch * spec.model.seq_len
    memory = plan.requested.memory
    assert memory.teacher_weights == params * bytes_per_param
    assert memory.teacher_logits == tokens_per_micro_batch * TEACHER["vocab_size"] * 4
    record = plan.to_json()
    assert record["distill_teacher"]["params"] == params
    assert record["distill_teacher"]["forward_flops_per_step"] == 2 * params * step_tokens
    assert record["requested"]["memory"]["teacher_weights_bytes"] == params * bytes_per_param
    assert record["requested"]["step_time"]["teacher_forward_seconds"] > 0


def test_the_teacher_adds_its_bytes_to_the_peak_and_its_forward_to_the_step() -> None:
    student, distilled = _plan({}), _plan(_distill(TEACHER))
    grown = distilled.requested.memory.allocated_peak - student.requested.memory.allocated_peak
    memory = distilled.requested.memory
    assert grown >= memory.teacher_weights + memory.teacher_logits
    t = distilled.requested.time
    assert t.teacher_forward > 0
    assert distilled.requested.step_seconds > student.requested.step_seconds
    report = markdown_report(distilled)
    assert "distillation teacher weights" in report and "distillation teacher:" in report


def test_a_teacher_too_large_for_the_device_makes_the_plan_not_fit() -> None:
    assert _plan(SMALL_DEVICES).fits  # the student alone fits
    plan = _plan(deep_merge(SMALL_DEVICES, _distill(LARGE_TEACHER)))
    assert not plan.fits
    assert "distillation teacher" in plan.requested.why_not()
    assert plan.search.fitting == []  # every layout replicates the teacher: none fits
    assert isinstance(plan.error(), CapacityError)


def test_an_unknown_teacher_architecture_is_named_in_the_plans_warnings() -> None:
    s = parse_spec(deep_merge(BASE, _distill(TEACHER)))
    distill = s.distill.model_copy(update={"teacher_model": None})
    plan = plan_capacity(s.name, s.capacity, s.cluster, s.model, s.parallel, s.precision, s.run, distill=distill)
    assert plan.teacher is None and any("distill.teacher_model" in w for w in plan.warnings)
