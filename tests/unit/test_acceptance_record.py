"""The acceptance report owns its file: it reads back what it wrote, reads the reports written before it had a
reader, and no other module spells the file's name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.acceptance.record import ACCEPTANCE_JSON, AcceptanceReport, DrillResult, UnreadableReport
from tests.conftest import REPO
from validation.acceptance import (
    ConnectivityFigures,
    DimensionResult,
    PerformanceFigures,
    RecoveryFigures,
    figures_of,
)
from validation.plan_accuracy import PlanAccuracy, RankMemory


def _report() -> AcceptanceReport:
    """A report with every part filled: a failed, a passed and an unmeasured dimension, a drill, a plan."""
    regression = DimensionResult(
        name="regression", passed=False, measured={"tokens_per_s": {"baseline": 1000.0, "run": 730.0}},
        threshold={"tokens_per_s": 0.1}, evidence={"baseline_entry": "e1", "curve_key": "k"},
        message="tokens/s 730 is 27% below the baseline's 1000", look_first="what changed since entry e1",
    )  # fmt: skip
    plan = PlanAccuracy(
        accelerator="cpu", layout="dp2", planned_step_s=0.5, measured_step_s=0.4, memory_measure="CPU resident set",
        memory=[RankMemory(rank=0, stage=0, planned_bytes=2e6, measured_bytes=1e6)], tolerance=0.5, finding=None,
    )  # fmt: skip
    return AcceptanceReport(
        dimensions=[
            DimensionResult(name="connectivity", passed=True, measured={"world_size": 2}),
            regression,
            DimensionResult.not_measured("recovery", "the distributed run failed", "the stability dimension"),
        ],
        drills=[DrillResult(name="rank_kill", passed=True, recovery_s=3.5, steps_lost=2, evidence={"rank": 1})],
        runs={"distributed": "/runs/x/distributed/output", "reference": "/runs/x/reference/output"},
        ledger_entry="20260102T030405.123456Z-1a2b3c",
        plan_accuracy=plan,
    )


def test_the_report_reads_back_what_it_wrote(tmp_path: Path) -> None:
    report = _report()
    written = report.write(tmp_path / "ws")
    assert written == tmp_path / "ws" / ACCEPTANCE_JSON

    back = AcceptanceReport.read(tmp_path / "ws")
    assert back == report
    assert (back.passed, back.failed, back.not_measured) == (False, ["regression"], ["recovery"])
    assert AcceptanceReport.read(written) == report  # the file itself, as an acceptance error names it
    assert back.write(tmp_path / "again").read_bytes() == written.read_bytes()


def test_a_report_in_the_format_written_before_the_reader_reads(tmp_path: Path) -> None:
    """The keys the writer has always written, the derived ones (verdict, status, the plan's errors) included."""
    written = _report().write(tmp_path)
    data = json.loads(written.read_text())
    assert list(data) == ["verdict", "dimensions", "drills", "runs", "ledger_entry", "plan_accuracy", "goodput",
                          "distillation"]  # fmt: skip
    assert data["verdict"] == "failed" and [d["status"] for d in data["dimensions"]] == [
        "passed", "failed", "not measured"
    ]  # fmt: skip
    assert {"step_time_error", "memory_errors", "within_tolerance", "beyond", "line"} <= set(data["plan_accuracy"])
    assert list(data["drills"][0]) == [
        "name", "passed", "recovery_s", "detection_s", "steps_lost", "state_matched", "message", "evidence"
    ]  # fmt: skip

    old = {"verdict": "passed", "dimensions": [], "runs": {"distributed": "/out"},
           "drills": [{"name": "rank_kill", "passed": True, "recovery_s": 3.0, "steps_lost": 5,
                       "state_matched": True, "message": "", "evidence": {}}]}  # fmt: skip
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / ACCEPTANCE_JSON).write_text(json.dumps(old))
    report = AcceptanceReport.read(tmp_path / "old")
    assert report.runs == {"distributed": "/out"} and report.drills[0].detection_s is None and report.passed


def _figured() -> AcceptanceReport:
    """A report whose dimensions carry named figures (connectivity, performance, recovery) beside their detail."""
    performance = PerformanceFigures(
        scaling_efficiency=0.9, tokens_per_s=1800.0, tokens_per_s_per_rank=900.0, tokens_per_cpu_s=None,
        timed_s=4.5, comm_share=float("nan"), slow_rank=1, slow_host="host-b", layout="dp2 (ddp)",
    )  # fmt: skip
    return AcceptanceReport(
        dimensions=[
            DimensionResult(
                name="connectivity", passed=True, figures=ConnectivityFigures(world_size=2, busbw_gbps=1.5),
                measured={"hosts": {"host-a": 1, "host-b": 1}},
            ),
            DimensionResult(
                name="performance", passed=False, figures=performance,
                measured={"straggler_ratio_per_rank": {"0": 1.0, "1": 1.5}}, message="rank 1 on host-b computes",
            ),
            DimensionResult(name="recovery", passed=True, figures=RecoveryFigures(resumed_from_step=10,
                                                                                  steps_compared=10)),
        ]
    )  # fmt: skip


