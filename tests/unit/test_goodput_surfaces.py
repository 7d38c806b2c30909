"""Where goodput shows: acceptance.json and the acceptance step's summary line, the job step's summary and
`tdeploy status`'s history lines (the ledger entry: tests/unit/ledger/test_goodput_entry.py); and Slurm's queue
time read from its submit and start times."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.acceptance.record import AcceptanceReport
from tasks.acceptance.step import AcceptanceResult
from tasks.launch.history import JobHistory
from tasks.launch.kubernetes import kubernetes_queue_seconds
from tasks.launch.slurm import slurm_queue_seconds
from tasks.launch.step import JobResult
from validation.acceptance import DimensionResult
from validation.goodput import BADPUT_KINDS, Goodput

GOODPUT = Goodput(200.0, 150.0, {"queue": 20.0, "startup": 10.0, "recovery": 12.0, "redone_steps": 8.0})
LINE = "goodput 75.0% of 200.0s; badput: queue 10.0%, recovery 6.0%, startup 5.0%, redone_steps 4.0%"


def test_the_line_names_goodput_and_the_badput_kinds_that_took_time_largest_first() -> None:
    assert GOODPUT.describe() == LINE
    assert set(GOODPUT.badput_s) == set(BADPUT_KINDS)


def test_acceptance_json_keeps_the_goodput_with_its_share_and_the_step_summary_names_it(tmp_path: Path) -> None:
    report = AcceptanceReport(dimensions=[DimensionResult(name="connectivity", passed=True)], goodput=GOODPUT)
    path = report.write(tmp_path)
    written = json.loads(path.read_text())["goodput"]
    assert written["goodput"] == 0.75 and written["badput_s"]["recovery"] == 12.0
    assert AcceptanceReport.read(tmp_path).goodput == GOODPUT
    result = AcceptanceResult(verdict_text="passed", files={}, report=report.to_json(), root=str(tmp_path))
    assert result.summary() == f"passed: connectivity pass; {LINE}"
    assert AcceptanceReport.read(AcceptanceReport(dimensions=[]).write(tmp_path / "old")).goodput is None


def test_a_report_whose_goodput_does_not_add_up_is_refused(tmp_path: Path) -> None:
    data = AcceptanceReport(dimensions=[], goodput=GOODPUT).to_json()
    data["goodput"]["productive_s"] = 100.0  # 50 s of the allocation unaccounted for
    (tmp_path / "acceptance.json").write_text(json.dumps(data))
    with pytest.raises(Exception, match="differs from the allocation"):
        AcceptanceReport.read(tmp_path)


def test_the_job_summary_and_the_status_history_carry_the_goodput_line() -> None:
    job = JobResult(job="local:1", state="succeeded", output_dir="/o", handle={}, goodput=GOODPUT)
    assert job.summary() == f"`local:1` succeeded; output `/o`; {LINE}"
    assert JobResult.model_validate_json(job.model_dump_json()).goodput == GOODPUT
    assert JobHistory(events=[], goodput=GOODPUT).lines() == [f"  {LINE}"]


@pytest.mark.parametrize(
    ("submit", "start", "queue_s"),
    [
        ("2026-12-06T16:00:01", "2026-12-06T16:02:04", 123.0),
        ("2026-12-06T16:00:01", "2026-12-06T16:00:01", 0.0),
        ("2026-12-06T16:00:01", "Unknown", None),  # pending
        ("2026-12-06T16:00:01", "None", None),
        ("2026-12-06T16:00:01", "2999-01-01T00:00:00", None),  # a pending job's estimated start
    ],
)
def test_slurm_queue_time_is_start_less_submit_and_unknown_while_pending(
    submit: str, start: str, queue_s: float | None
) -> None:
    assert slurm_queue_seconds(submit, start) == queue_s


def test_kubernetes_queue_time_runs_from_the_job_creation_to_its_last_pod_start() -> None:
    job = {"metadata": {"creationTimestamp": "2026-12-06T16:00:00Z"}}
    pods = [{"status": {"startTime": "2026-12-06T16:00:05Z"}}, {"status": {"startTime": "2026-12-06T16:01:30Z"}}]
    assert kubernetes_queue_seconds(job, pods) == 90.0
    assert kubernetes_queue_seconds(job, [*pods, {"status": {"phase": "Pending"}}]) is None  # a pod not started yet
    assert kubernetes_queue_seconds(job, []) is None
