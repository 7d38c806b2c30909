"""The summary page is built from the steps' typed results: every step's key figures appear in it."""

from __future__ import annotations

from tasks.acceptance.step import AcceptanceResult
from tasks.capacity.step import CapacityInputs, CapacityResult
from tasks.image.step import ImageStepResult
from tasks.launch.step import JobResult
from tasks.nodes.step import NodesResult
from tasks import tables
from tasks.pipeline import FIGURES_SHOWN, summarize
from tasks.prepare.step import DataResult
from tasks.results import StepResult
from tasks.steps import BY_NAME
from tasks.spec import parse_spec
from tests.conftest import TINY_SPEC, deep_merge

BASE = deep_merge(
    TINY_SPEC, {"data": {"dataset_url": "/tmp/d"}, "checkpoint": {"url": "/tmp/c"}, "run": {"output_url": "/tmp/o"}}
)


def _results() -> dict[str, StepResult]:
    spec = parse_spec(BASE)
    report = {"verdict": "passed", "dimensions": [{"name": "stability", "passed": True}], "drills": []}
    drills = {
        "verdict": "passed",
        "dimensions": [],
        "drills": [{"name": "rank_kill", "passed": True, "recovery_s": 2.5}],
    }
    files = {"json": "acc/acceptance.json", "junit": "acc/junit.xml", "plot": None}
    return {
        "capacity": CapacityResult.of(CapacityInputs.of(spec).estimate(), "runs/tiny/plan.json"),
        "nodes": NodesResult(
            ok=True, hosts=["a", "b"], warnings=3, report_path="runs/tiny/node-check.json", elapsed_s=1
        ),
        "image": ImageStepResult(
            status="built", reason="new tag", record={"pushed": True, "reference_by_digest": "reg/t@sha256:ab"}
        ),
        "data": DataResult(
            dataset_url="runs/tiny/datasets/k", reused=False, splits={"train": {"tokens": 1234, "docs": 5}}
        ),
        "job": JobResult(job="local:42", state="succeeded", output_dir="runs/tiny/output", handle={}),
        "acceptance": AcceptanceResult(verdict_text="passed", files=files, report=report, root="acc"),
        "drills": AcceptanceResult(verdict_text="passed", files=files, report=drills, root="acc/drills"),
    }


def test_every_steps_key_figures_appear_in_the_summary_table_and_page() -> None:
    results = _results()
    summary = summarize("tiny", results, None, None, None)
    page = summary.markdown()
    rows = {row.step: row for row in summary.steps}
    for step, result in results.items():
        figures = result.figures()
        assert figures and rows[step].figures == figures and rows[step].verdict == "passed"
        line = next(line for line in page.splitlines() if line.startswith(f"| {BY_NAME[step].title} |"))
        assert rows[step].text() in line and tables.text(figures, limit=FIGURES_SHOWN) in line


def test_each_summary_names_the_figures_people_look_for() -> None:
    results = _results()
    assert "peak " in results["capacity"].summary() and "`runs/tiny/plan.json`" in results["capacity"].summary()
    assert results["nodes"].summary().startswith("2 host(s), 3 warning(s)")
    assert "`reg/t@sha256:ab`" in results["image"].summary() and results["image"].job_image == "reg/t@sha256:ab"
    assert "train 1,234 tokens / 5 docs" in results["data"].summary()
    assert results["job"].summary() == "`local:42` succeeded; output `runs/tiny/output`"
    assert results["drills"].summary() == "passed: rank_kill pass (recovery 2.5 s)"


def test_the_step_results_survive_a_json_round_trip_as_prefect_persists_them() -> None:
    for result in _results().values():
        assert type(result).model_validate_json(result.model_dump_json()) == result


def test_the_acceptance_summary_shows_the_plan_beside_the_run_and_the_capacity_step_carries_the_planned_figures() -> (
    None
):
    line = "plan vs run (dp2 tp1 pp1 zero0 mb4x2 none): step 0.0121 s planned, 0.0235 s measured (-49%); beyond ±50%"
    report = {"verdict": "passed", "dimensions": [], "drills": [], "plan_accuracy": {"line": line}}
    result = AcceptanceResult(verdict_text="passed", files={}, report=report, root="acc")
    assert result.summary() == f"passed: {line}"
    with_rows = result.model_copy(update={"report": {**report, "dimensions": [{"name": "stability", "passed": True}]}})
    assert with_rows.summary() == f"passed: stability pass; {line}"
    capacity = _results()["capacity"]
    assert isinstance(capacity, CapacityResult) and capacity.planned is not None
    assert capacity.planned.layout == capacity.layout and capacity.calibration == "none"


def test_the_acceptance_report_carries_a_distill_runs_student_beside_its_teacher() -> None:
    from tasks.acceptance.record import AcceptanceReport
    from training.run_output import DistillationRecord, ModelFigures

    record = DistillationRecord(
        step=20, student=ModelFigures(24_200, 4.27, 71.5, 9.0e4), teacher=ModelFigures(35_000, 3.88, 48.4, 5.0e4),
        speed_tokens=512, speed_repeats=5, speed_threads=1,
    )  # fmt: skip
    written = AcceptanceReport(dimensions=[], distillation=record).to_json()
    assert AcceptanceReport.model_validate(written).distillation == record  # read back from acceptance.json
    result = AcceptanceResult(verdict_text="passed", files={}, report=written, root="acc")
    assert result.summary() == f"passed: {record.summary()}"
    assert "student 1.80x the teacher's speed at 0.69x its size" in record.summary()
