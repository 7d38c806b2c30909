"""The deployment summary page: every step's verdict with the figures its result really holds."""

from __future__ import annotations

from tasks.capacity.plan import plan_capacity
from tasks.capacity.step import CapacityResult
from tasks.image.step import ImageStepResult
from tasks.pipeline import summary_markdown
from tasks.spec import SpecError, parse_spec
from tests.conftest import TINY_SPEC, deep_merge

BASE = deep_merge(
    TINY_SPEC, {"data": {"dataset_url": "/tmp/d"}, "checkpoint": {"url": "/tmp/c"}, "run": {"output_url": "/tmp/o"}}
)


def test_the_summary_shows_the_capacity_plans_peak_memory_per_device() -> None:
    spec = parse_spec(BASE)
    plan = plan_capacity(spec.name, spec.capacity, spec.cluster, spec.model, spec.parallel, spec.precision, spec.run)
    result = CapacityResult.of(plan, "runs/tiny/plan.json")  # estimate_capacity
    peak, usable = plan.requested.memory.total / 2**20, plan.requested.usable_bytes / 2**30
    page = summary_markdown(spec.name, {"capacity": result}, None, None, None)
    row = next(line for line in page.splitlines() if line.startswith("| capacity estimation |"))
    assert f"peak_bytes={peak:.3g} MiB; usable_bytes={usable:.3g} GiB" in row and "?" not in row
    assert "plan_url=runs/tiny/plan.json" in row and "| passed |" in row
    assert "| spec validation | passed |" in page and "| node environment checks | not run |" in page


def test_a_spec_failure_lists_every_problem_in_the_summary_row() -> None:
    try:
        parse_spec(deep_merge(BASE, {"parallel": {"micro_batch": 0}, "optim": {"lr_peak": 0}}), "bad.yaml")
    except SpecError as err:
        error = f"SpecError: {err}"
    diagnosis = {"findings": [{"cause": "invalid deployment spec", "fix": "fix every field", "evidence": []}]}
    page = summary_markdown("bad.yaml", {}, "spec", error, diagnosis)
    row = next(line for line in page.splitlines() if line.startswith("| spec validation |"))
    assert "**FAILED**" in row and "parallel.micro_batch=0: must be >= 1; optim.lr_peak=0: must be > 0" in row
    assert "| capacity estimation | not run |" in page and "- **invalid deployment spec**: fix every field" in page


def test_a_skipped_step_reads_skipped_on_the_summary_page_not_passed() -> None:
    page = summary_markdown("x", {"image": ImageStepResult(status="skipped", reason="no builder")}, None, None, None)
    row = next(line for line in page.splitlines() if line.startswith("| image build |"))
    assert "| skipped |" in row and "passed" not in row