def test_the_report_reads_back_its_dimensions_named_figures_typed(tmp_path: Path) -> None:
    written = _figured().write(tmp_path)
    back = AcceptanceReport.read(tmp_path)
    perf = figures_of(back.dimensions, PerformanceFigures)
    assert isinstance(perf, PerformanceFigures)
    assert (perf.tokens_per_s, perf.timed_s, perf.slow_rank, perf.slow_host) == (1800.0, 4.5, 1, "host-b")
    assert perf.tokens_per_cpu_s is None and perf.comm_share != perf.comm_share  # NaN stays NaN
    assert figures_of(back.dimensions, ConnectivityFigures) == ConnectivityFigures(world_size=2, busbw_gbps=1.5)
    recovery = figures_of(back.dimensions, RecoveryFigures)
    assert recovery is not None and recovery.resumed_from_step == 10 and recovery.first_mismatch is None
    # the figures sit among `measured`, beside the detail, as reports always had them: the file keeps its shape
    data = json.loads(written.read_text())
    assert data["dimensions"][1]["measured"]["tokens_per_s"] == 1800.0
    assert data["dimensions"][1]["measured"]["straggler_ratio_per_rank"] == {"0": 1.0, "1": 1.5}
    assert all("figures" not in d for d in data["dimensions"])
    assert back.write(tmp_path / "again").read_bytes() == written.read_bytes()


def test_a_report_written_before_figures_were_typed_reads_them_from_its_measured_values(tmp_path: Path) -> None:
    old = {"verdict": "passed", "drills": [], "runs": {}, "dimensions": [
        {"name": "connectivity", "passed": True, "status": "passed", "threshold": {"world_size": 2}, "evidence": {},
         "message": "", "look_first": "",
         "measured": {"world_size": 2, "hosts": {"h": 2}, "comm_probe": {"busbw_gbps": 2.5, "busbw_timed_s": 0.2}}},
        {"name": "performance", "passed": True, "status": "passed", "threshold": {}, "evidence": {}, "message": "",
         "look_first": "", "measured": {"scaling_efficiency": 0.8, "tokens_per_s": 1000.0, "timed_s": 3.0,
                                        "comm_share": 0.1, "slow_rank": None, "compute_s_per_rank": {"0": 0.1}}},
    ]}  # fmt: skip
    (tmp_path / ACCEPTANCE_JSON).write_text(json.dumps(old))
    report = AcceptanceReport.read(tmp_path)
    perf = figures_of(report.dimensions, PerformanceFigures)
    assert perf == PerformanceFigures(scaling_efficiency=0.8, tokens_per_s=1000.0, timed_s=3.0, comm_share=0.1)
    probe = figures_of(report.dimensions, ConnectivityFigures)
    assert probe == ConnectivityFigures(world_size=2, busbw_gbps=2.5, busbw_timed_s=0.2)
    assert report.dimensions[1].measured["compute_s_per_rank"] == {"0": 0.1}


def test_a_dimension_takes_its_fields_by_name_only() -> None:
    with pytest.raises(TypeError):
        DimensionResult("connectivity", True)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "FileNotFoundError"),
        ("{not json", "JSONDecodeError"),
        ('{"dimensions": [], "score": 3}', "score: Extra inputs are not permitted"),
    ],
)
def test_a_file_that_is_no_report_is_an_error_naming_it(tmp_path: Path, content: str | None, problem: str) -> None:
    if content is not None:
        (tmp_path / ACCEPTANCE_JSON).write_text(content)
    with pytest.raises(UnreadableReport) as caught:
        AcceptanceReport.read(tmp_path)
    assert caught.value.path == tmp_path / ACCEPTANCE_JSON and problem in caught.value.problem
    assert f"{tmp_path / ACCEPTANCE_JSON}: not an acceptance report" in str(caught.value)
    assert "pass an acceptance run workspace" in str(caught.value)


def test_only_the_report_module_spells_the_reports_file_name() -> None:
    spelled = sorted(
        str(path.relative_to(REPO))
        for package in ("tasks", "flows", "validation", "training")
        for path in (REPO / package).rglob("*.py")
        if ACCEPTANCE_JSON in path.read_text()
    )
    assert spelled == ["tasks/acceptance/record.py"], "read and write it through tasks.acceptance.record instead"


def test_reading_a_report_loads_neither_torch_nor_the_acceptance_suite() -> None:
    """The diagnosis and the ledger read reports: the reader must not pull in the suite's heavy imports."""
    script = (
        "import sys, tasks.acceptance.record, tasks.diagnose\n"
        "print(sorted(m for m in ('torch', 'tasks.acceptance.suite', 'tasks.acceptance.drills') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"
